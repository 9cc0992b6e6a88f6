"""The mean across ranks of a sparse payload with error feedback (SparseLoCo, arXiv 2508.15706): :class:`SparseMean`.

Each rank adds its payload to its error-feedback accumulator (decayed by ``decay``), sends the top ``density`` share
of each chunk of it (:mod:`fabric_multimodel.comm.sparse`: about 10 bits an entry) and keeps the rest for later
rounds. A sum of sparse vectors with different supports is not a dense allreduce: each rank's payload goes to every
other rank (an all-gather, as point-to-point messages on gloo), after one small all-gather of their sizes, so that a
rank receives no more than the longest payload and refuses, on every rank alike and before the payloads cross, a
size no payload can have. Every rank then decodes every payload, its own included, and adds them in rank order: the
mean is bitwise the same everywhere.

Beside the entries rides an exact channel, as in :class:`~fabric_multimodel.comm.quantized.QuantizedMean`: a small
fp32 tensor (a round's header) sent as raw bytes and summed in rank order. A rank whose accumulator is not finite
(or beyond float16's range, the payload's scales) sends that channel and one bit per chunk, set where the chunk is
not: every rank then reads NaN in those chunks of the mean, so a round's finiteness check rolls it back everywhere
alike and names the tensors there.

Example::

    mean = SparseMean(delta.numel(), 1 / 64, delta.device, exact_numel=header.numel())
    mean.all_reduce_mean(delta, header)  # delta <- the mean of what every rank sent, header <- the exact sum
"""

from __future__ import annotations

from typing import Any

import torch

from fabric_multimodel.comm import collectives
from fabric_multimodel.comm.codec import check_count
from fabric_multimodel.comm.collectives import ProcessGroup, Traffic, check_member, group_rank, group_size
from fabric_multimodel.comm.phased_mean import GATHERING, SENT, PhasedMean
from fabric_multimodel.comm.sparse import decode, encode, max_bytes, pack_bits, per_chunk, unpack_bits
from fabric_multimodel.plan.payloads import SPARSE_CHUNK

#: Values per chunk of the top-k selection unless ``chunk`` says otherwise.
DEFAULT_CHUNK = SPARSE_CHUNK
#: The accumulator's decay unless ``decay`` says otherwise.
DEFAULT_DECAY = 0.95
#: The largest magnitude a payload's float16 scales hold.
_FP16_MAX = 65504.0
#: The bytes of each rank's size in the first all-gather.
_SIZE_BYTES = 8


