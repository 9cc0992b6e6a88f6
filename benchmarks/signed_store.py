"""What signing a run's store costs (issue 70): seconds a store call takes on a local coordinator, plain and through
``SignedStore`` (a run with ``FABRIC_MULTIMODEL_SECRET``), for the calls membership makes.

Usage::

    python benchmarks/signed_store.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from fabric_multimodel.coordinator import serve
from fabric_multimodel.membership.signed import SignedStore
from fabric_multimodel.membership.stores import coordinator_store
from fabric_multimodel.run.launch import free_port


def per_call(call: Callable[[int], object], calls: int) -> float:
    """Microseconds a call, the median of 5 batches of ``calls``."""
    batches = []
    for batch in range(5):
        start = time.perf_counter()
        for i in range(calls):
            call(batch * calls + i)
        batches.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(batches)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args()
    port, stop, ready = free_port(), threading.Event(), threading.Event()
    threading.Thread(target=serve, args=(port, stop, ready), daemon=True).start()
    ready.wait(30)
    raw = coordinator_store(f"127.0.0.1:{port}", timeout=30)
    stores: dict[str, dist.Store] = {"plain": raw, "signed": SignedStore(raw, b"a long random secret")}
    value = "2|" + ",".join(f"site{i}#{i}" for i in range(8))  # a decision of 8 members
    rows = []
    for name, store in stores.items():
        key = functools.partial("{}/k{}".format, name)
        set_us = per_call(lambda i, s=store, k=key: s.set(k(i), value), args.calls)
        get_us = per_call(lambda i, s=store, k=key: s.get(k(i % args.calls)), args.calls)
        check_us = per_call(lambda i, s=store, k=key: s.check([k(i % args.calls)]), args.calls)
        add_us = per_call(lambda i, s=store, k=key: s.add(k("beat"), 1), args.calls)
        rows.append((name, set_us, get_us, check_us, add_us))
    print("| store | set, us | get, us | check, us | add, us |\n| --- | ---: | ---: | ---: | ---: |")
    for name, *figures in rows:
        print(f"| {name} | " + " | ".join(f"{f:.1f}" for f in figures) + " |")
    ratios = [s / p for s, p in zip(rows[1][1:], rows[0][1:])]
    print(f"\nsigned / plain: set {ratios[0]:.2f}x, get {ratios[1]:.2f}x, check {ratios[2]:.2f}x, add {ratios[3]:.2f}x")
    stop.set()


if __name__ == "__main__":
    main()
