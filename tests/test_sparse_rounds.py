"""Sparse rounds in the Averager (issue 68): ``density`` below 1 sends each rank's top entries of its pseudo-gradient
plus its error-feedback accumulator (:class:`~fabric_multimodel.comm.sparse_mean.SparseMean`), in real gloo worlds.

The exchange itself is tested in tests/test_sparse_mean.py; here: the rounds keep replicas bitwise identical (blocking,
overlapped, streaming, DiLoCo's outer step or none, islands), count what they send, resume bitwise with the
accumulator, keep it in a new group, catch a NaN on every rank and roll back, and refuse what they cannot combine
with on every rank."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric_multimodel import Averager, Replica, replicas_in_sync, setup_models
from fabric_multimodel.comm import collectives
from tests.gan import mlp
from tests.test_local_checkpoints import two_nodes
from tests.test_lowbit import NESTEROV, SIZES, local_update, nan_on_one_rank, regrouped_midway, resumed_bitwise
from tests.test_sharded import sharded_and_islands
from tests.worlds import errors_of, in_step

GATHERS = ("all_gather_single", "all_gather_messages")


def sparse_rounds(fabric, density, overlap, fragments, outer):
    """24 steps of rounds every 8 (per fragment: every 8 / fragments); the gathers' bytes counted per step."""
    torch.manual_seed(0)
    (m,) = setup_models(fabric, m=mlp(SIZES))
    options = {"outer_optimizer": NESTEROV} if outer else {}
    averager = Averager(fabric, m, period=8, density=density, overlap_steps=overlap, fragments=fragments, **options)
    originals = {name: getattr(collectives, name) for name in GATHERS}
    calls, now = [], [0]

    def counting(name):
        def call(output, message, **kwargs):
            calls.append((name, now[0], message.numel() * message.element_size()))
            return originals[name](output, message, **kwargs)

        return call

    identical = []
    for name in GATHERS:
        setattr(collectives, name, counting(name))
    try:
        with averager:
            for step in range(1, 25):
                local_update(fabric, m, step)
                now[0] = step
                averager.step()
                if not overlap and fragments == 1 and step % 8 == 0:
                    identical.append(bool(replicas_in_sync(fabric, m)))
            now[0] = -1  # leaving the block: a round of every fragment
    finally:
        for name, original in originals.items():
            setattr(collectives, name, original)
    return calls, identical, averager.traffic.bytes, bool(replicas_in_sync(fabric, m))


