"""A round no single rank steers alone: :class:`RobustMean`, every rank's payload to every other rank (an
all-gather, as point-to-point messages on gloo) and, on each rank, a robust rule over what it received
(:mod:`fabric_multimodel.comm.robust`): a hostile rank cannot opt out by not applying the rule itself, and as the
rule is deterministic, the honest ranks stay bitwise identical.

A contribution that is not finite is dropped and logged (by its rank in the group), never a crash; when none is
left, the round's mean is NaN, which a round's finiteness check rolls back everywhere alike. An exact channel rides
beside the payload, as in :class:`~fabric_multimodel.comm.quantized.QuantizedMean` (a round's header, summed in rank
order). With a ``code_dtype`` (fp8, fp4), each payload crosses block-quantized (:mod:`fabric_multimodel.comm.codec`)
and every rank decodes every one before the rule. The price: each rank receives every other rank's payload, ``world
- 1`` times an allreduce's receive, and holds them all for the rule.

Example::

    mean = RobustMean(delta.numel(), delta.device, rule="trimmed_mean", trim=0.25, exact_numel=header.numel())
    mean.all_reduce_mean(delta, header)  # delta <- the trimmed mean of every rank's delta, header <- the exact sum
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from fabric_multimodel.comm import collectives
from fabric_multimodel.comm.codec import (
    DEFAULT_BLOCK_SIZE,
    SCALE_DTYPE,
    Quantized,
    ceil_div,
    check_block,
    check_count,
    code_format,
    dequantize,
    quantize,
)
from fabric_multimodel.comm.collectives import ProcessGroup, Traffic, check_member, group_rank, group_size
from fabric_multimodel.comm.phased_mean import SENT, PhasedMean
from fabric_multimodel.comm.robust import RULES, centered_clip, trimmed_mean

_log = logging.getLogger(__name__)


def check_rule(rule: object, trim: object, caller: str) -> None:
    """A ValueError naming ``caller``'s argument unless ``rule`` is one of
    :data:`~fabric_multimodel.comm.robust.RULES` and ``trim`` a share in ``[0, 0.5)``.

    Example::

        check_rule("trimmed_mean", 0.25, "Averager")
    """
    if rule not in RULES:
        raise ValueError(f"{caller}: `robust` must be one of {', '.join(map(repr, RULES))} (or None), got {rule!r}.")
    if isinstance(trim, bool) or not isinstance(trim, (int, float)) or not 0 <= trim < 0.5:
        raise ValueError(f"{caller}: `trim` is the share trimmed from each side, in [0, 0.5); got {trim!r}.")


class RobustMean(PhasedMean):
    """A robust mean of a fixed-size fp32 payload across the ranks of ``group``: ``rule`` ``"trimmed_mean"``
    (dropping the ``trim`` share of values from each side, per coordinate) or ``"clip"`` (centered clipping).

    Its phases: :meth:`start` launches the all-gather of the payloads; :meth:`exchange` has nothing to launch;
    :meth:`finish` waits for it and writes the rule's result into the payload given to :meth:`start`.
    ``traffic``: what a round sends from this rank (its payload and exact channel, to each other rank).

    Example::

        mean = RobustMean(delta.numel(), delta.device, rule="clip")
        mean.start(delta)
        mean.finish()
    """

    #: The parameters themselves (a first round after training apart) may cross: the rule is as right for them.
    carries_parameters = True

    def __init__(
        self,
        numel: int,
        device: torch.device | str,
        *,
        rule: str,
        trim: float = 0.25,
        group: ProcessGroup = None,
        exact_numel: int = 0,
        code_dtype: torch.dtype | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> None:
        caller = "RobustMean"
        check_count(numel, "numel", 1, caller, "the payload's number of elements")
        check_count(exact_numel, "exact_numel", 0, caller, "the exact channel's number of elements (0 for none)")
        check_rule(rule, trim, caller)
        check_member(group, caller)
        self.numel, self.exact_numel, self.rule, self.trim = numel, exact_numel, rule, trim
        self.group, self.world, self.rank = group, group_size(group), group_rank(group)
        self.device = torch.device(device)
        self.code_dtype, self.block_size, self._blocks = code_dtype, block_size, 0
        body = 4 * numel
        if code_dtype is not None:
            check_block(block_size, code_dtype, caller)
            self._blocks = ceil_div(numel, block_size)
            self._code_bytes = block_size * code_format(code_dtype, caller).bits // 8  # a block's
            body = self._blocks * (self._code_bytes + SCALE_DTYPE.itemsize)
        self._row = 4 * exact_numel + body  # the bytes of one rank's message
        self._traffic = Traffic() if self.world == 1 else Traffic(numel + exact_numel, (self.world - 1) * self._row)
        super().__init__()
        self._gathered = torch.empty(0, device=self.device)
        self._payload: torch.Tensor | None = None
        self._exact_out: torch.Tensor | None = None
        #: Ranks (in the group) whose contribution the last round dropped: not finite.
        self.dropped: list[int] = []

    @property
    def traffic(self) -> Traffic:
        """What a round sends from this rank: the elements it carries and the bytes that leave this rank."""
        return self._traffic

    def start(self, payload: torch.Tensor, exact: torch.Tensor | None = None, *, carry: bool = True) -> None:
        """Launch the all-gather of ``payload`` (and ``exact``) to every rank; both are read, then written by
        :meth:`finish`. ``carry`` changes nothing: a robust mean keeps nothing between rounds."""
        flat, exact_flat = self._check_round(payload, exact)
        head = (exact_flat if exact_flat is not None else flat.new_zeros(0)).view(torch.uint8)
        message = torch.cat([head, self._encoded(flat)])
        self._payload, self._exact_out = flat, exact_flat
        if self.world > 1:
            self._gathered = torch.empty(self.world * self._row, dtype=torch.uint8, device=self.device)
            self._handle = collectives.all_gather_messages(self._gathered, message, group=self.group, async_op=True)
        else:
            self._gathered = message
        self._phase = SENT

    def exchange(self) -> None:
        """Nothing to launch: the payloads cross in :meth:`start`'s one all-gather."""
        if self._phase != SENT:
            raise RuntimeError("RobustMean.exchange: no round was started; call start(payload, exact) first.")

    def finish(self) -> None:
        """Wait for every rank's payload; the payload given to :meth:`start` <- the rule over the finite ones, its
        ``exact`` <- the exact sum (in rank order)."""
        self._waited(SENT, "finish")
        flat, exact_out = self._payload, self._exact_out
        assert flat is not None
        rows, head = self._gathered.view(self.world, self._row), 4 * self.exact_numel
        if exact_out is not None:
            exact_out.copy_(rows[:, :head].clone().view(torch.float32).sum(dim=0))
        contributions = self._decoded(rows[:, head:])
        finite = contributions.isfinite().all(dim=1)
        self.dropped = [rank for rank, ok in enumerate(finite.tolist()) if not ok]
        if self.dropped:
            _log.warning("robust round: dropped the contributions of ranks %s (not finite)", self.dropped)
        kept = contributions[finite]
        if not kept.shape[0]:
            flat.fill_(float("nan"))
        elif self.rule == "trimmed_mean":
            flat.copy_(trimmed_mean(kept, self.trim))
        else:
            flat.copy_(centered_clip(kept))
        self._payload = self._exact_out = None
        self._gathered = self._gathered.new_empty(0)

    def _encoded(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's payload as the bytes it sends: fp32, or block-quantized codes then their scales."""
        if self.code_dtype is None:
            return flat.view(torch.uint8)
        codes, scales = quantize(flat, self.code_dtype, self.block_size, SCALE_DTYPE)
        return torch.cat([codes.view(torch.uint8).view(-1), scales.view(torch.uint8)])

    def _decoded(self, bodies: torch.Tensor) -> torch.Tensor:
        """Every rank's payload (the rows of ``bodies``, the bytes each sent) as fp32 rows of ``numel``."""
        if self.code_dtype is None:
            return bodies.clone().view(torch.float32)
        split = self._blocks * self._code_bytes
        rows = []
        for body in bodies:
            codes = body[:split].clone().view(self._blocks, -1).view(self.code_dtype)
            rows.append(dequantize(Quantized(codes, body[split:].clone().view(SCALE_DTYPE)), self.numel))
        return torch.stack(rows)

    def clear_residual(self) -> None:
        """Nothing kept between rounds."""

    def keep_residual(self, previous: Any) -> None:
        """Nothing kept between rounds."""

    def state_dict(self) -> dict[str, Any]:
        """Nothing to save."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to load."""
