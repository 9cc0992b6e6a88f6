"""What an :class:`~fabric_multimodel.Averager`'s ``state_dict`` holds, checked before ``load_state_dict`` changes
anything: its counters, the period ``period="auto"`` chose and the pace ``pace="speed"`` agreed. Each problem is a
``KeyError`` or ``ValueError`` naming the field."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fabric_multimodel.averaging.auto_period import PeriodChoice, shortest_period
from fabric_multimodel.averaging.config import AveragerConfig
from fabric_multimodel.averaging.pacing import Pace, paced


def times_warmup(config: AveragerConfig) -> bool:
    """Whether the warm-up's step times are measured (and saved): ``period="auto"`` and ``pace="speed"`` use them."""
    return config.period == "auto" or config.pace == "speed"


def checked_counters(
    state: dict[str, Any], round_keys: Sequence[str], fragments: int
) -> tuple[dict[str, int], list[int], int | None]:
    """A state's counters, each fragment's last round step and the replica that saved it (None: not said),
    checked before anything is changed; a KeyError or ValueError naming the field."""
    counters = ("steps", "rounds", "synced_at_step", "elements_communicated", "bytes_communicated")
    missing = (set(counters) | set(round_keys)) - set(state)
    if missing:
        raise KeyError(f"Averager.load_state_dict: the state is missing {sorted(missing)}.")
    values = {}
    for name in counters:
        value = state[name]
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"Averager.load_state_dict: `{name}` must be a whole number >= 0, got {value!r}.")
        values[name] = value
    if values["synced_at_step"] > values["steps"]:
        raise ValueError(
            f"Averager.load_state_dict: `synced_at_step` ({values['synced_at_step']}) is beyond `steps`"
            f" ({values['steps']}); the state is corrupt."
        )
    synced_at = _whole_numbers(
        state.get("fragments_synced_at", [values["synced_at_step"]] * fragments),
        fragments,
        values["steps"],
        "fragments_synced_at",
    )
    saved_by = state.get("replica")
    if saved_by is not None and (isinstance(saved_by, bool) or not isinstance(saved_by, int) or saved_by < 0):
        raise ValueError(f"Averager.load_state_dict: `replica` must be a whole number >= 0, got {saved_by!r}.")
    return values, synced_at, saved_by


def _whole_numbers(values: Any, count: int, limit: int, name: str) -> list[int]:
    """``values`` as ``count`` whole numbers in 0..``limit``, or a ValueError naming the state's field."""
    if not isinstance(values, (list, tuple)) or len(values) != count:
        raise ValueError(f"Averager.load_state_dict: `{name}` must hold {count} numbers (one per fragment).")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
            raise ValueError(
                f"Averager.load_state_dict: `{name}` must hold whole numbers in 0..{limit}, got {value!r}."
            )
    return list(values)


def checked_choice(
    state: dict[str, Any], steps: int, config: AveragerConfig, overlap_steps: int, fragments: int
) -> tuple[PeriodChoice | None, list[float]]:
    """period="auto": the state's chosen period (None: not chosen yet) and warm-up step times, checked."""
    if not times_warmup(config):
        return None, []
    gaps = state.get("warmup_step_s")
    if not isinstance(gaps, list) or not all(isinstance(g, float) and g >= 0 for g in gaps):
        raise ValueError(
            "Averager.load_state_dict: period='auto' and pace='speed' need the state's `warmup_step_s` (a list"
            " of seconds); it was saved by an Averager without them: give the period as a number, or drop pace."
        )
    if config.period != "auto":
        return None, gaps
    saved = state.get("period_choice")
    if saved is None:
        if steps >= config.warmup_steps:
            raise ValueError("Averager.load_state_dict: the state is past warm-up but holds no chosen period.")
        return None, gaps
    overlap = overlap_steps
    if config.overlap_steps == "auto":  # chosen with the period: the state's
        saved_overlap = saved[4] if len(saved) > 4 else None
        if isinstance(saved_overlap, bool) or not isinstance(saved_overlap, int) or saved_overlap < 1:
            raise ValueError(
                f"Averager.load_state_dict: overlap_steps='auto' needs the chosen overlap in the state's"
                f" `period_choice`, found {saved_overlap!r}; it was saved with another overlap: give that one."
            )
        overlap = saved_overlap
    choice = PeriodChoice(*saved[:4])._replace(overlap_steps=overlap)  # the period is checked below
    period = choice.period
    smallest = shortest_period(fragments, overlap)
    if isinstance(period, bool) or not isinstance(period, int) or period < smallest or period % fragments:
        raise ValueError(
            f"Averager.load_state_dict: `period_choice` holds period {period!r}; with these fragments and overlap"
            f" it must be a multiple of {fragments} of at least {smallest}."
        )
    return choice, gaps


def checked_pace(
    state: dict[str, Any], steps: int, config: AveragerConfig, live: bool, fastest_period: int, world: int
) -> Pace | None:
    """pace="speed": the state's agreed pace (None: not agreed yet), checked against this group. Under a
    membership, none: the members agree it at each epoch."""
    if live:
        return None
    if config.pace != "speed" or state.get("pace") is None:
        if config.pace == "speed" and steps > config.warmup_steps:
            raise ValueError("Averager.load_state_dict: the state is past warm-up but holds no pace.")
        return None
    try:
        pace = Pace(*(tuple(values) for values in state["pace"]))
        paced(fastest_period, pace.step_s)  # checks the step times
    except (TypeError, ValueError):
        raise ValueError(f"Averager.load_state_dict: `pace` is not a saved pace: {state['pace']!r}.") from None
    if pace != paced(fastest_period, pace.step_s) or len(pace.periods) != world:
        raise ValueError(
            f"Averager.load_state_dict: `pace` was agreed by {len(pace.periods)} sites with another period;"
            f" this Averager averages over {world} with period {fastest_period}."
        )
    return pace
