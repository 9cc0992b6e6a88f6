"""What an :class:`~fabric_multimodel.Averager` does, as one value: :class:`AveragerConfig`.

The Averager's options are fields of a frozen dataclass, checked when it is built (on every rank,
before any collective), so a new capability is one more field documented and checked here, not one
more keyword argument threaded through the Averager, the Trainer callback and the examples. The
objects an Averager works *with* (the optimizers whose state it averages, the process groups) stay
keyword arguments of the Averager; everything about *what it does* is here.

Example::

    diloco = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
    config = AveragerConfig(period=128, warmup_steps=20, outer_optimizer=diloco, fragments=4, overlap_steps=16)
    averager = Averager(fabric, model, config)
    Averager(fabric, model, period=8)  # the same as Averager(fabric, model, AveragerConfig(period=8))
    Averager(fabric, model, config, comm_dtype=torch.bfloat16)  # config with one field replaced
    print(config)  # period=128 warmup_steps=20 outer_optimizer=SGD(lr=0.7, momentum=0.9, nesterov=True) ...
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

from fabric_multimodel.comm.codec import CODE_DTYPES
from fabric_multimodel.comm.robust_mean import check_rule
from fabric_multimodel.rounds.fragments import Fragments
from fabric_multimodel.rounds.outer import OuterOptimizerFactory


@dataclass(frozen=True)
class AveragerConfig:
    """The schedule and the rounds of an :class:`~fabric_multimodel.Averager`; see it for what each option does.

    Attributes:
        period: local steps between rounds after warm-up (with fragments: between two rounds of one fragment);
            ``"auto"``: the smallest whose rounds hide behind compute, chosen at the end of warm-up from the
            measured step and link (:mod:`fabric_multimodel.averaging.auto_period`).
        warmup_steps: synchronous steps before local steps begin.
        average_buffers: also average floating-point buffers (BatchNorm running statistics).
        outer_optimizer: DiLoCo's outer optimizer, a factory ``params -> Optimizer``.
        comm_dtype: the floating dtype of the payload; None sends the parameters' own dtype.
        error_feedback: with a low-bit ``comm_dtype``, add back what each rank's quantization dropped.
        density: below 1, sparse rounds (SparseLoCo, arXiv 2508.15706): each rank sends the top ``density`` share of
            each chunk of its pseudo-gradient plus its error-feedback accumulator, at about 10 bits an entry
            (:mod:`fabric_multimodel.comm.sparse_mean`); the accumulator stands in for the outer momentum.
        error_decay: the sparse rounds' accumulator decay (SparseLoCo's beta): ``e <- error_decay * e + delta``.
        robust: None for the plain mean; ``"trimmed_mean"`` or ``"clip"`` (centered clipping) for rounds that no
            single rank (site) steers alone: every rank receives every pseudo-gradient and applies the rule
            (:mod:`fabric_multimodel.comm.robust_mean`).
        trim: with ``robust="trimmed_mean"``, the share of values dropped from each side, per coordinate.
        overlap_steps: 0 for blocking rounds; k to merge each round k steps after its launch; ``"auto"`` (with
            ``period="auto"``): the steps a round needs, measured, then the smallest period they allow.
        fragments: 1 for rounds of everything; ``F`` (or a list of parameter groups) for streaming rounds.
        mixing: None to keep the local progress in overlapped merges; ``a`` in [0, 1] to mix.
        check_finite: raise on every rank when a round's payload holds NaN or Inf.
        node_period: two-level averaging: a round inside the node every ``node_period`` steps.
        pace: ``"steps"``: every site runs ``period`` local steps per round; ``"speed"``: the fastest site runs
            ``period`` and the others in proportion to their speed, measured in warm-up, and a round weights
            each site by its steps (:mod:`fabric_multimodel.averaging.pacing`).

    Example::

        config = AveragerConfig(period=32, warmup_steps=100, comm_dtype=torch.bfloat16)
        dataclasses.replace(config, overlap_steps=4)  # another config; this one is unchanged
    """

    period: int | str
    warmup_steps: int = 0
    average_buffers: bool = True
    outer_optimizer: OuterOptimizerFactory | None = None
    comm_dtype: torch.dtype | None = None
    error_feedback: bool = False
    density: float = 1.0
    error_decay: float = 0.95
    robust: str | None = None
    trim: float = 0.25
    overlap_steps: int | str = 0
    fragments: Fragments = 1
    mixing: float | None = None
    check_finite: bool = True
    node_period: int | None = None
    pace: str = "steps"

    def __post_init__(self) -> None:
        _check(self)

    @classmethod
    def build(cls, config: AveragerConfig | None, options: dict[str, Any], caller: str) -> AveragerConfig:
        """``config`` with ``options`` (field names) replaced, or a config of ``options`` alone; unknown names
        are a TypeError that lists the fields."""
        fields = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(fields))
        if unknown:
            raise TypeError(
                f"{caller}: unknown option(s) {', '.join(map(repr, unknown))}; the options are {', '.join(fields)}."
            )
        if config is None:
            if "period" not in options:
                raise TypeError(f"{caller}: pass `period` (or an AveragerConfig), e.g. {caller}(..., period=8).")
            return cls(**options)
        if not isinstance(config, cls):
            hint = f"; to give the period, write period={config!r}" if isinstance(config, int) else ""
            raise TypeError(f"{caller}: `config` must be an AveragerConfig, got {type(config).__name__}{hint}.")
        return dataclasses.replace(config, **options)

    @property
    def first_overlap(self) -> int:
        """The overlap until one is chosen: ``overlap_steps``, or 1 with ``overlap_steps="auto"`` (chosen with the
        period at the end of warm-up)."""
        return self.overlap_steps if isinstance(self.overlap_steps, int) else 1

    def __str__(self) -> str:
        """The fields that differ from their defaults, on one line: ``period=128 fragments=4 ...``."""
        said = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.default is dataclasses.MISSING or value != field.default:
                said.append(f"{field.name}={_short(value)}")
        return " ".join(said)

    def agreement(self) -> tuple[Any, ...]:
        """What every rank's config must agree on, in a form that prints the same on every rank (a factory's
        repr holds addresses, so only its presence counts; fragment groups count by their number)."""
        return tuple(_comparable(field.name, getattr(self, field.name)) for field in dataclasses.fields(self))


def _comparable(name: str, value: Any) -> Any:
    if name == "outer_optimizer":
        return value is not None
    if name == "comm_dtype":
        return str(value)
    if name == "fragments" and not isinstance(value, int):
        return len(value)
    return value


def _short(value: Any) -> str:
    """A value as a person reads it: dtypes without ``torch.``, an optimizer factory as its call."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, functools.partial):
        arguments = [*map(repr, value.args), *(f"{k}={v!r}" for k, v in value.keywords.items())]
        return f"{getattr(value.func, '__name__', value.func)}({', '.join(arguments)})"
    if callable(value):
        return getattr(value, "__name__", type(value).__name__)
    return repr(value) if isinstance(value, str) else str(value)


