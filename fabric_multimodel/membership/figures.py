"""A site's figures for the status page (its step, rounds, bytes sent, ...): the one rule for how they ride in the
store, written by the site (:meth:`~fabric_multimodel.Membership.publish`) and read by the page
(:mod:`fabric_multimodel.status.snapshot`), which trusts nothing it reads: a value that is not what
:func:`encode_figures` makes is refused by :func:`decode_figures`.

Example::

    text = encode_figures({"step": 1200, "rounds": 9, "bytes": 48_210})
    assert decode_figures(text.encode()) == {"step": 1200, "rounds": 9, "bytes": 48210}
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping

#: The most figures one site publishes, and the longest name and value text.
MAX_FIGURES = 16
MAX_BYTES = 1024
_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


def encode_figures(figures: Mapping[str, float]) -> str:
    """``figures`` as the store holds them: JSON of at most :data:`MAX_FIGURES` finite numbers under names of lower
    case letters, digits and ``_``; a ValueError naming what does not fit.

    Example::

        encode_figures({"step": 1200, "round_s": 0.41})  # '{"round_s":0.41,"step":1200}'
    """
    if len(figures) > MAX_FIGURES:
        raise ValueError(f"at most {MAX_FIGURES} figures, got {len(figures)}")
    for name, value in figures.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"a figure's name is 1 to 32 lower-case letters, digits or '_', got {name!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"figure {name!r} must be a finite number, got {value!r}")
    text = json.dumps(dict(sorted(figures.items())), separators=(",", ":"))
    if len(text) > MAX_BYTES:
        raise ValueError(f"the figures take {len(text)} bytes; at most {MAX_BYTES}")
    return text


def decode_figures(value: bytes) -> dict[str, float] | None:
    """What :func:`encode_figures` wrote, or None for anything else (too long, not JSON, other names or values).

    Example::

        decode_figures(b'{"step":3}')  # {'step': 3}
        decode_figures(b"<script>")    # None
    """
    if len(value) > MAX_BYTES:
        return None
    try:
        figures = json.loads(value.decode("utf-8"), parse_constant=lambda _: None)
        encode_figures(figures)
    except (ValueError, TypeError, AttributeError):
        return None
    return figures if isinstance(figures, dict) else None
