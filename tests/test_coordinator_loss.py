"""A run outlives its coordinator: a site that loses it keeps its epoch (no store call, no error) while it is away,
finds it again at the same address, puts the run's state back into the empty store so that joins work again,
refuses a store that holds another run's keys, and stops cleanly once the coordinator stays away past the grace.

The coordinator here is the one ``python -m fabric_multimodel.coordinator`` serves, in a thread that is stopped and
started again on the same port; ``tests/test_minimal_loop.py`` kills a real one under three live sites."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fabric_multimodel import Averager, CoordinatorLost, Membership
from fabric_multimodel.coordinator import serve
from fabric_multimodel.membership.stores import coordinator_store
from fabric_multimodel.run.launch import free_port

_runs = itertools.count()


class Coordinator:
    """A coordinator in a thread of this process, stopped and started again on one port (an empty store each time)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop, ready = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=serve, args=(self.port, self._stop, ready), daemon=True)
        self._thread.start()
        assert ready.wait(30), "the coordinator did not start"

    def stop(self) -> None:
        assert self._stop is not None and self._thread is not None
        self._stop.set()
        self._thread.join(timeout=10)

    def store(self, run: str) -> dist.Store:
        return dist.PrefixStore(f"{run}/", coordinator_store(self.address, timeout=10))


@pytest.fixture
def coordinator() -> Iterator[Coordinator]:
    served = Coordinator()
    served.start()
    yield served
    if served._thread is not None and served._thread.is_alive():
        served.stop()


def _until(condition: Callable[[], Any], seconds: float = 30.0) -> Any:
    deadline = time.monotonic() + seconds
    while not (result := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return result


def _site(coordinator: Coordinator, name: str, run: str, **options: Any) -> Membership:
    return Membership(coordinator.address, name, run=run, timeout=5.0, heartbeat_s=0.1, **options)


def test_a_site_keeps_its_epoch_while_the_coordinator_is_away_and_admits_a_site_once_it_is_back(
    coordinator: Coordinator, caplog: pytest.LogCaptureFixture
) -> None:
    run = f"back{next(_runs)}"
    a = _site(coordinator, "a", run)
    first = a.join()
    assert a.at_boundary(1) is None
    coordinator.stop()
    with caplog.at_level("WARNING", logger="fabric_multimodel"):
        for index in range(2, 12):  # rounds go on: every boundary keeps the epoch, none raises
            assert a.at_boundary(index) is None
            assert not a.failing()
            time.sleep(0.05)
        assert a.epoch == first
        coordinator.start()  # a new process at the same address: an empty store
        index = itertools.count(12)
        _until(lambda: a.at_boundary(next(index)) is None and a.outages)
    said = [record.getMessage() for record in caplog.records]
    assert sum("lost" in line for line in said) == 1 and sum("back after" in line for line in said) == 1, said
    store = coordinator.store(run)
    assert store.get("id").decode() == a.run_id  # the run's state is back: a site that starts now joins it
    assert store.check(["epoch/0/next"]) and store.add("joins", 0) == 1
    b = _site(coordinator, "b", run)
    joined: list[Any] = []
    thread = threading.Thread(target=lambda: joined.append(b.join()), daemon=True)
    thread.start()
    second = _until(lambda: a.at_boundary(next(index)))
    thread.join(timeout=30)
    assert second.number == first.number + 1 and second.sites == ("a", "b") == joined[0].sites
    assert joined[0].members == ("a#1", "b#2")  # b's number comes after the ones the run had
    a.close(finished=True)
    b.close(finished=True)


def test_a_coordinator_that_comes_back_with_another_runs_keys_is_refused(coordinator: Coordinator) -> None:
    run = f"other{next(_runs)}"
    a = _site(coordinator, "a", run)
    a.join()
    coordinator.stop()
    assert a.at_boundary(1) is None
    coordinator.start()
    coordinator.store(run).set("id", "someone-else")
    index = itertools.count(2)
    with pytest.raises(CoordinatorLost, match="holds another run's keys.*someone-else"):
        _until(lambda: a.at_boundary(next(index)))
    a.close()


def test_a_coordinator_away_past_the_grace_stops_the_site_when_it_needs_a_decision(coordinator: Coordinator) -> None:
    run = f"grace{next(_runs)}"
    a = _site(coordinator, "a", run, grace_s=1.0)
    a.join()
    coordinator.stop()
    assert a.at_boundary(1) is None and not a.coordinator_lost
    _until(lambda: a.at_boundary(2) is None and a.coordinator_lost, seconds=10)
    start = time.monotonic()
    gone = rf"coordinator {a.coordinator} has been out of reach for \d+ s \(grace 1 s\)"
    with pytest.raises(CoordinatorLost, match=gone):
        a.recover()  # a round failed: the survivors cannot agree without it
    assert time.monotonic() - start < 1.0
    a.close()


def test_a_site_started_before_its_coordinator_waits_for_it() -> None:
    later = Coordinator()
    made: list[Membership] = []
    thread = threading.Thread(target=lambda: made.append(Membership(later.address, "a", grace_s=30.0)), daemon=True)
    thread.start()
    time.sleep(1.0)
    later.start()
    thread.join(timeout=30)
    assert made and made[0].join().sites == ("a",)
    made[0].close()
    later.stop()


def test_no_coordinator_within_the_grace_is_one_clear_error() -> None:
    nobody = f"127.0.0.1:{free_port()}"
    with pytest.raises(CoordinatorLost, match=rf"coordinator {nobody} did not answer for \d+ s \(grace 1 s\)"):
        Membership(nobody, "a", grace_s=1.0)


def test_a_site_waiting_to_be_admitted_registers_again_once_the_coordinator_is_back(coordinator: Coordinator) -> None:
    run = f"waiting{next(_runs)}"
    a = _site(coordinator, "a", run, min_sites=2)
    admitted: list[Any] = []
    thread = threading.Thread(target=lambda: admitted.append(a.join()), daemon=True)
    thread.start()
    _until(lambda: coordinator.store(run).add("joins", 0) == 1)  # registered, waiting for a second site
    coordinator.stop()
    time.sleep(0.5)
    coordinator.start()  # empty: a's registration went with the old store
    b = _site(coordinator, "b", run, min_sites=2)
    epoch = b.join()
    thread.join(timeout=30)
    assert admitted and admitted[0].members == epoch.members and set(epoch.sites) == {"a", "b"}
    a.close(finished=True)
    b.close(finished=True)


@pytest.mark.parametrize("leaves", [False, True])
def test_a_site_that_leaves_on_its_own_makes_no_round_at_the_blocks_end(coordinator: Coordinator, leaves: bool) -> None:
    """Leaving the block ends with a round every member makes; a site that stops alone (a signal, a lost coordinator)
    must not start one, since the others are in rounds of their own."""
    run = f"leave{next(_runs)}"
    model = torch.nn.Linear(4, 1)
    membership = _site(coordinator, "a", run)
    averager = Averager(
        SimpleNamespace(device=torch.device("cpu")), model, period=4, warmup_steps=0, membership=membership
    )
    with averager:
        for _ in range(6):
            averager.step()
        rounds = averager.rounds
        if leaves:
            averager.leave()
    assert averager.rounds == (rounds if leaves else rounds + 1)
    membership.close()
