"""A replica that rejoins with an older checkpoint, or none, receives only what it lacks: with an anchored
Averager, its state (the anchors: the global model; the outer optimizer) and the plain values, once per node
across the link, in short messages; its inner optimizer keeps its own older copy and its model starts from
the anchors. Without an anchor (or before the end of warm-up) the whole newest copy travels."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fabric_multimodel import Averager, setup_models
from fabric_multimodel.checkpoints.files import CheckpointWriter, read_checkpoint, replica_path
from fabric_multimodel.checkpoints.resume import _plan, resume_latest
from tests.gan import collectives, mlp
from tests.test_local_checkpoints import train_step

NESTEROV = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
WARMUP = 2


def build(fabric, options):
    torch.manual_seed(0)
    (model,) = setup_models(fabric, m=mlp([3, 64, 64, 2]))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, optimizer, Averager(fabric, model, period=4, warmup_steps=WARMUP, **options)


def rejoin(fabric, folder, options, newest, older, saved_as=0):
    """Train to ``newest``; replica 1 keeps only its checkpoint at ``older`` (None: none), replica 0 the newest,
    its Averager state saying it was written by replica ``saved_as`` (1: the world was numbered otherwise then).
    Then both resume from fresh objects with ``resume_latest``."""
    model, optimizer, averager = build(fabric, options)
    index = averager.replica.index
    path = replica_path(Path(folder) / "checkpoint.pt", index)
    writer = CheckpointWriter(path)
    keep_at = newest if index == 0 else older
    with averager:
        for step in range(1, newest + 1):
            train_step(fabric, model, optimizer, step)
            averager.step()
            if step == keep_at:
                saved = averager.state_dict() | ({"replica": saved_as} if index == 0 and averager.anchored else {})
                writer.save({"model": model, "optimizer": optimizer, "averager": saved, "step": step})
                writer.close()
        global_model = [a.clone() for a in averager._round.params] if averager.anchored and averager.local else None
    fabric.barrier()
    model, optimizer, averager = build(fabric, options)
    state = {"model": model, "optimizer": optimizer, "averager": averager, "step": 0}
    reports = []
    issued = collectives(
        lambda: reports.append(
            resume_latest(fabric, path, state, progress=lambda done, total, s: reports.append((done, total)))
        )
    )
    resumed, progress = reports[-1], reports[:-1]
    own = read_checkpoint(path) if path.is_file() else None
    return {
        "resumed": resumed._replace(extra={}, seconds={}),
        "file_bytes": (Path(folder) / "checkpoint.pt").stat().st_size,
        "issued": sorted(name for name, _ in issued),
        "progress": progress,
        "step": state["step"],
        "params_are_global": global_model is not None
        and all(torch.equal(p.detach(), a) for p, a in zip(model.parameters(), global_model)),
        "optimizer_is_own": own is not None
        and all(
            torch.equal(optimizer.state_dict()["state"][i]["exp_avg"], own["optimizer"]["state"][i]["exp_avg"])
            for i in own["optimizer"]["state"]
        ),
    }


@pytest.mark.parametrize(
    "older, saved_as", [(6, 0), (None, 0), (6, 1)], ids=["own-older-copy", "no-copy", "saved-under-its-index"]
)
def test_a_rejoining_replica_receives_the_global_state_and_keeps_its_own_optimizer(worlds, tmp_path, older, saved_as):
    options = {"outer_optimizer": NESTEROV, "fragments": 2}
    holder, joiner = worlds(2).run(rejoin, str(tmp_path), options, 10, older, saved_as)
    assert holder["step"] == joiner["step"] == 10
    assert holder["resumed"].kept == () and holder["resumed"].own_step == 10
    assert joiner["resumed"].kept == ("model", "optimizer") and joiner["resumed"].own_step == (older or -1)
    sent = holder["resumed"].bytes
    assert sent == joiner["resumed"].bytes > 0
    # The anchors and the outer momentum, not the model and Adam's two moments as well.
    assert sent < 0.6 * holder["file_bytes"], (sent, holder["file_bytes"])
    assert joiner["params_are_global"]
    # The holder keeps its own replica, unless its file says another replica wrote it (then it starts globally).
    assert holder["params_are_global"] == (saved_as != 0)
    assert joiner["optimizer_is_own"] == (older is not None)
    # One all-gather to agree; then the size and one message per CHUNK_BYTES, point to point.
    for result in (holder, joiner):
        assert result["issued"].count("gloo:all_gather") == 1
        assert not {"gloo:broadcast", "gloo:all_reduce"} & set(result["issued"])
    assert holder["issued"].count("gloo:send") == 2 and joiner["issued"].count("gloo:recv") == 2
    assert holder["progress"][-1] == joiner["progress"][-1] == (sent, sent)


@pytest.mark.parametrize(
    "options, newest",
    [({"outer_optimizer": NESTEROV}, WARMUP - 1), ({}, 10)],
    ids=["diloco-in-warm-up", "plain-averaging"],
)
def test_without_a_global_model_the_whole_newest_copy_travels(worlds, tmp_path, options, newest):
    holder, joiner = worlds(2).run(rejoin, str(tmp_path), options, newest, None)
    anchored = "outer_optimizer" in options
    assert joiner["resumed"].kept == (("optimizer",) if anchored else ())
    assert joiner["step"] == newest and joiner["resumed"].broadcast


@given(data=st.data(), nodes=st.integers(1, 4), per_node=st.integers(1, 3))
def test_the_plan_crosses_the_link_once_per_node_that_lacks_the_newest(data, nodes, per_node):
    world = nodes * per_node
    node_of = [r // per_node for r in range(world)]
    steps = data.draw(st.lists(st.sampled_from([-1, 3, 7]), min_size=world, max_size=world).filter(lambda s: 7 in s))
    plan = _plan(steps, node_of, 7)
    holding = {r for r, s in enumerate(steps) if s == 7}
    for sender, receiver in plan:
        assert sender in holding and receiver not in holding  # only a rank that has it sends it
        holding.add(receiver)
    assert holding == set(range(world))
    receivers = [receiver for _, receiver in plan]
    assert len(receivers) == len(set(receivers))  # each rank receives at most once
    crossing = [(s, r) for s, r in plan if node_of[s] != node_of[r]]
    lacking_nodes = {n for n in set(node_of) if all(steps[r] != 7 for r in range(world) if node_of[r] == n)}
    assert len(crossing) == len(lacking_nodes)


def test_restore_global_before_the_end_of_warm_up_says_why():
    from types import SimpleNamespace

    averager = Averager(SimpleNamespace(device=torch.device("cpu")), mlp([3, 2]), period=4, warmup_steps=2,
                        outer_optimizer=NESTEROV)  # fmt: skip
    with pytest.raises(RuntimeError, match="before an anchored round"):
        averager.restore_global()
