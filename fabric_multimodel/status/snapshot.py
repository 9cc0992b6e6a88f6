"""What a live run's store says of it, for an operator: :class:`StatusReader` reads the epochs' decisions, the
heartbeats and the registrations that wait, and returns one plain dict (the status page's JSON).

Each member's figures (step, rounds, bytes sent, seconds spent on membership changes) are what its process 0 last
published at a round boundary. Everything in the store was written by a process that reached the coordinator's
port, so it is untrusted here: a value that does not decode is counted and skipped, every name is cut to
:data:`MAX_TEXT` characters, the lists are bounded, and a read scans at most :data:`MAX_NEW_EPOCHS` new epochs.
Decisions are written once, so each is read once; heartbeats are counters the reader looks at on every read: a
member whose count stood still for ``stale_s`` seconds is listed under ``silent``, not ``members``.

Example::

    reader = StatusReader(dist.PrefixStore("run/", coordinator_store("127.0.0.1:29400", timeout=5)))
    status = reader.read()
    print([m["site"] for m in status["members"]])
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from fabric_multimodel.membership.decisions import Decision
from fabric_multimodel.membership.figures import decode_figures
from fabric_multimodel.membership.membership import GONE, NAMELESS
from fabric_multimodel.membership.names import site_of

#: The longest text (a token, a site's name) a status holds; the rest is cut and marked.
MAX_TEXT = 80
#: The most members, waiting registrants and history entries a status lists.
MAX_LISTED = 64
#: The most new epochs one read scans (a store full of epochs is read over several refreshes).
MAX_NEW_EPOCHS = 256
#: The epochs of the history a status carries (the newest).
HISTORY = 50


class Store(Protocol):
    """The calls of torch's store the reader makes (a ``TCPStore``, an ``EtcdStore``, a ``PrefixStore``)."""

    def check(self, keys: list[str]) -> bool: ...

    def get(self, key: str) -> bytes: ...

    def add(self, key: str, amount: int) -> int: ...


