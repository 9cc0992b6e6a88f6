"""Cost of ONE averaging round against the floor: one allreduce of a flat fp32 tensor of the same size.

Methods, all on the same ranks, interleaved inside every repeat:

- ``floor``: ``dist.all_reduce`` of a preallocated flat fp32 tensor with the model's element count.
- ``floor+div`` (diagnostic): the floor followed by ``div_(world)``, the least a mean costs on gloo.
- ``ours``: an ``Averager`` round (parameters live in flat storage; one in-place allreduce + divide),
  with its default NaN/Inf check; ``ours-nocheck``: the same with ``check_finite=False``.
- ``ours-adam``: ``ours`` with an Adam optimizer passed to the ``Averager``, whose moments (twice the
  parameters) a plain round averages too; its ratio is to ``floor-adam``, one flat allreduce of the
  parameters and moments together.
- ``ours-bf16``: plain averaging with ``comm_dtype=torch.bfloat16`` (sends ``param - anchor`` at half the bytes).
- ``ours-diloco``: DiLoCo, an outer Nesterov step (lr 0.7, momentum 0.9, ``foreach=True``) on fp32 pseudo-gradients.
- ``ours-diloco-bf16``: the same with bf16 pseudo-gradients.
- ``ours-diloco-fp8`` / ``ours-diloco-fp4``: the same with block-quantized fp8 / fp4 pseudo-gradients (an
  all-to-all and an all-gather of uint8 codes; "bytes sent" is the all-to-all's input).
- ``pytorch``: ``torch.distributed.algorithms.model_averaging.utils.average_parameters``.
- ``per-tensor``: ``for p in params: dist.all_reduce(p.data); p.data.div_(world)`` (accelerate, torchft).
- ``torchft`` / ``torchft-bucketized``: torchft 0.2.0's own ``DiLoCo`` round (``sync_every=1``, its
  quorum and commit vote included), at 2 ranks, when torchft is installed (``pip install -e '.[peers]'``).

Each repeat times every method once, in a new order: where one floor round is shorter than ``TIMED_S``
(20 ms), each method as the mean of as many calls in a row as make about that long of the floor (the
same count for every method; once for a method whose call alone lasts twice that), since single rounds
of a few milliseconds on a shared 2-core machine are bimodal.

Models: a DCGAN-sized generator + discriminator pair (~6.1M parameters in 18 tensors) and an MLP of
400 small tensors (~0.83M parameters). Usage::

    python benchmarks/averaging_cost.py [--quick] [--out DIR] [--world-sizes 2 4] [--repeats N] [--no-peers]
        [--accelerator cuda]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from fabric_multimodel.run.launch import run_world  # noqa: E402

NAME = "averaging_cost"
OURS = {  # method -> the Averager's options
    "ours": {},
    "ours-nocheck": {"check_finite": False},
    "ours-adam": {"optimizers": "adam"},
    "ours-bf16": {"comm_dtype": "bfloat16"},
    "ours-diloco": {"outer_optimizer": "nesterov"},
    "ours-diloco-bf16": {"outer_optimizer": "nesterov", "comm_dtype": "bfloat16"},
    "ours-diloco-fp8": {"outer_optimizer": "nesterov", "comm_dtype": "float8_e4m3fn"},
    "ours-diloco-fp4": {"outer_optimizer": "nesterov", "comm_dtype": "float4_e2m1fn_x2"},
}
BASE_METHODS = ("floor", "floor+div", "floor-adam", *OURS, "pytorch", "per-tensor")
PEER_METHODS = ("torchft", "torchft-bucketized")
HAS_TORCHFT = importlib.util.find_spec("torchft") is not None
METHOD_LABELS = {
    "floor": "floor (one flat fp32 allreduce)",
    "floor+div": "floor + one in-place divide (gloo has no AVG)",
    "floor-adam": "floor of the parameters and Adam's two moments (one flat fp32 allreduce)",
    "ours": "ours: plain averaging (NaN/Inf check on)",
    "ours-nocheck": "ours: plain averaging, check_finite=False",
    "ours-adam": "ours: plain averaging of the parameters and Adam's moments",
    "ours-bf16": "ours: plain averaging, bf16 payload",
    "ours-diloco": "ours: DiLoCo outer Nesterov step, fp32",
    "ours-diloco-bf16": "ours: DiLoCo outer Nesterov step, bf16",
    "ours-diloco-fp8": "ours: DiLoCo, fp8 (e4m3) block-quantized payload",
    "ours-diloco-fp4": "ours: DiLoCo, fp4 (e2m1) block-quantized payload",
    "pytorch": "PyTorch average_parameters",
    "per-tensor": "per-tensor allreduce",
    "torchft": "torchft 0.2.0 DiLoCo round",
    "torchft-bucketized": "torchft 0.2.0 DiLoCo round, bucketized",
}
MODELS = ("dcgan", "mlp400")
MODEL_LABELS = {"dcgan": "DCGAN G+D", "mlp400": "MLP 400 tensors"}


def build(model: str):
    """The model(s) of one benchmark case, as a dict name -> nn.Module (same on every rank)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if model == "dcgan":
        # DCGAN for 32x32 images (4 transposed convs / 4 convs, no conv biases): 6.09M parameters in
        # 18 tensors, each BatchNorm counting 2 (weight, bias).
        gen = nn.Sequential(
            nn.ConvTranspose2d(100, 512, 4, 1, 0, bias=False), nn.BatchNorm2d(512), nn.ReLU(True),
            nn.ConvTranspose2d(512, 256, 4, 2, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(True),
            nn.ConvTranspose2d(256, 128, 4, 2, 1, bias=False), nn.BatchNorm2d(128), nn.ReLU(True),
            nn.ConvTranspose2d(128, 3, 4, 2, 1, bias=False), nn.Tanh(),
        )  # fmt: skip
        disc = nn.Sequential(
            nn.Conv2d(3, 128, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, True),
            nn.Conv2d(128, 256, 4, 2, 1, bias=False), nn.BatchNorm2d(256), nn.LeakyReLU(0.2, True),
            nn.Conv2d(256, 512, 4, 2, 1, bias=False), nn.BatchNorm2d(512), nn.LeakyReLU(0.2, True),
            nn.Conv2d(512, 1, 4, 1, 0, bias=False),
        )  # fmt: skip
        return {"gen": gen, "disc": disc}
    if model == "mlp400":
        return {"mlp": nn.Sequential(*[nn.Linear(64, 64) for _ in range(200)])}
    raise ValueError(f"unknown model {model!r}")


def _params(modules) -> list:
    return [p for m in modules for p in m.parameters()]


def measure_on_device(fabric, models: list[str], repeats: int, warmup: int, peers: bool) -> list[dict]:
    """:func:`measure_world` with every tensor it makes on the world's device: the floor's and PyTorch's too."""
    import torch

    if fabric.device.type != "cpu":  # on CPU no default-device mode, which would slow every torch call
        torch.set_default_device(fabric.device)
    return measure_world(fabric, models, repeats, warmup, peers)


def measure_world(fabric, models: list[str], repeats: int, warmup: int, peers: bool) -> list[dict]:
    """On every rank: time each method on each model, interleaved; then profile one call of each."""
    import torch.distributed as dist

    rows = []
    for model in models:
        rows += measure_model(fabric, model, repeats, warmup, peers)
        dist.barrier()
    return rows


def _methods(fabric, model: str, peers: bool) -> tuple[dict, list, int, int]:
    """The calls to time for ``model``: {method: one round}, the entered Averagers, elements, tensors."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.model_averaging.utils import average_parameters

    from fabric_multimodel import Averager, setup_models

    world = fabric.world_size
    calls = {}
    averagers = []
    for method, options in OURS.items():
        # Each method gets its own copy: an Averager re-homes its parameters into flat storage.
        options = dict(options)
        if options.get("outer_optimizer") == "nesterov":
            options["outer_optimizer"] = functools.partial(
                torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True, foreach=True
            )
        if "comm_dtype" in options:
            options["comm_dtype"] = getattr(torch, options["comm_dtype"])
        modules = list(setup_models(fabric, **build(model)))
        if options.get("optimizers") == "adam":  # one step (of zero gradients) makes Adam's moments
            adam = torch.optim.Adam(_params(modules))
            for p in _params(modules):
                p.grad = torch.zeros_like(p)
            adam.step()
            options["optimizers"] = [adam]
        # Parameters only, so every method moves the same elements (BatchNorm running statistics
        # would add 1,792 elements on the DCGAN pair). period=1: every step() is a full round.
        averager = Averager(fabric, modules, period=1, average_buffers=False, **options)
        averager.__enter__()
        averagers.append(averager)
        calls[method] = averager.step
    pytorch_params = _params(build(model).values())
    per_tensor_params = _params(build(model).values())
    n_params = sum(p.numel() for p in pytorch_params)
    floor = torch.zeros(n_params, dtype=torch.float32)
    floor_div = torch.zeros(n_params, dtype=torch.float32)
    floor_adam = torch.zeros(3 * n_params, dtype=torch.float32)

    def floor_only() -> None:
        dist.all_reduce(floor)

    def floor_and_divide() -> None:
        dist.all_reduce(floor_div)
        floor_div.div_(world)

    def pytorch() -> None:
        average_parameters(pytorch_params, None)

    def per_tensor() -> None:
        with torch.no_grad():
            for p in per_tensor_params:
                dist.all_reduce(p.data)
                p.data.div_(world)

    calls.update(
        {
            "floor": floor_only,
            "floor+div": floor_and_divide,
            "floor-adam": lambda: dist.all_reduce(floor_adam),
            "pytorch": pytorch,
            "per-tensor": per_tensor,
        }
    )
    if peers and HAS_TORCHFT and world == 2:
        from benchmarks.peers import torchft_diloco_round

        for method, bucketize in (("torchft", False), ("torchft-bucketized", True)):
            calls[method] = torchft_diloco_round(fabric, lambda: build(model), bucketize=bucketize)
    return calls, averagers, n_params, len(pytorch_params)


def measure_model(fabric, model: str, repeats: int, warmup: int, peers: bool) -> list[dict]:
    import torch.distributed as dist

    world, rank = fabric.world_size, fabric.global_rank
    calls, averagers, n_params, n_tensors = _methods(fabric, model, peers)
    methods = [m for m in (*BASE_METHODS, *PEER_METHODS) if m in calls]
    times: dict[str, list[float]] = {m: [] for m in methods}
    floor_s = seconds_per_call(calls["floor"], fabric.device)
    floor_calls = max(1, math.ceil(TIMED_S / floor_s))
    # The same count for every method, so that each ratio compares runs of equal length; a method whose one
    # call lasts twice that (the per-tensor loop) is already long enough, and is timed once.
    in_a_row = {m: floor_calls if seconds_per_call(calls[m], fabric.device) < 2 * TIMED_S else 1 for m in methods}
    bar = common.Progress(f"{model} at {world} ranks", warmup + repeats)
    for r in range(warmup + repeats):
        # Interleaved, in a new order each repeat (the same on every rank): no method always runs first, or right
        # after the same other one, whose memory traffic would slow it alone (a rotation kept the neighbours:
        # `ours` always ran after `floor-adam`'s 10 MB and measured 12-27% slower than `ours-nocheck`, the same work).
        order = random.Random(r).sample(methods, len(methods))
        for method in order:
            elapsed = common.barrier_timed(calls[method], in_a_row[method])
            if r >= warmup:
                times[method].append(elapsed)
        bar.advance()
    counted = {}
    for method in methods:
        dist.barrier()
        counted[method] = common.profile_call(calls[method])
        common.progress(f"{model} at {world} ranks: profiled one {method} round")
    # What each of our rounds sent, as the Averager counts it (exact; the quantized ones are no allreduce).
    sent = {method: a.traffic.bytes // max(1, a.rounds) for method, a in zip(OURS, averagers)}
    for averager in averagers:
        averager.__exit__(None, None, None)
    all_times = common.gather(times)
    all_counted = common.gather(counted)
    if rank != 0:
        return []
    rows = []
    floors: dict[str, list[float]] = {}
    for method in methods:
        # A round ends when its slowest rank is done: per repeat, the max over ranks.
        per_repeat = [max(rank_times[method][i] for rank_times in all_times) for i in range(repeats)]
        med = common.median(per_repeat)
        if method.startswith("floor"):
            floors[method] = per_repeat
        floor = floors["floor-adam" if method.endswith("-adam") else "floor"]
        quartiles = _quartiles(per_repeat)
        collectives = all_counted[0][method]["collectives"]
        reductions = [(n, dtypes) for name, n, dtypes in collectives if name.endswith("all_reduce")]
        rows.append(
            {
                "model": model,
                "params": n_params,
                "tensors": n_tensors,
                "ranks": world,
                "method": method,
                "median_ms": med * 1e3,
                "min_ms": min(per_repeat) * 1e3,
                "p25_ms": quartiles[0] * 1e3,
                "p75_ms": quartiles[1] * 1e3,
                "ratio_to_floor": med / common.median(floor),
                # Each repeat's own ratio (both timed within one repeat, under the same load), then the median:
                # steadier than the ratio of the medians on a shared machine whose load drifts between repeats.
                "paired_ratio": common.median([t / f for t, f in zip(per_repeat, floor)]),
                "allreduce_calls": len(reductions),
                "elements_allreduced": sum(n for n, _ in reductions),
                "bytes_allreduced": sent.get(method, sum(n * _dtype_bytes(dtypes) for n, dtypes in reductions)),
                "other_collectives": len(collectives) - len(reductions),
                "extra_bytes": max(c[method]["peak_extra_bytes"] for c in all_counted),
                "repeats": repeats,
                "in_a_row": in_a_row[method],
            }
        )
    return rows


#: Rounds of a floor shorter than this are timed several in a row, as many as make about this long.
TIMED_S = 0.02


def seconds_per_call(call: Callable[[], object], device: Any) -> float:
    """Seconds one ``call()`` takes, the slowest rank's mean of 3 (after one that sets up gloo's pairs), the
    same on every rank. One round of a few milliseconds on a 2-core machine is bimodal (each rank and gloo's
    thread share the cores): single timings of the same call differ by 30% from run to run, a run of rounds
    does not."""
    import torch
    import torch.distributed as dist

    call()
    start = time.perf_counter()
    for _ in range(3):
        call()
    slowest = torch.tensor([(time.perf_counter() - start) / 3], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest)


def _quartiles(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)

    def at(q: float) -> float:
        position = q * (len(ordered) - 1)
        low = int(position)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    return at(0.25), at(0.75)


def _dtype_bytes(dtypes: tuple) -> int:
    name = dtypes[0] if dtypes else "float"
    return {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4}.get(name, 4)


SUMMARY = (
    "ours",
    "ours-adam",
    "ours-bf16",
    "ours-diloco",
    "ours-diloco-bf16",
    "ours-diloco-fp8",
    "ours-diloco-fp4",
    "pytorch",
    "per-tensor",
    "torchft",
    "torchft-bucketized",
)


def summary_table(rows: list[dict]) -> str:
    """One line per model and world size: each method's time as a ratio to the floor, and the check's cost."""
    by_case: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        by_case.setdefault((row["model"], row["ranks"]), {})[row["method"]] = row
    present = [m for m in SUMMARY if any(m in cells for cells in by_case.values())]
    headers = ["model", "ranks", "floor rounds in a row", "floor ms", *present, "NaN/Inf check"]
    table = []
    for (model, ranks), cells in by_case.items():
        line = [MODEL_LABELS[model], ranks, cells["floor"]["in_a_row"], f"{cells['floor']['median_ms']:.2f}"]
        line += [common.ratio(cells[m]["ratio_to_floor"]) if m in cells else "-" for m in present]
        check = cells["ours"]["median_ms"] / cells["ours-nocheck"]["median_ms"] - 1
        line.append(f"{100 * check:+.1f}%")
        table.append(line)
    return common.markdown_table(headers, table)


def memory_table(rows: list[dict]) -> str:
    """Peak extra bytes PyTorch's allocator held during one round, and the bytes each rank sent."""
    by_case: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        by_case.setdefault((row["model"], row["ranks"]), {})[row["method"]] = row
    present = [m for m in SUMMARY if any(m in cells for cells in by_case.values())]
    headers = ["model", "ranks", "bytes sent: floor", *(f"{m} (sent / extra memory)" for m in present)]
    table = []
    for (model, ranks), cells in by_case.items():
        line = [MODEL_LABELS[model], ranks, common.human_bytes(cells["floor"]["bytes_allreduced"])]
        line += [
            f"{common.human_bytes(cells[m]['bytes_allreduced'])} / {common.human_bytes(cells[m]['extra_bytes'])}"
            if m in cells
            else "-"
            for m in present
        ]
        table.append(line)
    return common.markdown_table(headers, table)


