"""What a sparse payload costs the CPU (or the GPU, with --device cuda): encode and decode time per value, a whole
round's work on one rank (the accumulator, encode, decode, the accumulator again: SparseMean with no peer), and its
bytes, per density and size, beside an fp32 ring allreduce's bytes for 4 ranks.

    python benchmarks/sparse_cost.py                       # 2^20 and 2^24 values, densities 1/16, 1/64, 1/256
    python benchmarks/sparse_cost.py --device cuda --sizes 26
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from fabric_multimodel.comm.sparse import decode, encode
from fabric_multimodel.comm.sparse_mean import SparseMean


def timed(call, repeats: int, device: torch.device) -> float:  # type: ignore[no-untyped-def]
    """The median seconds of ``call()`` over ``repeats`` runs, after one to warm up."""
    call()
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def one_round(mean: SparseMean, values: torch.Tensor) -> None:
    """A round of ``values`` on one rank (the accumulator grows with each; its work per value does not)."""
    mean.all_reduce_mean(values.clone())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[20, 24], help="log2 of the values per payload")
    p.add_argument("--densities", type=float, nargs="+", default=[1 / 16, 1 / 64, 1 / 256])
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"device={device} threads={args.threads} chunk={args.chunk} torch={torch.__version__}")
    print(
        "| values | density | bits / entry | bytes vs fp32 ring (4 ranks) | encode ns / value | decode ns / value"
        " | a round on one rank, ns / value |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for size in args.sizes:
        values = torch.randn(2**size, generator=torch.Generator().manual_seed(0)).to(device)
        for density in args.densities:
            payload, _ = encode(values, args.chunk, density)
            entries = decode(payload, values.numel(), args.chunk, density)[0].numel()
            encode_s = timed(functools.partial(encode, values, args.chunk, density), args.repeats, device)
            decoding = functools.partial(decode, payload, values.numel(), args.chunk, density)
            decode_s = timed(decoding, args.repeats, device)
            one_rank = functools.partial(
                one_round, SparseMean(values.numel(), density, device, chunk=args.chunk), values
            )
            round_s = timed(one_rank, args.repeats, device)
            ring = 2 * 3 / 4 * 4 * values.numel()
            print(
                f"| 2^{size} | 1/{round(1 / density)} | {8 * payload.numel() / entries:.2f} |"
                f" 1/{ring / (3 * payload.numel()):.0f} | {1e9 * encode_s / values.numel():.1f} |"
                f" {1e9 * decode_s / values.numel():.1f} | {1e9 * round_s / values.numel():.1f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
