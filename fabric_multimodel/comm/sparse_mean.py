"""The mean of every rank's sparse payload (:mod:`fabric_multimodel.comm.sparse`): :func:`sparse_mean`.

A sum of sparse vectors with different supports is not a dense allreduce: each rank's payload goes to every other
rank (an all-gather, as point-to-point messages on gloo), after one small all-gather of their sizes, so that a rank
receives no more than the longest payload and refuses, on every rank alike and before the payloads cross, a size
no payload can have. Every rank then decodes every payload, its own included, and adds them in rank order: the mean
is bitwise the same everywhere.
"""

from __future__ import annotations

import torch

from fabric_multimodel.comm import collectives
from fabric_multimodel.comm.collectives import ProcessGroup, Traffic, group_size
from fabric_multimodel.comm.sparse import decode, encode, max_bytes


def sparse_mean(
    values: torch.Tensor, chunk: int, density: float, group: ProcessGroup = None
) -> tuple[torch.Tensor, torch.Tensor, Traffic]:
    """The mean over ``group`` of what each rank's payload of ``values`` decodes to (float32, flat, the same bits on
    every rank); what this rank's payload decodes to (like ``values``: the caller keeps ``values - sent`` for the next
    round); and what this rank sent (two all-gathers, looked up on ``collectives`` at the call: a test counts them).

    Example::

        mean, sent, traffic = sparse_mean(pseudo_gradient + residual, chunk=4096, density=1 / 64)
        residual = pseudo_gradient + residual - sent
    """
    payload, sent = encode(values, chunk, density)
    world, device, numel = group_size(group), payload.device, values.numel()
    sizes = torch.zeros(world, dtype=torch.int64, device=device)
    collectives.all_gather_single(sizes, torch.tensor([payload.numel()], device=device), group=group)
    limit = max_bytes(numel, chunk, density)
    if (sizes < 1).any() or (sizes > limit).any():  # every rank sees the same sizes: all raise, none waits
        raise ValueError(f"sparse_mean: a rank announced a payload of {sizes.tolist()} bytes; at most {limit} can be.")
    longest = int(sizes.max())
    everyone = torch.empty(world * longest, dtype=torch.uint8, device=device)
    padded = torch.cat([payload, payload.new_zeros(longest - payload.numel())])
    collectives.all_gather_messages(everyone, padded, group=group)
    total = torch.zeros(numel, dtype=torch.float32, device=device)
    for rank, size in enumerate(sizes.tolist()):
        indices, decoded = decode(everyone[rank * longest : rank * longest + size], numel, chunk, density)
        total.index_add_(0, indices, decoded)
    return total / world, sent, Traffic(numel, (world - 1) * (longest + sizes.element_size()))
