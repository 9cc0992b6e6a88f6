"""DiLoCo (outer optimizer) and half-precision payloads in the Averager, in real gloo worlds."""

from __future__ import annotations

import functools
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from fabric_multimodel import Averager, replicas_in_sync, setup_models
from fabric_multimodel.rounds.header import Header
from tests.gan import allreduce_payloads, mlp
from tests.worlds import errors_of, in_step

NESTEROV = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
PLAIN_SGD = functools.partial(torch.optim.SGD, lr=1.0)


def flat_params(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in module.parameters()])


def train(fabric, model, averager, steps, seed, lr=0.05):
    """``steps`` SGD iterations on rank-specific data, each followed by ``averager.step()``."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        data = torch.Generator().manual_seed(1000 * seed + 10 * step + fabric.global_rank)
        x, y = torch.randn(4, model.module[0].in_features, generator=data), torch.randn(4, 2, generator=data)
        fabric.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
        averager.step()


# --- the identity: outer SGD with lr 1 and no momentum is plain averaging -----------------------


def outer_lr1_vs_plain(fabric, seed, hidden, period, warmup_steps, steps, batch_norm):
    results = []
    for outer in (None, PLAIN_SGD):
        torch.manual_seed(seed)
        (m,) = setup_models(fabric, m=mlp([3, *hidden, 2], batch_norm=batch_norm))
        averager = Averager(fabric, m, period=period, warmup_steps=warmup_steps, outer_optimizer=outer)
        with averager:
            train(fabric, m, averager, steps, seed)
        results.append(
            (
                torch.cat([flat_params(m), *[b.double().reshape(-1) for b in m.buffers() if b.is_floating_point()]]),
                averager.rounds,
            )
        )
    (plain, plain_rounds), (outer, outer_rounds) = results
    return (plain - outer).abs().max().item(), plain_rounds == outer_rounds, bool(replicas_in_sync(fabric, m))


@pytest.mark.parametrize("size", [2, 4])
@given(
    seed=st.integers(0, 2**16),
    hidden=st.lists(st.integers(1, 8), min_size=1, max_size=2),
    period=st.integers(1, 4),
    warmup_steps=st.integers(0, 3),
    steps=st.integers(1, 9),
    batch_norm=st.booleans(),
)
def test_outer_sgd_with_lr_one_is_plain_averaging(worlds, size, seed, hidden, period, warmup_steps, steps, batch_norm):
    for difference, same_rounds, in_sync in worlds(size).run(
        outer_lr1_vs_plain, seed, hidden, period, warmup_steps, steps, batch_norm
    ):
        assert difference < 1e-6 and same_rounds and in_sync


# --- two rounds against a hand-computed Nesterov step -------------------------------------------


def two_outer_rounds(fabric, lr, momentum):
    """Known values: params = anchor - delta_r on rank r, two rounds; returns the anchors after each."""
    torch.manual_seed(0)
    (m,) = setup_models(fabric, m=nn.Linear(3, 2))
    factory = functools.partial(torch.optim.SGD, lr=lr, momentum=momentum, nesterov=True)
    user_grads = [torch.full_like(p, 7.0) for p in m.parameters()]
    for p, g in zip(m.parameters(), user_grads):
        p.grad = g.clone()
    rank = fabric.global_rank
    after = []
    with Averager(fabric, m, period=1, outer_optimizer=factory) as averager:
        start = flat_params(m)
        for round_number in (1, 2):
            with torch.no_grad():
                for i, p in enumerate(m.parameters()):
                    p.sub_((rank + 1) * round_number * (i + 1) * 0.01)
            averager.step()
            after.append(flat_params(m))
        grads_kept = all(torch.equal(p.grad, g) for p, g in zip(m.parameters(), user_grads))
    return start, after, grads_kept, [p.numel() for p in m.parameters()]


@pytest.mark.parametrize("size", [2, 4])
def test_two_rounds_match_a_hand_computed_nesterov_step(worlds, size):
    lr, momentum = 0.7, 0.9
    for start, after, grads_kept, sizes in worlds(size).run(two_outer_rounds, lr, momentum):
        # Rank r moved tensor i by (r+1) * round * (i+1) * 0.01: the mean pseudo-gradient is known.
        mean_rank = sum(r + 1 for r in range(size)) / size
        unit = torch.cat(
            [torch.full((n,), (i + 1) * 0.01 * mean_rank, dtype=torch.float64) for i, n in enumerate(sizes)]
        )
        anchor, buf = start, None
        for round_number, actual in zip((1, 2), after):
            g = unit * round_number
            buf = g.clone() if buf is None else momentum * buf + g  # torch SGD: first step copies the gradient
            anchor = anchor - lr * (g + momentum * buf)
            assert (actual - anchor).abs().max().item() < 1e-5, (round_number, actual - anchor)
        assert grads_kept  # the user's param.grad is never touched


# --- bf16 payload: half the bytes, within bf16 rounding of fp32 ---------------------------------


def payload_bytes_and_result(fabric, comm_dtype_name, outer):
    comm_dtype = {"none": None, "bfloat16": torch.bfloat16, "float16": torch.float16}[comm_dtype_name]
    torch.manual_seed(0)
    (m,) = setup_models(fabric, m=mlp([5, 16, 16, 2]))
    averager = Averager(fabric, m, period=2, comm_dtype=comm_dtype, outer_optimizer=NESTEROV if outer else None)
    with averager:
        train(fabric, m, averager, 3, seed=1)  # a round at step 2
        sent = allreduce_payloads(averager.sync)  # and one now; leaving sends one more that changes nothing
    n_params = sum(p.numel() for p in m.parameters())
    return sent, averager.traffic, flat_params(m), n_params


@pytest.mark.parametrize("outer", [False, True])
def test_bfloat16_sends_half_the_bytes_and_lands_within_its_rounding(worlds, outer):
    world = worlds(2)
    fp32 = world.run(payload_bytes_and_result, "none", outer)[0]
    bf16 = world.run(payload_bytes_and_result, "bfloat16", outer)[0]
    (fp32_sent, fp32_traffic, fp32_params, n_params), (bf16_sent, bf16_traffic, bf16_params, _) = fp32, bf16
    header = Header.SLOTS * 2
    assert fp32_sent == [(n_params + header, "float")]  # one allreduce of the payload, counted by the profiler
    assert bf16_sent == [(n_params + header, "c10::BFloat16")]
    assert bf16_traffic.bytes * 2 == fp32_traffic.bytes == 3 * 4 * (n_params + header)  # 3 payloads each
    # bf16 keeps 8 significant bits of each pseudo-gradient; the parameters themselves stay fp32.
    scale = (fp32_params.abs().max() * 2**-7).item()
    assert 0 < (bf16_params - fp32_params).abs().max().item() < scale


# --- exact resume from a checkpoint written right after a round ---------------------------------


def resume_bitwise(fabric, period, warmup_steps, split, extra, comm_dtype_name, path):
    comm_dtype = None if comm_dtype_name == "none" else getattr(torch, comm_dtype_name)

    def build():
        torch.manual_seed(0)
        (m,) = setup_models(fabric, m=mlp([3, 8, 2], batch_norm=True))
        opt = fabric.setup_optimizers(torch.optim.Adam(m.parameters(), lr=0.01))
        # Rank 0 writes the checkpoint, so every rank's inner Adam state must be the same at that point:
        # averaged in the rounds. (Left local, as DiLoCo usually does, it needs a checkpoint per rank.)
        averager = Averager(
            fabric,
            m,
            period=period,
            warmup_steps=warmup_steps,
            outer_optimizer=NESTEROV,
            comm_dtype=comm_dtype,
            optimizers=[opt],
        )
        return m, opt, averager

    def run(m, opt, averager, start, stop, trace):
        for step in range(start, stop):
            data = torch.Generator().manual_seed(100 * step + fabric.global_rank)
            x, y = torch.randn(4, 3, generator=data), torch.randn(4, 2, generator=data)
            fabric.backward(nn.functional.mse_loss(m(x), y))
            opt.step()
            opt.zero_grad()
            averager.step()
            trace.append(flat_params(m))

    uninterrupted: list[torch.Tensor] = []
    m, opt, averager = build()
    with averager:
        run(m, opt, averager, 0, split, [])
        averager.sync()
        run(m, opt, averager, split, split + extra, uninterrupted)

    m, opt, averager = build()
    with averager:
        run(m, opt, averager, 0, split, [])
        averager.sync()
        fabric.save(path, {"m": m, "opt": opt, "averager": averager})
    m, opt, averager = build()
    fabric.load(path, {"m": m, "opt": opt, "averager": averager})
    resumed: list[torch.Tensor] = []
    with averager:
        run(m, opt, averager, split, split + extra, resumed)
    return all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed)) and len(resumed) == extra


@given(
    period=st.integers(1, 4),
    warmup_steps=st.integers(0, 3),
    split=st.integers(1, 6),
    extra=st.integers(1, 8),
    comm_dtype_name=st.sampled_from(["none", "bfloat16"]),
)
def test_resume_after_sync_is_bitwise_identical_at_every_later_step(
    worlds, period, warmup_steps, split, extra, comm_dtype_name
):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt.pt")
        assert all(worlds(2).run(resume_bitwise, period, warmup_steps, split, extra, comm_dtype_name, path))


# --- the anchor is taken at the end of warm-up ----------------------------------------------------


def anchor_at_warmup_end(fabric, warmup_steps, period):
    """Outer SGD lr 0.5 (no momentum): the first round lands halfway between the warm-up's end and the mean."""
    torch.manual_seed(0)
    (m,) = setup_models(fabric, m=mlp([3, 4, 2]))
    half = functools.partial(torch.optim.SGD, lr=0.5)
    seen = {}
    with Averager(fabric, m, period=period, warmup_steps=warmup_steps, outer_optimizer=half) as averager:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for step in range(1, warmup_steps + period + 1):
            data = torch.Generator().manual_seed(step * 10 + fabric.global_rank)
            fabric.backward(m(torch.randn(4, 3, generator=data)).pow(2).mean())
            opt.step()
            opt.zero_grad()
            if step == warmup_steps + period:
                local = flat_params(m)
                everyone = [torch.empty_like(local) for _ in range(fabric.world_size)]
                dist.all_gather(everyone, local)
                seen["mean"] = torch.stack(everyone).mean(0)
            averager.step()
            if step == warmup_steps:
                seen["anchor"] = flat_params(m)
        result = flat_params(m)
    expected = seen["anchor"] + 0.5 * (seen["mean"] - seen["anchor"])
    return (result - expected).abs().max().item()