def _check(config: AveragerConfig, caller: str = "Averager") -> None:
    for check in (_check_schedule, _check_payload, _check_robust, _check_node_period, _check_pace):
        check(config, caller)


def _check_schedule(config: AveragerConfig, caller: str) -> None:
    """The period, the warm-up, the overlap and the flags."""
    check_int("warmup_steps", config.warmup_steps, minimum=0, caller=caller)
    if config.overlap_steps == "auto":
        if config.period != "auto":
            raise ValueError(
                f"{caller}: `overlap_steps='auto'` is chosen with the period, from the measured step and link: it"
                f" needs `period='auto'` (got {config.period!r}); or give overlap_steps as a number."
            )
    else:
        check_int("overlap_steps", config.overlap_steps, minimum=0, caller=caller)
    if config.period == "auto":
        if config.warmup_steps < 2 or config.node_period is not None:
            raise ValueError(
                f"{caller}: `period='auto'` times the warm-up's steps and chooses the period across the world: it"
                f" needs `warmup_steps` >= 2 (got {config.warmup_steps}) and no `node_period`."
            )
    else:
        check_int("period", config.period, minimum=1, caller=caller)
    for name in ("average_buffers", "check_finite", "error_feedback"):
        flag = getattr(config, name)
        if not isinstance(flag, bool):
            raise TypeError(f"{caller}: `{name}` must be True or False, got {flag!r}.")
    if isinstance(config.period, int) and config.first_overlap >= config.period:
        raise ValueError(
            f"{caller}: `overlap_steps` ({config.overlap_steps}) must be smaller than `period` ({config.period}), so"
            " that a round is merged before the next one starts."
        )
    mixing = config.mixing
    if mixing is not None:
        if isinstance(mixing, bool) or not isinstance(mixing, (int, float)) or not 0 <= mixing <= 1:
            raise ValueError(f"{caller}: `mixing` must be a number in [0, 1] or None, got {mixing!r}.")
        if not config.overlap_steps:
            raise ValueError(
                f"{caller}: `mixing` sets how overlapped rounds merge; set `overlap_steps` too, or drop `mixing`."
            )


def _check_payload(config: AveragerConfig, caller: str) -> None:
    """What a round sends, and the outer optimizer that applies it."""
    comm_dtype = config.comm_dtype
    if comm_dtype is not None and not (isinstance(comm_dtype, torch.dtype) and comm_dtype.is_floating_point):
        raise TypeError(
            f"{caller}: `comm_dtype` must be a floating torch.dtype such as torch.bfloat16 (or, for block-quantized"
            " rounds, torch.float8_e4m3fn, torch.float8_e5m2 or torch.float4_e2m1fn_x2), or None; got"
            f" {comm_dtype!r}."
        )
    if config.error_feedback and comm_dtype not in CODE_DTYPES:
        raise ValueError(
            f"{caller}: `error_feedback` keeps what block quantization drops; it needs a low-bit `comm_dtype`"
            f" (torch.float8_e4m3fn, torch.float8_e5m2 or torch.float4_e2m1fn_x2), got {comm_dtype!r}."
        )
    _check_density(config, caller)
    if isinstance(config.outer_optimizer, Optimizer):
        raise TypeError(
            f"{caller}: `outer_optimizer` must be a factory that builds the optimizer from the parameters it is"
            " given, not an optimizer: e.g."
            " functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)."
        )


