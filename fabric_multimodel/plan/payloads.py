"""What a round can send, by name: the one vocabulary of payload dtypes that the command-line flags, the planner, the
run folders and the cost model share (torch's names, the short ones, and their bytes per element). No torch import:
a name becomes a dtype with ``getattr(torch, name)``.

Example::

    assert PAYLOADS["float8_e4m3fn"].short == "fp8" and payload_name("fp4") == "float4_e2m1fn_x2"
"""

from __future__ import annotations

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
