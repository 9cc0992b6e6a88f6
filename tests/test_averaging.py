"""Averager, average_models, replicas_in_sync: the invariants of docs/design.md section 4, in gloo worlds."""

from __future__ import annotations

import copy
import functools
import os
import tempfile
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from lightning_fabric import Fabric
from torch import nn

from fabric_multimodel import Averager, AveragerConfig, average_models, frozen, replicas_in_sync, setup_models
from tests.gan import collectives, gan_iteration, make_gan, mlp
from tests.worlds import errors_of, in_step


def _gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor.contiguous())
    return out


def _flat_state(modules) -> torch.Tensor:
    tensors = [
        t.detach().double().reshape(-1)
        for m in modules
        for t in [*m.parameters(), *m.buffers()]
        if t.is_floating_point()
    ]
    return torch.cat(tensors)


def _ranks_differ(modules, buffers: bool = True) -> bool:
    state = (
        _flat_state(modules)
        if buffers
        else torch.cat([p.detach().reshape(-1) for m in modules for p in m.parameters()])
    )
    gathered = _gather(state)
    return any(not torch.equal(gathered[0], g) for g in gathered[1:])


# --- invariant 3: a round is the arithmetic mean --------------------------------------------------

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def round_is_mean(fabric, seed, hidden, dtype_name, batch_norm, with_optimizer):
    dtype = DTYPES[dtype_name]
    gen, disc = make_gan(seed, 3, 2, hidden, batch_norm)
    gen, disc = setup_models(fabric, gen=gen.to(dtype), disc=disc.to(dtype))
    opt = torch.optim.SGD(gen.parameters(), lr=0.1, momentum=0.9)
    # Make the replicas (and the momentum buffers) differ, as local steps would.
    torch.manual_seed(seed + 100 * fabric.global_rank)
    with torch.no_grad():
        for t in [*gen.parameters(), *disc.parameters(), *gen.buffers(), *disc.buffers()]:
            if t.is_floating_point():
                t.add_(torch.randn_like(t))
        for p in gen.parameters():
            opt.state[p]["momentum_buffer"] = torch.randn_like(p)
    before = _flat_state([gen, disc])
    momentum_before = torch.cat([opt.state[p]["momentum_buffer"].double().reshape(-1) for p in gen.parameters()])
    expected = torch.stack(_gather(before)).mean(0)
    expected_momentum = torch.stack(_gather(momentum_before)).mean(0)
    traffic = average_models(fabric, [gen, disc], optimizers=[opt] if with_optimizer else [])
    after = _flat_state([gen, disc])
    momentum_after = torch.cat([opt.state[p]["momentum_buffer"].double().reshape(-1) for p in gen.parameters()])
    # bfloat16 keeps 8 significant bits: each of the world-size additions may round once.
    relative = 2.0**-8 * (fabric.world_size + 1) if dtype is torch.bfloat16 else 1e-6

    def error(actual, wanted):  # in units of the tolerance: <= 1 passes
        return ((actual - wanted).abs() / (relative * wanted.abs().clamp(min=1.0))).max().item()

    return {
        "mean_error": error(after, expected),
        "momentum_error": error(momentum_after, expected_momentum if with_optimizer else momentum_before),
        "in_sync": replicas_in_sync(fabric, [gen, disc]),
        "elements": traffic.elements,
        "expected_elements": before.numel() + (momentum_before.numel() if with_optimizer else 0),
    }


@pytest.mark.parametrize("size", [2, 3])
@given(
    seed=st.integers(0, 2**16),
    hidden=st.lists(st.integers(1, 16), min_size=1, max_size=3),
    dtype_name=st.sampled_from(sorted(DTYPES)),
    batch_norm=st.booleans(),
    with_optimizer=st.booleans(),
)
def test_a_round_is_the_mean_of_the_replicas(worlds, size, seed, hidden, dtype_name, batch_norm, with_optimizer):
    for result in worlds(size).run(round_is_mean, seed, hidden, dtype_name, batch_norm, with_optimizer):
        assert result["mean_error"] <= 1 and result["momentum_error"] <= 1, result
        assert result["in_sync"]
        assert result["elements"] == result["expected_elements"]


# --- invariant 4: period=1, warmup_steps=0 reproduces synchronous DDP ------------------------------