def detail_table(rows: list[dict]) -> str:
    headers = [
        "model",
        "ranks",
        "method",
        "median ms",
        "in a row",
        "p25-p75 ms",
        "ratio to floor",
        "paired ratio",
        "allreduce calls",
        "elements",
        "bytes sent",
        "extra bytes",
    ]
    table = [
        [
            r["model"],
            r["ranks"],
            r["method"],
            f"{r['median_ms']:.3f}",
            r["in_a_row"],
            f"{r['p25_ms']:.3f}-{r['p75_ms']:.3f}",
            common.ratio(r["ratio_to_floor"]),
            common.ratio(r["paired_ratio"]),
            r["allreduce_calls"],
            common.thousands(r["elements_allreduced"]),
            r["bytes_allreduced"],
            r["extra_bytes"],
        ]
        for r in rows
    ]
    return common.markdown_table(headers, table)


def main(argv: list[str] | None = None) -> None:
    common.start_clock()
    p = common.parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=None, help="ranks per world (default: 2 4; quick: 2)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds per method (default: 60; quick: 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds per method first (default: 5; quick: 1)")
    p.add_argument(
        "--peers",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time torchft's DiLoCo round at 2 ranks, when installed (default: yes; quick: no)",
    )
    p.add_argument(
        "--accelerator",
        default="cpu",
        help="where the ranks' tensors live (default: cpu); cuda: every rank on the first GPU, over gloo",
    )
    p.add_argument(
        "--models", nargs="+", choices=MODELS, default=None, help="the models to time (default: all; quick: mlp400)"
    )
    args = p.parse_args(argv)
    args.models = args.models or (["mlp400"] if args.quick else list(MODELS))
    args.world_sizes = args.world_sizes or ([2] if args.quick else [2, 4])
    repeats = args.repeats or (3 if args.quick else 60)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 5)
    peers = args.peers if args.peers is not None else not args.quick
    info = common.machine_info()

    rows: list[dict] = []
    for size in args.world_sizes:
        common.progress(f"starting a {size}-process gloo world ({repeats} repeats, {warmup} warm-up)")
        world = run_world(
            size, measure_on_device, list(args.models), repeats, warmup, peers, accelerator=args.accelerator
        )
        rows += world[0]
    elapsed = common.elapsed()

    print(f"# Averaging round cost{' (QUICK mode: indicative only)' if args.quick else ''}\n")
    print(common.machine_line(info, world_sizes=" ".join(map(str, args.world_sizes)), repeats=repeats, warmup=warmup))
    print()
    print("Median ms per round over repeats (per repeat: the slowest rank; each method's rounds timed in a row, as")
    print(f"many as make about {1000 * TIMED_S:.0f} ms of the floor: the third column), as a ratio to the floor;")
    print("the last column is what the default NaN/Inf check adds to a plain round (ours vs ours-nocheck).\n")
    print(summary_table(rows))
    print("\n## Bytes sent per rank and extra memory per round\n")
    print(memory_table(rows))
    print("\n## Details (per method)\n")
    print(detail_table(rows))
    if peers and not HAS_TORCHFT:
        print("\ntorchft is not installed (pip install -e '.[peers]'): no torchft rows.")
    for model in args.models:
        first = next(r for r in rows if r["model"] == model)
        print(f"\n{MODEL_LABELS[model]}: {first['params']:,} parameters in {first['tensors']} tensors.", end="")
    print()
    csv_path = common.write_results(args.out, NAME, info, args, elapsed, rows)
    common.progress(f"done in {elapsed:.0f}s; wrote {csv_path}")


if __name__ == "__main__":
    main()
