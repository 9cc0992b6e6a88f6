"""Gradient elements and bytes allreduced per GAN iteration, and time per iteration, on the ring GAN.

Settings, each on the same world, one after the other:

- (a) one DDP around a container holding G and D, ``find_unused_parameters=True`` (what one DDP
  around a LightningModule does);
- (b) a separate DDP per model with plain Fabric, no ``frozen``: D's parameters still require grad in
  the G step, so D's gradients are allreduced twice per iteration;
- (c) ``setup_models`` + ``frozen(disc)`` in the G step: each model's gradients once.

Counts come from ``torch.profiler`` (``gloo:all_reduce`` events and their input shapes/dtypes) over
steady-state iterations; time per iteration is measured without the profiler. Usage::

    python benchmarks/gan_comm.py [--quick] [--out DIR] [--ranks 4] [--iterations N] [--batch-size B]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from fabric_multimodel.run.launch import run_world  # noqa: E402

NAME = "gan_comm"
SETTINGS = ("a", "b", "c")
SETTING_LABELS = {
    "a": "(a) one DDP around G+D, find_unused_parameters=True",
    "b": "(b) DDP per model, no frozen (plain Fabric)",
    "c": "(c) setup_models + frozen",
}
WARMUP_ITERATIONS = 2  # DDP rebuilds its buckets (one broadcast) in the first iterations
PROFILED_ITERATIONS = 3
Z_DIM = 2  # the example's latent size, so |G| here is the example's


def _container_type():
    from torch import nn

    class Container(nn.Module):
        """One module holding both models, so one DDP wraps both (as with a LightningModule)."""

        def __init__(self, gen: nn.Module, disc: nn.Module) -> None:
            super().__init__()
            self.gen, self.disc = gen, disc

        def forward(self, z, real=None):
            fake = self.gen(z)
            if real is not None:  # D step: D(real), D(fake.detach()); G is unused in its backward
                return self.disc(real), self.disc(fake.detach())
            return self.disc(fake)  # G step: D(G(z)); every parameter gets a gradient

    return Container


def _setting_iteration(fabric, setting: str, lr: float):
    """Build one setting's models and optimizers on this rank.

    Returns (one-iteration function of (real, z), (|G|, |D|), number of parameter tensors).
    """
    import torch
    from torch import nn

    from fabric_multimodel import frozen, setup_models
    from fabric_multimodel.ring import ring_gan

    torch.manual_seed(0)
    gen, disc = ring_gan(Z_DIM)
    sizes = (sum(p.numel() for p in gen.parameters()), sum(p.numel() for p in disc.parameters()))
    n_tensors = len([*gen.parameters(), *disc.parameters()])
    bce = nn.BCEWithLogitsLoss()

    def adam(params):
        return torch.optim.Adam(params, lr=lr, betas=(0.5, 0.999))

    if setting == "a":
        # The same DDP as Fabric(strategy=DDPStrategy(find_unused_parameters=True)).setup_module(...).
        (both,) = setup_models(
            fabric, both=_container_type()(gen, disc), ddp_kwargs={"both": {"find_unused_parameters": True}}
        )
        opt_g, opt_d = fabric.setup_optimizers(adam(both.module.gen.parameters()), adam(both.module.disc.parameters()))

        def container_iteration(real, z):
            ones = torch.ones(real.shape[0], 1)
            d_real, d_fake = both(z, real)
            opt_d.zero_grad()
            fabric.backward(bce(d_real, ones) + bce(d_fake, torch.zeros_like(ones)))
            opt_d.step()
            g_loss = bce(both(z), ones)
            opt_g.zero_grad()
            fabric.backward(g_loss)
            opt_g.step()

        return container_iteration, sizes, n_tensors

    if setting == "b":
        gen, disc = fabric.setup_module(gen), fabric.setup_module(disc)
    else:
        gen, disc = setup_models(fabric, gen=gen, disc=disc)
    opt_g, opt_d = fabric.setup_optimizers(adam(gen.parameters()), adam(disc.parameters()))

    def iteration(real, z):
        ones = torch.ones(real.shape[0], 1)
        fake = gen(z)
        d_loss = bce(disc(real), ones) + bce(disc(fake.detach()), torch.zeros_like(ones))
        opt_d.zero_grad()
        fabric.backward(d_loss)
        opt_d.step()
        if setting == "c":
            with frozen(disc):  # D is used, not trained: no gradients for it, no allreduce
                g_loss = bce(disc(fake), ones)
        else:
            g_loss = bce(disc(fake), ones)  # D's parameters get gradients, and DDP allreduces them
        opt_g.zero_grad()
        fabric.backward(g_loss)
        opt_g.step()

    return iteration, sizes, n_tensors


def measure_world(fabric, iterations: int, batch: int, lr: float) -> list[dict]:
    """On every rank: for each setting, warm up, profile a few iterations, then time many."""
    import torch.distributed as dist

    rows = []
    for setting in SETTINGS:
        rows += measure_setting(fabric, setting, iterations, batch, lr)
        dist.barrier()
    return rows


def measure_setting(fabric, setting: str, iterations: int, batch: int, lr: float) -> list[dict]:
    """One setting on every rank: warm up, profile a few iterations, then time many. Rank 0 gets the row."""
    import torch
    import torch.distributed as dist

    from fabric_multimodel.ring import sample_ring

    world, rank = fabric.world_size, fabric.global_rank
    iteration, (g, d), n_tensors = _setting_iteration(fabric, setting, lr)
    data = torch.Generator().manual_seed(1000 + rank)  # different data on every rank

    def batch_data():
        return sample_ring(batch, generator=data), torch.randn(batch, Z_DIM, generator=data)

    for _ in range(WARMUP_ITERATIONS):
        iteration(*batch_data())
    inputs = [batch_data() for _ in range(PROFILED_ITERATIONS)]
    dist.barrier()

    def profiled():
        for real, z in inputs:
            iteration(real, z)

    counted = common.profile_call(profiled)
    times = []
    bar = common.Progress(f"setting ({setting}) at {world} ranks", iterations)
    dist.barrier()
    for _ in range(iterations):
        real, z = batch_data()
        start = time.perf_counter()
        iteration(real, z)
        times.append(time.perf_counter() - start)
        bar.advance()
    all_times = common.gather(times)
    all_counted = common.gather(counted["collectives"])
    # Every rank issues the same collectives (the profiler may list events of the autograd thread
    # and of the main thread in either order); check it rather than assume it, on every rank.
    if any(sorted(c) != sorted(all_counted[0]) for c in all_counted):
        raise RuntimeError(f"setting {setting}: ranks issued different collectives: {all_counted}")
    if rank != 0:
        return []
    reductions = [(n, dtypes) for name, n, dtypes in all_counted[0] if name.endswith("all_reduce")]
    floating = [n for n, dtypes in reductions if all(_is_float(t) for t in dtypes)]
    integer = [n for n, dtypes in reductions if not all(_is_float(t) for t in dtypes)]
    others = [name for name, _, _ in all_counted[0] if not name.endswith("all_reduce")]
    per_iteration = [max(rank_times[i] for rank_times in all_times) for i in range(iterations)]
    row = {
        "setting": setting,
        "description": SETTING_LABELS[setting],
        "ranks": world,
        "gen_params": g,
        "disc_params": d,
        "param_tensors": n_tensors,
        "gradient_elements_per_iter": sum(floating) / PROFILED_ITERATIONS,
        "gradient_bytes_per_iter": 4 * sum(floating) / PROFILED_ITERATIONS,
        "used_map_elements_per_iter": sum(integer) / PROFILED_ITERATIONS,
        "allreduce_calls_per_iter": len(reductions) / PROFILED_ITERATIONS,
        "other_collectives_per_iter": len(others) / PROFILED_ITERATIONS,
        "ms_per_iter_median": common.median(per_iteration) * 1e3,
        "iterations_timed": iterations,
        "iterations_profiled": PROFILED_ITERATIONS,
        "batch_per_rank": batch,
    }
    return [row]


def _is_float(dtype: str) -> bool:
    return any(word in dtype.lower() for word in ("float", "double", "half", "bfloat"))


def table(rows: list[dict]) -> str:
    ours = next(r for r in rows if r["setting"] == "c")
    headers = [
        "setting",
        "gradient elements/iter",
        "gradient bytes/iter",
        "ratio to (c)",
        "allreduce calls/iter",
        "extra allreduce calls",
        "used-map elements/iter",
        "ms/iter",
        "ms ratio to (c)",
    ]
    body = [
        [
            r["description"],
            _number(r["gradient_elements_per_iter"]),
            _number(r["gradient_bytes_per_iter"]),
            common.ratio(r["gradient_elements_per_iter"] / ours["gradient_elements_per_iter"]),
            _number(r["allreduce_calls_per_iter"]),
            _number(r["allreduce_calls_per_iter"] - ours["allreduce_calls_per_iter"]),
            _number(r["used_map_elements_per_iter"]),
            f"{r['ms_per_iter_median']:.2f}",
            common.ratio(r["ms_per_iter_median"] / ours["ms_per_iter_median"]),
        ]
        for r in rows
    ]
    return common.markdown_table(headers, body)


def _number(value: float) -> str:
    return common.thousands(value) if float(value).is_integer() else f"{value:,.2f}"


def main(argv: list[str] | None = None) -> None:
    common.start_clock()
    p = common.parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=None, help="processes (default: 4; quick: 2)")
    p.add_argument(
        "--iterations", type=int, default=None, help="timed iterations per setting (default: 300; quick: 30)"
    )
    p.add_argument("--batch-size", type=int, default=256, help="samples per rank per iteration (default: 256)")
    p.add_argument("--lr", type=float, default=2e-4, help="Adam learning rate (default: 2e-4)")
    args = p.parse_args(argv)
    ranks = args.ranks or (2 if args.quick else 4)
    iterations = args.iterations or (30 if args.quick else 300)
    info = common.machine_info()

    common.progress(f"starting a {ranks}-process gloo world ({iterations} timed iterations per setting)")
    rows = run_world(ranks, measure_world, iterations, args.batch_size, args.lr)[0]
    elapsed = common.elapsed()
    g, d, tensors = rows[0]["gen_params"], rows[0]["disc_params"], rows[0]["param_tensors"]

    print(f"# GAN communication per iteration{' (QUICK mode: indicative only)' if args.quick else ''}\n")
    print(common.machine_line(info, world_size=ranks, batch_per_rank=args.batch_size, timed_iterations=iterations))
    print()
    print(
        f"Ring GAN (fabric_multimodel.ring.ring_gan): |G| = {g:,}, |D| = {d:,} parameters in {tensors} tensors."
        f" Expected gradient elements/iter: (c) |G|+|D| = {g + d:,}; (b) |G|+2|D| = {g + 2 * d:,};"
        f" (a) 2(|G|+|D|) = {2 * (g + d):,}."
    )
    print(
        f"Counted by torch.profiler (gloo:all_reduce input elements) over {PROFILED_ITERATIONS} iterations after"
        f" {WARMUP_ITERATIONS} warm-up iterations; bytes = elements x 4 (fp32 gradients). The used-map is DDP's"
        " int32 map of used parameters that find_unused_parameters allreduces every backward, counted apart."
        " ms/iter: median over timed iterations (no profiler) of the slowest rank.\n"
    )
    print(table(rows))
    csv_path = common.write_results(args.out, NAME, info, args, elapsed, rows)
    common.progress(f"done in {elapsed:.0f}s; wrote {csv_path}")


if __name__ == "__main__":
    main()
