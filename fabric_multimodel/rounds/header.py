"""The header every round's payload ends with: each rank writes its own ``step()`` count, the layout of the optimizer
state it averages, and whether it made progress (the other ranks write zeros), so that the summed payload tells every
rank what all of them wrote, with no collective of its own."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class Stamp(NamedTuple):
    """What one rank writes into a round's header."""

    steps: int  # its step() count (modulo 16**8)
    layout: int  # a 16-bit fingerprint of the optimizer state it averages (0: none)
    progress: bool  # whether it took a local step since its last round


class Header:
    """Per-rank slots at the end of a payload, holding each rank's :class:`Stamp` as base-16 digits.

    Each rank writes digits into its own slots and zeros elsewhere, so after a SUM every slot holds
    one rank's digit exactly, in any floating dtype (bfloat16 holds 0..15 exactly).
    """

    STEP_DIGITS = 8
    LAYOUT_DIGITS = 4
    SLOTS = STEP_DIGITS + LAYOUT_DIGITS + 1

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.size = world * self.SLOTS

    def write(self, slots: torch.Tensor, stamp: Stamp) -> None:
        digits = (
            _digits(stamp.steps, self.STEP_DIGITS) + _digits(stamp.layout, self.LAYOUT_DIGITS) + [int(stamp.progress)]
        )
        slots.zero_()
        start = self.rank * self.SLOTS
        slots[start : start + self.SLOTS] = torch.tensor(digits, dtype=slots.dtype)

    def read(self, values: Sequence[float]) -> list[Stamp]:
        """Every rank's stamp, from the summed slots."""
        stamps = []
        for r in range(self.world):
            digits = [round(v) for v in values[r * self.SLOTS : (r + 1) * self.SLOTS]]
            steps = _number(digits[: self.STEP_DIGITS])
            layout = _number(digits[self.STEP_DIGITS : self.STEP_DIGITS + self.LAYOUT_DIGITS])
            stamps.append(Stamp(steps, layout, bool(digits[-1])))
        return stamps


def _digits(value: int, count: int) -> list[int]:
    return [(value >> (4 * i)) & 15 for i in range(count)]


def _number(digits: Sequence[int]) -> int:
    return sum(d << (4 * i) for i, d in enumerate(digits))
