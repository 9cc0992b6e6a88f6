"""Low-bit rounds in the Averager: fp8 and fp4 pseudo-gradients through the quantized mean, in real gloo worlds.

The quantized mean itself is tested in tests/test_quantized.py; here: the rounds built on it keep
replicas identical, count what they send, resume exactly with error feedback, catch NaN on every
rank, overlap (the all-gather a step later) and stream fragments.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from fabric_multimodel import Averager, NonFiniteError, replicas_in_sync, setup_models
from fabric_multimodel.comm import collectives
from fabric_multimodel.comm.codec import relative_error
from tests.gan import mlp
from tests.worlds import errors_of, in_step

NESTEROV = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
CODES = ["float8_e4m3fn", "float8_e5m2", "float4_e2m1fn_x2"]
SIZES = [3, 48, 48, 2]


def local_update(fabric, module, step: int) -> None:
    with torch.no_grad():
        for p in module.parameters():
            noise = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + fabric.global_rank))
            p.add_(0.01 * noise)


def counted(calls: list[tuple[str, int, int]]):
    """Wrap the collectives a quantized round uses, recording (name, step, bytes): torch's all-reduce, the
    library's all-to-all and all-gather (messages on gloo)."""
    places = {"all_reduce": dist, "all_to_all_messages": collectives, "all_gather_messages": collectives}
    originals = {name: getattr(module, name) for name, module in places.items()}
    step = [0]

    def wrap(name):
        def call(*args, **kwargs):
            tensor = args[1] if name != "all_reduce" else args[0]  # what this rank sends or contributes
            if step[0] is not None:  # None: the test's own checks
                calls.append((name, step[0], tensor.numel() * tensor.element_size()))
            return originals[name](*args, **kwargs)

        return call

    for name, module in places.items():
        setattr(module, name, wrap(name))
    return places, originals, step


def lowbit_rounds(fabric, code, overlap, fragments, outer):
    torch.manual_seed(0)
    (m,) = setup_models(fabric, m=mlp(SIZES))
    options = {"outer_optimizer": NESTEROV} if outer else {}
    calls: list[tuple[str, int, int]] = []
    averager = Averager(
        fabric, m, period=8, comm_dtype=getattr(torch, code), overlap_steps=overlap, fragments=fragments, **options
    )
    places, originals, step_now = counted(calls)
    identical = []
    try:
        with averager:
            for step in range(1, 25):
                local_update(fabric, m, step)
                step_now[0] = step
                averager.step()
                if not overlap and fragments == 1 and step % 8 == 0:
                    step_now[0] = None
                    identical.append(bool(replicas_in_sync(fabric, m)))
            step_now[0] = -1  # leaving the block: a round of every fragment
    finally:
        for name, fn in originals.items():
            setattr(places[name], name, fn)
    return calls, identical, averager.traffic.bytes, bool(replicas_in_sync(fabric, m))


