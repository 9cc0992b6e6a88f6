"""What the coordinator's store holds for a run: each epoch's :class:`Decision`, and :func:`put_back`, which writes
the run's state into a coordinator that came back empty (a new process at the same address)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from fabric_multimodel.membership.link import CoordinatorLost
from fabric_multimodel.membership.names import registration_of

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    """What a key of the store says an epoch is: its members, and the registrations it has seen.

    Example::

        Decision(("a#1", "b#2"), 2).encode()  # '2|a#1,b#2'
    """

    members: tuple[str, ...]
    registrations: int

    def encode(self) -> str:
        return f"{self.registrations}|{','.join(self.members)}"

    @classmethod
    def decode(cls, value: bytes) -> Decision:
        registrations, _, members = value.decode().partition("|")
        return cls(tuple(m for m in members.split(",") if m), int(registrations))


class Keys(Protocol):
    """The store calls :func:`put_back` makes (a :class:`~fabric_multimodel.membership.link.CoordinatorLink`)."""

    def check(self, keys: list[str]) -> bool: ...

    def set(self, key: str, value: str) -> None: ...

    def add(self, key: str, amount: int) -> int: ...

    def compare_set(self, key: str, expected: str, desired: str) -> bytes: ...


def put_back(store: Keys, run_id: str, epoch: int, decision: Decision, processes: int, coordinator: str) -> bool:
    """The run's state written back into ``store`` when it lost it (a new coordinator process): its id, the current
    ``epoch`` and its ``decision``, the registrations counted and the processes per site; every key with
    ``compare_set``, so the members that put it back at once write it once. True when this call wrote it.
    :class:`~fabric_multimodel.membership.link.CoordinatorLost` when the store holds another run's keys.

    Example::

        put_back(link, membership.run_id, epoch.number, decision, processes=1, coordinator="host:29400")
    """
    found = store.compare_set("id", "", run_id).decode()
    if found != run_id:
        raise CoordinatorLost(
            f"the coordinator {coordinator} holds another run's keys (run id {found[:40]!r}, this run's {run_id!r});"
            " give each run its own coordinator or its own `run` name"
        )
    decided = f"epoch/{epoch - 1}/next"
    if store.check([decided]):
        return False  # it never lost them, or another member put them back
    numbers = [decision.registrations, *(registration_of(token) for token in decision.members)]
    store.compare_set("processes", "", str(processes))
    joins = int(store.compare_set("joins", "", str(max(numbers))).decode())
    if joins < max(numbers):  # a site registered first: its number and the later ones go past the old ones
        store.add("joins", max(numbers))
    store.compare_set("epoch/0/next", "", decision.encode())  # a site starting now joins, never starts a run
    store.compare_set(decided, "", decision.encode())
    store.set("epoch", str(epoch))
    _log.warning(
        "coordinator %s came back empty: put back run %s, epoch %d (%s), %d registrations",
        coordinator,
        run_id,
        epoch,
        ", ".join(decision.members),
        max(numbers),
    )
    return True
