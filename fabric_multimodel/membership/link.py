"""A site's connection to its coordinator, which may be lost and found again: :class:`CoordinatorLink`.

The rounds run on each epoch's own process group and never need the coordinator; only the membership's decisions do
(who joins, who is lost). So a site that loses its coordinator trains on in its epoch: the link says so in one log
line, its heartbeat thread tries the coordinator again (with backoff, never the training thread), and the membership
holds its decisions until the coordinator answers again at the same address (one line more). Past ``grace_s`` the
link gives up: :class:`CoordinatorLost`. Every store call of the membership goes through the link; a failed one is
:class:`Unreachable`, which the membership turns into a wait, never a traceback.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from fabric_multimodel.membership.etcd_store import SCHEME
from fabric_multimodel.membership.signed import signed
from fabric_multimodel.membership.stores import coordinator_store

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: The longest a reconnection attempt waits for the coordinator to answer, and the longest pause between two.
PROBE_S, MAX_BACKOFF_S = 2.0, 2.0


class CoordinatorLost(RuntimeError):
    """This site cannot go on without its coordinator: it was out of reach for longer than the membership's
    ``grace_s`` when a decision was needed (a member was lost), or it came back holding another run's keys.
    The site's checkpoints resume it: start the coordinator and the same commands again.

    Example::

        try:
            with averager:
                ...
        except CoordinatorLost as error:
            checkpointer.save(state)
            raise SystemExit(f"stopped: {error}")
    """


class Unreachable(RuntimeError):
    """A store call failed: the coordinator is out of reach (the membership decides what waits)."""


class CoordinatorLink:
    """The run's store on ``coordinator`` (its keys under ``run/``), reached again after a loss, and this process's
    heartbeats.

    Args:
        coordinator: ``host:port`` or ``etcd://host:port,...`` (see :class:`~fabric_multimodel.Membership`).
        run: the run's name: its keys' prefix.
        timeout: seconds a store call may take.
        grace_s: how long the coordinator may be out of reach before :meth:`check_grace` gives up.

    Example::

        link = CoordinatorLink("coordinator-host:29400", "run", timeout=30.0, grace_s=300.0)
        link.add("joins", 0)  # Unreachable when the coordinator is gone; link.lost says so from then on
    """

    def __init__(
        self, coordinator: str, run: str, *, timeout: float, grace_s: float, secret: bytes | None = None
    ) -> None:
        self.coordinator, self.run, self.timeout, self.grace_s = coordinator, run, timeout, grace_s
        self._secret = secret  # the run's (see fabric_multimodel.membership.signed): every key and value signed
        self._stores: list[dist.Store] = []  # a Python store (etcd's) lives only while Python holds it
        self._lock = threading.Lock()
        self._lost_since: float | None = None
        self._found: dist.Store | None = None  # a new connection the heartbeat thread made for the training thread
        #: Seconds of each outage this process lived through, once it ended.
        self.outages: list[float] = []
        self._stop = threading.Event()
        self._beats: threading.Thread | None = None
        self._store = self._first_connection()

    def _connect(self, timeout: float) -> dist.Store:
        if not self.coordinator.startswith(SCHEME):
            # A plain connection first: torch's client, refused, retries and logs each try (C++ stack traces).
            host, _, port = self.coordinator.rpartition(":")
            try:
                socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
            except OSError as error:
                raise RuntimeError(f"no answer from {self.coordinator}: {error}") from error
        store = coordinator_store(self.coordinator, timeout)
        store.set_timeout(timedelta(seconds=self.timeout))
        self._stores.append(store)
        run_store = signed(store, self.run, self._secret)  # WrongSecret before this process writes anything
        self._stores.append(run_store)
        return dist.PrefixStore(f"{self.run}/", run_store)

    def _first_connection(self) -> dist.Store:
        """The coordinator may start after the site, or be restarting: wait for it, ``grace_s`` at most."""
        start, said = time.monotonic(), False
        while True:
            try:
                return self._connect(min(self.timeout, max(PROBE_S, self.grace_s)))
            except RuntimeError as error:
                if time.monotonic() - start >= self.grace_s:
                    raise CoordinatorLost(self._gone(time.monotonic() - start, "did not answer")) from error
                if not said:
                    _log.warning("coordinator %s does not answer yet: waiting for it", self.coordinator)
                    said = True
                time.sleep(PROBE_S)

    # --- the store's calls ------------------------------------------------------------------------

    def add(self, key: str, amount: int) -> int:
        return self._call(lambda store: store.add(key, amount))

    def check(self, keys: list[str]) -> bool:
        return self._call(lambda store: store.check(keys))

    def get(self, key: str) -> bytes:
        return self._call(lambda store: store.get(key))

    def set(self, key: str, value: str) -> None:
        self._call(lambda store: store.set(key, value))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._call(lambda store: store.compare_set(key, expected, desired))

    def prefixed(self, prefix: str) -> dist.Store:
        """The store under ``prefix``, for what needs a store of its own (an epoch's process group)."""
        return dist.PrefixStore(prefix, self._store)

    def _call(self, call: Callable[[dist.Store], _T]) -> _T:
        if self.lost:
            raise Unreachable(f"the coordinator {self.coordinator} is out of reach")
        try:
            return call(self._store)
        except RuntimeError as error:  # torch's DistNetworkError, DistStoreError; EtcdStore's
            self._lose(error)
            raise Unreachable(f"the coordinator {self.coordinator} is out of reach: {error}") from error

    # --- lost and found ---------------------------------------------------------------------------

    @property
    def lost(self) -> bool:
        """True from a failed call until :meth:`found` switched to a new connection."""
        return self._lost_since is not None

    def away_s(self) -> float:
        """Seconds since the coordinator was lost (0.0 while it is reached)."""
        since = self._lost_since
        return 0.0 if since is None else time.monotonic() - since

    def _lose(self, error: BaseException) -> None:
        with self._lock:
            if self._lost_since is not None:
                return
            self._lost_since = time.monotonic()
        text = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
        _log.warning(
            "coordinator %s lost (%s): training goes on in this epoch, membership changes wait; trying it again",
            self.coordinator,
            text,
        )

    def found(self) -> bool:
        """True once the coordinator answers again (the heartbeat thread reached it): from here on the calls go to a
        new connection. False while it is lost; True at once when it never was."""
        if not self.lost:
            return True
        with self._lock:
            store, self._found = self._found, None
        if store is None and self._beats is None:  # no heartbeat thread to try it yet (a site still registering)
            try:
                store = self._connect(PROBE_S)
            except RuntimeError:
                return False
        if store is None:
            return False
        away = self.away_s()
        self._store, self._lost_since = store, None
        self.outages.append(away)
        _log.warning("coordinator %s back after %.1f s", self.coordinator, away)
        return True

    def check_grace(self) -> None:
        """:class:`CoordinatorLost` once the coordinator has been lost for longer than ``grace_s``."""
        away = self.away_s()
        if away > self.grace_s:
            raise CoordinatorLost(self._gone(away, "has been out of reach"))

    def wait_found(self) -> None:
        """Wait until the coordinator answers again: :class:`CoordinatorLost` past ``grace_s``."""
        while not self.found():
            self.check_grace()
            time.sleep(min(PROBE_S, self.grace_s / 10))

    def _gone(self, seconds: float, what: str) -> str:
        return (
            f"the coordinator {self.coordinator} {what} for {seconds:.0f} s (grace {self.grace_s:.0f} s); start it"
            " again at that address and run the same commands: every site resumes from its checkpoints"
        )

    # --- heartbeats ---------------------------------------------------------------------------------

    def start_heartbeats(self, key: Callable[[], str], every_s: float, name: str) -> None:
        """Add 1 to ``key()`` every ``every_s`` seconds on a connection of the thread's own (the training thread's may
        be waiting on the store); while the coordinator is lost, try it again with backoff instead, and once it
        answers make the training thread's new connection (see :meth:`found`)."""
        if self._beats is not None:
            return

        def beat() -> None:
            store: dist.Store | None = None
            pause = every_s
            while not self._stop.is_set():
                try:
                    if store is None:
                        store = self._connect(PROBE_S)
                    if self.lost and self._found is None:
                        found = self._connect(PROBE_S)
                        with self._lock:
                            self._found = found
                    store.add(key(), 1)
                    pause = every_s
                except RuntimeError as error:
                    self._lose(error)
                    store, pause = None, min(max(pause, every_s) * 2, MAX_BACKOFF_S)
                self._stop.wait(pause)

        self._beats = threading.Thread(target=beat, name=name, daemon=True)
        self._beats.start()

    def stop_heartbeats(self, wait_s: float) -> None:
        self._stop.set()
        if self._beats is not None:
            self._beats.join(timeout=wait_s)
