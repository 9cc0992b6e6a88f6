"""The all-to-all and all-gather sent as point-to-point messages on gloo (collectives.all_to_all_messages,
all_gather_messages): bitwise what torch's collectives give, waited for at once or later, in real gloo worlds."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric_multimodel.comm.collectives import (
    ALL_GATHER_SINGLE,
    Messages,
    all_gather_messages,
    all_to_all_messages,
    wait_all,
)

DTYPES = {"uint8": torch.uint8, "float32": torch.float32, "bfloat16": torch.bfloat16}


def both_ways(fabric, dtype: str, shard: int, seed: int, later: bool):
    """The messages' results and torch's collectives' for the same inputs, and the kind of handle returned."""
    world, rank = fabric.world_size, fabric.global_rank
    g = torch.Generator().manual_seed(seed + rank)
    source = (torch.randn(world * shard, generator=g) * 50).to(DTYPES[dtype])
    mine = source[:shard].clone()
    ours, theirs = torch.zeros_like(source), torch.zeros_like(source)
    gathered, expected = torch.zeros_like(source), torch.zeros_like(source)
    handles = [all_to_all_messages(ours, source, async_op=later), all_gather_messages(gathered, mine, async_op=later)]
    if later:
        wait_all(handles, abandon=lambda: False)  # polled, as a round's wait is
    dist.all_to_all_single(theirs, source)
    getattr(dist, ALL_GATHER_SINGLE)(expected, mine)
    kinds = [type(h).__name__ for h in handles]
    return torch.equal(ours, theirs), torch.equal(gathered, expected), kinds


@pytest.mark.parametrize("size", [2, 4])
@settings(max_examples=6)
@given(
    dtype=st.sampled_from(sorted(DTYPES)),
    shard=st.integers(1, 3000),
    seed=st.integers(0, 1000),
    later=st.booleans(),
)
def test_messages_give_bitwise_what_torchs_collectives_give(worlds, size, dtype, shard, seed, later):
    for exchanged, gathered, kinds in worlds(size).run(both_ways, dtype, shard, seed, later):
        assert exchanged and gathered
        assert kinds == ([Messages.__name__] * 2 if later else ["NoneType"] * 2)
