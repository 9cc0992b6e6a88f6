"""Flat storage: many tensors living as views of one contiguous buffer per device and dtype.

An averaging round over flat storage is one in-place allreduce per buffer: no gather into a
temporary copy of the model, no scatter back, no per-tensor calls. A :class:`Part` is a run of
consecutive tensors (a fragment of the model): one contiguous range of each buffer.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch


class FlatStorage:
    """Re-home ``tensors`` (parameters or buffers) into flat buffers; each becomes a view of one.

    The tensors keep their identity (optimizers, DDP and user references stay valid) and their
    values; only their storage moves. Something that later gives a tensor new storage (``.to()``,
    ``param.data = ...``) detaches it from the buffer, which :meth:`intact` detects. ``spare``
    extra elements at the end of the first buffer hold no tensor (a round's header rides there).

    ``rehome=False`` leaves the tensors where they are, for storage someone else owns (FSDP2's
    local shards are views of its own flat buffer, which its all-gathers read): the buffers are then
    a copy that exists only inside :meth:`synced`, which fills it from the tensors, writes it back to
    them and frees its memory (the buffers and their views stay, with no storage). ``shards`` names,
    per tensor, the FSDP2 parameter (a DTensor) whose local shard it is (None for a tensor that is
    not a shard), so that state kept in the storage's layout (an anchor) can be handed out as
    DTensors placed like the parameters (:meth:`sharded`), which ``torch.distributed.checkpoint``
    saves and reshards.

    Example::

        storage = FlatStorage(list(model.parameters()))
        torch.distributed.all_reduce(storage.buffers[0])  # reduces every parameter at once
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        names: Sequence[str] | None = None,
        spare: int = 0,
        *,
        rehome: bool = True,
        shards: Sequence[torch.Tensor | None] | None = None,
    ) -> None:
        #: False: the tensors keep their own storage and the buffers are a copy (see :meth:`synced`).
        self.rehome = rehome
        #: Per tensor (in the order of ``tensors``), the DTensor whose local shard it is; None: not a sharded storage.
        self.shards: list[torch.Tensor | None] | None = None if shards is None else []
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for index, t in enumerate(tensors):
            groups.setdefault((t.device, t.dtype), []).append(index)
        self.tensors: list[torch.Tensor] = []
        self.names: list[str] = []
        #: Per tensor, in the order of ``tensors``: (buffer index, offset, number of elements).
        self.slots: list[tuple[int, int, int]] = []
        #: Per buffer, the number of elements that belong to tensors (the rest is spare).
        self.sizes: list[int] = []
        self.buffers: list[torch.Tensor] = []
        #: Per tensor, where its data was when the storage was made (see :meth:`intact`).
        self.addresses: list[int] = []
        self._copies: list[torch.Tensor] = []  # not re-homed: each tensor's place in the buffers
        with torch.no_grad():
            for (device, dtype), indices in groups.items():
                size = sum(tensors[i].numel() for i in indices)
                flat = torch.zeros(size + (spare if not self.buffers else 0), dtype=dtype, device=device)
                offset = 0
                for i in indices:
                    t = tensors[i]
                    view = flat[offset : offset + t.numel()].view_as(t)
                    view.copy_(t)
                    if rehome:
                        # `.data =` swaps the storage under the same Python object, so the Parameter
                        # that optimizers and DDP's reducer hold now reads and writes the flat buffer.
                        t.data = view
                    else:
                        self._copies.append(view)
                    self.tensors.append(t)
                    self.names.append(names[i] if names is not None else f"tensor {i}")
                    if self.shards is not None and shards is not None:
                        self.shards.append(shards[i])
                    self.slots.append((len(self.buffers), offset, t.numel()))
                    self.addresses.append(t.data_ptr())
                    offset += t.numel()
                self.buffers.append(flat)
                self.sizes.append(size)
        self._depth = 0  # synced() blocks entered and not left
        self._nbytes = [flat.untyped_storage().nbytes() for flat in self.buffers]

    def release(self) -> None:
        """Free the memory of a copy (``rehome=False``) until the next :meth:`synced` block; call it once the
        views that rounds keep of the buffers are made (a view made later, outside the block, raises)."""
        if not self.rehome and not self._depth:
            for flat in self.buffers:
                flat.untyped_storage().resize_(0)

    @contextmanager
    def synced(self) -> Iterator[None]:
        """Inside the block the buffers hold the tensors' values, and what the block writes to them reaches
        the tensors on exit (also by exception); with re-homed tensors there is nothing to copy.

        Example::

            with storage.synced():
                torch.distributed.all_reduce(storage.buffers[0])
        """
        if self.rehome or self._depth:  # a block inside another: the outer one fills and writes back
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        with torch.no_grad():
            for flat, nbytes in zip(self.buffers, self._nbytes):
                flat.untyped_storage().resize_(nbytes)
            for copy, t in zip(self._copies, self.tensors):
                copy.copy_(t)
        self._depth = 1
        try:
            yield
        finally:
            self._depth = 0
            with torch.no_grad():
                for copy, t in zip(self._copies, self.tensors):
                    t.copy_(copy)
            self.release()

    @property
    def data(self) -> list[torch.Tensor]:
        """Per buffer, the part that holds the tensors (the buffer without its spare elements)."""
        return [flat[:size] for flat, size in zip(self.buffers, self.sizes)]

    @property
    def spare(self) -> torch.Tensor:
        """The spare elements at the end of the first buffer."""
        return self.buffers[0][self.sizes[0] :]

    def mirror(self) -> list[torch.Tensor]:
        """New zeroed buffers shaped like :attr:`data` (an anchor or a snapshot of every tensor)."""
        return [torch.zeros(size, dtype=flat.dtype, device=flat.device) for flat, size in zip(self.buffers, self.sizes)]

    def views(self, buffers: Sequence[torch.Tensor], indices: Sequence[int]) -> list[torch.Tensor]:
        """Views of ``buffers`` (shaped like :attr:`data`) in the place and shape of ``tensors[i]`` for each index."""
        return [
            buffers[b][offset : offset + numel].view_as(self.tensors[i])
            for i in indices
            for b, offset, numel in [self.slots[i]]
        ]

    def nonfinite(self, buffers: Sequence[torch.Tensor]) -> list[str]:
        """Names of the tensors whose slice of ``buffers`` (shaped like :attr:`data`) holds a NaN or Inf."""
        return [
            self.names[i]
            for i, (b, offset, numel) in enumerate(self.slots)
            if not bool(torch.isfinite(buffers[b][offset : offset + numel]).all())
        ]

    def shard(self, index: int, local: torch.Tensor) -> torch.Tensor:
        """``local`` (shaped like ``tensors[index]``) as a DTensor placed like the parameter whose shard that
        tensor is; ``local`` itself for a tensor that is no shard (a buffer, replicated inside the site)."""
        return placed_like(self.shards[index], local) if self.shards is not None else local

    def sharded(self, buffers: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each tensor's slice of ``buffers`` (shaped like :attr:`data`), by name, as :meth:`shard` places it:
        views, so that ``torch.distributed.checkpoint.load`` writes straight into ``buffers``.

        Example::

            torch.distributed.checkpoint.save({"anchor": storage.sharded(anchor)}, checkpoint_id=folder)
        """
        views = self.views(buffers, range(len(self.tensors)))
        return {name: self.shard(i, view) for i, (name, view) in enumerate(zip(self.names, views))}

    def unsharded(self, saved: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """New buffers shaped like :attr:`data` holding :meth:`sharded`'s form (DTensors or their local tensors,
        by name); a ValueError naming the first tensor that is missing or shaped otherwise."""
        buffers = self.mirror()
        for name, view in zip(self.names, self.views(buffers, range(len(self.tensors)))):
            value = saved.get(name)
            local = local_part(value) if value is not None else None
            if not isinstance(local, torch.Tensor) or local.shape != view.shape:
                found = "nothing" if local is None else f"shape {tuple(getattr(local, 'shape', ()))}"
                raise ValueError(f"`{name}`: expected this rank's shard of shape {tuple(view.shape)}, found {found}.")
            with torch.no_grad():
                view.copy_(local)
        return buffers

    def part(self, indices: Sequence[int]) -> Part:
        """The consecutive tensors ``indices`` (positions in ``tensors``) as one range of each buffer.

        Example::

            first_half = storage.part(range(len(storage.tensors) // 2))
        """
        return Part(self, indices)

    def intact(self) -> bool:
        """True while every tensor still lives in its slot of the flat buffers.

        Example::

            assert storage.intact(), "a parameter was given new storage (model.to()?)"
        """
        return list(map(torch.Tensor.data_ptr, self.tensors)) == self.addresses


class Part:
    """Consecutive tensors of a :class:`FlatStorage`: per buffer, the range ``[start, end)`` they fill.

    Buffers of the same shape as :attr:`FlatStorage.data` (an anchor, a snapshot) are cut the same
    way by :meth:`of`. The whole storage is a part too (``storage.part(range(len(storage.tensors)))``).

    Example::

        part = storage.part([2, 3])
        for flat, anchor in zip(part.data, part.of(anchor_buffers)):
            anchor.copy_(flat)
    """

    def __init__(self, storage: FlatStorage, indices: Sequence[int]) -> None:
        self.storage = storage
        self.indices = list(indices)
        bounds: dict[int, list[int]] = {}
        for i in self.indices:
            b, offset, numel = storage.slots[i]
            low, high = bounds.setdefault(b, [offset, offset])
            if offset != high:
                raise ValueError("a part must be consecutive tensors of each flat buffer")
            bounds[b][1] = offset + numel
        #: Per buffer, the range of elements this part covers (empty ranges where it has none).
        self.ranges = [tuple(bounds.get(b, (0, 0))) for b in range(len(storage.buffers))]
        self.whole = sorted(self.indices) == list(range(len(storage.tensors)))

    @property
    def sizes(self) -> list[int]:
        """Per buffer, the number of elements of this part."""
        return [end - start for start, end in self.ranges]

    @property
    def data(self) -> list[torch.Tensor]:
        """Per buffer, the range holding this part's tensors."""
        return self.of(self.storage.buffers)

    def of(self, buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """This part's ranges of ``buffers`` (shaped like the storage's :attr:`~FlatStorage.data`)."""
        return [buffer[start:end] for buffer, (start, end) in zip(buffers, self.ranges)]


def local_part(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: a DTensor's local shard (of an FSDP2 parameter, a view of FSDP's own
    storage), else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.to_local().detach() if isinstance(t, DTensor) else t


def placed_like(like: torch.Tensor | None, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a DTensor placed like ``like`` (its local shard has ``local``'s shape), or ``local`` itself
    when ``like`` is no DTensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(like, DTensor):
        return local
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )
