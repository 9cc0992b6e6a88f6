"""Shared fixtures: the pool of gloo worlds, and the device of the tests that can run on any device.

``--device cuda`` (default ``cpu``) runs the tests that take the ``device`` fixture with their tensors
there; every such test is marked ``device``, so ``-m device`` selects them alone::

    python -m pytest tests/test_quantized.py tests/test_flat.py -q -m device --device cuda
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

from tests.worlds import World

# Distributed examples take ~0.1-2 s each on 2 cores; keep the number small (the suite has 12 minutes) and never
# time them.
settings.register_profile(
    "worlds",
    max_examples=8,
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
        for world in self._worlds.values():  # all at once: each rank's exit takes seconds
            world.ask_to_leave()
        for world in self._worlds.values():
            world.join()


@pytest.fixture(scope="session")
def worlds() -> Iterator[Worlds]:
    pool = Worlds()
    yield pool
    pool.close()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        default="cpu",
        help="where the tests that take the `device` fixture put their tensors, e.g. cuda (select them with -m device)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "device: the test takes the `device` fixture (its tensors live on --device)")
    name = config.getoption("--device")
    try:
        torch.empty(0, device=name)
    except (RuntimeError, AssertionError) as error:  # an unknown name, or a device this torch or machine lacks
        raise pytest.UsageError(f"--device {name}: {error}") from None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.device)


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> torch.device:
    """The ``--device`` as torch names the tensors made there (``cuda`` -> ``cuda:0``)."""
    return torch.empty(0, device=request.config.getoption("--device")).device
