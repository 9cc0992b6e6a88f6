"""Only invited sites: a run with a secret keeps its store under keys and values that only holders of the secret
can make. :class:`SignedStore` wraps the coordinator's store (a ``TCPStore``, an ``EtcdStore``) so that

- every key becomes ``fmm/<HMAC(secret, key)>``: a process without the secret cannot name a key of the run, so it
  can neither write a decision, an admission or a group's address where the sites look, nor occupy one first;
- every value carries an HMAC-SHA256 tag over the key (the run's name is its first part) and the value: a value
  that fails it (someone with access to the store's keys and no secret wrote it) is never acted on:
  :meth:`SignedStore.check` does not see it and :meth:`SignedStore.get` raises :class:`ForgedValue`, logged with
  its key.

Counters (``add``: registrations, heartbeats) carry no tag; their keys are as unguessable as the rest. The secret
comes from ``Membership(..., secret=...)`` or ``FABRIC_MULTIMODEL_SECRET``; a site whose secret is wrong, or that has
none in a run that has one, learns it from the run's public ``secret`` key (:func:`check_secret`) before it writes
anything, and stops with :class:`WrongSecret`. The threat model: ``docs/guides/security.md``.

Example::

    store = SignedStore(coordinator_store("10.0.0.1:29400", timeout=30), b"a long random secret")
    run = dist.PrefixStore("run/", store)
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from datetime import timedelta
from typing import Any

import torch.distributed as dist

_log = logging.getLogger(__name__)

#: The environment variable a site's secret may come from.
SECRET_ENV = "FABRIC_MULTIMODEL_SECRET"
#: Bytes of the tag in front of every value.
TAG_BYTES = 16
#: What the public ``<run>/secret`` key holds: this, a random salt, and the HMAC of the run under it.
_VERIFIER = b"fmm-secret-1:"


class WrongSecret(PermissionError):
    """This process's secret is not the run's (or it has none in a run that has one, or the reverse)."""


class ForgedValue(ValueError):
    """A value in the store whose tag does not match: written by someone without the run's secret."""


def run_secret(secret: str | bytes | None, *, warn: bool) -> bytes | None:
    """The secret a site uses: ``secret``, else ``FABRIC_MULTIMODEL_SECRET``, else None (``warn``: say once that the
    run admits anyone who reaches its coordinator). A ValueError for an empty one.

    Example::

        key = run_secret(None, warn=True)  # from the environment
    """
    chosen = secret if secret is not None else os.environ.get(SECRET_ENV) or None
    if chosen is None:
        if warn:
            _log.warning("no %s: the run admits anyone who reaches its coordinator", SECRET_ENV)
        return None
    chosen = chosen.encode() if isinstance(chosen, str) else bytes(chosen)
    if not chosen:
        raise ValueError(f"an empty secret protects nothing: set {SECRET_ENV} (or `secret`) to a long random string")
    return chosen


def check_secret(store: dist.Store, run: str, secret: bytes | None) -> None:
    """Before a process writes anything into ``run``: the first process with a secret leaves a verifier of it in the
    public ``<run>/secret`` key; every later one checks its own against it. :class:`WrongSecret` (one line naming the
    variable) when they differ, when this process has none and the run has one, or the reverse.

    Example::

        check_secret(raw_store, "run", b"s3cret")
    """
    key = f"{run}/secret"
    if secret is None:
        if store.check([key]):
            raise WrongSecret(f"run {run!r} is invited only: set {SECRET_ENV} to its secret")
        return
    salt = secrets.token_hex(16).encode()
    mine = _VERIFIER + salt + b":" + _verifier(secret, run, salt)
    held = store.compare_set(key, "", mine)  # type: ignore[arg-type]  # bytes, as every store takes
    parts = held.removeprefix(_VERIFIER).split(b":")
    if (
        not held.startswith(_VERIFIER)
        or len(parts) != 2
        or not hmac.compare_digest(_verifier(secret, run, parts[0]), parts[1])
    ):
        raise WrongSecret(f"{SECRET_ENV} is not the secret of run {run!r}: this site was not let in")


def signed(store: dist.Store, run: str, secret: bytes | None) -> dist.Store:
    """``store`` as a process of ``run`` uses it: checked against the run's secret (:func:`check_secret`), then
    signed with it (:class:`SignedStore`); as it is in a run without one. Keep ``store`` referenced as well.

    Example::

        run_store = dist.PrefixStore("run/", signed(raw, "run", run_secret(None, warn=True)))
    """
    check_secret(store, run, secret)
    return store if secret is None else SignedStore(store, secret)


def _verifier(secret: bytes, run: str, salt: bytes) -> bytes:
    return hmac.new(secret, b"verifier\0" + run.encode() + b"\0" + salt, hashlib.sha256).hexdigest().encode()


class SignedStore(dist.Store):
    """``store`` with every key named and every value tagged by ``secret`` (see the module's docstring); the calls of
    torch's store, so a ``PrefixStore`` and a process group's rendezvous go through it too.

    Example::

        signed = SignedStore(dist.TCPStore("10.0.0.1", 29400, is_master=False), b"s3cret")
        signed.set("run/epoch/0/next", "2|a#1,b#2")
    """

    def __init__(self, store: dist.Store, secret: bytes) -> None:
        super().__init__()
        self._secret = secret
        self.store: Any = store  # torch's stubs say str values; every store takes bytes (the tags are binary)

    def _key(self, key: str) -> str:
        return "fmm/" + hmac.new(self._secret, b"key\0" + key.encode(), hashlib.sha256).hexdigest()[:40]

    def _tag(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._secret, b"value\0" + key.encode() + b"\0" + value, hashlib.sha256).digest()[:TAG_BYTES]

    def _seal(self, key: str, value: str | bytes) -> bytes:
        value = value.encode() if isinstance(value, str) else bytes(value)
        return self._tag(key, value) + value

    def _open(self, key: str, sealed: bytes) -> bytes | None:
        value = sealed[TAG_BYTES:]
        return value if hmac.compare_digest(self._tag(key, value), sealed[:TAG_BYTES]) else None

    def _forged(self, key: str) -> ForgedValue:
        _log.warning("store key %r holds a value without the run's signature: ignored", key[:200])
        return ForgedValue(f"store key {key[:200]!r} holds a value without the run's signature (ignored)")

    # --- the Store's methods ----------------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        self.store.set(self._key(key), self._seal(key, value))

    def get(self, key: str) -> bytes:
        value = self._open(key, self.store.get(self._key(key)))
        if value is None:
            raise self._forged(key)
        return value

    def add(self, key: str, amount: int) -> int:
        return self.store.add(self._key(key), amount)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        name, desired = self._key(key), self._seal(key, desired)
        sealed = self.store.compare_set(name, self._seal(key, expected) if expected else b"", desired)
        if not expected and sealed == self._seal(key, b""):  # "" stands for absent and for an empty value alike
            sealed = self.store.compare_set(name, sealed, desired)
        value = self._open(key, sealed)
        if value is None:
            raise self._forged(key)
        return value

    def check(self, keys: list[str]) -> bool:
        if not self.store.check([self._key(key) for key in keys]):
            return False
        return all(self._open(key, self.store.get(self._key(key))) is not None for key in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        names = [self._key(key) for key in keys]
        self.store.wait(names) if timeout is None else self.store.wait(names, timeout)

    def delete_key(self, key: str) -> bool:
        return self.store.delete_key(self._key(key))

    def num_keys(self) -> int:
        return self.store.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.store.set_timeout(timeout)
