"""EtcdStore: the operations a live membership and gloo's rendezvous use behave as torch's own stores' do (a
property test over random sequences, against a HashStore), on a real etcd cluster; and a key that never comes is
a timeout, not a hang."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric_multimodel.membership.etcd_store import EtcdStore, endpoints_of

KEYS = st.sampled_from(["a", "b", "c/d"])
VALUES = st.sampled_from(["", "1", "x", "yz"])
OPS = st.one_of(
    st.tuples(st.just("set"), KEYS, VALUES),
    st.tuples(st.just("add"), KEYS, st.integers(-3, 3)),
    st.tuples(st.just("compare_set"), KEYS, VALUES, VALUES),
    st.tuples(st.just("check"), KEYS),
    st.tuples(st.just("get"), KEYS),
)
_runs = iter(range(10**6))


def apply(store: dist.Store, ops: list[tuple[Any, ...]]) -> list[Any]:
    results = []
    for kind, key, *args in ops:
        if kind == "get" and not store.check([key]):  # a get of a missing key waits: compared elsewhere
            results.append(None)
        elif kind == "check":
            results.append(store.check([key]))
        else:
            try:
                results.append(getattr(store, kind)(key, *args))
            except (ValueError, RuntimeError):  # add to a key that holds no number: an error on both
                results.append("error")
    return results


@settings(max_examples=30, deadline=None)
@given(ops=st.lists(OPS, max_size=12))
def test_every_operation_answers_as_torchs_own_store_does(etcd: tuple[str, Any], ops) -> None:
    address, _ = etcd
    store = EtcdStore(endpoints_of(address), timeout=20)
    ours = dist.PrefixStore(f"case{next(_runs)}/", store)  # store stays referenced: see coordinator_store
    assert apply(ours, ops) == apply(dist.HashStore(), ops)


def test_a_key_that_never_comes_is_a_timeout(etcd: tuple[str, Any]) -> None:
    address, _ = etcd
    store = EtcdStore(endpoints_of(address), timeout=0.5)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out"):
        store.get("never")
    with pytest.raises(RuntimeError, match="timed out"):
        store.wait(["never"], timedelta(seconds=0.2))
    assert time.monotonic() - start < 5


class LosingAnswers(EtcdStore):
    """An EtcdStore whose first transactions (every other one of the first eight) are applied by etcd but their
    answers lost (a member lost mid-call): each such call goes again to the next member."""

    transactions = 0

    def _post(self, url: str, data: bytes) -> dict[str, Any]:
        answer = super()._post(url, data)
        if url.endswith("/v3/kv/txn"):
            self.transactions += 1
            if self.transactions <= 8 and self.transactions % 2 == 1:
                raise OSError("the connection was reset before the answer came")
        return answer


def test_an_operation_whose_answer_was_lost_is_applied_once(etcd: tuple[str, Any]) -> None:
    address, _ = etcd
    store = LosingAnswers(endpoints_of(address), timeout=20)
    counter, flag = f"counter{next(_runs)}", f"flag{next(_runs)}"
    assert [store.add(counter, 1) for _ in range(4)] == [1, 2, 3, 4]
    assert store.compare_set(flag, "", "first") == b"first" and store.compare_set(flag, "", "second") == b"first"
    assert store.transactions > 8  # four answers were lost, and the counts are still right


@pytest.mark.parametrize("address", ["etcd://", "etcd://host", "etcd://a:1,b"])
def test_a_bad_cluster_address_names_itself(address: str) -> None:
    with pytest.raises(ValueError, match="etcd://host:port"):
        endpoints_of(address)
