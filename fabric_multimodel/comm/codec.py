"""The block codec: fp32 values as 8-bit (fp8) or 4-bit (fp4) codes with one scale per block
(:func:`quantize`, :func:`dequantize`, and :class:`Codec`, the same kernels into preallocated buffers).

E2M1 codes follow the OCP MX layout (bit 3 sign, bits 2-1 exponent with bias 1, bit 0 mantissa), two
per byte with the first element in the low nibble, as torch packs ``float4_e2m1fn_x2``: the bytes can
be viewed as that dtype where torch computes with it (CUDA); on CPU torch cannot cast it, so encoding
and decoding are done here with plain tensor ops, on any device.

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

from typing import Any, NamedTuple

import torch

#: The packed 4-bit dtype (every torch pyproject.toml admits has it).
FLOAT4_E2M1 = torch.float4_e2m1fn_x2

#: One scale per block, in this dtype (chosen by measurement: benchmarks/quantized_cost.py).
SCALE_DTYPE = torch.bfloat16

#: Elements per block (chosen by measurement: benchmarks/quantized_cost.py).
DEFAULT_BLOCK_SIZE = 32

# Scales never go below the smallest normal fp32: their reciprocal stays finite, and a block of
# zeros gets a positive scale (codes 0, no 0/0).
_MIN_SCALE = 2.0**-126

# The nibble's magnitudes, in code order (OCP MX E2M1: 1 sign, 2 exponent, 1 mantissa bit).
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


class Format(NamedTuple):
    max_code: float
    half_step: float  # half the distance between the two largest codes
    bits: int


FORMATS: dict[torch.dtype, Format] = {
    torch.float8_e4m3fn: Format(448.0, 16.0, 8),
    torch.float8_e5m2: Format(57344.0, 4096.0, 8),
    FLOAT4_E2M1: Format(6.0, 1.0, 4),
}

#: The code dtypes a :class:`~fabric_multimodel.comm.quantized.QuantizedMean` (and :func:`quantize`) accepts.
CODE_DTYPES = tuple(FORMATS)


def relative_error(code_dtype: torch.dtype) -> float:
    """The largest error of one quantization, relative to its block's amax (``c`` in the module's bound).

    Example::

        relative_error(torch.float8_e4m3fn)  # 0.0359: |x - dequantize(quantize(x))| <= 0.036 * amax
    """
    fmt = code_format(code_dtype, "relative_error")
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

    ``scale_dtype`` is bfloat16 (what :class:`~fabric_multimodel.comm.quantized.QuantizedMean` sends) or float32.
    Allocates its result; :class:`~fabric_multimodel.comm.quantized.QuantizedMean` runs the same kernels into
    preallocated buffers.

    Example::

        q = quantize(torch.randn(100), torch.float8_e4m3fn)
        x = dequantize(q, 100)
    """
    check_tensor(x, "quantize", "x", x.numel(), x.device)
    check_block(block_size, code_dtype, "quantize")
    if scale_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"quantize: `scale_dtype` must be torch.bfloat16 or torch.float32, got {scale_dtype}.")
    blocks = ceil_div(x.numel(), block_size)
    codec = Codec(code_dtype, block_size, x.device, scale_dtype, blocks)
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
    block_size = bytes_per_block * 8 // code_format(code_dtype, "dequantize").bits
    blocks = codes.shape[0]
    if not 0 <= numel <= blocks * block_size:
        raise ValueError(f"dequantize: `numel` must be 0..{blocks * block_size} (what the blocks hold), got {numel}.")
    codec = Codec(code_dtype, block_size, codes.device, scales.dtype, blocks)
    out = torch.empty(blocks * block_size, dtype=torch.float32, device=codes.device)
    codec.decode(codes.view(torch.uint8).view(1, blocks, -1), scales.view(1, blocks), out.view(1, blocks, -1))
    return out[:numel]


class Codec:
    """The quantize/dequantize kernels for one format, with scratch for up to ``capacity`` blocks at a time.

    Every op writes into preallocated buffers (``out=``, in place), so a round allocates nothing.
    """

    def __init__(
        self, code_dtype: torch.dtype, block: int, device: torch.device, scale_dtype: torch.dtype, capacity: int
    ) -> None:
        self.fmt = FORMATS[code_dtype]
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


def code_format(code_dtype: Any, caller: str) -> Format:
    fmt = FORMATS.get(code_dtype) if isinstance(code_dtype, torch.dtype) else None
    if fmt is None:
        names = ", ".join(f"torch.{str(d).removeprefix('torch.')}" for d in CODE_DTYPES)
        raise TypeError(f"{caller}: `code_dtype` must be one of {names}; got {code_dtype!r}.")
    return fmt


def check_block(block_size: Any, code_dtype: Any, caller: str) -> None:
    fmt = code_format(code_dtype, caller)
    check_count(block_size, "block_size", 1, caller, f"elements per scale, e.g. {DEFAULT_BLOCK_SIZE}")
    if fmt.bits == 4 and block_size % 2:
        raise ValueError(
            f"{caller}: `block_size` must be even for {code_dtype} (two codes per byte); got {block_size}."
        )


def check_count(value: Any, name: str, minimum: int, caller: str, meaning: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{caller}: `{name}` ({meaning}) must be an integer >= {minimum}; got {value!r}.")


def check_tensor(t: Any, caller: str, name: str, numel: int, device: torch.device, contiguous: bool = False) -> None:
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


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
