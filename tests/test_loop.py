"""Loop, in a real 2-process gloo world: a SIGTERM on one rank at any step stops both ranks at one step with no
round in flight, after a checkpoint of that step; the run resumed from it ends bitwise as one never stopped; the
periodic checkpoints fall where the clock passes a multiple, once nothing is in flight."""

from __future__ import annotations

import functools
import os
import signal
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fabric_multimodel import Averager, Checkpointer, Loop, PreemptionStop, setup_models
from fabric_multimodel.comm.collectives import tensors_fingerprint
from tests.gan import mlp

NESTEROV = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)


def _run(fabric, folder: str, options: dict, steps: int, signal_at: tuple[int, int] | None, every: int, resume: bool):
    """Train to ``steps`` (resumed from ``folder`` when asked); rank ``signal_at[0]`` gets SIGTERM at step
    ``signal_at[1]``. Returns the step reached, whether it stopped, each save's (kind, step, round in flight) and
    the model's fingerprint."""
    torch.manual_seed(0)
    (model,) = setup_models(fabric, m=mlp([3, 8, 2]))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    averager = Averager(fabric, model, **options)
    checkpointer = Checkpointer(fabric, folder, averager=averager)
    state = {"model": model, "optimizer": optimizer, "averager": averager, "step": 0}
    if resume:
        assert checkpointer.resume(state) is not None
    saves: list[tuple[str, int, bool]] = []
    for kind in ("save", "after_round"):
        method = getattr(checkpointer, kind)

        def saving(state, method=method, kind=kind):
            saves.append((kind, state["step"], averager.pending))
            return method(state)

        setattr(checkpointer, kind, saving)
    loop = Loop(averager, steps, checkpointer=checkpointer, state=lambda: state | {"step": loop.step},
                checkpoint_every=every, checkpoint_rounds=True, stop=PreemptionStop(every=2, lag=3))  # fmt: skip
    with averager:
        for step in loop:
            if signal_at == (fabric.global_rank, step):
                os.kill(os.getpid(), signal.SIGTERM)
            data = torch.Generator().manual_seed(100 * step + fabric.global_rank)
            x, y = torch.randn(6, 3, generator=data), torch.randn(6, 2, generator=data)
            fabric.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            averager.step()
    loop.close()
    return loop.step, loop.stopped, saves, tensors_fingerprint(list(model.parameters()))


@settings(max_examples=8, deadline=None)
@given(
    per_fragment=st.integers(2, 4),
    fragments=st.integers(1, 2),
    overlap=st.integers(1, 3),
    warmup=st.integers(0, 6),
    rank=st.integers(0, 1),
    at=st.integers(1, 30),
    every=st.integers(0, 9),
)
def test_a_signal_at_any_step_stops_both_ranks_where_nothing_is_in_flight_and_the_resume_is_exact(
    worlds, per_fragment, fragments, overlap, warmup, rank, at, every
) -> None:
    period, overlap = per_fragment * fragments, min(overlap, per_fragment - 1)
    options = dict(period=period, fragments=fragments, overlap_steps=overlap, warmup_steps=warmup,
                   outer_optimizer=NESTEROV, comm_dtype=torch.bfloat16)  # fmt: skip
    steps, world = 40, worlds(2)
    with tempfile.TemporaryDirectory() as whole, tempfile.TemporaryDirectory() as folder:
        (end, stopped, _, expected), _ = world.run(_run, whole, options, steps, None, every, False)
        assert end == steps and not stopped
        ranks = world.run(_run, folder, options, steps, (rank, at), every, False)
        (step, stopped, saves, _), (other_step, _, other_saves, _) = ranks
        assert step == other_step and saves == other_saves  # both ranks: the same stop, the same checkpoints
        assert all(not in_flight for _, _, in_flight in saves)
        if not stopped:  # the signal came too late to stop before the end
            assert step == steps
            return
        assert at <= step < steps and saves[-1] == ("save", step, False)  # the stop's checkpoint, at its step
        periodic = [at for kind, at, _ in saves[:-1] if kind == "save"]
        assert all(any(at - overlap <= k * every <= at for k in range(1, steps)) for at in periodic)
        resumed = world.run(_run, folder, options, steps, None, every, True)
    assert [(end, fingerprint) for end, _, _, fingerprint in resumed] == [(steps, expected)] * 2


def test_a_loop_whose_averager_counts_no_step_says_so() -> None:
    loop = Loop(None, 3, stop=False)
    assert list(loop) == [1, 2, 3] and loop.step == 3 and loop.close() == ""
    with pytest.raises(ValueError, match="`checkpoint_every`"):
        Loop(None, 3, checkpoint_every=-1, stop=False)
    with pytest.raises(ValueError, match="`state`"):
        Loop(None, 3, checkpointer=object(), stop=False)  # type: ignore[arg-type]


def _refusals(fabric, folder: str, damage: str) -> tuple[str, str, int, bool]:
    """A checkpoint of step 3, then the two ways a run could lose it: a save of a state with no step (refused before
    anything is written), and a resume of a folder whose checkpoint cannot be resumed (``damage``: none is whole on
    any rank). Returns both errors, the step the file still holds and whether its bytes are untouched."""
    torch.manual_seed(0)
    (model,) = setup_models(fabric, m=mlp([3, 8, 2]))
    checkpointer = Checkpointer(fabric, folder)
    path = checkpointer.save({"model": model, "step": 3})
    with pytest.raises(ValueError) as no_step:
        checkpointer.save({"model": model})  # a loop's state without its step
    fabric.barrier()
    kept = torch.load(path, weights_only=True)["step"]
    fabric.barrier()  # every rank read it before rank 0 damages it
    if fabric.global_rank == 0:
        if damage == "no step":
            torch.save({"model": model.state_dict()}, path)
        else:  # torn: the first half of the file
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    fabric.barrier()
    before = path.read_bytes()
    with pytest.raises(ValueError) as unresumable:
        Checkpointer(fabric, folder).resume({"model": model, "step": 0})
    return str(no_step.value), str(unresumable.value), kept, path.read_bytes() == before


@pytest.mark.parametrize("damage", ["no step", "torn"])
def test_a_checkpoint_is_never_lost_to_a_silent_fresh_start(worlds, tmp_path, damage):
    for no_step, unresumable, kept, untouched in worlds(2).run(_refusals, str(tmp_path), damage):
        assert "needs 'step'" in no_step and kept == 3
        assert str(tmp_path / "checkpoint.pt") in unresumable and "nothing was overwritten" in unresumable
        assert ("it has no step" if damage == "no step" else "not a complete PyTorch checkpoint") in unresumable
        assert untouched and "\n" not in unresumable