def period_one_vs_ddp(fabric, seed, hidden, momentum, steps):
    """Train one copy with synchronous DDP and one with Averager(period=1); return max difference."""
    torch.manual_seed(seed)
    model = mlp([3, *hidden, 2])
    results = []
    for use_averager in (False, True):
        (m,) = setup_models(fabric, m=copy.deepcopy(model))
        opt = fabric.setup_optimizers(torch.optim.SGD(m.parameters(), lr=0.05, momentum=momentum))
        averager = Averager(fabric, m, period=1, optimizers=[opt]) if use_averager else None
        data = torch.Generator().manual_seed(seed + fabric.global_rank)
        with averager if averager is not None else nullcontext():
            for _ in range(steps):
                x, y = torch.randn(4, 3, generator=data), torch.randn(4, 2, generator=data)
                fabric.backward(nn.functional.mse_loss(m(x), y))
                opt.step()
                opt.zero_grad()
                if averager is not None:
                    assert averager.step()
        results.append(torch.cat([p.detach().reshape(-1) for p in m.parameters()]))
    return (results[0] - results[1]).abs().max().item()


@given(
    seed=st.integers(0, 2**16),
    hidden=st.lists(st.integers(1, 12), min_size=1, max_size=2),
    momentum=st.sampled_from([0.0, 0.9]),
    steps=st.integers(1, 5),
)
def test_period_one_without_warmup_reproduces_synchronous_ddp(worlds, seed, hidden, momentum, steps):
    assert max(worlds(2).run(period_one_vs_ddp, seed, hidden, momentum, steps)) < 1e-5


# --- schedule, zero collectives in the local phase, replicas differ then agree ---------------------


def run_schedule(fabric, period, warmup_steps, steps, batch_norm):
    """A GAN loop under an Averager; per step: did it average, collectives issued by the iteration,
    and whether replicas differ after it."""
    gen, disc = make_gan(0, 3, 2, [8], batch_norm)
    gen, disc = setup_models(fabric, gen=gen, disc=disc)
    opt_g, opt_d = fabric.setup_optimizers(
        torch.optim.SGD(gen.parameters(), lr=0.1), torch.optim.SGD(disc.parameters(), lr=0.1)
    )
    data = torch.Generator().manual_seed(fabric.global_rank)
    log = []
    with Averager(fabric, [gen, disc], period=period, warmup_steps=warmup_steps) as averager:
        for _ in range(steps):
            real, z = torch.randn(4, 2, generator=data), torch.randn(4, 3, generator=data)
            local = averager.local
            issued = collectives(gan_iteration, fabric, gen, disc, opt_g, opt_d, real, z, frozen)
            averaged = averager.step()
            log.append(
                {
                    "local": local,
                    "issued": issued,
                    "averaged": averaged,
                    "differ": _ranks_differ([gen, disc]),
                    "params_differ": _ranks_differ([gen, disc], buffers=False),
                }
            )
        rounds_inside = averager.rounds
    return {
        "log": log,
        "rounds_inside": rounds_inside,
        "rounds": averager.rounds,
        "in_sync": replicas_in_sync(fabric, [gen, disc]),
    }


@given(
    period=st.integers(1, 5),
    warmup_steps=st.integers(0, 4),
    steps=st.integers(1, 12),
    batch_norm=st.booleans(),
)
def test_schedule_and_silence_of_the_local_phase(worlds, period, warmup_steps, steps, batch_norm):
    result = worlds(2).run(run_schedule, period, warmup_steps, steps, batch_norm)[0]
    log = result["log"]
    for number, entry in enumerate(log, start=1):
        expected = number > warmup_steps and (number - warmup_steps) % period == 0
        assert entry["averaged"] == expected, (number, entry)
        assert entry["local"] == (number > warmup_steps)
        if entry["local"]:
            assert entry["issued"] == [], (number, entry["issued"])
            # Local steps really are local: replicas drift apart until the next round.
            assert entry["differ"] != expected
        else:
            # Synchronous DDP: parameters agree; BatchNorm statistics are each rank's own until a round.
            assert entry["issued"] and not entry["params_differ"]
    local_steps = max(0, steps - warmup_steps)
    rounds_inside = local_steps // period
    synced_at = (
        warmup_steps + period * rounds_inside if rounds_inside else (0 if batch_norm else min(steps, warmup_steps))
    )
    averaged_on_exit = steps > synced_at
    assert result["rounds_inside"] == rounds_inside
    assert result["rounds"] == result["rounds_inside"] + averaged_on_exit
    assert result["in_sync"]


