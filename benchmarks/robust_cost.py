"""What a robust round costs beside the plain mean (issue 70): the bytes each rank sends and receives, and the
seconds the rule takes on this CPU, for ``--numel`` values among W sites.

The plain mean's bytes are a ring allreduce's (each rank sends ``2 (W - 1) / W`` of the payload); a robust round
sends its payload to every other rank (``W - 1`` times it: fp32, or fp8/fp4 codes with a bf16 scale per 32 values)
and every rank holds all ``W`` rows. Seconds: the median of ``--repeats`` runs of the rule on ``W`` rows already
gathered (the decode of coded rows included), against the mean of the same rows.

Usage::

    python benchmarks/robust_cost.py [--numel 218416] [--sites 2 4 8] [--repeats 9]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from fabric_multimodel.comm.codec import dequantize, quantize
from fabric_multimodel.comm.robust import centered_clip, trimmed_mean

#: Bytes a value takes: fp32, and the codes with their share of a bf16 scale per 32-value block.
BYTES = {"fp32": 4.0, "fp8": 1 + 2 / 32, "fp4": 0.5 + 2 / 32}


def seconds(call: Callable[[], object], repeats: int) -> float:
    """The median seconds of ``repeats`` calls (one call first, untimed)."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=218_416, help="the payload's values (default: the LM example's)")
    p.add_argument("--sites", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args()
    torch.set_num_threads(1)
    n = args.numel
    print(f"{n:,} values; torch {torch.__version__}, 1 thread\n")
    print("| sites | round | MB sent per rank | ms a round on one rank |\n| --: | --- | --: | --: |")
    for world in args.sites:
        for line in lines(world, n, args.repeats):
            print(line)


def lines(world: int, n: int, repeats: int) -> list[str]:
    """The table's rows for ``world`` sites: the plain mean, each rule on fp32 rows, clipping on fp8 rows."""
    rows = torch.randn(world, n, generator=torch.Generator().manual_seed(world))
    received = [quantize(row, torch.float8_e4m3fn) for row in rows]  # every rank's codes, as the codec makes them
    ring, gathered = 2 * (world - 1) / world * 4 * n / 1e6, (world - 1) * n / 1e6
    timed = [
        ("plain mean (ring allreduce), fp32", ring, lambda: rows.mean(0)),
        ("trimmed_mean, fp32", gathered * BYTES["fp32"], lambda: trimmed_mean(rows, 0.25)),
        ("clip, fp32", gathered * BYTES["fp32"], lambda: centered_clip(rows)),
        ("clip, fp8 (decode included)", gathered * BYTES["fp8"],
         lambda: centered_clip(torch.stack([dequantize(q, n) for q in received]))),
    ]  # fmt: skip
    return [f"| {world} | {what} | {mb:.2f} | {seconds(call, repeats) * 1e3:.1f} |" for what, mb, call in timed]


if __name__ == "__main__":
    main()
