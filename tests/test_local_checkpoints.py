"""Checkpoints of anchored rounds send nothing: each replica saves the anchors, the outer optimizer and its own
parameters and inner optimizer, and resumes bitwise; in another world every replica starts from the anchors.
Also: a start that broadcasts only the values in which the replicas differ."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from fabric_multimodel import Averager, Replica, replicas_in_sync, setup_models
from fabric_multimodel.checkpoints.files import CheckpointWriter, load_checkpoint, replica_path
from fabric_multimodel.comm.collectives import broadcast_differences, tensors_fingerprint
from tests.gan import collectives, mlp
from tests.worlds import in_step

NESTEROV = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp4": torch.float4_e2m1fn_x2}


def build(fabric, options: dict, batch_norm: bool) -> tuple[nn.Module, torch.optim.Optimizer, Averager]:
    torch.manual_seed(0)
    (model,) = setup_models(fabric, m=mlp([3, 8, 8, 2], batch_norm=batch_norm))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)  # its moments stay each replica's own
    return model, optimizer, Averager(fabric, model, **options)


def train_step(fabric, model, optimizer, step: int) -> None:
    data = torch.Generator().manual_seed(100 * step + fabric.global_rank)
    x, y = torch.randn(6, 3, generator=data), torch.randn(6, 2, generator=data)
    fabric.backward(nn.functional.mse_loss(model(x), y))
    optimizer.step()
    optimizer.zero_grad()


def everything(model: nn.Module) -> int:
    return tensors_fingerprint([*model.parameters(), *model.buffers()])


def save_and_resume(fabric, folder, options, batch_norm, steps, save_at):
    """An uninterrupted run that saves once (when no round is in flight, from ``save_at`` on), and a second one
    resumed from that checkpoint; both run to ``steps``."""
    model, optimizer, averager = build(fabric, options, batch_norm)
    replica = averager.replica
    path = replica_path(Path(folder) / "checkpoint.pt", replica.index)
    writer = CheckpointWriter(path, enabled=replica.writer)
    issued, saved_at, at_save = None, None, None
    with averager:
        for step in range(1, steps + 1):
            train_step(fabric, model, optimizer, step)
            averager.step()
            if saved_at is None and step >= save_at and not averager.pending:
                state = {"model": model, "optimizer": optimizer, "averager": averager, "step": step}
                issued = collectives(writer.save, state)
                writer.close()
                saved_at, at_save = step, everything(model)
    uninterrupted = everything(model)
    dist.barrier()  # every replica's file is written before any rank reads one

    model, optimizer, averager = build(fabric, options, batch_norm)
    state = {"model": model, "optimizer": optimizer, "averager": averager, "step": 0}
    load_checkpoint(fabric, path, state)
    loaded = everything(model)
    with averager:
        for step in range(state["step"] + 1, steps + 1):
            train_step(fabric, model, optimizer, step)
            averager.step()
    return {
        "replica": (replica.index, replica.count),
        "issued": issued,
        "saved_at": saved_at,
        "loaded_is_saved": loaded == at_save,
        "at_save": at_save,
        "bitwise": everything(model) == uninterrupted,
    }


@given(
    payload=st.sampled_from(["fp32", "bf16", "fp8", "fp4"]),
    outer=st.booleans(),
    fragments=st.sampled_from([1, 2]),
    overlap=st.sampled_from([0, 1]),
    warmup=st.integers(0, 3),
    save_at=st.integers(1, 15),
    batch_norm=st.booleans(),
)
def test_a_replica_checkpoint_sends_nothing_and_resumes_bitwise(
    worlds, payload, outer, fragments, overlap, warmup, save_at, batch_norm
):
    dtype = DTYPES[payload]
    if dtype is None and not outer:
        outer = True  # plain averaging in fp32 has no anchor (that case is below)
    options = {"period": 4, "warmup_steps": warmup, "fragments": fragments, "overlap_steps": overlap}
    options |= {"outer_optimizer": NESTEROV} if outer else {}
    options |= {"comm_dtype": dtype} if dtype is not None else {}
    options |= {"error_feedback": True} if payload in ("fp8", "fp4") and save_at % 2 else {}
    with tempfile.TemporaryDirectory() as folder:
        results = worlds(2).run(save_and_resume, folder, options, batch_norm, 18, save_at)
    for rank, result in enumerate(results):
        assert result["replica"] == (rank, 2)
        assert result["issued"] == []  # not one collective: nothing crosses the link
        assert result["loaded_is_saved"]  # each rank loaded its own replica, not rank 0's
        assert result["bitwise"], (options, result)


def test_plain_averaging_has_no_anchor_and_says_so():
    fabric, model = SimpleNamespace(device=torch.device("cpu")), mlp([3, 2])
    assert not Averager(fabric, model, period=4).anchored  # its checkpoint of one model needs sync()
    assert Averager(fabric, model, period=4, comm_dtype=torch.bfloat16).anchored
    assert Averager(fabric, model, period=4, outer_optimizer=NESTEROV).anchored


def test_another_replica_s_checkpoint_starts_from_the_anchors(tmp_path):
    """One process loads the checkpoint replica 1 of a larger world wrote after local steps: its parameters become
    the anchors (the global model), its buffers keep the file's values. Replica 0's file loads as it is."""
    fabric = SimpleNamespace(device=torch.device("cpu"))
    options = {"period": 8, "warmup_steps": 2, "outer_optimizer": NESTEROV, "fragments": 2}
    torch.manual_seed(0)
    model = mlp([3, 8, 8, 2], batch_norm=True)
    averager = Averager(fabric, model, **options)
    with averager:
        for step in range(1, 9):  # warm-up 2, then 6 local steps: fragment 0 averaged at step 6
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * step)
            model(torch.randn(4, 3))  # moves the BatchNorm statistics
            averager.step()
        saved = {"model": model.state_dict(), "averager": averager.state_dict(), "step": 8}
    for index in (0, 1):
        path = replica_path(tmp_path / "checkpoint.pt", index)
        torch.save(saved | {"averager": saved["averager"] | {"replica": index}}, path)
        torch.manual_seed(1)
        fresh = mlp([3, 8, 8, 2], batch_norm=True)
        resumed = Averager(fabric, fresh, **options)
        load_checkpoint(fabric, path, {"model": fresh, "averager": resumed, "step": 0})
        anchors = resumed._round.params  # the anchor of each parameter, in the module's order
        for (name, p), anchor in zip(fresh.named_parameters(), anchors):
            assert not torch.equal(anchor, saved["model"][name])  # 2 local steps (and more) since any round
            assert torch.equal(p.detach(), anchor if index else saved["model"][name]), (index, name)
        for name, b in fresh.named_buffers():
            assert torch.equal(b, saved["model"][name]), name


def differing(fabric, which: list[int]):
    """Three pieces in two flat buffers; rank 1 changes the pieces in ``which``. What the call issued, sent,
    and whether every rank then holds rank 0's values."""
    flats = [torch.arange(10.0), torch.arange(6.0)]
    pieces = [(0, 0, 4), (0, 4, 6), (1, 0, 6)]
    expected = [f.clone() for f in flats]
    if fabric.global_rank == 1:
        for i in which:
            b, offset, numel = pieces[i]
            flats[b][offset : offset + numel] += 1
    sent = []
    issued = collectives(lambda: sent.append(broadcast_differences(flats, pieces, fabric.device)))
    return issued, sent[0], all(torch.equal(f, e) for f, e in zip(flats, expected)), in_step()


