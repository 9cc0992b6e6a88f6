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

E2M1 codes follow the OCP MX layout (bit 3 sign, bits 2-1 exponent with bias 1, bit 0 mantissa), two
per byte with the first element in the low nibble, as torch packs ``float4_e2m1fn_x2``: the bytes can
be viewed as that dtype where torch computes with it (CUDA); on CPU torch cannot cast it, so encoding
and decoding are done here with plain tensor ops, on any device.

Beside the codes rides an *exact* channel: a small fp32 tensor (a round's header) that is summed,
not quantized (raw bytes, summed in fp32 by the shard's owner), so a caller gets the header's sum
with no extra collective.

Example::

    mean = QuantizedMean(payload.numel(), torch.float8_e4m3fn, payload.device, exact_numel=header.numel())
    mean.all_reduce_mean(payload, header)  # payload <- the quantized mean, header <- the exact sum

Error bound. Per element of block ``k`` (``block_size`` consecutive payload elements), with ``A_r``
the block's largest magnitude on rank ``r``, ``Ā = mean_r A_r``, ``mu`` the exact mean and ``M`` the
largest magnitude of ``mu`` in the block, the result satisfies::

    |result - mu| <= c * (Ā + M + c * Ā)   (<= c * (2 + c) * Ā)

where ``c = relative_error(code_dtype)`` is half the code step at the top of the code's range,
relative to its largest code, times ``1 + 2**-8`` (the bf16 rounding of the scale): 1/28 for
e4m3fn, 1/14 for e5m2, 1/6 for e2m1. The first term is each rank's own quantization (``c * A_r``
each, averaged), the rest is the owner's quantization of the mean, whose block amax is at most
``M + c * Ā``. Add fp32 rounding (about ``2**-22`` relative) and, for blocks whose amax is below
``max_code * 2**-126`` (scales never go below the smallest normal fp32), an absolute
``c * max_code * 2**-126``.

Non-finite values propagate: a NaN or Inf in a block makes its scale NaN or Inf (e4m3fn has no Inf,
E2M1 neither NaN nor Inf, so the scale carries it), that block dequantizes to NaN or Inf on its
owner, the owner's mean of it is non-finite, and so is that block on every rank after the round.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fabric_multimodel.comm import collectives
from fabric_multimodel.comm.collectives import (
    ProcessGroup,
    Traffic,
    check_member,
    group_rank,
    group_size,
    wait_all,
)

#: The packed 4-bit dtype (every torch pyproject.toml admits has it).
FLOAT4_E2M1 = torch.float4_e2m1fn_x2

#: One scale per block, in this dtype (chosen by measurement: benchmarks/quantized_cost.py).
SCALE_DTYPE = torch.bfloat16

#: Elements per block (chosen by measurement: benchmarks/quantized_cost.py).
DEFAULT_BLOCK_SIZE = 32

#: Elements quantized per batch of kernels unless ``chunk_elements`` says otherwise: on CPU, scratch that
#: stays in cache (2**20 is up to 3x slower for E2M1); on other devices (GPUs), fewer kernel launches.
CHUNK_ELEMENTS = {"cpu": 1 << 18}
#: Elements per batch of kernels on a device :data:`CHUNK_ELEMENTS` names none of.
DEVICE_CHUNK_ELEMENTS = 1 << 22

# Scales never go below the smallest normal fp32: their reciprocal stays finite, and a block of
# zeros gets a positive scale (codes 0, no 0/0).
_MIN_SCALE = 2.0**-126

# The nibble's magnitudes, in code order (OCP MX E2M1: 1 sign, 2 exponent, 1 mantissa bit).
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


class _Format(NamedTuple):
    max_code: float
    half_step: float  # half the distance between the two largest codes
    bits: int


_FORMATS: dict[torch.dtype, _Format] = {
    torch.float8_e4m3fn: _Format(448.0, 16.0, 8),
    torch.float8_e5m2: _Format(57344.0, 4096.0, 8),
    FLOAT4_E2M1: _Format(6.0, 1.0, 4),
}

#: The code dtypes a :class:`QuantizedMean` (and :func:`quantize`) accepts.
CODE_DTYPES = tuple(_FORMATS)


def relative_error(code_dtype: torch.dtype) -> float:
    """The largest error of one quantization, relative to its block's amax (``c`` in the module's bound).

    Example::

        relative_error(torch.float8_e4m3fn)  # 0.0359: |x - dequantize(quantize(x))| <= 0.036 * amax
    """
    fmt = _format(code_dtype, "relative_error")
    return fmt.half_step / fmt.max_code * (1 + 2.0**-8)


class Quantized(NamedTuple):
    """Blocks of codes and their scales, as :func:`quantize` returns them.

    ``codes`` has the code dtype and shape ``[blocks, block_size]`` (fp8) or ``[blocks, block_size // 2]``
    (``float4_e2m1fn_x2``: the first element of a pair in the low nibble of its byte, as torch packs
    that dtype); ``scales`` has shape ``[blocks]``. ``codes.view(torch.uint8)`` gives the bytes sent.
    """

    codes: torch.Tensor
    scales: torch.Tensor


def quantize(
    x: torch.Tensor,
    code_dtype: torch.dtype,
    block_size: int = DEFAULT_BLOCK_SIZE,
    scale_dtype: torch.dtype = SCALE_DTYPE,
) -> Quantized:
    """Block-quantize the fp32 tensor ``x`` (flattened; the last block padded with zeros).

    ``scale_dtype`` is bfloat16 (what :class:`QuantizedMean` sends) or float32. Allocates its
    result; :class:`QuantizedMean` runs the same kernels into preallocated buffers.

    Example::

        q = quantize(torch.randn(100), torch.float8_e4m3fn)
        x = dequantize(q, 100)
    """
    _check_tensor(x, "quantize", "x", x.numel(), x.device)
    _check_block(block_size, code_dtype, "quantize")
    if scale_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"quantize: `scale_dtype` must be torch.bfloat16 or torch.float32, got {scale_dtype}.")
    blocks = _ceil_div(x.numel(), block_size)
    codec = _Codec(code_dtype, block_size, x.device, scale_dtype, blocks)
    padded = torch.zeros(blocks * block_size, dtype=torch.float32, device=x.device)
    padded[: x.numel()] = x.reshape(-1)
    codes = torch.empty(blocks, codec.code_bytes, dtype=torch.uint8, device=x.device)
    scales = torch.empty(blocks, dtype=scale_dtype, device=x.device)
    codec.encode(padded.view(1, blocks, block_size), codes.view(1, blocks, -1), scales.view(1, blocks))
    return Quantized(codes.view(code_dtype), scales)