def exit_by_exception(fabric):
    (m,) = setup_models(fabric, m=nn.Linear(2, 2))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ddp = m._forward_module
    try:
        with Averager(fabric, m, period=4) as averager:
            torch.manual_seed(fabric.global_rank)
            fabric.backward(m(torch.randn(3, 2)).sum())
            opt.step()
            averager.step()
            raise KeyError("boom")
    except KeyError:
        pass
    return {
        "rounds": averager.rounds,
        "restored": (ddp.require_backward_grad_sync, ddp.broadcast_buffers),
        "differ": _ranks_differ([m]),
        "in_sync": replicas_in_sync(fabric, [m]),
    }


def test_exit_by_exception_issues_no_collective_and_restores_ddp(worlds):
    for result in worlds(2).run(exit_by_exception):
        assert result["rounds"] == 0
        assert result["restored"] == (True, True)
        assert result["differ"] and not result["in_sync"]


# --- invariant 7: save after sync, load into fresh objects, continue == uninterrupted --------------


def train_with_checkpoint(fabric, period, warmup_steps, split, total, optimizer_name, path):
    def build():
        torch.manual_seed(0)
        (m,) = setup_models(fabric, m=mlp([3, 8, 2], batch_norm=True))
        cls = torch.optim.Adam if optimizer_name == "adam" else torch.optim.SGD
        kwargs = {"lr": 0.01} if optimizer_name == "adam" else {"lr": 0.05, "momentum": 0.9}
        opt = fabric.setup_optimizers(cls(m.parameters(), **kwargs))
        return m, opt

    def train(m, opt, averager, start, stop):
        for step in range(start, stop):
            data = torch.Generator().manual_seed(1000 * step + fabric.global_rank)
            x, y = torch.randn(4, 3, generator=data), torch.randn(4, 2, generator=data)
            fabric.backward(nn.functional.mse_loss(m(x), y))
            opt.step()
            opt.zero_grad()
            averager.step()

    m, opt = build()
    with Averager(fabric, m, period=period, warmup_steps=warmup_steps, optimizers=[opt]) as averager:
        train(m, opt, averager, 0, split)
        averager.sync()
        train(m, opt, averager, split, total)
    uninterrupted = _flat_state([m])

    m, opt = build()
    with Averager(fabric, m, period=period, warmup_steps=warmup_steps, optimizers=[opt]) as averager:
        train(m, opt, averager, 0, split)
        averager.sync()
        fabric.save(path, {"m": m, "opt": opt, "averager": averager})
    m, opt = build()
    averager = Averager(fabric, m, period=period, warmup_steps=warmup_steps, optimizers=[opt])
    fabric.load(path, {"m": m, "opt": opt, "averager": averager})
    with averager:
        train(m, opt, averager, split, total)
    return (uninterrupted - _flat_state([m])).abs().max().item(), averager.steps


@given(
    period=st.integers(1, 4),
    warmup_steps=st.integers(0, 3),
    split=st.integers(1, 6),
    extra=st.integers(1, 6),
    optimizer_name=st.sampled_from(["sgd", "adam"]),
)
def test_save_load_continue_equals_uninterrupted(worlds, period, warmup_steps, split, extra, optimizer_name):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt.pt")
        for difference, steps in worlds(2).run(
            train_with_checkpoint, period, warmup_steps, split, split + extra, optimizer_name, path
        ):
            assert steps == split + extra
            assert difference < 1e-6


# --- invariant 8: bad input raises on every rank before any collective ----------------------------


