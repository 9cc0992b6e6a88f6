"""Only invited sites (issue 70, signed membership): a run with a secret keeps its store under keys and values only
holders of the secret can make (``fabric_multimodel.membership.signed``), against a real coordinator, a real etcd
cluster and real memberships whose epochs make real gloo groups through the signed store."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric_multimodel import Membership, WrongSecret
from fabric_multimodel.membership.signed import SECRET_ENV, ForgedValue, SignedStore, check_secret
from fabric_multimodel.membership.stores import coordinator_store
from fabric_multimodel.status.snapshot import StatusReader
from tests.test_coordinator_loss import Coordinator

SECRET = "a long random secret, shared by the invited sites"


@pytest.fixture(scope="module")
def served() -> Iterator[Coordinator]:
    coordinator = Coordinator()
    coordinator.start()
    yield coordinator
    coordinator.stop()


@pytest.fixture(scope="module")
def raw(served: Coordinator) -> dist.Store:
    """A client of the coordinator's store as anyone who reaches its port has one."""
    return coordinator_store(served.address, timeout=5)


keys = st.text(st.characters(codec="utf-8", exclude_characters="\0"), min_size=1, max_size=60)


@settings(max_examples=40, deadline=None)
@given(key=keys, value=st.binary(max_size=300), other=st.binary(min_size=1, max_size=30))
def test_what_a_signed_store_holds_reads_back_under_a_name_only_the_secret_makes(
    raw: dist.Store, key: str, value: bytes, other: bytes
) -> None:
    signed = SignedStore(raw, SECRET.encode())
    key = f"t{time.monotonic_ns()}/{key}"
    assert not signed.check([key])
    signed.set(key, value)
    assert signed.check([key]) and signed.get(key) == value and not raw.check([key])
    assert signed.compare_set(key, b"not it", other) == value  # the first value stays
    assert signed.compare_set(key, value, other) == other and signed.get(key) == other
    assert SignedStore(raw, b"another secret").check([key]) is False  # another secret names other keys
    assert signed.add(key + "/n", 2) == 2 and signed.add(key + "/n", 3) == 5


def test_a_value_without_the_runs_signature_is_never_acted_on(
    raw: dist.Store, caplog: pytest.LogCaptureFixture
) -> None:
    signed = SignedStore(raw, SECRET.encode())
    signed.set("forged/decision", "2|a#1,b#2")
    raw.set(signed._key("forged/decision"), b"\0" * 16 + b"2|evil#9")  # someone who can list the keys, no secret
    with caplog.at_level(logging.WARNING, logger="fabric_multimodel"):
        assert not signed.check(["forged/decision"])
        with pytest.raises(ForgedValue, match="without the run's signature"):
            signed.get("forged/decision")
        with pytest.raises(ForgedValue):
            signed.compare_set("forged/decision", "", "1|mine#1")
    assert any("forged/decision" in record.getMessage() for record in caplog.records)


def test_the_first_secret_holds_the_run_and_every_other_is_refused(raw: dist.Store) -> None:
    check_secret(raw, "guarded", SECRET.encode())
    check_secret(raw, "guarded", SECRET.encode())  # the same secret again: let in
    for secret, named in ((b"wrong", "is not the secret of run 'guarded'"), (None, "is invited only")):
        with pytest.raises(WrongSecret, match=named) as caught:
            check_secret(raw, "guarded", secret)
        assert SECRET_ENV in str(caught.value) and "\n" not in str(caught.value)
    check_secret(raw, "open", None)  # a run without a secret: as today
    raw.set("hostile/secret", b"<script>")  # a run whose verifier someone else wrote
    with pytest.raises(WrongSecret):
        check_secret(raw, "hostile", SECRET.encode())


def two_sites(address: str, run: str, **options: Any) -> list[Membership]:
    """Two sites joined in one epoch (its gloo group made through the store)."""
    sites = [Membership(address, name, run=run, min_sites=2, timeout=10.0, heartbeat_s=0.1, **options)
             for name in ("a", "b")]  # fmt: skip
    threads = [threading.Thread(target=site.join, daemon=True) for site in sites]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert all(site.epoch is not None for site in sites)
    return sites


def test_invited_sites_train_a_forged_decision_changes_nothing_and_a_wrong_secret_is_refused(
    served: Coordinator, raw: dist.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    run = "invited"
    a, b = two_sites(served.address, run)
    # An outsider writes what would, unsigned, end the epoch and admit it: a decision, an admission, a registration.
    plain = dist.PrefixStore(f"{run}/", raw)
    number = a.epoch.number if a.epoch else 0
    plain.set(f"epoch/{number}/next", "9|evil#9")
    plain.set(f"epoch/{number}/round/1", "9|evil#9")
    plain.set("admit/evil#9", "1")
    plain.add("joins", 5)
    sums = []

    def round_on(site: Membership) -> None:
        tensor = torch.ones(3)
        assert site.epoch is not None
        dist.all_reduce(tensor, group=site.epoch.group)  # the group met through the signed store
        sums.append(tensor)

    for boundary in (1, 2):
        threads = [threading.Thread(target=lambda s=s, n=boundary: sums.append(s.at_boundary(n))) for s in (a, b)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
    assert sums == [None] * 4 and a.epoch is not None and b.epoch is not None  # no change: nothing to act on
    joined = a.epoch.members  # the two registered at once: either may hold number 1
    assert b.epoch.members == joined and sorted(joined) in (["a#1", "b#2"], ["a#2", "b#1"])
    sums.clear()
    threads = [threading.Thread(target=round_on, args=(s,)) for s in (a, b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert [t.tolist() for t in sums] == [[2.0] * 3] * 2
    start = time.monotonic()
    with pytest.raises(WrongSecret, match=SECRET_ENV):
        Membership(served.address, "c", run=run, secret="a guess", timeout=10.0)
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(WrongSecret, match="is invited only"):
        Membership(served.address, "d", run=run, timeout=10.0)
    assert time.monotonic() - start < 30
    members = StatusReader.connect(served.address, run, secret=SECRET).read()["members"]
    assert tuple(m["token"] for m in members) == joined
    for site in (a, b):
        site.close()


def test_a_run_without_a_secret_says_once_that_it_admits_anyone(
    served: Coordinator, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="fabric_multimodel"):
        site = Membership(served.address, "a", run="open-run", timeout=5.0)
    said = [r.getMessage() for r in caplog.records if "admits anyone" in r.getMessage()]
    assert said == [f"no {SECRET_ENV}: the run admits anyone who reaches its coordinator"]
    with pytest.raises(ValueError, match="an empty secret protects nothing"):
        Membership(served.address, "b", run="open-run", timeout=5.0, secret="")
    site.close()


def test_an_etcd_run_is_signed_the_same_way(etcd: tuple[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    address, _ = etcd
    monkeypatch.setenv(SECRET_ENV, SECRET)
    a, b = two_sites(address, "etcd-invited")
    with pytest.raises(WrongSecret):
        Membership(address, "c", run="etcd-invited", secret="a guess", timeout=10.0)
    raw = coordinator_store(address, timeout=5)
    assert not raw.check(["etcd-invited/epoch/0/next"]) and raw.check(["etcd-invited/secret"])
    for site in (a, b):
        site.close()
