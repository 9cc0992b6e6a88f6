"""Rounds no single site steers alone (issue 70, robust rounds): the rules (``comm/robust.py``) with hypothesis, the
exchange (``RobustMean``) and ``Averager(robust=...)`` in real gloo worlds of three ranks, one of them hostile."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric_multimodel import Averager, AveragerConfig, replicas_in_sync, setup_models
from fabric_multimodel.comm import collectives
from fabric_multimodel.comm.robust import centered_clip, median, trimmed, trimmed_mean
from fabric_multimodel.comm.robust_mean import RobustMean
from tests.gan import mlp
from tests.test_lowbit import NESTEROV, SIZES, local_update

THIRD = 1 / 3  # of three sites, one trimmed from each side


def honest_and_hostile(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """3 to 6 honest rows near one another, and one hostile row anywhere (up to 1e12 away)."""
    honest, width = draw(st.integers(3, 6)), draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**31 - 1))
    centre = torch.randn(width, generator=torch.Generator().manual_seed(seed))
    rows = centre + 0.1 * torch.randn(honest, width, generator=torch.Generator().manual_seed(seed + 1))
    hostile = draw(st.sampled_from([1e3, -1e6, 1e12])) * torch.randn(
        width, generator=torch.Generator().manual_seed(-seed - 1)
    )
    return rows, hostile


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_one_hostile_row_leaves_the_trimmed_mean_among_the_honest_ones(data: st.DataObject) -> None:
    rows, hostile = honest_and_hostile(data.draw)
    everything = torch.cat([rows, hostile[None]])
    trim = data.draw(st.floats(1 / everything.shape[0], 0.49))
    assert trimmed(everything.shape[0], trim) >= 1
    result = trimmed_mean(everything, trim)
    assert (result >= rows.min(0).values).all() and (result <= rows.max(0).values).all()
    order = torch.randperm(everything.shape[0], generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))
    assert torch.equal(trimmed_mean(everything[order], trim), result)  # rank order does not matter, bitwise


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_one_hostile_row_moves_the_centered_clip_no_farther_than_the_honest_rows_spread(data: st.DataObject) -> None:
    rows, hostile = honest_and_hostile(data.draw)
    result = centered_clip(torch.cat([rows, hostile[None]]))
    spread = torch.cdist(rows, rows).max()
    assert (result - rows.mean(0)).norm() <= 2 * spread + 1e-5
    assert torch.equal(centered_clip(torch.cat([rows, hostile[None]])), result)  # deterministic


@given(st.integers(1, 9), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_the_median_leans_to_neither_side(count: int, width: int, seed: int) -> None:
    rows = torch.randn(count, width, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(median(-rows), -median(rows)) and torch.equal(median(rows[torch.randperm(count)]), median(rows))
    assert torch.allclose(median(rows), rows.double().quantile(0.5, dim=0).float(), atol=1e-6)


@given(st.integers(1, 8), st.floats(0, 0.49))
def test_no_trim_drops_every_row_and_none_is_a_plain_mean(count: int, trim: float) -> None:
    assert 0 <= trimmed(count, trim) and count - 2 * trimmed(count, trim) >= 1
    rows = torch.arange(count * 3, dtype=torch.float32).view(count, 3)
    assert torch.allclose(trimmed_mean(rows, 0.0), rows.mean(0))


def _robust_round(fabric: object, rule: str, hostile: str, numel: int, code: str | None = None) -> tuple:
    """One robust round of ``numel`` values and a 2-value header; rank 2 sends ``hostile`` (``scale``: its payload
    times 1e6, ``nan``: one NaN); the all-gathers counted."""
    rank = dist.get_rank()
    payload = 1.0 + 0.1 * torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    honest = payload.clone()
    if rank == 2:
        payload = payload * 1e6 if hostile == "scale" else payload.index_fill(0, torch.tensor([0]), float("nan"))
    header = torch.tensor([float(rank), 1.0])
    calls = []
    original = collectives.all_gather_messages

    def counting(output, message, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(message.numel() * message.element_size())
        return original(output, message, **kwargs)

    collectives.all_gather_messages = counting
    code_dtype = getattr(torch, code) if code else None
    mean = RobustMean(numel, "cpu", rule=rule, trim=THIRD, exact_numel=2, code_dtype=code_dtype)
    try:
        mean.start(payload, header)
        mean.exchange()
        mean.finish()
    finally:
        collectives.all_gather_messages = original
    return payload, honest, header, calls, mean.traffic.bytes, mean.dropped


#: The bytes of one rank's message of 1000 values and a 2-value header: fp32, fp8 and fp4 codes (32-value blocks,
#: a bf16 scale each).
ROW_BYTES = {None: 4 * 1002, "float8_e4m3fn": 8 + 32 * (32 + 2), "float4_e2m1fn_x2": 8 + 32 * (16 + 2)}


@pytest.mark.parametrize("rule", ["trimmed_mean", "clip"])
@pytest.mark.parametrize(("hostile", "code"), [("scale", None), ("nan", None), ("scale", "float8_e4m3fn"),
                                               ("nan", "float4_e2m1fn_x2")])  # fmt: skip
def test_a_robust_round_agrees_bitwise_and_no_hostile_rank_steers_it(
    worlds, rule: str, hostile: str, code: str | None
) -> None:
    numel = 1000
    results = worlds(3).run(_robust_round, rule, hostile, numel, code)
    means = [mean for mean, *_ in results]
    assert all(torch.equal(mean, means[0]) for mean in means)  # every rank, the hostile one too
    honest = torch.stack([results[0][1], results[1][1]])
    assert (means[0] - honest.mean(0)).abs().max() < 0.5, (means[0] - honest.mean(0)).abs().max()
    assert all(torch.equal(result[2], torch.tensor([3.0, 3.0])) for result in results)  # the header: summed
    for _, _, _, calls, sent, dropped in results:
        assert calls == [ROW_BYTES[code]] and sent == 2 * ROW_BYTES[code]  # one all-gather: to each of 2 others
        assert dropped == ([2] if hostile == "nan" else [])


def _hostile_run(fabric: object, robust: str | None, code: str | None = None) -> tuple[torch.Tensor, bool]:
    """DiLoCo rounds every 4 steps for 16 steps; rank 2 (when ``robust`` is not 'honest') pushes its parameters
    100 times farther each step. Returns rank 0's parameters and whether every replica agrees."""
    torch.manual_seed(0)
    (m,) = setup_models(fabric, m=mlp(SIZES))
    options = {} if robust in (None, "honest") else {"robust": robust, "trim": THIRD} if robust == "trimmed_mean" else {
        "robust": robust}  # fmt: skip
    if code:
        options["comm_dtype"] = getattr(torch, code)
    averager = Averager(fabric, m, period=4, outer_optimizer=NESTEROV, **options)
    with averager:
        for step in range(1, 17):
            before = [p.detach().clone() for p in m.parameters()]
            local_update(fabric, m, step)
            if dist.get_rank() == 2 and robust != "honest":
                with torch.no_grad():
                    for p, b in zip(m.parameters(), before):
                        p.copy_(b + 100 * (p - b))
            averager.step()
    flat = torch.cat([p.detach().flatten() for p in m.parameters()])
    return flat, bool(replicas_in_sync(fabric, m))


