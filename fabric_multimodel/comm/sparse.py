"""Sparse payloads: the top entries of each chunk of a vector, in about 10 bits each (SparseLoCo's selection,
arXiv 2508.15706, with the positions coded more tightly than its 12-bit indices).

A vector of ``numel`` values is cut into chunks of ``chunk`` (the last may be shorter); of each, the ``k`` entries of
largest magnitude are kept (:func:`per_chunk`: ``density * chunk``, at least one). A payload holds, per chunk, two
fp16 magnitudes (the mean of its small and of its large kept entries); per kept entry a sign bit and a level bit;
and the positions, as the gaps between them inside the chunk, Rice-coded in two streams (the low ``r`` bits of each
gap, fixed width, then the high part in unary), so that both encoding and decoding are a handful of vector
operations on the tensor's own device, never a loop per entry. At ``density = 1/64`` an entry costs about
2 + 5 + 2.5 + 0.5 = 10 bits.

A payload comes from another site: :func:`decode` checks its length, its scales and its positions (exactly ``k``
per chunk, each inside its chunk) before it returns anything, and raises ``ValueError`` naming what is wrong.

Example::

    payload, sent = encode(pseudo_gradient, chunk=4096, density=1 / 64)
    residual = pseudo_gradient - sent  # error feedback: what this round did not send
    indices, values = decode(payload, pseudo_gradient.numel(), chunk=4096, density=1 / 64)
"""

from __future__ import annotations

import torch

from fabric_multimodel.plan.payloads import SCALE_BYTES, max_bytes, per_chunk, rice_bits

__all__ = ["SCALE_BYTES", "decode", "encode", "max_bytes", "pack_bits", "per_chunk", "rice_bits", "unpack_bits"]


def _counts(numel: int, chunk: int, k: int) -> torch.Tensor:
    """Entries kept per chunk: ``k`` for each full chunk, at most the tail's length for the last."""
    full, tail = divmod(numel, chunk)
    return torch.tensor([k] * full + ([min(k, tail)] if tail else []))


