"""Rounds at the link's rate: one averaging round of each payload across simulated sites, against its bytes over
the link's rate.

For each ``--bandwidth`` and ``--sites`` count, the sites tool (``fabric_multimodel.sites --launcher torchrun``,
one process per site, root) starts the sites and each times ``--repeats`` rounds of a payload of ``--elements``
fp32 elements (the LM example's parameters by default), each after ``--idle`` seconds with the link quiet, as
between two rounds of training:

- ``fp32``, ``bf16``: torch's allreduce of the payload in that dtype, as the rounds send it;
- ``fp8``, ``fp4``: :class:`~fabric_multimodel.comm.quantized.QuantizedMean` (an all-to-all and an all-gather of
  uint8 codes and scales, as point-to-point messages on gloo);
- ``sparse 1/64``: :class:`~fabric_multimodel.comm.sparse_mean.SparseMean` at density 1/64 (an all-gather of the
  payload sizes, then of the payloads, as point-to-point messages on gloo; each site's payload goes to every other);
- ``fp8, gloo collectives``: the same bytes through gloo's own all-to-all and all-gather, as the rounds sent
  them before (for comparison);
- ``fp8 bytes, one way``: as many bytes from site 0 to site 1 and nothing back, the link's own figure;
- ``fp8 bytes, both ways``: as many bytes from each site to the next at once (each to the one after it, round the
  sites), as an exchange loads the link: each way carries data and the other way's acknowledgements, so this is
  the floor a round's exchange can reach on the link, with no library in it.

``ratio`` = the slowest site's median round / (the bytes each site sends / the nominal rate): a ring allreduce
and the quantized all-to-all plus all-gather each send ``2 (S - 1) / S`` of the payload's bytes, a sparse round
its payload and size to each of the ``S - 1`` others (its last round's, counted by the round); beside it the
same against the rate the sites tool measured for the link. The simulated
link adds no latency; tbf counts the TCP/IP headers, so TCP carries about 95.7% of the rate and no round can
beat a ratio of 1.045.

Usage::

    python benchmarks/link_rate.py [--quick] [--out DIR] [--bandwidth 3mbit 10mbit] [--sites 2 3] [--payloads fp4 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402

NAME = "link_rate"
LM_ELEMENTS = 218_416  # examples/lm_fabric.py at its defaults
PAYLOADS = (
    "fp32", "bf16", "fp8", "fp4", "sparse 1/64", "fp8, gloo collectives", "fp8 bytes, one way", "fp8 bytes, both ways"
)  # fmt: skip


def worker(args: argparse.Namespace) -> None:
    """One site's process: time every payload's rounds; rank 0 writes the slowest rank's medians to ``--result``."""
    import torch
    import torch.distributed as dist

    from fabric_multimodel.comm.collectives import all_gather_single
    from fabric_multimodel.comm.quantized import QuantizedMean
    from fabric_multimodel.comm.sparse_mean import SparseMean

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    n = args.elements
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    fp8 = QuantizedMean(n, torch.float8_e4m3fn, "cpu")
    fp4 = QuantizedMean(n, torch.float4_e2m1fn_x2, "cpu")
    sparse = SparseMean(n, 1 / 64, "cpu")
    codes = torch.zeros(fp8.traffic.bytes, dtype=torch.uint8)
    received, shard = torch.zeros_like(codes), torch.zeros(codes.numel() // world, dtype=torch.uint8)

    share = 2 * (world - 1) / world
    one_way_bytes = torch.zeros(int(fp8.traffic.bytes * share), dtype=torch.uint8)
    arriving = torch.zeros_like(one_way_bytes)

    def one_way() -> None:
        if rank == 0:
            dist.send(one_way_bytes, 1)
        elif rank == 1:
            dist.recv(one_way_bytes, 0)

    def both_ways() -> None:
        work = [dist.irecv(arriving, (rank - 1) % world), dist.isend(one_way_bytes, (rank + 1) % world)]
        for w in work:
            w.wait()

    def gloo_collectives() -> None:
        dist.all_to_all_single(received, codes)
        all_gather_single(codes, shard)

    rounds = {
        "fp32": (lambda: dist.all_reduce(x.clone()), 4 * n * share),
        "bf16": (lambda: dist.all_reduce(x.bfloat16()), 2 * n * share),
        "fp8": (lambda: fp8.all_reduce_mean(x.clone()), fp8.traffic.bytes * share),
        "fp4": (lambda: fp4.all_reduce_mean(x.clone()), fp4.traffic.bytes * share),
        "sparse 1/64": (lambda: sparse.all_reduce_mean(x.clone()), None),  # its size: known once it ran
        "fp8, gloo collectives": (gloo_collectives, fp8.traffic.bytes * share),
        "fp8 bytes, one way": (one_way, fp8.traffic.bytes * share),
        "fp8 bytes, both ways": (both_ways, fp8.traffic.bytes * share),
    }
    found = {}
    for name, (round_, sent) in rounds.items():
        if name not in args.payloads:
            continue
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            time.sleep(args.idle)
            dist.barrier()
            start = time.perf_counter()
            round_()
            times.append(time.perf_counter() - start)
        medians = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(medians, torch.tensor([statistics.median(times)]))
        sent = sparse.traffic.bytes if sent is None else sent
        found[name] = {"sent_bytes": int(sent), "round_s": max(float(m) for m in medians)}
    dist.barrier()
    if rank == 0:
        Path(args.result).write_text(json.dumps(found))
    dist.destroy_process_group()


def measure(args: argparse.Namespace, bandwidth: str, sites: int) -> list[dict[str, Any]]:
    """One sites run at ``bandwidth``: a row per payload."""
    from fabric_multimodel.sites import parse_rate, run_sites

    folder = args.out / f"{NAME}_runs" / f"{bandwidth}-{sites}"
    result_file = folder / "result.json"
    folder.mkdir(parents=True, exist_ok=True)
    result_file.unlink(missing_ok=True)
    worker_args = ["--worker", "--result", str(result_file), "--elements", str(args.elements)]
    worker_args += ["--repeats", str(args.repeats), "--idle", str(args.idle), "--payloads", *args.payloads]
    run = run_sites(
        Path(__file__),
        worker_args,
        sites=sites,
        devices=1,
        bandwidth=bandwidth,
        out=folder / f"sites-{time.time_ns()}",
        launcher="torchrun",
        max_restarts=0,
        stream=False,
        timeout=args.run_timeout,
    )
    if run.code != 0 or not result_file.exists():
        raise SystemExit(f"{NAME}: the run at {bandwidth} with {sites} sites failed (code {run.code}): {run.out}")
    rate = parse_rate(bandwidth)
    assert rate is not None
    rows = []
    for payload, found in json.loads(result_file.read_text()).items():
        ideal = found["sent_bytes"] * 8 / rate
        rows.append(
            {
                "bandwidth": bandwidth,
                "sites": sites,
                "payload": payload,
                "sent_bytes": found["sent_bytes"],
                "round_ms": round(1000 * found["round_s"], 1),
                "bytes_over_rate_ms": round(1000 * ideal, 1),
                "ratio": round(found["round_s"] / ideal, 3),
                "measured_mbit_s": run.measured_mbit_s,
                "ratio_measured": round(found["round_s"] * run.measured_mbit_s * 1e6 / (found["sent_bytes"] * 8), 3)
                if run.measured_mbit_s
                else None,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    common.start_clock()
    p = common.parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--bandwidth", nargs="+", default=None, help="link rates (default 3mbit 10mbit; quick 10mbit)")
    p.add_argument("--sites", type=int, nargs="+", default=None, help="site counts (default 2 3; quick 2)")
    p.add_argument("--elements", type=int, default=None, help=f"fp32 payload elements (default {LM_ELEMENTS})")
    p.add_argument("--repeats", type=int, default=None, help="rounds timed per payload (median; default 9, quick 1)")
    p.add_argument("--idle", type=float, default=None, help="seconds the link is quiet before each round (0.3)")
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds before a sites run is abandoned")
    p.add_argument("--payloads", nargs="+", choices=PAYLOADS, default=list(PAYLOADS), help="which rounds (all)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    quick = args.quick
    args.elements = args.elements or (20_000 if quick else LM_ELEMENTS)
    args.repeats = args.repeats or (1 if quick else 9)
    if args.idle is None:
        args.idle = 0.05 if quick else 0.3
    if args.worker:
        return worker(args)
    bandwidths = args.bandwidth or (["10mbit"] if quick else ["3mbit", "10mbit"])
    site_counts = args.sites or ([2] if quick else [2, 3])
    if os.geteuid() != 0:
        raise SystemExit(f"{NAME}: the simulated sites need root (network namespaces and tc)")
    info = common.machine_info()
    rows: list[dict[str, Any]] = []
    runs = common.Progress("sites runs", len(bandwidths) * len(site_counts), every_s=0)
    for bandwidth in bandwidths:
        for sites in site_counts:
            rows += measure(args, bandwidth, sites)
            runs.advance(note=f"{bandwidth}, {sites} sites")
    common.write_results(args.out, NAME, info, args, common.elapsed(), rows)
    print(common.machine_line(info, elements=args.elements, repeats=args.repeats, idle_s=args.idle) + "\n")
    headers = ["link", "sites", "payload", "bytes sent per site", "round ms", "bytes / rate ms", "ratio"]
    headers.append("ratio to the measured rate")
    table = [
        [r["bandwidth"], r["sites"], r["payload"], common.thousands(r["sent_bytes"]), common.ms(r["round_ms"] / 1000)]
        + [common.ms(r["bytes_over_rate_ms"] / 1000), common.ratio(r["ratio"]), common.ratio(r["ratio_measured"])]
        for r in rows
    ]
    print(common.markdown_table(headers, table))


if __name__ == "__main__":
    main()
