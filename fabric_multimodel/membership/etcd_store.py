"""A ``torch.distributed.Store`` kept in an etcd cluster: :class:`EtcdStore`, so that a live membership's
coordinator is no single point of failure (a cluster of three members survives the loss of any one).

It speaks etcd's own v3 API through the JSON gateway every etcd server (3.4 and later) serves beside gRPC,
with the standard library's HTTP client: no client package to install. Each call goes to one of the
cluster's endpoints and, when that one is unreachable or has no leader, to the next, until the store's
timeout. Atomic operations (``add``, ``compare_set``) are etcd transactions, so every site sees one order.

Example::

    store = EtcdStore(["http://10.0.0.1:2379", "http://10.0.0.2:2379", "http://10.0.0.3:2379"])
    store.set("greeting", "hello")
    store.get("greeting")  # b"hello"
    Membership("etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379", site="berlin")  # what a site passes
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import ssl
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from fabric_multimodel.membership.etcd_tls import CA_ENV, CERT_ENV, KEY_ENV, EtcdTLS, EtcdTLSError

_log = logging.getLogger(__name__)

#: How a coordinator address names an etcd cluster: ``etcd://host:port,host:port,...``.
SCHEME = "etcd://"


def endpoints_of(address: str, secure: bool = False) -> list[str]:
    """The HTTP (``secure``: HTTPS) endpoints of ``etcd://host:port,host:port,...``; ValueError naming the address
    otherwise.

    Example::

        endpoints_of("etcd://a:2379,b:2379")  # ["http://a:2379", "http://b:2379"]
    """
    members = address.removeprefix(SCHEME).split(",")
    for member in members:
        host, _, port = member.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"an etcd cluster is 'etcd://host:port,host:port,...', got {address!r}")
    return [f"{'https' if secure else 'http'}://{member}" for member in members]


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


class EtcdStore(dist.Store):
    """A store of keys in the etcd cluster at ``endpoints`` (``http://host:port`` each), under ``prefix``.

    ``get`` and ``wait`` wait for a key up to ``timeout`` seconds (then ``RuntimeError``, as a ``TCPStore``'s
    do); any call that finds no reachable member with a leader for that long fails the same way. A call whose
    answer was lost (a member lost mid-call) is sent again to the next member; ``add`` then tells, from a key of
    its own (``fmm-etcd-ops/<this store's id>``), whether the first attempt was applied, so it never counts twice.

    Example::

        store = EtcdStore(["http://127.0.0.1:2379"], timeout=30.0)
        store.add("counter", 1)  # 1
        store.compare_set("leader", "", "site-a")  # b"site-a" for the first caller, the winner's for the others
    """

    def __init__(
        self, endpoints: Sequence[str], *, timeout: float = 30.0, prefix: str = "", tls: EtcdTLS | None = None
    ) -> None:
        super().__init__()
        if not endpoints:
            raise ValueError("EtcdStore: `endpoints` must name at least one etcd member, e.g. http://host:2379.")
        self.endpoints, self.prefix = list(endpoints), prefix
        self._tls = None if tls is None else tls.context()  # https endpoints: the members' CA, this one's certificate
        self._seconds = float(timeout)
        self._at = 0  # the endpoint that answered last: tried first
        # Each swap also writes its number here, so that a swap whose answer was lost can be told applied.
        self._marker, self._swaps = f"fmm-etcd-ops/{uuid.uuid4().hex}", itertools.count(1)

    # --- etcd's v3 JSON gateway ------------------------------------------------------------------

    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>`` of the first member that answers; members are tried in turn (a short
        pause after each full turn) until ``timeout``."""
        data, deadline, failures = json.dumps(body).encode(), time.monotonic() + self._seconds, []
        while True:
            for _ in range(len(self.endpoints)):
                url = f"{self.endpoints[self._at]}/v3/{path}"
                try:
                    return self._post(url, data)
                except ssl.SSLError as error:  # a certificate the member refuses, or one that is not the member's
                    raise EtcdTLSError(
                        f"EtcdStore: the TLS handshake with {url} failed ({error.reason or error}): check {CA_ENV},"
                        f" {CERT_ENV} and {KEY_ENV} (a certificate the cluster's CA signed, and its key)"
                    ) from None
                except (urllib.error.URLError, OSError, ValueError) as error:  # unreachable, no leader, cut off
                    failures.append(f"{url}: {error}")
                    self._at = (self._at + 1) % len(self.endpoints)
                    _log.warning("etcd member %s did not answer (%s); trying %s", url, error, self.endpoints[self._at])
            if time.monotonic() >= deadline:
                raise RuntimeError(f"EtcdStore: no etcd member answered in {self._seconds:.0f} s ({failures[-1]})")
            time.sleep(0.1)

    def _post(self, url: str, data: bytes) -> dict[str, Any]:
        """One attempt: POST ``data`` to ``url``; its JSON answer."""
        request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
        try:
            reply = urllib.request.urlopen(request, timeout=max(1.0, min(5.0, self._seconds)), context=self._tls)
        except urllib.error.URLError as error:
            if isinstance(error.reason, ssl.SSLError):
                raise error.reason from None
            raise
        with reply:
            return json.loads(reply.read() or b"{}")

    def _key(self, key: str) -> str:
        return _b64(self.prefix + key)

    def _range(self, key: str) -> dict[str, Any] | None:
        kvs = self._call("kv/range", {"key": self._key(key)}).get("kvs")
        return kvs[0] if kvs else None

    def _swap(self, key: str, seen: dict[str, Any] | None, value: bytes) -> bool:
        """Put ``value`` if ``key`` is still as ``seen`` (absent: None); whether it was put."""
        compare = {"key": self._key(key), "result": "EQUAL"}
        if seen is None:
            compare |= {"target": "CREATE", "create_revision": "0"}
        else:
            compare |= {"target": "MOD", "mod_revision": seen["mod_revision"]}
        number = str(next(self._swaps))
        put = {"request_put": {"key": self._key(key), "value": _b64(value)}}
        mark = {"request_put": {"key": self._key(self._marker), "value": _b64(number)}}
        if self._call("kv/txn", {"compare": [compare], "success": [put, mark]}).get("succeeded"):
            return True
        # Not applied now; but an attempt whose answer was lost may have been (then the compare failed on it).
        marked = self._range(self._marker)
        return marked is not None and base64.b64decode(marked.get("value", "")) == number.encode()

    # --- the Store's methods ----------------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        self._call("kv/put", {"key": self._key(key), "value": _b64(value)})

    def get(self, key: str) -> bytes:
        self.wait([key])
        found = self._range(key)
        assert found is not None  # keys are never deleted while a run waits on them
        return base64.b64decode(found.get("value", ""))

    def add(self, key: str, amount: int) -> int:
        while True:
            seen = self._range(key)
            value = int(base64.b64decode(seen.get("value", "")) or 0) + amount if seen else amount
            if self._swap(key, seen, str(value).encode()):
                return value

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        expected = expected.encode() if isinstance(expected, str) else expected
        desired = desired.encode() if isinstance(desired, str) else desired
        while True:
            seen = self._range(key)
            current = base64.b64decode(seen.get("value", "")) if seen else None
            if (current is None and expected == b"") or (current is not None and current == expected):
                if self._swap(key, seen, desired):
                    return desired
            elif current is None:  # absent and expected a value: nothing set (TCPStore returns the expected)
                return expected
            else:
                return current

    def check(self, keys: list[str]) -> bool:
        return all(self._range(key) is not None for key in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = timeout.total_seconds() if timeout is not None else self._seconds
        deadline, pause = time.monotonic() + limit, 0.005
        while not self.check(keys):
            if time.monotonic() >= deadline:
                raise RuntimeError(f"EtcdStore: wait timed out after {limit:.0f} s for {', '.join(keys)}")
            time.sleep(pause)
            pause = min(2 * pause, 0.1)

    def delete_key(self, key: str) -> bool:
        return int(self._call("kv/deleterange", {"key": self._key(key)}).get("deleted", 0)) > 0

    def num_keys(self) -> int:
        everything = {"key": _b64(self.prefix or "\0"), "range_end": _b64("\0"), "count_only": True}
        if self.prefix:
            end = self.prefix[:-1] + chr(ord(self.prefix[-1]) + 1)
            everything = {"key": _b64(self.prefix), "range_end": _b64(end), "count_only": True}
        return int(self._call("kv/range", everything).get("count", 0))

    def set_timeout(self, timeout: timedelta) -> None:
        self._seconds = timeout.total_seconds()
