from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from tests.worlds import World

# Distributed examples take ~0.1-2 s each on 2 cores; keep the number small and never time them.
settings.register_profile(
    "worlds",
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.load_profile("worlds")


class Worlds:
    """One live world per size for the whole session; a world that failed is replaced."""

    def __init__(self) -> None:
        self._worlds: dict[int, World] = {}

    def __call__(self, size: int) -> World:
        world = self._worlds.get(size)
        if world is None or world.broken:
            if world is not None:
                world.close()
            world = self._worlds[size] = World(size)
        return world

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()


@pytest.fixture(scope="session")
def worlds() -> Iterator[Worlds]:
    pool = Worlds()
    yield pool
    pool.close()
