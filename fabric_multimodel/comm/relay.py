"""Bytes passed point to point: a state, a checkpoint, sent to the ranks that lack it (:func:`relay_bytes`, which
a receiver may pass on), or posted to them while the sender trains on (:func:`post_bytes`), in messages that stay
short on the slowest link."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fabric_multimodel.comm.collectives import Messages, ProcessGroup, group_rank

#: Bytes per message of :func:`relay_bytes`: a message stays short at the slowest link (1 MiB: 8 s at 1 Mbit/s).
CHUNK_BYTES = 1 << 20
#: The tag of :func:`relay_bytes`' messages over a standalone group: a state sent to a site that joined is still on
#: its way when the group's rounds send their own messages (tag 0) to the same peer.
STATE_TAG = 1
#: Seconds between two calls of ``progress`` during :func:`relay_bytes`.
PROGRESS_EVERY_S = 5.0


def relay_bytes(
    plan: Sequence[tuple[int, int]],
    payload: bytes | None,
    device: torch.device,
    progress: Callable[[int, int, float], None] | None = None,
    group: ProcessGroup = None,
) -> tuple[bytes | None, int]:
    """Pass ``payload`` along ``plan``, pairs of ranks of ``group`` (global ranks when None) ``(sender, receiver)``
    in order: a receiver may send on what it received. Point to point: per pair, one message of the size and one
    per ``CHUNK_BYTES``; ranks in no pair issue nothing. ``progress(bytes_done, bytes_total, seconds)`` is
    called on both ends every ``PROGRESS_EVERY_S`` seconds and at the end. Returns the bytes this rank
    holds at the end (its ``payload`` when it received none) and their size when it took part, else 0.

    Example::

        data, size = relay_bytes([(0, 2), (2, 3)], payload if rank == 0 else None, fabric.device)
    """
    rank = group_rank(group)

    # The group's own point to point by its ranks: torch.distributed's would look for global ranks, which a
    # standalone group has none of.
    def send(tensor: torch.Tensor, peer: int) -> None:
        if group is None:
            dist.send(tensor, dst=peer)
        else:
            group.send([tensor], peer, STATE_TAG).wait()

    def recv(tensor: torch.Tensor, peer: int) -> None:
        if group is None:
            dist.recv(tensor, src=peer)
        else:
            group.recv([tensor], peer, STATE_TAG).wait()

    data = payload
    for sender, receiver in plan:
        if rank == receiver:
            size = torch.zeros(1, dtype=torch.int64, device=device)
            recv(size, sender)
            buffer = torch.empty(int(size), dtype=torch.uint8, device=device)
            _chunks(buffer, recv, sender, progress)
            data = buffer.cpu().numpy().tobytes()
        elif rank == sender:
            if data is None:
                raise ValueError(f"relay_bytes: rank {rank} sends to {receiver} in `plan` but has no `payload`.")
            buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
            send(torch.tensor([buffer.numel()], dtype=torch.int64, device=device), receiver)
            _chunks(buffer, send, receiver, progress)
    return data, len(data) if data is not None and any(rank in pair for pair in plan) else 0


def post_bytes(payload: bytes, receivers: Sequence[int], device: torch.device, group: dist.ProcessGroup) -> Messages:
    """Send ``payload`` to each of ``receivers`` (ranks of ``group``, a standalone group's) as :func:`relay_bytes`
    does, its size then messages of ``CHUNK_BYTES``, each receiver's in turn, and return at once: every message is
    posted here, in this thread (a backend that orders its operations, NCCL, then has them before any later
    collective of the group), and the returned handle is complete once all have left. How a member sends its state
    to a site that joined while it trains on; the receivers call :func:`relay_bytes`.

    Example::

        sending = post_bytes(payload, [2], fabric.device, epoch.group)  # on rank 2: relay_bytes([(0, 2)], ...)
    """
    buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    size = torch.tensor([buffer.numel()], dtype=torch.int64, device=device)
    work: list[dist.Work] = []

    def post(tensor: torch.Tensor, peer: int) -> None:
        work.append(group.send([tensor], peer, STATE_TAG))

    for receiver in receivers:
        post(size, receiver)
        _chunks(buffer, post, receiver, None)
    return Messages([work])


def _chunks(
    buffer: torch.Tensor,
    move: Callable[[torch.Tensor, int], Any],
    peer: int,
    progress: Callable[[int, int, float], None] | None,
) -> None:
    """``move`` (a send or a receive) ``buffer`` to or from ``peer`` in messages of ``CHUNK_BYTES``."""
    start = reported = time.perf_counter()
    total = buffer.numel()
    for offset in range(0, total, CHUNK_BYTES):
        move(buffer[offset : offset + CHUNK_BYTES], peer)
        now = time.perf_counter()
        if progress is not None and (now - reported >= PROGRESS_EVERY_S or offset + CHUNK_BYTES >= total):
            progress(min(offset + CHUNK_BYTES, total), total, now - start)
            reported = now
