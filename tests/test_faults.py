"""Faults injected into real gloo worlds: what the library does, what the user reads, how long it takes.

Each case asserts the message every rank sees and that it came quickly (no waiting for a timeout).
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fabric_multimodel import Averager, NonFiniteError, average_models, replicas_in_sync, setup_models
from fabric_multimodel.run.launch import run_world
from tests.gan import mlp
from tests.worlds import in_step, run_faulty_world

NESTEROV = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)


def timed_error(call):
    start = time.monotonic()
    try:
        call()
    except Exception as error:  # the test asserts on the type and message
        return type(error).__name__, str(error), time.monotonic() - start
    return None, None, time.monotonic() - start


# --- setup_models: different models on different ranks ---------------------------------------------


def mismatched_setup_models(fabric, case):
    torch.manual_seed(0)
    gen, disc = mlp([2, 4, 2]), mlp([2, 4, 1])
    rank1 = fabric.global_rank == 1
    if case == "missing model":
        call = lambda: setup_models(fabric, gen=gen) if rank1 else setup_models(fabric, gen=gen, disc=disc)  # noqa: E731
    elif case == "dtype":
        call = lambda: setup_models(fabric, gen=gen, disc=disc.double() if rank1 else disc)  # noqa: E731
    else:  # ddp_kwargs given on one rank only
        options = {"disc": {"bucket_cap_mb": 1}} if rank1 else None
        call = lambda: setup_models(fabric, gen=gen, disc=disc, ddp_kwargs=options)  # noqa: E731
    return timed_error(call), in_step()


@pytest.mark.parametrize(
    "case, words",
    [
        ("missing model", ["models", "gen [", "disc ["]),
        ("dtype", ["float64", "float32"]),
        ("ddp_kwargs", ["bucket_cap_mb"]),
    ],
)
def test_setup_models_refuses_models_that_differ_across_ranks(worlds, case, words, record_property):
    results = worlds(2).run(mismatched_setup_models, case)
    record_property("seconds", max(seconds for (_, _, seconds), _ in results))
    for (kind, message, seconds), check in results:
        assert kind == "ValueError" and "differ across ranks" in message, message
        assert all(word in message for word in words), message
        assert "rank 0:" in message and "rank 1:" in message
        assert seconds < 10 and check == 2


# --- step() called a different number of times on different ranks --------------------------------


def drifting_schedule(fabric, extra, warmup_steps, overlap_steps, outer):
    """Rank 1 calls step() one extra time (``extra``) or skips one call, in the local phase."""
    torch.manual_seed(0)
    (m,) = setup_models(fabric, m=nn.Linear(3, 2))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def run():
        with Averager(
            fabric,
            m,
            period=3,
            warmup_steps=warmup_steps,
            overlap_steps=overlap_steps,
            outer_optimizer=NESTEROV if outer else None,
        ) as averager:
            for step in range(1, warmup_steps + 11):
                fabric.backward(m(torch.randn(4, 3)).sum())
                opt.step()
                opt.zero_grad()
                odd = fabric.global_rank == 1 and step == warmup_steps + 2
                if not (odd and not extra):
                    averager.step()
                if odd and extra:
                    averager.step()

    return timed_error(run), in_step()


@pytest.mark.parametrize("extra", [True, False])
@pytest.mark.parametrize("overlap_steps, outer", [(0, False), (1, False), (0, True), (2, True)])
def test_schedule_drift_in_the_local_phase_is_an_error_on_every_rank(
    worlds, extra, overlap_steps, outer, record_property
):
    results = worlds(2).run(drifting_schedule, extra, 2, overlap_steps, outer)
    record_property("seconds", max(seconds for (_, _, seconds), _ in results))
    counts = []
    for (kind, message, seconds), check in results:
        assert kind == "AveragingError", message
        assert "averager.step() was called" in message and "call it exactly once per iteration" in message
        assert seconds < 10 and check == 2
        counts.append(message.split("was called ")[1].split(" times")[0])
    assert counts[0] != counts[1]  # each rank reports its own count and names the other's


def warmup_drift(fabric):
    torch.manual_seed(0)
    (m,) = setup_models(fabric, m=nn.Linear(3, 2))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with Averager(fabric, m, period=2, warmup_steps=4) as averager:
        for step in range(1, 11):
            fabric.backward(m(torch.randn(4, 3)).sum())
            opt.step()
            opt.zero_grad()
            averager.step()
            if fabric.global_rank == 1 and step == 2:
                averager.step()


def test_schedule_drift_in_warmup_fails_fast_instead_of_hanging(record_property):
    # In warm-up, DDP's gradient allreduce pairs with whatever collective the other rank issues next;
    # nothing can tell them apart without a collective per step. Gloo detects the size mismatch and
    # aborts the process; what we promise is a prompt failure, not a hang.
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="warmup_drift failed"):
        run_world(2, warmup_drift, timeout=120)
    record_property("seconds", time.monotonic() - start)  # the world's start included
    assert time.monotonic() - start < 60


# --- optimizer state laid out differently on different ranks -------------------------------------


def different_optimizer_layouts(fabric):
    torch.manual_seed(0)
    (m,) = setup_models(fabric, m=nn.Linear(3, 2))
    opt = torch.optim.Adam(m.parameters(), lr=0.01, amsgrad=fabric.global_rank == 1)

    def run():
        with Averager(fabric, m, period=2, optimizers=[opt]) as averager:
            for _ in range(4):
                fabric.backward(m(torch.randn(4, 3)).sum())
                opt.step()
                opt.zero_grad()
                averager.step()

    return timed_error(run), in_step()


def test_optimizer_state_that_differs_across_ranks_is_an_error_at_the_first_round(worlds, record_property):
    results = worlds(2).run(different_optimizer_layouts)
    record_property("seconds", max(seconds for (_, _, seconds), _ in results))
    for (kind, message, seconds), check in results:
        assert kind == "AveragingError" and "averaging round 1 at step 2" in message, message
        assert "optimizers' state differs across ranks" in message and "max_exp_avg_sq" in message
        assert seconds < 10 and check == 2


# --- a parameter given new storage after the Averager was built ---------------------------------------


def moved_after_building(fabric, kind):
    torch.manual_seed(0)
    (model,) = setup_models(fabric, m=mlp([2, 4, 1]))
    averager = Averager(fabric, [model], period=2, **({"overlap_steps": 1} if kind == "overlap" else {}))

    def run():
        with averager:
            for step in range(1, 5):
                if step == 2:  # what `.to()` onto another device, or `param.data = ...`, does
                    model.module[0].weight.data = model.module[0].weight.data.clone()
                averager.step()

    return timed_error(run), in_step()


@pytest.mark.parametrize("kind", ["blocking", "overlap"])
def test_a_parameter_given_new_storage_is_an_error_at_the_next_round_on_every_rank(worlds, kind):
    for (name, message, seconds), check in worlds(2).run(moved_after_building, kind):
        assert name == "RuntimeError" and "given new storage after the Averager was built" in message, message
        assert seconds < 10 and check == 2  # no collective left half-issued


# --- NaN or Inf on one rank -------------------------------------------------------------------------


def nonfinite_on_one_rank(fabric, value, kind):
    torch.manual_seed(0)
    models = setup_models(fabric, gen=mlp([2, 4, 2]), disc=mlp([2, 4, 1]))
    options = {
        "plain": {},
        "diloco": {"outer_optimizer": NESTEROV},
        "bf16": {"comm_dtype": torch.bfloat16},
        "overlap": {"overlap_steps": 1},
    }[kind]
    opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
    averager = Averager(fabric, models, period=2, **options)

    def run():
        with averager:
            for step in range(1, 5):
                fabric.backward(sum(m(torch.randn(4, 2)).sum() for m in models))
                opt.step()
                opt.zero_grad()
                if step == 3 and fabric.global_rank == 1:
                    with torch.no_grad():
                        models.disc.module[0].weight[0, 0] = value
                averager.step()

    error = timed_error(run)
    report = replicas_in_sync(fabric, models)
    return error, bool(report), report.finite, in_step()


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("kind", ["plain", "diloco", "bf16", "overlap"])
def test_nonfinite_values_on_one_rank_raise_on_every_rank(worlds, value, kind, record_property):
    results = worlds(2).run(nonfinite_on_one_rank, value, kind)
    record_property("seconds", max(seconds for (_, _, seconds), *_ in results))
    for (name, message, seconds), in_sync, finite, check in results:
        assert name == "NonFiniteError", message
        assert "NaN or Inf" in message and "disc.0.weight" in message and "gen." not in message, message
        assert seconds < 10 and check == 2
        if kind == "plain":  # averaging already spread it: every replica is poisoned, and says so
            assert "restore a checkpoint" in message and not finite and not in_sync
        elif kind == "overlap":  # the round was not applied: each rank keeps its own parameters
            assert "not applied" in message and not in_sync
        else:  # anchored rounds roll back: identical, finite replicas
            assert "back at the anchor" in message and finite and in_sync


def nonfinite_everywhere(fabric):
    (model,) = setup_models(fabric, m=mlp([2] * 11))  # 20 tensors
    if fabric.global_rank == 1:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
    try:
        with Averager(fabric, [model], period=1, warmup_steps=0) as averager:
            averager.step()
    except NonFiniteError as error:
        return str(error), error.names, in_step()
    return None, [], in_step()


def test_an_error_names_the_first_tensors_and_counts_the_rest(worlds):
    for message, names, check in worlds(2).run(nonfinite_everywhere):
        assert len(names) == 20 and check == 2, message
        assert f"in {', '.join(names[:8])} and 12 more (on at least one rank)" in message, message


def nonfinite_average_models(fabric):
    (m,) = setup_models(fabric, m=mlp([2, 3, 1]))
    with torch.no_grad():
        if fabric.global_rank == 0:
            m.module[0].bias[1] = float("inf")
    return timed_error(lambda: average_models(fabric, m)), in_step()


def test_average_models_checks_for_nonfinite_values(worlds):
    for (name, message, _), check in worlds(2).run(nonfinite_average_models):
        assert name == "NonFiniteError" and "0.bias" in message and check == 2


# --- replicas_in_sync: parameters, buffers and non-finite values told apart ----------------------


def sync_reports(fabric):
    torch.manual_seed(0)
    (m,) = setup_models(fabric, m=mlp([2, 4, 1], batch_norm=True))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(2):  # synchronous DDP: parameters identical, BatchNorm statistics rank-local
        fabric.backward(m(torch.randn(4, 2) + fabric.global_rank).sum())
        opt.step()
        opt.zero_grad()
    after_ddp = replicas_in_sync(fabric, m)
    parameters_only = replicas_in_sync(fabric, m, buffers=False)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(float("nan"))  # the same NaN everywhere: bitwise equal, still not "in sync"
    all_nan = replicas_in_sync(fabric, m)
    return after_ddp, after_ddp.explain(), parameters_only, all_nan, all_nan.explain()


def test_replicas_in_sync_tells_parameters_buffers_and_nonfinite_apart(worlds):
    for after_ddp, explained, parameters_only, all_nan, nan_explained in worlds(2).run(sync_reports):
        assert after_ddp.parameters_equal and not after_ddp.buffers_equal and not after_ddp
        assert "buffers differ" in explained and "BatchNorm" in explained and "parameters differ" not in explained
        assert parameters_only and not parameters_only.buffers_equal
        assert all_nan.parameters_equal and not all_nan.finite and not all_nan
        assert "NaN or Inf" in nan_explained


# --- a process group this rank is not in ----------------------------------------------------------


def group_without_this_rank(fabric):
    group = dist.new_group([0, 1])  # every rank must call new_group; rank 2 is not a member
    alone = dist.new_group([2])
    (m,) = setup_models(fabric, m=nn.Linear(2, 2), process_group=group if fabric.global_rank < 2 else alone)
    errors = {}
    if fabric.global_rank == 2:
        for name, call in {
            "Averager": lambda: Averager(fabric, m, period=2, process_group=group),
            "average_models": lambda: average_models(fabric, m, process_group=group),
            "replicas_in_sync": lambda: replicas_in_sync(fabric, m, process_group=group),
        }.items():
            errors[name] = timed_error(call)[:2]
    else:
        with Averager(fabric, m, period=1, process_group=group) as averager:  # members average among themselves
            averager.step()
        errors["members"] = bool(replicas_in_sync(fabric, m, process_group=group))
    return errors, in_step()


def test_a_group_without_this_rank_is_refused_at_construction(worlds):
    results = worlds(3).run(group_without_this_rank)
    for errors, check in results[:2]:
        assert errors == {"members": True} and check == 3
    errors, check = results[2]
    assert check == 3
    for name in ("Averager", "average_models", "replicas_in_sync"):
        kind, message = errors[name]
        assert kind == "ValueError" and "does not contain this rank (2)" in message and "[0, 1]" in message


# --- Averager.load_state_dict validates what it is given ----------------------------------------


BAD_STATES = {
    "negative steps": ({"steps": -1}, ValueError, "`steps`"),
    "float rounds": ({"rounds": 2.5}, ValueError, "`rounds`"),
    "synced beyond steps": ({"synced_at_step": 99}, ValueError, "beyond `steps`"),
    "missing anchor": ({"anchor": None}, KeyError, "anchor"),
    "anchor of another model": ({"anchor": [torch.zeros(3)]}, ValueError, "does not match"),
}


def load_bad_states(fabric):
    (m,) = setup_models(fabric, m=nn.Linear(2, 2))
    averager = Averager(fabric, m, period=2, outer_optimizer=NESTEROV)
    good = averager.state_dict()
    results = {}
    for case, (change, _, _) in BAD_STATES.items():
        state = {**good, **change}
        if change.get("anchor", 0) is None:
            del state["anchor"]
        before = (averager.steps, averager.rounds)
        try:
            averager.load_state_dict(state)
            results[case] = None
        except (KeyError, ValueError) as error:
            results[case] = (type(error).__name__, str(error), (averager.steps, averager.rounds) == before)
    return results


def test_load_state_dict_refuses_corrupt_counters_and_changes_nothing(worlds):
    results = worlds(2).run(load_bad_states)[0]
    for case, (_, error_type, words) in BAD_STATES.items():
        assert results[case] is not None, f"{case} was accepted"
        kind, message, unchanged = results[case]
        assert kind == error_type.__name__ and words in message and unchanged, (case, message)


# --- a peer that dies or stalls ---------------------------------------------------------------------


def peer_dies_or_stalls(fabric, fault, phase):
    """Rank 1 is killed (SIGKILL) or stalls for a minute at step 5; rank 0 trains on."""
    import os
    import signal

    torch.manual_seed(0)
    (m,) = setup_models(fabric, m=nn.Linear(3, 2))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with Averager(fabric, m, period=3, warmup_steps=10 if phase == "warm-up" else 2) as averager:
        for step in range(1, 15):
            if fabric.global_rank == 1 and step == 5:
                if fault == "killed":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(60)
            fabric.backward(m(torch.randn(4, 3)).sum())
            opt.step()
            opt.zero_grad()
            averager.step()
    return "finished"


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["killed", "stalled"])
@pytest.mark.parametrize("phase", ["warm-up", "local"])
def test_a_peer_that_dies_or_stalls_ends_the_run_with_a_clear_error(fault, phase, record_property):
    timeout_s = 5
    survivor, peer = run_faulty_world(2, peer_dies_or_stalls, fault, phase, timeout_s=timeout_s, deadline_s=90)
    assert survivor is not None and survivor.error is not None, survivor
    _, seconds = survivor.value
    record_property("seconds", seconds)
    if phase == "local":  # the next round says which round and step, and why
        assert survivor.error.startswith(
            "PeerError: averaging round 1 at step 5 failed: a peer exited or is unreachable"
        ), survivor.error
    else:  # DDP's own gradient allreduce fails first, with gloo's message
        assert "RuntimeError" in survivor.error or "DistBackendError" in survivor.error, survivor.error
    # A dead peer is noticed at once; a stalled one after the process group's timeout, not 30 minutes.
    assert seconds < (timeout_s + 15 if fault == "stalled" else 15), seconds
    if fault == "stalled":
        assert seconds >= timeout_s - 1 and "timed out" in survivor.error.lower(), (seconds, survivor.error)
    assert peer is None or fault == "stalled"


# --- sharded models cannot be averaged ----------------------------------------------------------------


def sharded_model(fabric):
    from lightning_fabric.wrappers import _FabricModule
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (fabric.world_size,))
    layer = nn.Linear(4, 4)
    layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(0)]))  # tensor parallel
    module = _FabricModule(layer, fabric.strategy, original_module=layer)
    return timed_error(lambda: Averager(fabric, module, period=2))[:2], in_step()


def test_sharded_models_are_refused(worlds):
    for (kind, message), check in worlds(2).run(sharded_model):
        assert kind == "TypeError" and "holds a shard of the model" in message and check == 2
