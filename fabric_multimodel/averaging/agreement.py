"""The checks that keep every rank of an Averager's group in step: the same Averager built everywhere, the same number
of ``step()`` calls (or rounds) behind each round, optimizers of one layout, and storage left where it was built.

Each raises on every rank of the group alike, from values every rank holds (a round's stamps, one small collective's
answer), so that a mistake is an error everywhere rather than one rank waiting in a collective nobody else starts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fabric_multimodel.comm.collectives import ProcessGroup, describe_disagreement, group_rank, group_ranks
from fabric_multimodel.rounds.errors import AveragingError
from fabric_multimodel.rounds.header import Header, Stamp


def check_agreement(agreement: str, device: torch.device, group: ProcessGroup) -> None:
    """One small collective: every rank of ``group`` built the same tensors and options, or all raise."""
    problem = describe_disagreement(agreement, device, group)
    if problem:
        raise ValueError(
            "Averager: the modules' parameters (names, shapes, dtypes) or the arguments (period, warmup_steps,"
            " average_buffers, optimizers, outer_optimizer, comm_dtype, overlap_steps, check_finite,"
            " node_period, the layout, fragments, mixing) differ across ranks; build the same models and"
            f" Averager on every rank. {shorten(problem)}"
        )


def check_stamps(
    stamps: list[Stamp],
    group: ProcessGroup,
    label: str,
    *,
    count: int,
    by_rounds: bool,
    paced: bool,
    layouts: Callable[[], str | None],
) -> None:
    """The stamps of a finished round agree: every rank wrote the same count, ``count`` here (rounds when
    ``by_rounds``: paced sites and a membership's differ in steps, not rounds; ``step()`` calls otherwise), and the
    same optimizer layout (``layouts()``, a collective every rank makes alike, says how they differ)."""
    mine = stamps[group_rank(group)]
    for rank, stamp in zip(group_ranks(group), stamps):
        if stamp.steps == mine.steps:
            continue
        theirs = unwrap_steps(stamp.steps, count)
        if by_rounds:
            advice = (
                "with pace='speed', make averager.local_steps(total) step() calls on each rank"
                if paced
                else "call averager.step() once per iteration"
            )
            raise AveragingError(
                f"{label}: this rank is at round {count + 1} but rank {rank} at round {theirs + 1}; {advice}."
            )
        raise AveragingError(
            f"{label}: averager.step() was called {count} times on this rank but {theirs} times on rank {rank};"
            " call it exactly once per iteration, on every rank."
        )
    if any(stamp.layout != mine.layout for stamp in stamps):
        raise AveragingError(
            f"{label}: the optimizers' state differs across ranks (build the same optimizer types and options,"
            f" e.g. amsgrad, on every rank). {shorten(layouts() or '')}"
        )


def stamp_count(count: int) -> int:
    """``count`` as a round's header holds it (its low digits)."""
    return count % 16**Header.STEP_DIGITS


def check_intact(intact: bool) -> None:
    """The averaged tensors still live in the storage the Averager was built on."""
    if not intact:
        raise RuntimeError(
            "Averager: a parameter or buffer was given new storage after the Averager was built (for"
            " example by `.to()` or `param.data = ...`); move models before building the Averager."
        )


def unwrap_steps(digits: int, near: int) -> int:
    """The full count whose low 32 bits are ``digits``, nearest to ``near`` (the header keeps 32 bits)."""
    base = near - (near % 2**32)
    candidates = [base - 2**32 + digits, base + digits, base + 2**32 + digits]
    return min(candidates, key=lambda c: abs(c - near))


def shorten(text: str, limit: int = 600) -> str:
    """``text``, cut to ``limit`` characters for an error message."""
    return text if len(text) <= limit else text[: limit - 3] + "..."