def _check_density(config: AveragerConfig, caller: str) -> None:
    """Sparse rounds: a density in (0, 1], and what it cannot be combined with."""
    density, decay = config.density, config.error_decay
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
        raise ValueError(
            f"{caller}: `density` must be a number with 0 < density <= 1 (1: dense rounds), got {density!r}."
        )
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 <= decay <= 1:
        raise ValueError(f"{caller}: `error_decay` must be a number in [0, 1], got {decay!r}.")
    if density == 1:
        if decay != AveragerConfig.error_decay:
            raise ValueError(
                f"{caller}: `error_decay` is the decay of the sparse rounds' accumulator; set `density` below 1 too,"
                " or drop `error_decay`."
            )
        return
    if config.comm_dtype is not None:
        raise ValueError(
            f"{caller}: `density` ({density}) sends each entry in its own two-level code; it cannot be combined with"
            f" `comm_dtype` ({config.comm_dtype}): drop one of them."
        )


def _check_robust(config: AveragerConfig, caller: str) -> None:
    """Robust rounds: a rule, its trim, and what they cannot be combined with yet."""
    if config.robust is None:
        if config.trim != AveragerConfig.trim:
            raise ValueError(
                f"{caller}: `trim` is the trimmed mean's; set `robust='trimmed_mean'` too, or drop `trim`."
            )
        return
    check_rule(config.robust, config.trim, caller)
    if config.robust != "trimmed_mean" and config.trim != AveragerConfig.trim:
        raise ValueError(f"{caller}: `trim` is the trimmed mean's, not {config.robust!r}'s: drop `trim`.")
    coded = config.comm_dtype is None or config.comm_dtype in CODE_DTYPES
    if not coded or config.error_feedback or config.density != 1 or config.node_period is not None:
        raise ValueError(
            f"{caller}: `robust` ({config.robust!r}) receives every rank's pseudo-gradient, fp32 or block-quantized"
            " (a float8 or float4 `comm_dtype`); it cannot be combined with another `comm_dtype`, `error_feedback`,"
            " `density` or `node_period` yet: drop one of them."
        )
    if config.pace != "steps":
        raise ValueError(f"{caller}: `robust` cannot be combined with `pace='speed'` yet: drop one of them.")


def _check_node_period(config: AveragerConfig, caller: str) -> None:
    """Two-level averaging: plain blocking rounds inside the node between the rounds across the world."""
    if config.node_period is not None:
        check_int("node_period", config.node_period, minimum=1, caller=caller)
        assert isinstance(config.period, int)  # "auto" was refused above
        if config.period % config.node_period or config.node_period == config.period:
            raise ValueError(
                f"{caller}: `period` ({config.period}) must be a multiple of `node_period` ({config.node_period}),"
                " and larger: a round across the world every `period` steps, inside the node every `node_period`"
                " steps in between."
            )
        if (
            config.comm_dtype is not None
            or config.density != 1
            or config.outer_optimizer is not None
            or config.overlap_steps
            or config.fragments != 1
        ):
            raise ValueError(
                f"{caller}: two-level averaging (`node_period`) is plain, blocking averaging; drop outer_optimizer,"
                " comm_dtype, density, overlap_steps and fragments, or use the islands layout (DDP inside the node)"
                " for those."
            )


def _check_pace(config: AveragerConfig, caller: str) -> None:
    """``pace='speed'``: what it can pace yet."""
    if config.pace not in ("steps", "speed"):
        raise ValueError(
            f"{caller}: `pace` must be 'steps' (every site runs `period` local steps per round) or 'speed' (each"
            f" site in proportion to its speed), got {config.pace!r}."
        )
    encoded = config.comm_dtype in CODE_DTYPES or config.density != 1
    paced_round = config.fragments == 1 and not config.overlap_steps and not encoded
    if config.pace == "speed" and (
        config.period == "auto" or config.warmup_steps < 2 or config.node_period is not None or not paced_round
    ):
        raise ValueError(
            f"{caller}: `pace='speed'` times the warm-up's steps and paces blocking rounds of the whole model: it"
            " needs a number `period` and `warmup_steps` >= 2, and no `fragments`, `overlap_steps`, `node_period`,"
            " low-bit `comm_dtype` or `density` yet."
        )


def check_int(name: str, value: Any, minimum: int, caller: str = "Averager") -> None:
    """A whole number (not a bool) of at least ``minimum``, or an error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{caller}: `{name}` must be an int >= {minimum}, got {value!r} ({type(value).__name__}).")
    if value < minimum:
        raise ValueError(f"{caller}: `{name}` must be >= {minimum}, got {value}.")