class SparseMean(PhasedMean):
    """The mean of a fixed-size fp32 payload across the ranks of ``group``, each rank sending the largest entries
    of each chunk of its payload plus what it did not send before.

    A round runs in three phases a caller can spread over training steps, as
    :class:`~fabric_multimodel.comm.quantized.QuantizedMean`'s do:

    - :meth:`start` adds the decayed accumulator to the payload (``payload + decay * e``), encodes the top entries
      of that and launches the all-gather of the payload sizes;
    - :meth:`exchange` waits for it, checks the sizes and launches the all-gather of the payloads;
    - :meth:`finish` waits for it and writes the mean of what every rank sent into the payload given to
      :meth:`start`, and the exact channel's sum into its ``exact`` tensor; the accumulator ``e`` becomes
      ``payload + decay * e`` less what this rank sent.

    ``traffic`` is what the last round sent from this rank (its payload, padded to the longest, and its size, to
    each other rank); before the first round, the most a round can send. Memory: the accumulator (one fp32 copy of
    the payload); each round allocates its payloads and the decoded entries.

    Example::

        mean = SparseMean(delta.numel(), 1 / 64, delta.device, exact_numel=header.numel())
        mean.start(delta, header)   # after a local step
        mean.exchange()             # a step later
        mean.finish()               # delta and header now hold the mean and the exact sum
    """

    #: A plain mean of parameters must not cross sparse: it would keep a few of each chunk and zero the rest.
    carries_parameters = False

    def __init__(
        self,
        numel: int,
        density: float,
        device: torch.device | str,
        *,
        group: ProcessGroup = None,
        chunk: int = DEFAULT_CHUNK,
        exact_numel: int = 0,
        decay: float = DEFAULT_DECAY,
    ) -> None:
        caller = "SparseMean"
        check_count(numel, "numel", 1, caller, "the payload's number of elements")
        check_count(exact_numel, "exact_numel", 0, caller, "the exact channel's number of elements (0 for none)")
        per_chunk(chunk, density)  # raises for a chunk or density that is not one
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 <= decay <= 1:
            raise ValueError(f"{caller}: `decay` must be a number in [0, 1] (SparseLoCo's beta), got {decay!r}.")
        check_member(group, caller)
        self.numel, self.exact_numel, self.density, self.chunk, self.decay = numel, exact_numel, density, chunk, decay
        self.group, self.world, self.rank = group, group_size(group), group_rank(group)
        self.device = torch.device(device)
        self._residual = torch.zeros(numel, dtype=torch.float32, device=self.device)
        self._limit = max_bytes(numel, chunk, density)
        self._chunks = -(-numel // chunk)
        self._spoiled = -(-self._chunks // 8)  # the bytes of a rank's bits of chunks that are not finite
        head = 4 * exact_numel
        self._traffic = Traffic() if self.world == 1 else self._sent(head + self._limit)
        self._sizes = torch.zeros(self.world, dtype=torch.int64, device=self.device)
        super().__init__()
        self._carry = True
        self._message = self._gathered = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._payload: torch.Tensor | None = None
        self._exact_out: torch.Tensor | None = None

    @property
    def traffic(self) -> Traffic:
        """What the last round sent from this rank: the elements it carries and the bytes that left this rank."""
        return self._traffic

    def start(self, payload: torch.Tensor, exact: torch.Tensor | None = None, *, carry: bool = True) -> None:
        """Add the decayed accumulator to ``payload`` (which then holds the accumulator until :meth:`finish`, which
        writes the mean there), encode its top entries and launch the all-gather of the sizes; ``exact`` is only
        read. The accumulator itself changes only when the round finishes: a round that fails leaves it as it was.
        ``carry=False`` sends the payload alone and leaves the accumulator for a later round (this rank made no
        progress for this one, which may not be applied at all). Every argument is checked before any collective
        (every rank passes the same kind of arguments, so every rank raises).
        """
        flat, exact_flat = self._check_round(payload, exact)
        self._carry = carry
        if carry:
            flat.add_(self._residual, alpha=self.decay)
        head = (exact_flat if exact_flat is not None else flat.new_zeros(0)).view(torch.uint8)
        if float(flat.abs().max()) <= _FP16_MAX:  # False for NaN and Inf too
            self._message = torch.cat([head, encode(flat, self.chunk, self.density)[0]])
        else:  # the exact channel and the chunks that are not finite: every rank reads NaN there
            bad = ~(flat.abs() <= _FP16_MAX)
            spoiled = torch.cat([bad, bad.new_zeros(self._chunks * self.chunk - self.numel)]).view(self._chunks, -1)
            self._message = torch.cat([head, pack_bits(spoiled.any(1).to(torch.uint8))])
        self._payload, self._exact_out = flat, exact_flat
        if self.world > 1:
            size = torch.tensor([self._message.numel()], dtype=torch.int64, device=self.device)
            self._handle = collectives.all_gather_single(self._sizes, size, group=self.group, async_op=True)
        else:
            self._sizes.fill_(self._message.numel())
        self._phase = SENT

    def exchange(self) -> None:
        """Wait for the sizes, check them and launch the all-gather of the payloads (padded to the longest)."""
        self._waited(SENT, "exchange")
        head, sizes = 4 * self.exact_numel, self._sizes.tolist()
        least, most = head + self._spoiled, head + self._limit
        if any(not least <= size <= most for size in sizes):  # the same sizes everywhere: all raise
            raise ValueError(
                f"SparseMean: a rank announced a payload of {sizes} bytes; each must hold from {least} to {most} bytes"
                f" ({head} of them the exact channel's)."
            )
        longest = max(sizes)
        message = torch.cat([self._message, self._message.new_zeros(longest - self._message.numel())])
        if self.world > 1:
            self._gathered = torch.empty(self.world * longest, dtype=torch.uint8, device=self.device)
            self._handle = collectives.all_gather_messages(self._gathered, message, group=self.group, async_op=True)
            self._traffic = self._sent(longest)
        else:
            self._gathered = message
        self._phase = GATHERING

    def finish(self) -> None:
        """Wait for the payloads and decode them: the payload given to :meth:`start` <- the mean of what every rank
        sent (NaN where a rank sent none), and its ``exact`` <- the exact sum."""
        if self._phase == SENT:
            self.exchange()
        self._waited(GATHERING, "finish")
        flat, exact_out, head = self._payload, self._exact_out, 4 * self.exact_numel
        assert flat is not None
        longest = self._gathered.numel() // self.world
        rows = self._gathered.view(self.world, longest)
        total = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        exact_sum = total.new_zeros(self.exact_numel)
        if self._carry:
            self._residual.copy_(flat)  # the accumulator, less what this rank sent (below)
        for rank, size in enumerate(self._sizes.tolist()):  # in rank order: the same sums on every rank
            exact_sum += rows[rank, :head].clone().view(torch.float32)
            if size == head + self._spoiled:
                total[self._spoiled_entries(rows[rank, head:size])] = float("nan")
                continue
            indices, values = decode(rows[rank, head:size], self.numel, self.chunk, self.density)
            total.index_add_(0, indices, values)
            if rank == self.rank and self._carry:
                self._residual.index_add_(0, indices, values, alpha=-1)
        flat.copy_(total.div_(self.world))
        if exact_out is not None:
            exact_out.copy_(exact_sum)
        self._payload = self._exact_out = None
        self._message = self._gathered = self._message.new_empty(0)

    def clear_residual(self) -> None:
        """Forget the accumulator (after a round that was rolled back: it held that round's values)."""
        self._check_between_rounds("clear_residual")
        self._residual.zero_()

    def keep_residual(self, previous: SparseMean) -> None:
        """Start from the accumulator ``previous``, this rank's mean of the same payload over another group, kept:
        it is this rank's own whatever the group (a membership's new epoch). Nothing is kept when the payloads
        differ in size; no collective.

        Example::

            mean = SparseMean(delta.numel(), 1 / 64, delta.device, group=new)
            mean.keep_residual(old_mean)
        """
        if isinstance(previous, SparseMean) and previous.numel == self.numel:
            self._residual.copy_(previous._residual)

    def state_dict(self) -> dict[str, Any]:
        """The accumulator, for an exact resume; between rounds only."""
        self._check_between_rounds("state_dict")
        return {"residual": self._residual.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (from an object built for a payload of the same size)."""
        self._check_between_rounds("load_state_dict")
        saved = state.get("residual")
        if not isinstance(saved, torch.Tensor) or saved.numel() != self.numel:
            raise ValueError(
                f"SparseMean.load_state_dict: `residual` must be a tensor of {self.numel} elements (this payload's"
                f" size), got {getattr(saved, 'shape', type(saved).__name__)}."
            )
        self._residual.copy_(saved.reshape(-1))

    def _spoiled_entries(self, data: torch.Tensor) -> torch.Tensor:
        """The entries of the chunks a rank's bits say are not finite (a ValueError, alike everywhere, for none)."""
        chunks = unpack_bits(data)[: self._chunks].bool()
        if not chunks.any():
            raise ValueError("SparseMean: a rank said its payload was not finite but named no chunk of it.")
        return chunks.repeat_interleave(self.chunk)[: self.numel]

    def _sent(self, longest: int) -> Traffic:
        """What a round sends from this rank when the longest payload has ``longest`` bytes."""
        return Traffic(self.numel + self.exact_numel, (self.world - 1) * (longest + _SIZE_BYTES))