@pytest.mark.parametrize(
    ("which", "broadcasts"),
    [([], []), ([1], [6]), ([0, 1], [10]), ([2], [6]), ([0, 2], [4, 6])],
)
def test_a_start_broadcasts_only_what_differs(worlds, which, broadcasts):
    for issued, sent, equal, step in worlds(2).run(differing, which):
        assert issued[0] == ("gloo:all_reduce", 6)  # two int64s per piece: the checksums' maximum and minimum
        assert [elements for _, elements in issued[1:]] == broadcasts
        assert all(name == "gloo:broadcast" for name, _ in issued[1:])
        assert sent.elements == sum(broadcasts) and equal and step == 2


def one_node_left(fabric):
    """The islands layout with a single node (what an elastic run shrinks to): DDP over the node, rounds over a
    group of one. The node's processes must stay one replica, written by its first process."""
    alone = [dist.new_group([rank]) for rank in range(fabric.world_size)][fabric.global_rank]
    options = {"period": 4, "warmup_steps": 2, "outer_optimizer": NESTEROV, "process_group": alone}
    model, optimizer, averager = build(fabric, options, False)
    checks = []
    with averager:
        for step in range(1, 9):
            train_step(fabric, model, optimizer, step)
            averager.step()
            checks.append(bool(replicas_in_sync(fabric, model)))
    return averager.islands, averager.replica, checks