@given(warmup_steps=st.integers(1, 4), period=st.integers(1, 4))
def test_first_round_steps_from_the_parameters_at_the_end_of_warmup(worlds, warmup_steps, period):
    assert max(worlds(2).run(anchor_at_warmup_end, warmup_steps, period)) < 1e-6


# --- bad input: a clear error on every rank, before any collective --------------------------------

DILOCO_BAD_INPUTS = {
    "factory not callable": (lambda f, m: Averager(f, m, period=2, outer_optimizer="sgd"), TypeError, "factory"),
    "an optimizer instead of a factory": (
        lambda f, m: Averager(f, m, period=2, outer_optimizer=torch.optim.SGD(m.parameters(), lr=1)),
        TypeError,
        "not an optimizer",
    ),
    "factory returns no optimizer": (
        lambda f, m: Averager(f, m, period=2, outer_optimizer=lambda params: params),
        TypeError,
        "must return a torch.optim.Optimizer",
    ),
    "factory optimizes other tensors": (
        lambda f, m: Averager(f, m, period=2, outer_optimizer=lambda params: torch.optim.SGD(m.parameters(), lr=1)),
        ValueError,
        "exactly the tensors it was given",
    ),
    "comm_dtype an int dtype": (lambda f, m: Averager(f, m, period=2, comm_dtype=torch.int8), TypeError, "comm_dtype"),
    "comm_dtype a string": (lambda f, m: Averager(f, m, period=2, comm_dtype="bf16"), TypeError, "comm_dtype"),
}


def raise_diloco_bad_inputs(fabric):
    (m,) = setup_models(fabric, m=nn.Linear(2, 2))
    calls = {case: functools.partial(call, fabric, m) for case, (call, _, _) in DILOCO_BAD_INPUTS.items()}
    return errors_of(calls), in_step()


def test_diloco_bad_input_raises_on_every_rank(worlds):
    for errors, total in worlds(2).run(raise_diloco_bad_inputs):
        assert total == 2
        for case, (_, error_type, words) in DILOCO_BAD_INPUTS.items():
            assert errors[case] is not None, f"{case} did not raise"
            assert errors[case][0] == error_type.__name__ and words in errors[case][1], (case, errors[case])
