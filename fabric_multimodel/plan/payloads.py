"""What a round can send, by name: the one vocabulary of payload dtypes that the command-line flags, the planner, the
run folders and the cost model share (torch's names, the short ones, and their bytes per element); and the size of a
sparse round's payload (:mod:`fabric_multimodel.comm.sparse` encodes it; the planner prices it). No torch import: a
name becomes a dtype with ``getattr(torch, name)``.

Example::

    assert PAYLOADS["float8_e4m3fn"].short == "fp8" and payload_name("fp4") == "float4_e2m1fn_x2"
    max_bytes(65_536, 4096, 1 / 64)  # 1342: the most a sparse payload of 65,536 values takes at density 1/64
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import NamedTuple


class Payload(NamedTuple):
    """One payload dtype: torch's name, the short name runs and tables use, its bytes per element, and whether it is
    block-quantized (a scale per block rides with it)."""

    name: str
    short: str
    bytes: float
    low_bit: bool


#: Every payload a round can send, by torch's name, in order of precision.
PAYLOADS = {
    p.name: p
    for p in (
        Payload("float32", "fp32", 4.0, False),
        Payload("bfloat16", "bf16", 2.0, False),
        Payload("float8_e4m3fn", "fp8", 1.0, True),
        Payload("float8_e5m2", "fp8e5m2", 1.0, True),
        Payload("float4_e2m1fn_x2", "fp4", 0.5, True),
    )
}
#: The block-quantized ones.
LOW_BIT = tuple(name for name, p in PAYLOADS.items() if p.low_bit)


def payload_name(name: str) -> str:
    """Torch's name for ``name``, given either way (``fp8`` or ``float8_e4m3fn``); ``ValueError`` naming both lists.

    Example::

        payload_name("bf16")  # 'bfloat16'
    """
    if name in PAYLOADS:
        return name
    for payload in PAYLOADS.values():
        if payload.short == name:
            return payload.name
    shorts = [p.short for p in PAYLOADS.values()]
    raise ValueError(f"{name!r} is no payload: use one of {list(PAYLOADS)} or {shorts}")


#: Bytes of the two fp16 magnitudes each chunk of a sparse payload carries.
SCALE_BYTES = 4
#: Values per chunk of a sparse round's top-k selection (SparseLoCo's 64 x 64 tiles hold as many).
SPARSE_CHUNK = 4096


def per_chunk(chunk: int, density: float) -> int:
    """Entries a sparse payload keeps of each full chunk: ``density * chunk`` rounded, at least 1, at most ``chunk``.

    Example::

        per_chunk(4096, 1 / 64)  # 64
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"sparse: `chunk` must be a positive int, got {chunk!r}.")
    if not isinstance(density, (int, float)) or isinstance(density, bool) or not 0 < density <= 1:
        raise ValueError(f"sparse: `density` must be in (0, 1], got {density!r}.")
    return min(chunk, max(1, round(density * chunk)))


def rice_bits(chunk: int, k: int) -> int:
    """The width ``r`` of a gap's low part: near the best Rice parameter for gaps of mean ``chunk / k``.

    Example::

        rice_bits(4096, 64)  # 5
    """
    mean_gap = max(chunk / k - 1, 1.0)
    return max(0, round(math.log2(mean_gap * math.log(2))))


def max_bytes(numel: int, chunk: int, density: float) -> int:
    """The longest sparse payload of ``numel`` values: the bound a receiver holds a peer's to, and what the planner
    prices a sparse round at (a typical one is about 5% shorter).

    Example::

        max_bytes(65_536, 4096, 1 / 64)  # 1342: 10.5 bits an entry
    """
    k = per_chunk(chunk, density)
    full, tail = divmod(numel, chunk)
    chunks, entries, r = full + (tail > 0), full * k + min(k, tail), rice_bits(chunk, k)
    unary = entries + (numel - entries) // 2**r + chunks  # a chunk's gaps sum to at most its free places
    return chunks * SCALE_BYTES + -(-(entries * (2 + r) + unary) // 8)


def fraction(text: str) -> float:
    """A share written as a number or a fraction (``0.0156``, ``1/64``), in (0, 1]; an argparse type.

    Example::

        fraction("1/64")  # 0.015625
    """
    try:
        value = float(Fraction(text.strip()))
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"a number or a fraction such as 1/64, got {text!r}") from None
    if not 0 < value <= 1:
        raise ValueError(f"a share in (0, 1], got {text!r}")
    return value