def dequantize(quantized: Quantized, numel: int) -> torch.Tensor:
    """The fp32 values (the first ``numel``) that :func:`quantize` encoded: code * scale.

    Example::

        dequantize(quantize(x, torch.float8_e5m2), x.numel()).view_as(x)
    """
    codes, scales = quantized
    code_dtype = codes.dtype
    bytes_per_block = codes.shape[-1] * codes.element_size()
    block_size = bytes_per_block * 8 // _format(code_dtype, "dequantize").bits
    blocks = codes.shape[0]
    if not 0 <= numel <= blocks * block_size:
        raise ValueError(f"dequantize: `numel` must be 0..{blocks * block_size} (what the blocks hold), got {numel}.")
    codec = _Codec(code_dtype, block_size, codes.device, scales.dtype, blocks)
    out = torch.empty(blocks * block_size, dtype=torch.float32, device=codes.device)
    codec.decode(codes.view(torch.uint8).view(1, blocks, -1), scales.view(1, blocks), out.view(1, blocks, -1))
    return out[:numel]


class _Codec:
    """The quantize/dequantize kernels for one format, with scratch for up to ``capacity`` blocks at a time.

    Every op writes into preallocated buffers (``out=``, in place), so a round allocates nothing.
    """

    def __init__(
        self, code_dtype: torch.dtype, block: int, device: torch.device, scale_dtype: torch.dtype, capacity: int
    ) -> None:
        self.fmt = _FORMATS[code_dtype]
        self.code_dtype, self.block, self.scale_dtype = code_dtype, block, scale_dtype
        self.code_bytes = block * self.fmt.bits // 8  # per block
        self._amax = torch.empty(capacity, dtype=torch.float32, device=device)
        self._q = torch.empty(capacity * block, dtype=torch.float32, device=device)
        # Decoding goes through fp16 bit patterns, which hold every code's value exactly: an fp8 byte is
        # shifted into place (e5m2 is an fp16's top byte; e4m3fn lands with its exponent 8 too low, which
        # the scale makes up), an E2M1 byte is looked up as two fp16s. On CPU that beats torch's fp8 cast
        # two- to eightfold, and E2M1 has no cast at all.
        self._half = torch.empty(capacity * block, dtype=torch.int16, device=device)
        self._e2m1: list[torch.Tensor] = []
        self._mask: int | None  # e4m3fn's sign mask; None for e5m2 (E2M1 decodes by table)
        if code_dtype == torch.float8_e4m3fn:
            # The sign-extended byte shifted by 7 copies the sign into bit 14 too; the mask clears it.
            self._shift, self._mask, self._factor = 7, ~0x4000, 2.0**8
        elif code_dtype == torch.float8_e5m2:
            self._shift, self._mask, self._factor = 8, None, 1.0
        else:
            self._factor = 1.0
            nibbles = torch.tensor(_E2M1_MAGNITUDES + tuple(-m for m in _E2M1_MAGNITUDES), dtype=torch.float16)
            every_byte = torch.arange(256)
            pairs = torch.stack([nibbles[every_byte & 15], nibbles[every_byte >> 4]], dim=1)  # low nibble first
            self._table = pairs.contiguous().view(torch.int32).view(256).to(device)
            self._index = torch.empty(capacity * self.code_bytes, dtype=torch.int32, device=device)
            self._e2m1 = [torch.empty(capacity * block, dtype=torch.float32, device=device) for _ in range(3)]
            self._four, self._sign_offset, self._magic, self._magic_4 = (
                torch.tensor(c, device=device) for c in (4.0, 4.0 - 2.0**23, 2.0**23, 2.0**23 + 4)
            )

    def buffers(self) -> list[torch.Tensor]:
        tensors = [self._amax, self._q, self._half, *self._e2m1]
        return tensors + ([self._table, self._index] if self._e2m1 else [])

    def encode(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """Quantize ``x`` ``[k, m, block]`` (fp32, read only) into ``codes`` ``[k, m, code_bytes]`` (uint8)
        and ``scales`` ``[k, m]``."""
        k, m, _ = x.shape
        amax = self._amax[: k * m].view(k, m)
        q = self._q[: x.numel()].view_as(x)
        torch.abs(x, out=q)
        torch.amax(q, dim=-1, out=amax)  # NaN propagates; an Inf makes the scale Inf
        amax.div_(self.fmt.max_code).clamp_min_(_MIN_SCALE)
        scales.copy_(amax)
        # Codes come from the scale as sent (bf16-rounded), so code * scale is what every reader decodes;
        # rounding the scale down by up to 2**-8 pushes codes at most that far past the top code, which
        # the fp8 casts round back to it (e4m3fn saturates, e5m2 reaches Inf only at 61440).
        amax.copy_(scales).reciprocal_()
        torch.mul(x, amax.unsqueeze(-1), out=q)  # an Inf scale gives 0 (or NaN): its decoded block is NaN
        if self.fmt.bits == 8:
            codes.view(self.code_dtype).copy_(q)  # round to nearest even, as torch casts
        else:
            self._encode_e2m1(q, codes)

    def _encode_e2m1(self, q: torch.Tensor, codes: torch.Tensor) -> None:
        # The magnitude code m of |q| rounded to nearest, ties to the even code: the code is a concave
        # piecewise-linear function of the value, min(2a, a + 2, a/2 + 4) (affine between neighbouring
        # codes), so m = min(rne(2a), rne(a) + 2, rne(a/2) + 4). Each rne is one fp32 addition of 2**23
        # (plus the even offset, which keeps the parity that ties round to) to an exact multiple of a.
        a, low, other = (t[: q.numel()].view_as(q) for t in self._e2m1)
        torch.abs(q, out=a)
        torch.copysign(self._four, q, out=q)
        torch.sub(self._sign_offset, q, out=q)  # the sign bit's value (0 or 8), less 2**23
        torch.add(self._magic, a, alpha=2, out=low)
        torch.add(a, 2.0**23 + 2, out=other)
        torch.minimum(low, other, out=low)
        torch.add(self._magic_4, a, alpha=0.5, out=other)
        torch.minimum(low, other, out=low)
        low.add_(q)  # the nibble, 0..15 (past 6.0 the a/2 branch gives 7)
        pairs = low.view(*q.shape[:-1], -1, 2)
        packed = a[..., : pairs.shape[-2]]
        torch.add(pairs[..., 0], pairs[..., 1], alpha=16, out=packed)  # first element in the low nibble
        codes.copy_(packed)

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> None:
        """Dequantize ``codes`` ``[k, m, code_bytes]`` (uint8) and ``scales`` ``[k, m]`` into ``out``
        ``[k, m, block]`` (contiguous fp32), or add them to it (``accumulate``).

        A non-finite block decodes to non-finite values through its scale (e4m3fn's NaN code itself
        decodes as 480: :meth:`encode` only writes it into blocks whose scale is NaN or Inf).
        """
        half = self._half[: out.numel()].view_as(out)
        if self._e2m1:
            index = self._index[: codes.numel()].view_as(codes)
            index.copy_(codes)
            torch.index_select(self._table, 0, index.view(-1), out=half.view(torch.int32).view(-1))
        else:
            half.copy_(codes.view(torch.int8))  # sign-extends
            half.bitwise_left_shift_(self._shift)
            if self._mask is not None:
                half.bitwise_and_(self._mask)
        # Scales widened into scratch first (a mixed-dtype multiply would allocate that copy itself).
        wide = self._amax[: scales.numel()].view_as(scales)
        wide.copy_(scales)
        if self._factor != 1.0:
            wide.mul_(self._factor)
        values = half.view(torch.float16)
        if accumulate:
            widened = self._q[: out.numel()].view_as(out)
            widened.copy_(values)
            out.addcmul_(widened, wide.unsqueeze(-1))
        else:
            out.copy_(values)
            out.mul_(wide.unsqueeze(-1))


class _Layout:
    """Where a shard's exact slice, scales and codes sit in its segment of a uint8 buffer (one row per shard)."""

    def __init__(self, shard_blocks: int, code_bytes: int, exact_per_shard: int, scale_dtype: torch.dtype) -> None:
        self.shard_blocks, self.code_bytes, self.scale_dtype = shard_blocks, code_bytes, scale_dtype
        self.exact_end = 4 * exact_per_shard
        self.scales_end = self.exact_end + shard_blocks * scale_dtype.itemsize
        # Rows start at multiples of 4 bytes, so their fp32 and bf16 parts can be viewed in place.
        self.segment = _ceil_div(self.scales_end + shard_blocks * code_bytes, 4) * 4

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


_IDLE, _SENT, _GATHERING = "idle", "sent", "gathering"


class QuantizedMean:
    """The mean of a fixed-size fp32 payload across the ranks of ``group``, sent as block-quantized codes.

    Built once per payload size, code dtype (one of :data:`CODE_DTYPES`), block size, group and
    device; every buffer is allocated here, so a round allocates nothing. ``exact_numel`` fp32
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
        _check_count(numel, "numel", 1, caller, "the payload's number of elements")
        _check_count(exact_numel, "exact_numel", 0, caller, "the exact channel's number of elements (0 for none)")
        _check_block(block_size, code_dtype, caller)
        device = torch.device(device)
        if chunk_elements is None:
            chunk_elements = CHUNK_ELEMENTS.get(device.type, DEVICE_CHUNK_ELEMENTS)
        _check_count(chunk_elements, "chunk_elements", 1, caller, "the elements quantized per batch of kernels")
        check_member(group, caller)
        self.numel, self.exact_numel, self.code_dtype, self.block_size = numel, exact_numel, code_dtype, block_size
        self.group = group
        self.world = group_size(group)
        self.rank = group_rank(group)
        world, block = self.world, block_size
        self._shard_blocks = _ceil_div(_ceil_div(numel, block), world)
        self._full_blocks = numel // block  # blocks that lie entirely in the payload's own memory
        padded = world * self._shard_blocks * block
        capacity = min(max(1, chunk_elements // block), world * self._shard_blocks)
        exact_per_shard = _ceil_div(exact_numel, world)
        self._codec = _Codec(code_dtype, block, device, SCALE_DTYPE, capacity)
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
        self._phase = _IDLE
        #: Asked while a wait is unfinished: True ends it with an error (see collectives.wait_all).
        self.abandon: Callable[[], bool] | None = None
        self._handle: Any = None
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

    @property
    def pending(self) -> bool:
        """True between :meth:`start` and :meth:`finish`."""
        return self._phase != _IDLE

    def all_reduce_mean(self, payload: torch.Tensor, exact: torch.Tensor | None = None) -> None:
        """A whole round at once: ``payload`` <- the quantized mean, ``exact`` <- the exact sum.

        Example::

            mean.all_reduce_mean(delta, header)
        """
        self.start(payload, exact)
        self.exchange()
        self.finish()

    def start(self, payload: torch.Tensor, exact: torch.Tensor | None = None) -> None:
        """Quantize ``payload`` (and copy ``exact``) into the send buffer and launch the all-to-all.

        Both are only read here; :meth:`finish` writes the results into them. Every argument is
        checked before any collective (every rank passes the same kind of arguments, so every rank
        raises). With error feedback, the residual is added first and replaced by what this
        quantization dropped.
        """
        flat, exact_flat = self._check_round(payload, exact)
        codec, layout, send = self._codec, self._layout, self._send
        rest = self.numel - self._full_blocks * self.block_size
        self._tail[:rest].copy_(flat[self.numel - rest :])
        codes, scales = layout.codes(send), layout.scales(send)
        for tile in self._tiles:
            x = self._source(flat, tile)
            tile_codes, tile_scales = codes[tile.shards, tile.blocks], scales[tile.shards, tile.blocks]
            if self._residual is None:
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
        self._payload, self._exact_out, self._phase = flat, exact_flat, _SENT

    def exchange(self) -> None:
        """Wait for the all-to-all, reduce this rank's shard (mean of the dequantized versions, quantized
        again; exact slices summed), and launch the all-gather."""
        if self._phase != _SENT:
            raise RuntimeError("QuantizedMean.exchange: no round was started; call start(payload, exact) first.")
        handle, self._handle, self._phase = self._handle, None, _IDLE
        wait_all([handle], self.abandon)
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
        self._phase = _GATHERING

    def finish(self) -> None:
        """Wait for the all-gather and dequantize: the payload given to :meth:`start` <- the mean, and its
        ``exact`` <- the sum."""
        if self._phase == _SENT:
            self.exchange()
        if self._phase != _GATHERING:
            raise RuntimeError("QuantizedMean.finish: no round in flight; call start(payload, exact) first.")
        handle, self._handle, self._phase = self._handle, None, _IDLE
        wait_all([handle], self.abandon)
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

    def _check_round(
        self, payload: torch.Tensor, exact: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        caller = "QuantizedMean.start"
        if self._phase != _IDLE:
            raise RuntimeError(f"{caller}: a round is in flight; finish() it first.")
        _check_tensor(payload, caller, "payload", self.numel, self.device, contiguous=True)
        if self.exact_numel == 0:
            if exact is not None and exact.numel():
                raise ValueError(
                    f"{caller}: `exact` has {exact.numel()} elements but this QuantizedMean was built with"
                    " exact_numel=0; pass exact=None or build it with exact_numel."
                )
            return payload.view(-1), None
        if exact is None:
            raise ValueError(
                f"{caller}: `exact` is required: this QuantizedMean was built with exact_numel={self.exact_numel};"
                " pass a float32 tensor of that many elements."
            )
        _check_tensor(exact, caller, "exact", self.exact_numel, self.device, contiguous=True)
        return payload.view(-1), exact.view(-1)

    def _check_between_rounds(self, name: str) -> None:
        if self._phase != _IDLE:
            raise RuntimeError(
                f"QuantizedMean.{name}: a round is in flight (the residual is mid-update); finish() it first."
            )


def _format(code_dtype: Any, caller: str) -> _Format:
    fmt = _FORMATS.get(code_dtype) if isinstance(code_dtype, torch.dtype) else None
    if fmt is None:
        names = ", ".join(f"torch.{str(d).removeprefix('torch.')}" for d in CODE_DTYPES)
        raise TypeError(f"{caller}: `code_dtype` must be one of {names}; got {code_dtype!r}.")
    return fmt


def _check_block(block_size: Any, code_dtype: Any, caller: str) -> None:
    fmt = _format(code_dtype, caller)
    _check_count(block_size, "block_size", 1, caller, f"elements per scale, e.g. {DEFAULT_BLOCK_SIZE}")
    if fmt.bits == 4 and block_size % 2:
        raise ValueError(
            f"{caller}: `block_size` must be even for {code_dtype} (two codes per byte); got {block_size}."
        )


def _check_count(value: Any, name: str, minimum: int, caller: str, meaning: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{caller}: `{name}` ({meaning}) must be an integer >= {minimum}; got {value!r}.")


def _check_tensor(t: Any, caller: str, name: str, numel: int, device: torch.device, contiguous: bool = False) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{caller}: `{name}` must be a torch.Tensor; got {type(t).__name__}.")
    if t.dtype != torch.float32:
        raise TypeError(
            f"{caller}: `{name}` must be torch.float32, got {t.dtype}; codes are computed from fp32"
            " (send an fp32 copy)."
        )
    if t.numel() != numel:
        raise ValueError(
            f"{caller}: `{name}` has {t.numel()} elements, but this QuantizedMean was built for {numel};"
            " build one per payload size."
        )
    if t.device != device:
        raise ValueError(f"{caller}: `{name}` is on {t.device}, but this QuantizedMean's buffers are on {device}.")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{caller}: `{name}` must be contiguous (the mean is written into it in place).")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