@pytest.mark.parametrize("size", [2, 4])
@given(code=st.sampled_from(CODES), overlap=st.sampled_from([0, 1, 2, 3]), fragments=st.sampled_from([1, 2]))
def test_lowbit_rounds_keep_replicas_identical_and_send_what_they_count(worlds, size, code, overlap, fragments):
    overlap = min(overlap, 8 // fragments - 1)
    calls, identical, sent, in_sync = worlds(size).run(lowbit_rounds, code, overlap, fragments, True)[0]
    assert all(identical) and in_sync  # every blocking round leaves the replicas bitwise identical
    assert not [c for c in calls if c[0] == "all_reduce"]  # no float collective: uint8 codes only
    launches = [s for name, s, _ in calls if name == "all_to_all_messages" and s > 0]
    gathers = [s for name, s, _ in calls if name == "all_gather_messages" and s > 0]
    spacing = 8 // fragments
    assert launches == list(range(spacing, 25, spacing))
    # The all-gather comes at the merge with overlap 1, half-way with more (the schedule's second phase).
    assert gathers == [s + (overlap // 2 if overlap >= 2 else overlap) for s in launches if s + overlap <= 24]
    # traffic counts each round's all-to-all input: codes, scales, the exact header, padding.
    assert sent == sum(b for name, _, b in calls if name == "all_to_all_messages")


def bytes_against_fp32(fabric, code):
    torch.manual_seed(0)
    sent = {}
    for dtype in (code, "float32"):
        (m,) = setup_models(fabric, m=mlp([64, 256, 256, 256, 64]))  # 0.15 M parameters
        averager = Averager(fabric, m, period=1, comm_dtype=getattr(torch, dtype), outer_optimizer=NESTEROV)
        with averager:
            local_update(fabric, m, 1)
            averager.step()
            sent[dtype] = averager.traffic.bytes
    return sent[code] / sent["float32"]


@pytest.mark.parametrize("code, limit", [("float8_e4m3fn", 0.27), ("float4_e2m1fn_x2", 0.15)])
def test_a_lowbit_round_sends_a_quarter_or_a_seventh_of_the_bytes(worlds, code, limit):
    for ratio in worlds(2).run(bytes_against_fp32, code):
        assert ratio <= limit, ratio


def close_to_fp32(fabric, code):
    """One DiLoCo round in fp32 and one in ``code`` from the same replicas: within the quantization's bound."""
    results = {}
    for dtype in ("float32", code):
        torch.manual_seed(0)
        (m,) = setup_models(fabric, m=mlp(SIZES))
        averager = Averager(fabric, m, period=1, comm_dtype=getattr(torch, dtype), outer_optimizer=HALF_SGD)
        with averager:
            local_update(fabric, m, 1)
            averager.step()
        results[dtype] = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    # With outer SGD lr 0.5 the result moves by half the mean pseudo-gradient; its error is half the mean's.
    return (results[code] - results["float32"]).abs().max().item()


HALF_SGD = functools.partial(torch.optim.SGD, lr=0.5)


@pytest.mark.parametrize("code", CODES)
def test_a_lowbit_round_lands_within_the_quantization_bound(worlds, code):
    c = relative_error(getattr(torch, code))
    for error in worlds(2).run(close_to_fp32, code):
        # Pseudo-gradients here are at most ~0.05 in magnitude (0.01 * a normal sample, a few of them).
        assert error <= 0.5 * c * (2 + c) * 0.06 + 1e-6, error


def resumed_bitwise(fabric, options, split, extra):
    """Rounds of ``options``, a checkpoint after ``split`` steps and a ``sync()``, then ``extra`` steps, run on and
    resumed from it: whether the checkpoint held a residual (what error feedback kept), and whether the two agree."""

    def build():
        torch.manual_seed(0)
        (m,) = setup_models(fabric, m=mlp(SIZES))
        return m, Averager(fabric, m, **options)

    def run(m, averager, start, stop, trace):
        for step in range(start, stop):
            local_update(fabric, m, step)
            averager.step()
            trace.append(torch.cat([p.detach().reshape(-1).clone() for p in m.parameters()]))

    m, averager = build()
    uninterrupted: list = []
    with averager:
        run(m, averager, 0, split, [])
        averager.sync()
        saved = copy.deepcopy({"m": m.state_dict(), "averager": averager.state_dict()})
        residual_kept = any(r.abs().sum() > 0 for r in saved["averager"]["error_feedback"])
        run(m, averager, split, split + extra, uninterrupted)
    m, averager = build()
    m.load_state_dict(saved["m"])
    averager.load_state_dict(saved["averager"])
    resumed: list = []
    with averager:
        run(m, averager, split, split + extra, resumed)
    return residual_kept, all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed))


def error_feedback_resume(fabric, code, split, extra):
    options = {"period": 4, "comm_dtype": getattr(torch, code), "outer_optimizer": NESTEROV, "error_feedback": True}
    return resumed_bitwise(fabric, options, split, extra)


@given(code=st.sampled_from(CODES), split=st.integers(2, 9), extra=st.integers(1, 9))
def test_error_feedback_resumes_bitwise(worlds, code, split, extra):
    for residual_kept, same in worlds(2).run(error_feedback_resume, code, split, extra):
        assert residual_kept and same


def regrouped_midway(fabric, options):
    """Rounds with error feedback, the round moved halfway to a new group of the same ranks (what a membership's
    new epoch does) or not; the parameters after each, and whether a residual was kept by then."""
    results, kept = [], False
    for regroup in (False, True):
        torch.manual_seed(0)
        (m,) = setup_models(fabric, m=mlp(SIZES))
        averager = Averager(fabric, m, period=2, outer_optimizer=NESTEROV, **options)
        with averager:
            for step in range(1, 9):
                local_update(fabric, m, step)
                averager.step()
                if regroup and step == 4:
                    kept = any(r.abs().sum() > 0 for r in averager.state_dict()["error_feedback"])
                    averager._round.regroup(collectives.new_group([0, 1]))
        results.append([p.detach().clone() for p in m.parameters()])
    return kept, all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("code", ["float8_e4m3fn", "float4_e2m1fn_x2"])
def test_error_feedback_goes_on_in_a_new_group(worlds, code):
    for kept, same in worlds(2).run(regrouped_midway, {"comm_dtype": getattr(torch, code), "error_feedback": True}):
        assert kept and same


def nan_on_one_rank(fabric, options, sizes=SIZES):
    """A NaN in rank 1's first weight before the second round: the error's names, whether the parameters are back
    at the anchor, what error feedback kept after it (None without), and whether the ranks are in step."""
    torch.manual_seed(0)
    (m,) = setup_models(fabric, m=mlp(sizes))
    averager = Averager(fabric, m, period=2, **options)
    anchor = [p.detach().clone() for p in m.parameters()]
    error = None
    try:
        with averager:
            local_update(fabric, m, 1)
            averager.step()
            if fabric.global_rank == 1:
                with torch.no_grad():
                    next(iter(m.parameters()))[0, 0] = float("nan")
            averager.step()
    except NonFiniteError as raised:
        error = raised.names
    back = all(torch.equal(p, a) for p, a in zip(m.parameters(), anchor))
    return error, back, averager.state_dict().get("error_feedback"), in_step()


@pytest.mark.parametrize("code", ["float8_e4m3fn", "float4_e2m1fn_x2"])
def test_nan_on_one_rank_is_caught_on_every_rank_and_rolled_back(worlds, code):
    options = {"comm_dtype": getattr(torch, code), "outer_optimizer": NESTEROV}
    for names, back_at_anchor, _, check in worlds(2).run(nan_on_one_rank, options):
        assert names == ["0.weight"] and back_at_anchor and check == 2


def bad_lowbit(fabric):
    (m,) = setup_models(fabric, m=mlp(SIZES))
    calls = {
        "an integer dtype": lambda: Averager(fabric, m, period=2, comm_dtype=torch.int8),
        "error feedback without low bits": lambda: Averager(fabric, m, period=2, error_feedback=True),
        "error feedback with bf16": lambda: Averager(
            fabric, m, period=2, comm_dtype=torch.bfloat16, error_feedback=True
        ),
    }
    return errors_of(calls), in_step()


def test_bad_lowbit_options_are_clear_errors_on_every_rank(worlds):
    for errors, check in worlds(2).run(bad_lowbit):
        assert check == 2
        assert "torch.float8_e4m3fn, torch.float8_e5m2 or torch.float4_e2m1fn_x2" in errors["an integer dtype"][1]
        for case in ("error feedback without low bits", "error feedback with bf16"):
            assert "`error_feedback` keeps what block quantization drops" in errors[case][1]