AVERAGER_BAD_INPUTS = {
    "period bool": (lambda f, m, other: Averager(f, m, period=True), TypeError, "`period`"),
    "period float": (lambda f, m, other: Averager(f, m, period=2.0), TypeError, "`period`"),
    "period zero": (lambda f, m, other: Averager(f, m, period=0), ValueError, "`period` must be >= 1"),
    "period negative": (lambda f, m, other: Averager(f, m, period=-3), ValueError, "`period` must be >= 1"),
    "warmup negative": (lambda f, m, other: Averager(f, m, period=2, warmup_steps=-1), ValueError, "`warmup_steps`"),
    "warmup float": (lambda f, m, other: Averager(f, m, period=2, warmup_steps=1.5), TypeError, "`warmup_steps`"),
    "average_buffers not bool": (
        lambda f, m, other: Averager(f, m, period=2, average_buffers=1),
        TypeError,
        "average_buffers",
    ),
    "raw module": (lambda f, m, other: Averager(f, nn.Linear(2, 2), period=2), TypeError, "was not set up"),
    "unknown option": (lambda f, m, other: Averager(f, m, period=2, perod=3), TypeError, "unknown option(s) 'perod'"),
    "no period": (lambda f, m, other: Averager(f, m, warmup_steps=2), TypeError, "pass `period`"),
    "config not a config": (lambda f, m, other: Averager(f, m, {"period": 2}), TypeError, "`config`"),
    "bad replacement": (
        lambda f, m, other: Averager(f, m, AveragerConfig(period=4), overlap_steps=4),
        ValueError,
        "`overlap_steps` (4) must be smaller than `period` (4)",
    ),
    "no modules": (lambda f, m, other: Averager(f, [], period=2), ValueError, "`modules` is empty"),
    "not a module": (lambda f, m, other: Averager(f, [m, "disc"], period=2), TypeError, "`modules`"),
    "optimizer not in a list": (
        lambda f, m, other: Averager(f, m, period=2, optimizers=torch.optim.SGD(m.parameters(), lr=1)),
        TypeError,
        "`optimizers`",
    ),
    # These disagree across ranks (DDP already rejects set-up models of different shapes; a different
    # order or selection of models is what slips through): one construction-time check catches them.
    "modules in another order on rank 1": (
        lambda f, m, other: Averager(f, [m, other] if f.global_rank == 0 else [other, m], period=2),
        ValueError,
        "differ across ranks",
    ),
    "other modules on rank 1": (
        lambda f, m, other: Averager(f, [m, other] if f.global_rank == 0 else [m], period=2),
        ValueError,
        "differ across ranks",
    ),
    "period differs across ranks": (
        lambda f, m, other: Averager(f, m, period=2 + f.global_rank),
        ValueError,
        "differ across ranks",
    ),
}


def raise_averager_bad_inputs(fabric):
    m, other = setup_models(fabric, m=nn.Linear(2, 2), other=nn.Linear(3, 1))
    calls = {case: functools.partial(call, fabric, m, other) for case, (call, _, _) in AVERAGER_BAD_INPUTS.items()}
    return errors_of(calls), in_step()


def test_averager_bad_input_raises_on_every_rank(worlds):
    for errors, total in worlds(2).run(raise_averager_bad_inputs):
        assert total == 2
        for case, (_, error_type, words) in AVERAGER_BAD_INPUTS.items():
            assert errors[case] is not None, f"{case} did not raise"
            assert errors[case][0] == error_type.__name__ and words in errors[case][1], (case, errors[case])


# --- world size 1: everything works and nothing is communicated ----------------------------------


@given(period=st.integers(1, 4), warmup_steps=st.integers(0, 3), steps=st.integers(0, 8))
def test_single_process_averager_communicates_nothing(period, warmup_steps, steps):
    fabric = Fabric(accelerator="cpu", devices=1)
    (m,) = setup_models(fabric, m=nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4)))
    opt = fabric.setup_optimizers(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    before = copy.deepcopy(m.state_dict())
    with Averager(fabric, m, period=period, warmup_steps=warmup_steps, optimizers=[opt]) as averager:
        for number in range(1, steps + 1):
            fabric.backward(m(torch.randn(3, 2)).sum())
            opt.step()
            assert averager.step() == (number > warmup_steps and (number - warmup_steps) % period == 0)
        averager.sync()
    assert averager.traffic.elements == averager.traffic.bytes == 0
    assert replicas_in_sync(fabric, m)
    assert average_models(fabric, m).elements == 0
    # The parameters still train (flat storage did not detach them from the optimizer).
    changed = any(not torch.equal(before[name], p) for name, p in m.module.named_parameters())
    assert changed == (steps > 0)
