"""Aggregation rules that no single contribution steers alone: :func:`trimmed_mean` (coordinate-wise) and
:func:`centered_clip` (Karimireddy, He and Jaggi, "Learning from History for Byzantine Robust Optimization", ICML
2021, arXiv 2012.10333). Each takes the contributions as the rows of one tensor, in rank order, and is
deterministic: every rank that holds the same rows computes bitwise the same result.

Example::

    rows = torch.stack([honest_a, honest_b, honest_c, hostile])
    trimmed_mean(rows, trim=0.25)   # per coordinate, the largest and the smallest dropped, the rest averaged
    centered_clip(rows)             # each row's distance from the centre clipped to the honest majority's radius
"""

from __future__ import annotations

import torch

#: The rules by name, as ``Averager(robust=...)`` takes them.
RULES = ("clip", "trimmed_mean")
#: Iterations of centered clipping (the paper finds one to three enough from a good start).
CLIP_ITERATIONS = 3


def trimmed(count: int, trim: float) -> int:
    """How many of ``count`` contributions :func:`trimmed_mean` drops from each side: ``floor(trim * count)``, and
    never all of them.

    Example::

        trimmed(4, 0.25)  # 1: of four sites, the mean of the middle two
    """
    return min(int(trim * count), (count - 1) // 2)


def trimmed_mean(rows: torch.Tensor, trim: float) -> torch.Tensor:
    """Per coordinate, the mean of ``rows`` (``n x d``) without the :func:`trimmed` largest and smallest values.

    Example::

        trimmed_mean(torch.tensor([[0.0], [1.0], [2.0], [100.0]]), 0.25)  # tensor([1.5])
    """
    cut = trimmed(rows.shape[0], trim)
    kept = rows.sort(dim=0).values[cut : rows.shape[0] - cut]
    return kept.sum(dim=0) / kept.shape[0]


def median(rows: torch.Tensor) -> torch.Tensor:
    """Per coordinate, the median of ``rows`` (``n x d``): of an even count, the mean of the two middle values (the
    lower one alone would lean toward whichever side a hostile row is on).

    Example::

        median(torch.tensor([[0.0], [1.0], [2.0], [100.0]]))  # tensor([1.5])
    """
    ordered = rows.sort(dim=0).values
    count = rows.shape[0]
    return (ordered[(count - 1) // 2] + ordered[count // 2]) / 2


def centered_clip(rows: torch.Tensor, iterations: int = CLIP_ITERATIONS) -> torch.Tensor:
    """Centered clipping of ``rows`` (``n x d``): from the coordinate-wise :func:`median`, ``iterations`` times move the
    centre by the mean of each row's difference from it, each difference clipped to the radius of the median
    distance (a distance of the honest majority: a row farther out, however far, moves it by that radius at most).

    Example::

        centered_clip(torch.stack([a, b, c, 100 * d]))  # close to the mean of a, b and c
    """
    centre = median(rows)
    radius = median((rows - centre).norm(dim=1, keepdim=True))
    for _ in range(iterations):
        away = rows - centre
        norms = away.norm(dim=1, keepdim=True)
        # 0/0 where a row is the centre: it moves nothing
        scale = torch.where(norms > radius, radius / norms.clamp_min(torch.finfo(rows.dtype).tiny), 1.0)
        centre = centre + (away * scale).sum(dim=0) / rows.shape[0]
    return centre
