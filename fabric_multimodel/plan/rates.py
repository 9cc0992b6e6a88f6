"""Link rates as people write them (``10mbit``, ``500kbit``): parsed, checked and printed, for the planner and the
sites tool alike. Units are SI, as ``tc`` reads them."""

from __future__ import annotations

import re

#: What ``--bandwidth`` accepts, for error messages.
RATE_FORMS = "500kbit, 10mbit, 1gbit, a plain number of bits per second, or none (unlimited)"
MIN_RATE = 8_000  # 1 kB/s: the slowest link worth simulating
MAX_RATE = 100_000_000_000
_UNITS = {"": 1, "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}  # SI, as tc reads them
_RATE = re.compile(r"(?P<number>\d+(?:\.\d+)?)(?P<unit>[kmg]?bit)?", re.IGNORECASE)


def parse_rate(text: str) -> int | None:
    """Bits per second for ``text`` (``500kbit``, ``10mbit``, ``1.5gbit``, ``2000000``), or None for ``none``
    (unlimited). Units are SI, as ``tc`` reads them. Raises ``ValueError`` naming the accepted forms.

    Example::

        assert parse_rate("100mbit") == 100_000_000 and parse_rate("none") is None
    """
    if text.strip().lower() == "none":
        return None
    match = _RATE.fullmatch(text.strip())
    if match is None or (match["unit"] is None and "." in match["number"]):
        raise ValueError(f"{text!r} is not a rate: use {RATE_FORMS}")
    bits = round(float(match["number"]) * _UNITS[(match["unit"] or "").lower()])
    if not MIN_RATE <= bits <= MAX_RATE:
        raise ValueError(f"{text!r} is outside {format_rate(MIN_RATE)}..{format_rate(MAX_RATE)}: use {RATE_FORMS}")
    return bits


def format_rate(bits: int | None) -> str:
    """``100mbit``, ``1gbit``, ``1500kbit``, ``12345bit``, or ``unlimited`` for None.

    Example::

        assert format_rate(parse_rate("1000mbit")) == "1gbit"
    """
    if bits is None:
        return "unlimited"
    for unit in ("gbit", "mbit", "kbit"):
        if bits % _UNITS[unit] == 0:
            return f"{bits // _UNITS[unit]}{unit}"
    return f"{bits}bit"