def test_robust_rounds_keep_a_hostile_site_from_steering_the_model(worlds) -> None:
    world = worlds(3)
    honest, synced = world.run(_hostile_run, "honest")[0]
    assert synced
    distance = {}
    for robust, code in ((None, None), ("trimmed_mean", None), ("clip", None), ("clip", "float4_e2m1fn_x2")):
        params, synced = world.run(_hostile_run, robust, code)[0]
        assert synced  # the rule is deterministic: every replica, the hostile one included, holds the same model
        distance[robust, code] = float((params - honest).norm())
    assert all(d < 0.1 * distance[None, None] for key, d in distance.items() if key[0]), distance


@pytest.mark.parametrize(
    ("options", "named"),
    [({"robust": "median"}, "`robust` must be one of 'clip', 'trimmed_mean'"),
     ({"robust": "trimmed_mean", "trim": 0.5}, "`trim` is the share trimmed from each side"),
     ({"trim": 0.2}, "set `robust='trimmed_mean'` too"),
     ({"robust": "clip", "trim": 0.2}, "not 'clip''s"),
     ({"robust": "clip", "comm_dtype": torch.bfloat16}, "cannot be combined with another `comm_dtype`"),
     ({"robust": "clip", "comm_dtype": torch.float8_e4m3fn, "error_feedback": True}, "`error_feedback`"),
     ({"robust": "clip", "density": 1 / 64}, "`density`"),
     ({"robust": "clip", "pace": "speed", "warmup_steps": 2}, "`pace='speed'`")],
)  # fmt: skip
def test_what_robust_rounds_cannot_take_is_an_error_naming_it(options: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        AveragerConfig(period=4, **options)


def test_a_dropped_contribution_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    mean = RobustMean(4, "cpu", rule="clip")
    with caplog.at_level(logging.WARNING, logger="fabric_multimodel"):
        payload = torch.tensor([1.0, float("inf"), 0.0, 0.0])
        mean.all_reduce_mean(payload)  # one rank: its own contribution is all there is, and it is not finite
    assert mean.dropped == [0] and payload.isnan().all() and "dropped the contributions of ranks [0]" in caplog.text