def test_the_last_node_of_an_islands_run_stays_one_replica(worlds):
    for rank, (islands, replica, checks) in enumerate(worlds(2).run(one_node_left)):
        assert islands and replica == Replica(0, 1, rank == 0)
        assert all(checks)  # DDP keeps synchronising inside the node in the local phase


def two_nodes(fabric, options, steps):
    """Four ranks as two nodes of two (DDP inside a node, rounds across): per step, whether the node's two
    processes are identical; at the end, whether all four are, what crossed per rank and the replica."""
    nodes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    across = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    node, peers = nodes[fabric.global_rank // 2], across[fabric.global_rank % 2]
    torch.manual_seed(0)
    (model,) = setup_models(fabric, m=mlp([3, 8, 8, 2]), process_group=node)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    averager = Averager(fabric, model, process_group=peers, **options)
    same_in_node, issued = [], []
    with averager:
        for step in range(1, steps + 1):
            train_step(fabric, model, optimizer, step)
            # The profiler around a step with a round in flight corrupts the heap (seen with gloo): blocking only.
            if options["overlap_steps"]:
                averager.step()
            else:
                issued += collectives(averager.step)
            same_in_node.append(bool(replicas_in_sync(fabric, model, process_group=node)))
    broadcasts = sum(name == "gloo:broadcast" for name, _ in issued)  # the slices exchanged inside the node
    return averager.replica, all(same_in_node), everything(model), averager.traffic.bytes, broadcasts


@given(
    payload=st.sampled_from(["fp32", "bf16", "fp8", "fp4"]),
    fragments=st.sampled_from([1, 2]),
    overlap=st.sampled_from([0, 1]),
)
def test_islands_send_half_a_payload_per_process_and_stay_in_sync(worlds, payload, fragments, overlap):
    options = {"period": 4, "warmup_steps": 2, "fragments": fragments, "overlap_steps": overlap}
    options |= {"outer_optimizer": NESTEROV} | ({"comm_dtype": DTYPES[payload]} if DTYPES[payload] else {})
    results = worlds(4).run(two_nodes, options, 11)
    assert [r[0] for r in results] == [
        Replica(0, 2, True),
        Replica(0, 2, False),
        Replica(1, 2, True),
        Replica(1, 2, False),
    ]
    assert all(r[1] for r in results)  # DDP keeps each node one replica, rounds and merges included
    assert len({r[2] for r in results}) == 1  # every replica leaves the block identical
    sent = [r[3] for r in results]
    assert sent[0] == sent[2] and sent[1] == sent[3] and min(sent) > 0  # each node's two processes split it
    assert abs(sent[0] - sent[1]) <= 0.1 * sent[0]  # in halves (the header rides with one of them)
    if not overlap:
        assert all(r[4] > 0 for r in results)
