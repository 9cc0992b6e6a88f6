"""A site's figures for the status page (its step, rounds, bytes sent, ...): the one rule for how they ride in the
store, written by the site (:meth:`~fabric_multimodel.Membership.publish`) and read by the page
(:mod:`fabric_multimodel.status.snapshot`), which trusts nothing it reads: a value that is not what
:func:`encode_figures` makes is refused by :func:`decode_figures`. A figure that is not finite (a loss gone NaN: what
an operator most needs to see) rides as ``null``, which JSON has and NaN is not.

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
#: The most figures a site reports of its own (a loss, ...), beside the library's.
MAX_REPORTED = 8
_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


def check_figure_name(name: object) -> str:
    """``name`` if a figure may be called so (1 to 32 lower-case letters, digits or ``_``), else a ValueError.

    Example::

        check_figure_name("loss")  # 'loss'
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"a figure's name is 1 to 32 lower-case letters, digits or '_', got {name!r}")
    return name


def check_reported(name: str, value: object, count: int) -> None:
    """A ValueError (naming the fix) unless a site may report ``value`` as figure ``name``, its ``count``-th: a
    number, or a tensor of one element (read only when published, so no device sync here).

    Example::

        check_reported("loss", torch.tensor(0.3), 1)
    """
    try:
        check_figure_name(name)
    except ValueError as error:
        raise ValueError(f"Membership.report: {error}.") from None
    if count > MAX_REPORTED:
        raise ValueError(f"Membership.report: at most {MAX_REPORTED} figures of a site's own, got {count}.")
    numel = getattr(value, "numel", None)
    if (numel is None or numel() != 1) and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ValueError(f"Membership.report: `{name}` must be a number or a one-element tensor, got {value!r:.80}.")


def encode_figures(figures: Mapping[str, float | None]) -> str:
    """``figures`` as the store holds them: JSON of at most :data:`MAX_FIGURES` numbers under names of lower case
    letters, digits and ``_`` (one that is not finite, or None, as ``null``); a ValueError naming what does not fit.

    Example::

        encode_figures({"step": 1200, "loss": float("nan")})  # '{"loss":null,"step":1200}'
    """
    if len(figures) > MAX_FIGURES:
        raise ValueError(f"at most {MAX_FIGURES} figures, got {len(figures)}")
    for name, value in figures.items():
        check_figure_name(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"figure {name!r} must be a number, got {value!r}")
    finite = {name: value if value is None or math.isfinite(value) else None for name, value in figures.items()}
    text = json.dumps(dict(sorted(finite.items())), separators=(",", ":"))
    if len(text) > MAX_BYTES:
        raise ValueError(f"the figures take {len(text)} bytes; at most {MAX_BYTES}")
    return text


def decode_figures(value: bytes) -> dict[str, float | None] | None:
    """What :func:`encode_figures` wrote, or None for anything else (too long, not JSON, other names or values).

    Example::

        decode_figures(b'{"step":3}')  # {'step': 3}
        decode_figures(b"<script>")    # None
    """
    if len(value) > MAX_BYTES:
        return None
    try:
        figures = json.loads(value.decode("utf-8"), parse_constant=_refuse)
        if encode_figures(figures).encode() != value:  # only what a site writes: no NaN, spaces or other order
            return None
    except (ValueError, TypeError, AttributeError):
        return None
    return figures if isinstance(figures, dict) else None


def _refuse(constant: str) -> None:
    raise ValueError(f"{constant} is not a figure")