def shown(text: str | bytes) -> str:
    """``text`` as a status may hold it: decoded (bytes that are not UTF-8 replaced), at most :data:`MAX_TEXT`
    characters (a longer one cut, ending in ``...``).

    Example::

        shown(b"\\xffsite")  # '\\ufffdsite'
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 3] + "..."


class StatusReader:
    """Reads a run's status from its store (one ``run``'s keys: a ``PrefixStore``); call :meth:`read` every second
    or so (the heartbeats' ages are measured between reads).

    Example::

        reader = StatusReader(store, stale_s=5.0)
        status = reader.read()  # {"run": ..., "epoch": ..., "members": [...], "silent": [...], "history": [...]}
    """

    def __init__(
        self, store: Store, *, stale_s: float = 5.0, clock: Callable[[], float] = time.time, keep: object = None
    ) -> None:
        self.store, self.stale_s, self.clock = store, stale_s, clock
        self._keep = keep  # the store under a PrefixStore, which does not keep an etcd store's object alive
        self.started = clock()
        self._epochs: list[dict[str, Any]] = []  # every epoch read so far, oldest first
        self._beats: dict[str, tuple[int, float]] = {}  # per member: its heartbeat count, and when it last moved
        self._ever: set[str] = set()  # every token some epoch held
        self.unreadable = 0  # values that did not decode (counted, never acted on)

    @classmethod
    def connect(
        cls,
        coordinator: str,
        run: str = "run",
        *,
        timeout: float = 5.0,
        stale_s: float = 5.0,
        secret: str | bytes | None = None,
    ) -> StatusReader:
        """A reader of ``run`` at ``coordinator``: ``host:port`` or ``etcd://...``, as
        :class:`~fabric_multimodel.Membership` takes it, with the run's ``secret`` (default:
        ``FABRIC_MULTIMODEL_SECRET``) when it has one (else ``WrongSecret``).

        Example::

            reader = StatusReader.connect("etcd://10.0.0.1:2379,10.0.0.2:2379", run="run")
        """
        import torch.distributed as dist

        from fabric_multimodel.membership.signed import run_secret, signed
        from fabric_multimodel.membership.stores import coordinator_store

        store = coordinator_store(coordinator, timeout=timeout)
        run_store = signed(store, run, run_secret(secret, warn=False))
        return cls(dist.PrefixStore(f"{run}/", run_store), stale_s=stale_s, keep=(store, run_store))

    def read(self) -> dict[str, Any]:
        """The run's status now (see the module's docstring); a store that cannot be reached raises as its calls do."""
        now = self.clock()
        self._read_new_epochs(now)
        current = self._epochs[-1] if self._epochs else {"epoch": None, "members": []}
        members: list[dict[str, Any]] = []
        silent: list[dict[str, Any]] = []
        for token in current["members"]:
            age = self._heartbeat_age(token, now)
            row = {"site": shown(site_of(token)), "token": token, "epoch": current["epoch"], "heartbeat_s": age}
            row["figures"] = self._figures(token)
            (members if age is None or age < self.stale_s else silent).append(row)
        return {
            "run": shown(self._get("id") or b""),
            "time": now,
            "epoch": current["epoch"],
            "members": members[:MAX_LISTED],
            "silent": silent[:MAX_LISTED],
            **self._registrations(),
            "history": self._epochs[-HISTORY:],
            "totals": {
                "epochs": len(self._epochs),
                "registrations": self._count("joins"),
                "finished": self._get("finished") is not None,
                "unreadable": self.unreadable,
            },
        }

    def _read_new_epochs(self, now: float) -> None:
        previous = self._epochs[-1]["members"] if self._epochs else []
        for _ in range(MAX_NEW_EPOCHS):
            number = len(self._epochs)  # epoch/<n>/next decides epoch n + 1
            value = self._get(f"epoch/{number}/next")
            if value is None:
                return
            try:
                decision = Decision.decode(value)
            except ValueError:  # not one a site writes (UnicodeDecodeError is one too): an epoch of nobody
                self.unreadable += 1
                decision = Decision((), 0)
            members = [shown(token) for token in decision.members[:MAX_LISTED]]
            self._ever.update(members)
            self._epochs.append(
                {
                    "epoch": number + 1,
                    "members": members,
                    "joined": [m for m in members if m not in previous],
                    "left": [m for m in previous if m not in members],
                    # the members agreed on it after one of theirs was lost in a round (its heartbeat stood still)
                    "after_loss": number > 0 and self._get(f"epoch/{number}/failing") is not None,
                    # when this reader first saw it: a reader started later saw the earlier ones at its start
                    "seen": now,
                }
            )
            previous = members

    def _heartbeat_age(self, token: str, now: float) -> float | None:
        """Seconds since ``token``'s heartbeat count last moved, as this reader saw it (None: not seen move yet)."""
        count = self._count(f"beat/{token}")
        last = self._beats.get(token)
        if last is None:
            self._beats[token] = (count, now if count else self.started)
            return None if not count else 0.0
        if count != last[0]:
            self._beats[token] = (count, now)
            return 0.0
        return round(now - last[1], 1)

    def _figures(self, token: str) -> dict[str, float | None]:
        """What the member last published (:meth:`~fabric_multimodel.Membership.publish`): its step, rounds, ...;
        empty before it did, or when the value is not figures (then counted as unreadable)."""
        value = self._get(f"status/{token}")
        if value is None:
            return {}
        figures = decode_figures(value)
        if figures is None:
            self.unreadable += 1
        return figures or {}

    def _registrations(self) -> dict[str, list[str]]:
        """The newest registrations no epoch has held: ``waiting`` to be admitted, or ``passed_over`` (the members
        found its heartbeat standing still when they could have admitted it: it registers again if it lives)."""
        joins = self._count("joins")
        found: dict[str, list[str]] = {"waiting": [], "passed_over": []}
        for number in range(max(1, joins - MAX_LISTED + 1), joins + 1):
            token = self._get(f"join/{number}")
            if token is None or token == NAMELESS.encode() or shown(token) in self._ever:
                continue
            answer = self._get(f"admit/{shown(token)}")
            if answer is None or answer == GONE.encode():
                found["waiting" if answer is None else "passed_over"].append(shown(token))
        return found

    def _get(self, key: str) -> bytes | None:
        return self.store.get(key) if self.store.check([key]) else None

    def _count(self, key: str) -> int:
        return int(self.store.add(key, 0))