def encode(values: torch.Tensor, chunk: int, density: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The payload (uint8, on ``values``' device) of the top entries of each chunk of ``values`` (any shape, read
    flat), and what it decodes to as a tensor like ``values`` (zeros elsewhere): the caller keeps the difference.

    Example::

        payload, sent = encode(torch.randn(10_000), chunk=1024, density=0.02)
    """
    k = per_chunk(chunk, density)
    flat = values.detach().reshape(-1).float()
    numel, device = flat.numel(), flat.device
    if numel == 0 or not torch.isfinite(flat).all():
        raise ValueError("sparse.encode: `values` must be non-empty and finite.")
    padded = torch.cat([flat, flat.new_zeros((-numel) % chunk)]).view(-1, chunk)
    magnitude = padded.abs()
    if numel % chunk:  # the padding is never chosen before a real entry
        magnitude[-1, numel % chunk :] = -1.0
    positions = magnitude.topk(k, dim=1).indices.sort(dim=1).values  # increasing in each row
    counts = _counts(numel, chunk, k).to(device)
    mask = torch.arange(k, device=device) < counts[:, None]
    rows = torch.arange(len(counts), device=device)[:, None].expand_as(positions)[mask]
    columns = positions[mask]
    chosen = padded[rows, columns]
    scales, large = _levels(chosen, rows, len(counts))
    sent = flat.new_zeros(numel)
    sent[rows * chunk + columns] = torch.where(large, scales[rows, 1], scales[rows, 0]).copysign(chosen)
    first = torch.ones_like(rows, dtype=torch.bool)
    first[1:] = rows[1:] != rows[:-1]
    previous = torch.cat([columns.new_zeros(1), columns[:-1]])
    gaps = torch.where(first, columns, columns - previous - 1)  # each chunk's first counts from its start
    r = rice_bits(chunk, k)
    low = ((gaps[:, None] >> torch.arange(r - 1, -1, -1, device=device)) & 1).reshape(-1)
    ends = (gaps >> r).add(1).cumsum(0) - 1  # the unary code of the high part: ones, then a zero
    unary = torch.ones(int(ends[-1]) + 1, dtype=torch.uint8, device=device)
    unary[ends] = 0
    bits = torch.cat([torch.signbit(chosen).to(torch.uint8), large.to(torch.uint8), low.to(torch.uint8), unary])
    return torch.cat([scales.half().view(torch.uint8).reshape(-1), pack_bits(bits)]), sent.view_as(values).to(
        values.dtype
    )


def decode(payload: torch.Tensor, numel: int, chunk: int, density: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat indices (increasing) and values (float32) that ``payload`` holds for a vector of ``numel`` values;
    ``ValueError`` for a payload that is not one :func:`encode` makes with these arguments.

    Example::

        indices, values = decode(payload, 10_000, chunk=1024, density=0.02)
        dense = torch.zeros(10_000).index_put_((indices,), values)
    """
    k = per_chunk(chunk, density)
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 1:
        raise ValueError(f"sparse.decode: `numel` must be a positive int, got {numel!r}.")
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise ValueError(f"sparse.decode: a payload is a 1-D uint8 tensor, got {payload.dtype}, {payload.dim()}-D.")
    device = payload.device
    counts = _counts(numel, chunk, k).to(device)
    chunks, entries, r = len(counts), int(counts.sum()), rice_bits(chunk, k)
    head, fixed = chunks * SCALE_BYTES, entries * (2 + r)
    if (payload.numel() - head) * 8 < fixed + entries:
        raise ValueError(f"sparse.decode: {payload.numel()} bytes are too few for {entries} entries.")
    scales = payload[:head].clone().view(torch.float16).float().view(chunks, 2)  # a copy: any offset can be viewed
    if not torch.isfinite(scales).all() or (scales < 0).any():
        raise ValueError("sparse.decode: the payload's scales are not finite non-negative numbers.")
    bits = unpack_bits(payload[head:])
    sign, large, low, unary = (
        bits[:entries].bool(),
        bits[entries : 2 * entries].bool(),
        bits[2 * entries : fixed],
        bits[fixed:],
    )
    ends = (unary == 0).nonzero().reshape(-1)
    if ends.numel() != entries or unary.numel() - int(ends[-1]) - 1 >= 8:
        raise ValueError(f"sparse.decode: the positions hold {ends.numel()} gaps, not {entries}.")
    gaps = (ends - torch.cat([ends.new_full((1,), -1), ends[:-1]]) - 1) << r
    if r:
        gaps = gaps + (low.view(entries, r).long() << torch.arange(r - 1, -1, -1, device=device)).sum(1)
    rows = torch.arange(chunks, device=device).repeat_interleave(counts)
    steps = (gaps + 1).cumsum(0)
    before = (steps - gaps - 1)[counts.cumsum(0) - counts]  # the count before each chunk's first entry
    columns = steps - before[rows] - 1
    lengths = torch.full((chunks,), chunk, device=device)
    lengths[-1] = numel - (chunks - 1) * chunk
    if (columns >= lengths[rows]).any():
        raise ValueError("sparse.decode: a position lies outside its chunk.")
    magnitudes = torch.where(large, scales[rows, 1], scales[rows, 0])
    return rows * chunk + columns, torch.where(sign, -magnitudes, magnitudes)


def _levels(chosen: torch.Tensor, rows: torch.Tensor, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per chunk, the mean magnitude of its kept entries at or below their mean, and of those above (as fp16 rounds
    them: what the receivers decode); and which entries are above."""
    magnitude = chosen.abs()
    zeros = chosen.new_zeros(chunks)
    counted = zeros.index_add(0, rows, torch.ones_like(magnitude))
    large = magnitude > (zeros.index_add(0, rows, magnitude) / counted)[rows]
    levels = []
    for side in (~large, large):
        total = zeros.index_add(0, rows, magnitude * side)
        levels.append(total / zeros.index_add(0, rows, side.float()).clamp(min=1))
    scales = torch.stack(levels, 1).half()
    if not torch.isfinite(scales).all():
        raise ValueError("sparse.encode: `values` are beyond float16's range (65504).")
    return scales.float(), large


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Bits (0/1, uint8) as bytes, first bit highest; the last byte filled with ones (never a unary code's end).

    Example::

        pack_bits(torch.tensor([1, 0, 1], dtype=torch.uint8))  # tensor([191], dtype=torch.uint8)
    """
    padded = torch.cat([bits, bits.new_ones((-bits.numel()) % 8)]).view(-1, 8)
    return (padded << torch.arange(7, -1, -1, device=bits.device, dtype=torch.uint8)).sum(1, dtype=torch.uint8)


def unpack_bits(data: torch.Tensor) -> torch.Tensor:
    """The bits (0/1, uint8) of bytes ``data``, first bit highest: what :func:`pack_bits` packed, and its filling."""
    return ((data[:, None] >> torch.arange(7, -1, -1, device=data.device, dtype=torch.uint8)) & 1).reshape(-1)