@settings(max_examples=12, deadline=None)
@given(
    density=st.sampled_from([1 / 64, 1 / 16, 0.3]),
    overlap=st.sampled_from([0, 1, 3]),
    fragments=st.sampled_from([1, 2]),
    outer=st.booleans(),
)
def test_sparse_rounds_keep_replicas_identical_and_send_what_they_count(worlds, density, overlap, fragments, outer):
    overlap = min(overlap, 8 // fragments - 1)
    calls, identical, sent, in_sync = worlds(2).run(sparse_rounds, density, overlap, fragments, outer)[0]
    assert all(identical) and in_sync  # every blocking round leaves the replicas bitwise identical
    sizes = [s for name, s, _ in calls if name == "all_gather_single" and s > 0]
    spacing = 8 // fragments
    assert sizes == list(range(spacing, 25, spacing))  # one round per launch
    # What crossed: each rank's size and payload to the one other rank.
    assert sent == sum(b for _, s, b in calls if s > 0 or s == -1)


def bytes_against_fp32(fabric, density):
    torch.manual_seed(0)
    sent = {}
    for option in ({"density": density}, {}):
        (m,) = setup_models(fabric, m=mlp([64, 256, 256, 256, 64]))  # 0.15 M parameters
        averager = Averager(fabric, m, period=1, outer_optimizer=NESTEROV, **option)
        with averager:
            local_update(fabric, m, 1)
            averager.step()
            sent[bool(option)] = averager.traffic.bytes
    return sent[True] / sent[False]


def test_a_round_at_density_one_sixty_fourth_sends_under_a_hundredth_of_fp32s_bytes(worlds):
    """Two ranks: an fp32 ring allreduce sends each rank's whole payload once, as the sparse round does its own."""
    for ratio in worlds(2).run(bytes_against_fp32, 1 / 64):
        assert ratio <= 1 / 100, ratio


@settings(max_examples=8, deadline=None)
@given(split=st.integers(2, 9), extra=st.integers(1, 9), decay=st.sampled_from([0.0, 0.95, 1.0]))
def test_the_accumulator_is_checkpointed_and_resumes_bitwise(worlds, split, extra, decay):
    options = {"period": 4, "density": 1 / 16, "error_decay": decay}
    for kept, same in worlds(2).run(resumed_bitwise, options, split, extra):
        assert kept and same


def test_the_accumulator_goes_on_in_a_new_group(worlds):
    for kept, same in worlds(2).run(regrouped_midway, {"density": 1 / 16}):
        assert kept and same


def sync_after_a_round(fabric, options):
    """A round, then ``sync()`` with no step between (no rank made progress: the round is not applied): what each
    rank kept before and after the sync, and whether the parameters moved."""
    torch.manual_seed(0)
    (m,) = setup_models(fabric, m=mlp(SIZES))
    averager = Averager(fabric, m, period=2, **options)
    with averager:
        for step in range(1, 3):
            local_update(fabric, m, step)
            averager.step()
        before = [r.clone() for r in averager.state_dict()["error_feedback"]]
        params = [p.detach().clone() for p in m.parameters()]
        averager.sync()
        after = averager.state_dict()["error_feedback"]
        moved = not all(torch.equal(p, q) for p, q in zip(params, m.parameters()))
    return any(r.abs().sum() > 0 for r in before), all(map(torch.equal, before, after)), moved


@pytest.mark.parametrize(
    "options", [{"density": 1 / 16}, {"comm_dtype": torch.float8_e4m3fn, "error_feedback": True}], ids=["sparse", "fp8"]
)
def test_a_round_no_rank_made_progress_for_keeps_what_each_rank_kept(worlds, options):
    """Such a round (a sync right after a round, the end of a block) is not applied: had a rank sent what it kept
    from earlier rounds in it, that would be lost."""
    for kept, unchanged, moved in worlds(2).run(sync_after_a_round, options):
        assert kept and unchanged and not moved


def test_nan_on_one_rank_is_caught_on_every_rank_named_and_rolled_back(worlds):
    # 0.weight: the first two chunks of 4096 entries, whose NaN every rank reads in them alone
    for names, back_at_anchor, kept, check in worlds(2).run(nan_on_one_rank, {"density": 1 / 64}, [128, 64, 2]):
        assert names == ["0.weight"] and back_at_anchor and not kept[0].any() and check == 2


def islands(fabric, fragments, overlap):
    options = {"period": 4, "warmup_steps": 2, "fragments": fragments, "overlap_steps": overlap, "density": 1 / 16}
    return two_nodes(fabric, options, 11)


@pytest.mark.parametrize(("fragments", "overlap"), [(1, 0), (2, 1)])
def test_islands_exchange_a_slice_per_process_and_end_as_one_replica(worlds, fragments, overlap):
    results = worlds(4).run(islands, fragments, overlap)
    assert [r[0] for r in results] == [Replica(0, 2, True), Replica(0, 2, False), Replica(1, 2, True),
                                       Replica(1, 2, False)]  # fmt: skip
    assert all(r[1] for r in results) and len({r[2] for r in results}) == 1 and min(r[3] for r in results) > 0


@pytest.mark.parametrize(("fragments", "overlap"), [(1, 0), (2, 1)])
def test_fsdp2_sites_send_their_shards_sparse_and_stay_in_sync(worlds, fragments, overlap):
    options = {"period": 4, "warmup_steps": 1, "fragments": fragments, "overlap_steps": overlap, "density": 1 / 16}
    for checks, _, sent in worlds(4).run(sharded_and_islands, options, 11):
        assert checks and all(checks) and sent["sharded"] > 0  # each shard equals the other site's after rounds


def first_round_after_apart(fabric, options):
    """Two nodes of two (DDP inside, rounds across), a warm-up in which the nodes train apart, and the first round
    across them (step 6): the parameters right after it."""
    nodes, across = [dist.new_group([0, 1]), dist.new_group([2, 3])], [dist.new_group([0, 2]), dist.new_group([1, 3])]
    node, peers = nodes[fabric.global_rank // 2], across[fabric.global_rank % 2]
    torch.manual_seed(0)
    (model,) = setup_models(fabric, m=mlp([3, 2048, 2]), process_group=node)  # 12,290 parameters: 3 chunks a slice
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    averager = Averager(fabric, model, process_group=peers, period=4, warmup_steps=2, **options)
    with averager:
        for step in range(1, 7):
            x = torch.randn(6, 3, generator=torch.Generator().manual_seed(100 * step + fabric.global_rank))
            fabric.backward(model(x).square().mean())
            optimizer.step()
            optimizer.zero_grad()
            averager.step()
        after = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    return after, averager.state_dict()["error_feedback"] if "density" in options else None


def test_the_first_round_across_replicas_that_trained_apart_is_a_plain_dense_mean(worlds):
    """Its payload is the parameters themselves, which set the anchor: sparse, it would keep a few of each chunk
    and zero the rest. It is the plain mean a dense round takes, and leaves the accumulators empty."""
    dense = worlds(4).run(first_round_after_apart, {})
    sparse = worlds(4).run(first_round_after_apart, {"density": 1 / 64, "outer_optimizer": NESTEROV})
    for (plain, _), (after, kept) in zip(dense, sparse):
        torch.testing.assert_close(after, plain, rtol=1e-6, atol=1e-6)
        assert all(not residual.any() for residual in kept)


def bad_sparse(fabric):
    (m,) = setup_models(fabric, m=mlp(SIZES))
    calls = {
        "with fp8": lambda: Averager(fabric, m, period=2, density=0.01, comm_dtype=torch.float8_e4m3fn),
        "with bf16": lambda: Averager(fabric, m, period=2, density=0.01, comm_dtype=torch.bfloat16),
        "zero": lambda: Averager(fabric, m, period=2, density=0.0),
        "above one": lambda: Averager(fabric, m, period=2, density=1.5),
        "a string": lambda: Averager(fabric, m, period=2, density="1%"),
        "decay alone": lambda: Averager(fabric, m, period=2, error_decay=0.5),
        "decay above one": lambda: Averager(fabric, m, period=2, density=0.01, error_decay=1.5),
        "node period": lambda: Averager(fabric, m, period=4, node_period=2, density=0.01),
        "paced": functools.partial(Averager, fabric, m, period=4, warmup_steps=2, pace="speed", density=0.01),
    }
    return errors_of(calls), in_step()


def test_what_sparse_rounds_cannot_combine_with_is_a_clear_error_on_every_rank(worlds):
    for errors, check in worlds(2).run(bad_sparse):
        assert check == 2
        for case in ("with fp8", "with bf16"):
            assert "cannot be combined with `comm_dtype`" in errors[case][1]
        for case in ("zero", "above one", "a string"):
            assert "`density` must be a number with 0 < density <= 1" in errors[case][1]
        assert "set `density` below 1 too" in errors["decay alone"][1]
        assert "`error_decay` must be a number in [0, 1]" in errors["decay above one"][1]
        assert "drop outer_optimizer, comm_dtype, density" in errors["node period"][1]
        assert "low-bit `comm_dtype` or `density` yet" in errors["paced"][1]
