"""Block-quantized means (fabric_multimodel.comm.quantized): the accuracy behind the format, and a round's cost.

Two parts:

- ``accuracy`` (one process): for each code dtype, scale dtype (fp32, bf16) and block size (32, 64,
  128, 256), the error of one quantization and of a 4-rank quantized mean (simulated in one process:
  quantize each rank's payload, average the dequantized versions, quantize the mean again), on four
  payloads: Gaussian, Student-t (3 degrees of freedom), a flat buffer of many tensors of different
  magnitudes, and a real pseudo-gradient (an MLP's parameters after 10 Adam steps minus before), with
  the bytes each rank sends per payload element and the ratio to an fp32 allreduce of the same payload
  plus a round's header.
- ``timing`` (a 2-process gloo world on loopback): a round of ``QuantizedMean`` (fp8 e4m3fn, fp4 e2m1)
  against one fp32 ``all_reduce`` + divide of the same payload, for 0.2M and 6M elements (median of the
  slowest rank), where the time goes (the three phases, the bare collectives of the same bytes, and the
  compute alone in a one-rank object), and the memory a round allocates beyond the object's buffers.

Usage::

    python benchmarks/quantized_cost.py [--quick] [--out DIR] [--repeats N]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from fabric_multimodel.run.launch import run_world  # noqa: E402

NAME = "quantized_cost"
HEADER_ELEMENTS = 13 * 4  # a round's header at 4 ranks (rounds.Header.SLOTS per rank)
BLOCK_SIZES = (32, 64, 128, 256)


# --- accuracy ------------------------------------------------------------------------------------


def payloads(n: int, seed: int) -> dict:
    """The test payloads, ``n`` elements each (the pseudo-gradient has its own size)."""
    import torch
    from torch import nn

    g = torch.Generator().manual_seed(seed)
    layered, at = torch.empty(n), 0
    while at < n:  # tensors of 100..30k elements, each with its own magnitude (1e-4..1)
        size = int(torch.randint(100, 30_000, (1,), generator=g))
        scale = 10 ** float(torch.empty(1).uniform_(-4, 0, generator=g))
        layered[at : at + size] = torch.randn(min(size, n - at), generator=g) * scale
        at += size
    torch.manual_seed(seed)
    mlp = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 64))
    before = torch.cat([p.detach().reshape(-1) for p in mlp.parameters()])
    opt = torch.optim.Adam(mlp.parameters(), lr=1e-3)
    for _ in range(10):
        x = torch.randn(64, 256, generator=g)
        nn.functional.mse_loss(mlp(x), x[:, :64].sin()).backward()
        opt.step()
        opt.zero_grad()
    after = torch.cat([p.detach().reshape(-1) for p in mlp.parameters()])
    return {
        "gaussian": torch.randn(n, generator=g),
        "student-t3": torch.distributions.StudentT(3.0).sample((n,)),
        "many tensors": layered,
        "pseudo-gradient": before - after,
    }


def accuracy_rows(n: int, world: int) -> list[dict]:
    """One row per code dtype, scale dtype and block size: relative RMS errors on each payload, and bytes."""
    import torch

    from fabric_multimodel.comm.codec import CODE_DTYPES, dequantize, quantize

    data = [payloads(n, seed) for seed in range(world)]  # one payload of each kind per simulated rank
    rows = []
    for code in CODE_DTYPES:
        for scale_dtype in (torch.float32, torch.bfloat16):
            for block in BLOCK_SIZES:

                def roundtrip(x):
                    return dequantize(quantize(x, code, block, scale_dtype), x.numel())  # noqa: B023

                row = {
                    "elements": n,
                    "code": str(code).removeprefix("torch."),
                    "scale": str(scale_dtype).removeprefix("torch."),
                    "block": block,
                }
                for kind in data[0]:
                    xs = [d[kind] for d in data]
                    row[f"{kind} one"] = _relative_rms(roundtrip(xs[0]), xs[0])
                    mean = roundtrip(torch.stack([roundtrip(x) for x in xs]).mean(0))
                    row[f"{kind} mean"] = _relative_rms(mean, torch.stack([x.double() for x in xs]).mean(0))
                sent = sent_bytes(n, world, block, code, scale_dtype, HEADER_ELEMENTS)
                row["bytes_per_element"] = sent / n
                row["bytes_ratio"] = sent / (4 * (n + HEADER_ELEMENTS))
                rows.append(row)
    return rows


def _relative_rms(approx, exact) -> float:
    exact = exact.double()
    return float((approx.double() - exact).norm() / exact.norm())


def sent_bytes(n: int, world: int, block: int, code, scale_dtype, header: int) -> int:
    """The all-to-all input of one round per rank: QuantizedMean's layout, with either scale dtype."""
    from fabric_multimodel.comm.codec import FLOAT4_E2M1

    def ceil_div(a: int, b: int) -> int:
        return -(-a // b)

    shard_blocks = ceil_div(ceil_div(n, block), world)
    code_bytes = block // 2 if code == FLOAT4_E2M1 else block
    segment = 4 * ceil_div(4 * ceil_div(header, world) + shard_blocks * (code_bytes + scale_dtype.itemsize), 4)
    return world * segment


# --- timing --------------------------------------------------------------------------------------

METHODS = ("fp32 allreduce", "fp8 e4m3fn", "fp4 e2m1")
PHASES = ("start", "exchange", "finish", "all_to_all", "all_gather", "quantize", "reduce", "dequantize")


def measure_world(fabric, sizes: list[int], repeats: int, warmup: int) -> list[dict]:
    """On every rank: time each method on each payload size (interleaved), its phases, and its memory."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    # A one-rank group per rank (every rank creates every group): the same rounds without communication.
    alone_group = [dist.new_group([r]) for r in range(world)][rank]
    rows = []
    for n in sizes:
        rows += measure_size(n, alone_group, repeats, warmup)
        dist.barrier()
    return rows


def measure_size(n: int, alone_group, repeats: int, warmup: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    from fabric_multimodel.comm.codec import FLOAT4_E2M1
    from fabric_multimodel.comm.quantized import QuantizedMean

    world, rank = dist.get_world_size(), dist.get_rank()
    codes = {"fp8 e4m3fn": torch.float8_e4m3fn, "fp4 e2m1": FLOAT4_E2M1}
    data = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    header = torch.zeros(HEADER_ELEMENTS)
    fp32, payload = torch.empty(n + HEADER_ELEMENTS), torch.empty(n)
    means = {name: QuantizedMean(n, code, "cpu", exact_numel=HEADER_ELEMENTS) for name, code in codes.items()}
    alone = {
        name: QuantizedMean(n, code, "cpu", exact_numel=HEADER_ELEMENTS, group=alone_group)
        for name, code in codes.items()
    }

    def allreduce() -> None:
        fp32[:n].copy_(data)
        dist.all_reduce(fp32)
        fp32.div_(world)

    def quantized(mean):
        def round_() -> None:
            payload.copy_(data)
            mean.all_reduce_mean(payload, header)

        return round_

    calls = {"fp32 allreduce": allreduce, **{name: quantized(mean) for name, mean in means.items()}}
    times: dict[str, list[float]] = {m: [] for m in calls}
    phases: dict[str, list[dict[str, float]]] = {m: [] for m in codes}
    bar = common.Progress(f"{n:,} elements at {world} ranks", warmup + repeats)
    for r in range(warmup + repeats):
        for method in METHODS[r % 3 :] + METHODS[: r % 3]:  # rotated: no method always runs first
            elapsed = common.barrier_timed(calls[method])
            if r >= warmup:
                times[method].append(elapsed)
        for name in codes:
            split = _phase_times(means[name], alone[name], payload, data, header)
            if r >= warmup:
                phases[name].append(split)
        bar.advance()
    memory = {}
    for method, call in calls.items():
        dist.barrier()
        memory[method] = common.profile_call(call)["peak_extra_bytes"]
    everyone = common.gather((times, phases, memory))
    return _timing_rows(n, world, everyone, means) if rank == 0 else []


def _phase_times(mean, alone, payload, data, header) -> dict[str, float]:
    """Seconds of each phase of one round, of the bare collectives of its bytes, and of its compute alone."""
    import torch
    import torch.distributed as dist

    from fabric_multimodel.comm.collectives import all_gather_single

    out: dict[str, float] = {}
    payload.copy_(data)
    dist.barrier()
    last = time.perf_counter()
    for phase, call in (
        ("start", lambda: mean.start(payload, header)),
        ("exchange", mean.exchange),
        ("finish", mean.finish),
    ):
        call()
        now = time.perf_counter()
        out[phase], last = now - last, now
    sent = torch.zeros(mean.traffic.bytes, dtype=torch.uint8)
    received = torch.empty_like(sent)
    out["all_to_all"] = common.barrier_timed(lambda: dist.all_to_all_single(received, sent))
    shard = sent[: sent.numel() // dist.get_world_size()]
    out["all_gather"] = common.barrier_timed(lambda: all_gather_single(received, shard))
    payload.copy_(data)
    for phase, call in (
        ("quantize", lambda: alone.start(payload, header)),
        ("reduce", alone.exchange),
        ("dequantize", alone.finish),
    ):
        start = time.perf_counter()
        call()
        out[phase] = time.perf_counter() - start
    return out


def _timing_rows(n: int, world: int, everyone: list, means: dict) -> list[dict]:
    """Per method: the median over repeats of the slowest rank, bytes per rank, and memory."""
    rows = []
    all_times = [times for times, _, _ in everyone]
    repeats = len(all_times[0]["fp32 allreduce"])
    floor = common.median([max(t["fp32 allreduce"][i] for t in all_times) for i in range(repeats)])
    for method in METHODS:
        median = common.median([max(t[method][i] for t in all_times) for i in range(repeats)])
        mean = means.get(method)
        sent = mean.traffic.bytes if mean is not None else 4 * (n + HEADER_ELEMENTS)
        row = {
            "elements": n,
            "ranks": world,
            "method": method,
            "median_ms": median * 1e3,
            "ratio_to_fp32": median / floor,
            "bytes_per_rank": sent,
            "bytes_ratio": sent / (4 * (n + HEADER_ELEMENTS)),
            "buffer_bytes": mean.buffer_bytes if mean is not None else 0,
            "round_extra_bytes": max(memory[method] for _, _, memory in everyone),
        }
        for phase in PHASES:  # the fp32 allreduce has no phases: empty cells
            per_repeat = [max(p[method][i][phase] for _, p, _ in everyone) for i in range(repeats)] if mean else []
            row[f"{phase}_ms"] = common.median(per_repeat) * 1e3 if per_repeat else ""
        rows.append(row)
    return rows


# --- main ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    common.start_clock()
    p = common.parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=None, help="timed rounds per method (default: 15; quick: 3)")
    args = p.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 15)
    sizes = [20_000, 200_000] if args.quick else [200_000, 6_000_000]
    info = common.machine_info()

    import torch

    torch.set_num_threads(1)
    common.progress("accuracy: one process")
    accuracy = accuracy_rows(1 << 16 if args.quick else 1 << 20, world=4)
    common.progress("timing: starting a 2-process gloo world")
    timing = run_world(2, measure_world, sizes, repeats, 1 if args.quick else 2)[0]
    elapsed = common.elapsed()

    print(f"# Block-quantized mean: accuracy and cost{' (QUICK mode: indicative only)' if args.quick else ''}\n")
    print(common.machine_line(info, repeats=repeats))
    n = accuracy[0]["elements"]
    print(f"\n## Accuracy: relative RMS error, {n:,} elements (the pseudo-gradient: 427,072), 4 simulated ranks\n")
    print("`one`: one quantization, ||Q(x) - x|| / ||x||; `mean`: the 4-rank quantized mean against the exact mean.")
    print(f"Bytes: what each rank sends per payload element at 4 ranks with a {HEADER_ELEMENTS}-element header;")
    print("ratio: those bytes over an fp32 allreduce's input (payload + header).\n")
    kinds = [k.removesuffix(" one") for k in accuracy[0] if k.endswith(" one")]
    headers = ["code", "scale", "block", *[f"{k} {w}" for k in kinds for w in ("one", "mean")], "bytes/elt", "ratio"]
    print(
        common.markdown_table(
            headers,
            [
                [r["code"], r["scale"], r["block"], *[f"{r[f'{k} {w}']:.4f}" for k in kinds for w in ("one", "mean")]]
                + [f"{r['bytes_per_element']:.4f}", f"{r['bytes_ratio']:.4f}"]
                for r in accuracy
            ],
        )
    )
    print("\n## Bytes per rank against an fp32 allreduce (default format: bf16 scales, blocks of 32)\n")
    print(common.markdown_table(["elements", "ranks", "code", "bytes per rank", "ratio"], bytes_rows()))
    print("\n## A round on loopback gloo, 2 ranks: median ms of the slowest rank\n")
    print("buffers: what the QuantizedMean holds; allocated per round: the peak the profiler sees during one round,")
    print("which is gloo's all-gather temporary (the size of its output); the round itself allocates nothing.\n")
    print(
        common.markdown_table(
            ["elements", "method", "ms", "vs fp32", "bytes ratio", "buffers", "allocated per round"],
            [
                [
                    common.thousands(r["elements"]),
                    r["method"],
                    f"{r['median_ms']:.2f}",
                    common.ratio(r["ratio_to_fp32"]),
                    f"{r['bytes_ratio']:.3f}",
                    common.human_bytes(r["buffer_bytes"]),
                    common.human_bytes(r["round_extra_bytes"]),
                ]
                for r in timing
            ],
        )
    )
    print("\n## Where a quantized round's time goes (ms, median of the slowest rank)\n")
    print("start / exchange / finish: the round's phases (each includes waiting for its collective);")
    print("all_to_all / all_gather: the bare collectives of the same bytes; quantize / reduce / dequantize: the")
    print("same phases in a one-rank object (compute only: it quantizes, reduces and dequantizes the whole payload).\n")
    quantized = [r for r in timing if r["start_ms"] != ""]
    print(
        common.markdown_table(
            ["elements", "method", *PHASES],
            [
                [common.thousands(r["elements"]), r["method"], *[f"{r[f'{p}_ms']:.2f}" for p in PHASES]]
                for r in quantized
            ],
        )
    )
    common.write_results(args.out, NAME, info, args, elapsed, accuracy)
    common.write_results(args.out, f"{NAME}_timing", info, args, elapsed, timing)


def bytes_rows() -> list[list[str]]:
    import torch

    from fabric_multimodel.comm.codec import CODE_DTYPES, DEFAULT_BLOCK_SIZE

    rows = []
    for n in (200_000, 6_000_000):
        for world in (2, 4):
            header = 13 * world
            for code in CODE_DTYPES:
                sent = sent_bytes(n, world, DEFAULT_BLOCK_SIZE, code, torch.bfloat16, header)
                rows.append(
                    [
                        common.thousands(n),
                        world,
                        str(code).removeprefix("torch."),
                        common.thousands(sent),
                        f"{sent / (4 * (n + header)):.4f}",
                    ]
                )
    return rows


if __name__ == "__main__":
    main()
