"""A block-quantized mean across ranks: 8-bit (fp8) or 4-bit (fp4) codes with one bf16 scale per block.

A flat fp32 payload is cut into blocks of ``block_size`` elements; each block is sent as codes in
``float8_e4m3fn``, ``float8_e5m2`` or E2M1 (``float4_e2m1fn_x2``, two codes per byte) and one
bfloat16 scale: 0.27x (fp8) or 0.14x (fp4) of the bytes of an fp32 allreduce. A round
is a reduce-scatter and an all-gather built from two uint8 exchanges (gloo cannot reduce 8-bit
floats, and summing codes would overflow them anyway), point-to-point messages on gloo
(:func:`~fabric_multimodel.comm.collectives.all_to_all_messages`: they keep a slow link busy) and torch's
collectives elsewhere:

1. every rank quantizes its payload, cut into ``world`` shards of whole blocks, and
   the all-to-all sends shard ``j`` (codes, scales, a slice of the exact channel) to rank ``j``;
2. rank ``j`` dequantizes the ``world`` versions of its shard, sums them in fp32 in rank order,
   divides by ``world``, quantizes that mean again, and an all-gather hands every rank
   every quantized mean shard;
3. every rank dequantizes the gathered bytes into the payload: every replica holds bitwise the same mean.

Beside the codes rides an *exact* channel: a small fp32 tensor (a round's header) that is summed,
not quantized (raw bytes, summed in fp32 by the shard's owner), so a caller gets the header's sum
with no extra collective.

Example::

    mean = QuantizedMean(payload.numel(), torch.float8_e4m3fn, payload.device, exact_numel=header.numel())
    mean.all_reduce_mean(payload, header)  # payload <- the quantized mean, header <- the exact sum

The codes, their error bound and how non-finite values travel: :mod:`fabric_multimodel.comm.codec`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fabric_multimodel.comm import collectives
from fabric_multimodel.comm.codec import (
    DEFAULT_BLOCK_SIZE,
    SCALE_DTYPE,
    Codec,
    ceil_div,
    check_block,
    check_count,
)
from fabric_multimodel.comm.collectives import (
    ProcessGroup,
    Traffic,
    check_member,
    group_rank,
    group_size,
)
from fabric_multimodel.comm.phased_mean import GATHERING, SENT, PhasedMean

#: Elements quantized per batch of kernels unless ``chunk_elements`` says otherwise: on CPU, scratch that
#: stays in cache (2**20 is up to 3x slower for E2M1); on other devices (GPUs), fewer kernel launches.
CHUNK_ELEMENTS = {"cpu": 1 << 18}
#: Elements per batch of kernels on a device :data:`CHUNK_ELEMENTS` names none of.
DEVICE_CHUNK_ELEMENTS = 1 << 22


class _Layout:
    """Where a shard's exact slice, scales and codes sit in its segment of a uint8 buffer (one row per shard)."""

    def __init__(self, shard_blocks: int, code_bytes: int, exact_per_shard: int, scale_dtype: torch.dtype) -> None:
        self.shard_blocks, self.code_bytes, self.scale_dtype = shard_blocks, code_bytes, scale_dtype
        self.exact_end = 4 * exact_per_shard
        self.scales_end = self.exact_end + shard_blocks * scale_dtype.itemsize
        # Rows start at multiples of 4 bytes, so their fp32 and bf16 parts can be viewed in place.
        self.segment = ceil_div(self.scales_end + shard_blocks * code_bytes, 4) * 4

    def _rows(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer.view(-1, self.segment)

    def exact(self, buffer: torch.Tensor) -> torch.Tensor:
        return self._rows(buffer)[:, : self.exact_end].view(torch.float32)

    def scales(self, buffer: torch.Tensor) -> torch.Tensor:
        return self._rows(buffer)[:, self.exact_end : self.scales_end].view(self.scale_dtype)

    def codes(self, buffer: torch.Tensor) -> torch.Tensor:
        rows = self._rows(buffer)
        end = self.scales_end + self.shard_blocks * self.code_bytes
        return rows[:, self.scales_end : end].view(rows.shape[0], self.shard_blocks, self.code_bytes)


class _Tile(NamedTuple):
    """A rectangle of the ``[world, shard_blocks]`` grid of blocks, contiguous in the padded payload."""

    shards: slice
    blocks: slice
    start: int  # its first element in the padded payload
    size: int  # its number of elements


def _tiles(world: int, shard_blocks: int, full_blocks: int, block: int, capacity: int) -> list[_Tile]:
    """Cover the grid with tiles of at most ``capacity`` blocks that lie on one side of ``full_blocks``
    (where the payload's own memory ends and the padded tail buffer begins)."""
    tiles = []
    for lo, hi in ((0, full_blocks), (full_blocks, world * shard_blocks)):
        at = lo
        while at < hi:
            shard, offset = divmod(at, shard_blocks)
            rows = min(hi - at, capacity) // shard_blocks if offset == 0 else 0
            if rows:  # whole shards at once: one batch of kernels for many small shards
                shards, blocks, count = slice(shard, shard + rows), slice(0, shard_blocks), rows * shard_blocks
            else:
                count = min(shard_blocks - offset, hi - at, capacity)
                shards, blocks = slice(shard, shard + 1), slice(offset, offset + count)
            tiles.append(_Tile(shards, blocks, at * block, count * block))
            at += count
    return tiles


class QuantizedMean(PhasedMean):
    """The mean of a fixed-size fp32 payload across the ranks of ``group``, sent as block-quantized codes.

    Built once per payload size, code dtype (one of :data:`~fabric_multimodel.comm.codec.CODE_DTYPES`), block size,
    group and device; every buffer is allocated here, so a round allocates nothing. ``exact_numel`` fp32
    elements ride beside the codes and are *summed* exactly (a round's header: small integers in
    per-rank slots). A round runs in three phases a caller can spread over training steps:

    - :meth:`start` quantizes the payload (it only reads it) and launches the all-to-all;
    - :meth:`exchange` waits for it, reduces this rank's shard, and launches the all-gather;
    - :meth:`finish` waits for it and writes the mean into the payload given to :meth:`start`
      and the exact sum into its ``exact`` tensor (it runs :meth:`exchange` first if needed).

    With one rank there is no collective, but the same quantization and dequantization, so results
    are alike in kind. A peer that fails makes the collective (or its wait) raise RuntimeError; the
    object is then idle again and the payload as it was (with error feedback, the residual already
    holds this round's quantization error: load a :meth:`state_dict` taken before it to replay the round).

    Memory: the send and receive buffers (``traffic.bytes`` each), one mean shard, and scratch for
    ``chunk_elements`` elements at a time (default :data:`CHUNK_ELEMENTS` per device type, else
    :data:`DEVICE_CHUNK_ELEMENTS`), plus the residual with error feedback.

    ``error_feedback=True`` keeps what this rank's quantization dropped (one fp32 buffer the size of
    the payload) and adds it to the next payload before quantizing. The owner's quantization of the
    mean is not fed back: its error is the same on every rank (all apply the same mean), so it never
    makes the replicas disagree, and it would be per-shard state tied to the world size, while the
    residual kept here covers this rank's whole payload and survives a change of world size.

    Example::

        mean = QuantizedMean(delta.numel(), torch.float4_e2m1fn_x2, delta.device, exact_numel=header.numel())
        mean.start(delta, header)   # after a local step
        mean.exchange()             # a step later
        mean.finish()               # delta and header now hold the mean and the exact sum
    """

    #: A plain mean of parameters may cross quantized (each block keeps its scale).
    carries_parameters = True

    def __init__(
        self,
        numel: int,
        code_dtype: torch.dtype,
        device: torch.device | str,
        *,
        group: ProcessGroup = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        exact_numel: int = 0,
        error_feedback: bool = False,
        chunk_elements: int | None = None,
    ) -> None:
        caller = "QuantizedMean"
        check_count(numel, "numel", 1, caller, "the payload's number of elements")
        check_count(exact_numel, "exact_numel", 0, caller, "the exact channel's number of elements (0 for none)")
        check_block(block_size, code_dtype, caller)
        device = torch.device(device)
        if chunk_elements is None:
            chunk_elements = CHUNK_ELEMENTS.get(device.type, DEVICE_CHUNK_ELEMENTS)
        check_count(chunk_elements, "chunk_elements", 1, caller, "the elements quantized per batch of kernels")
        check_member(group, caller)
        self.numel, self.exact_numel, self.code_dtype, self.block_size = numel, exact_numel, code_dtype, block_size
        self.group = group
        self.world = group_size(group)
        self.rank = group_rank(group)
        world, block = self.world, block_size
        self._shard_blocks = ceil_div(ceil_div(numel, block), world)
        self._full_blocks = numel // block  # blocks that lie entirely in the payload's own memory
        padded = world * self._shard_blocks * block
        capacity = min(max(1, chunk_elements // block), world * self._shard_blocks)
        exact_per_shard = ceil_div(exact_numel, world)
        self._codec = Codec(code_dtype, block, device, SCALE_DTYPE, capacity)
        self._layout = _Layout(self._shard_blocks, self._codec.code_bytes, exact_per_shard, SCALE_DTYPE)
        self._send = torch.zeros(world * self._layout.segment, dtype=torch.uint8, device=device)
        self.device = self._send.device
        self._received = self._send if world == 1 else torch.zeros_like(self._send)
        self._mean = torch.zeros(self._layout.segment, dtype=torch.uint8, device=device)
        # The all-gather lands in the send buffer (free once the all-to-all is done); one rank "gathers" its mean.
        self._gathered = self._mean if world == 1 else self._send
        self._tail = torch.zeros(padded - self._full_blocks * block, dtype=torch.float32, device=device)
        self._exact = torch.zeros(world * exact_per_shard, dtype=torch.float32, device=device)
        # The owner's running sum; with error feedback also what was sent, decoded.
        self._scratch = [
            torch.empty(capacity * block, dtype=torch.float32, device=device) for _ in range(1 + error_feedback)
        ]
        self._residual = torch.zeros(padded, dtype=torch.float32, device=device) if error_feedback else None
        self._tiles = _tiles(world, self._shard_blocks, self._full_blocks, block, capacity)
        shard_blocks = self._shard_blocks
        self._own_tiles = [(lo, min(lo + capacity, shard_blocks)) for lo in range(0, shard_blocks, capacity)]
        super().__init__()
        self._payload: torch.Tensor | None = None
        self._exact_out: torch.Tensor | None = None

    @property
    def traffic(self) -> Traffic:
        """What one round sends per rank: the payload and exact elements it carries, and the uint8 bytes it sends.

        ``bytes`` is the all-to-all's input (codes, scales, exact channel and padding); the
        all-gather moves as much again across the ranks, as a ring allreduce moves ``2(W-1)/W`` of
        its input, so ``bytes`` compares with an allreduce's input bytes (``4 * elements`` for fp32).
        Zero with one rank, as for an averaging round.
        """
        if self.world == 1:
            return Traffic()
        return Traffic(self.numel + self.exact_numel, self._send.numel())

    @property
    def buffer_bytes(self) -> int:
        """The bytes of every buffer this object holds (all allocated at construction)."""
        tensors = [self._send, self._mean, self._tail, self._exact, *self._scratch, *self._codec.buffers()]
        if self._received is not self._send:
            tensors.append(self._received)
        if self._residual is not None:
            tensors.append(self._residual)
        return sum(t.numel() * t.element_size() for t in tensors)

    def start(self, payload: torch.Tensor, exact: torch.Tensor | None = None, *, carry: bool = True) -> None:
        """Quantize ``payload`` (and copy ``exact``) into the send buffer and launch the all-to-all.

        Both are only read here; :meth:`finish` writes the results into them. Every argument is
        checked before any collective (every rank passes the same kind of arguments, so every rank
        raises). With error feedback, the residual is added first and replaced by what this
        quantization dropped; ``carry=False`` leaves it for a later round (this rank made no progress
        for this one, which may not be applied at all).
        """
        flat, exact_flat = self._check_round(payload, exact)
        codec, layout, send = self._codec, self._layout, self._send
        rest = self.numel - self._full_blocks * self.block_size
        self._tail[:rest].copy_(flat[self.numel - rest :])
        codes, scales = layout.codes(send), layout.scales(send)
        for tile in self._tiles:
            x = self._source(flat, tile)
            tile_codes, tile_scales = codes[tile.shards, tile.blocks], scales[tile.shards, tile.blocks]
            if self._residual is None or not carry:
                codec.encode(x, tile_codes, tile_scales)
                continue
            residual = self._residual[tile.start : tile.start + tile.size].view_as(x)
            total, decoded = (t[: tile.size].view_as(x) for t in self._scratch)
            torch.add(x, residual, out=total)
            codec.encode(total, tile_codes, tile_scales)
            codec.decode(tile_codes, tile_scales, decoded)
            torch.sub(total, decoded, out=residual)
        if exact_flat is not None:
            self._exact[: self.exact_numel].copy_(exact_flat)
        layout.exact(send).copy_(self._exact.view(self.world, -1))
        if self.world > 1:
            self._handle = collectives.all_to_all_messages(self._received, send, group=self.group, async_op=True)
        self._payload, self._exact_out, self._phase = flat, exact_flat, SENT

    def exchange(self) -> None:
        """Wait for the all-to-all, reduce this rank's shard (mean of the dequantized versions, quantized
        again; exact slices summed), and launch the all-gather."""
        self._waited(SENT, "exchange")
        codec, layout, block = self._codec, self._layout, self.block_size
        codes, scales = layout.codes(self._received), layout.scales(self._received)
        mean_codes, mean_scales = layout.codes(self._mean), layout.scales(self._mean)
        for lo, hi in self._own_tiles:
            total = self._scratch[0][: (hi - lo) * block].view(1, hi - lo, block)
            codec.decode(codes[:1, lo:hi], scales[:1, lo:hi], total)
            for r in range(1, self.world):  # in rank order, so the sum is the same whatever the timing
                codec.decode(codes[r : r + 1, lo:hi], scales[r : r + 1, lo:hi], total, accumulate=True)
            total.div_(self.world)
            codec.encode(total, mean_codes[:, lo:hi], mean_scales[:, lo:hi])
        torch.sum(layout.exact(self._received), dim=0, out=layout.exact(self._mean)[0])
        if self.world > 1:
            self._handle = collectives.all_gather_messages(self._send, self._mean, group=self.group, async_op=True)
        self._phase = GATHERING

    def finish(self) -> None:
        """Wait for the all-gather and dequantize: the payload given to :meth:`start` <- the mean, and its
        ``exact`` <- the sum."""
        if self._phase == SENT:
            self.exchange()
        self._waited(GATHERING, "finish")
        flat, layout = self._payload, self._layout
        assert flat is not None
        codes, scales = layout.codes(self._gathered), layout.scales(self._gathered)
        for tile in self._tiles:
            tile_codes, tile_scales = codes[tile.shards, tile.blocks], scales[tile.shards, tile.blocks]
            self._codec.decode(tile_codes, tile_scales, self._source(flat, tile))
        rest = self.numel - self._full_blocks * self.block_size
        flat[self.numel - rest :].copy_(self._tail[:rest])
        if self._exact_out is not None:
            self._exact.view(self.world, -1).copy_(layout.exact(self._gathered))
            self._exact_out.copy_(self._exact[: self.exact_numel])
        self._payload = self._exact_out = None

    def clear_residual(self) -> None:
        """Forget what error feedback kept (after a round that was rolled back: it held that round's values)."""
        self._check_between_rounds("clear_residual")
        if self._residual is not None:
            self._residual.zero_()

    def keep_residual(self, previous: QuantizedMean) -> None:
        """Start from what ``previous``, this rank's mean of the same payload over another group, kept: the residual
        is this rank's own whatever the group (a membership's new epoch). Nothing is kept when the payloads differ
        in size or either has no error feedback; no collective.

        Example::

            mean = QuantizedMean(delta.numel(), torch.float8_e4m3fn, delta.device, group=new, error_feedback=True)
            mean.keep_residual(old_mean)
        """
        if self._residual is not None and previous._residual is not None and previous.numel == self.numel:
            self._residual[: self.numel].copy_(previous._residual[: self.numel])

    def state_dict(self) -> dict[str, Any]:
        """The error-feedback residual (``{}`` without error feedback), for an exact resume; between rounds only."""
        self._check_between_rounds("state_dict")
        return {} if self._residual is None else {"residual": self._residual[: self.numel].clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (from an object built with the same numel and error feedback)."""
        self._check_between_rounds("load_state_dict")
        saved = state.get("residual")
        if self._residual is None or saved is None:
            if self._residual is not None or saved is not None:
                raise ValueError(
                    "QuantizedMean.load_state_dict: the state was saved with error_feedback="
                    f"{saved is not None}, this object has error_feedback={self._residual is not None}; build it alike."
                )
            return
        if not isinstance(saved, torch.Tensor) or saved.numel() != self.numel:
            raise ValueError(
                f"QuantizedMean.load_state_dict: `residual` must be a tensor of {self.numel} elements (this payload's"
                f" size), got {getattr(saved, 'shape', type(saved).__name__)}."
            )
        self._residual[: self.numel].copy_(saved.reshape(-1))

    def _source(self, flat: torch.Tensor, tile: _Tile) -> torch.Tensor:
        """The tile's elements: a view of the payload, or of the padded tail buffer past the last whole block."""
        boundary = self._full_blocks * self.block_size
        if tile.start < boundary:
            region = flat[tile.start : tile.start + tile.size]
        else:
            region = self._tail[tile.start - boundary : tile.start - boundary + tile.size]
        return region.view(tile.shards.stop - tile.shards.start, tile.blocks.stop - tile.blocks.start, self.block_size)
