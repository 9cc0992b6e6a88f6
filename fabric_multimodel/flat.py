"""Flat storage: many tensors living as views of one contiguous buffer per device and dtype.

An averaging round over flat storage is one in-place allreduce per buffer: no gather into a
temporary copy of the model, no scatter back, no per-tensor calls.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class FlatStorage:
    """Re-home ``tensors`` (parameters or buffers) into flat buffers; each becomes a view of one.

    The tensors keep their identity (optimizers, DDP and user references stay valid) and their
    values; only their storage moves. Something that later gives a tensor new storage (``.to()``,
    ``param.data = ...``) detaches it from the buffer, which :meth:`intact` detects. ``spare``
    extra elements at the end of the first buffer hold no tensor (a round's header rides there).

    Example::

        storage = FlatStorage(list(model.parameters()))
        torch.distributed.all_reduce(storage.buffers[0])  # reduces every parameter at once
    """

    def __init__(self, tensors: Sequence[torch.Tensor], names: Sequence[str] | None = None, spare: int = 0) -> None:
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
        self._addresses: list[int] = []
        with torch.no_grad():
            for (device, dtype), indices in groups.items():
                size = sum(tensors[i].numel() for i in indices)
                flat = torch.zeros(size + (spare if not self.buffers else 0), dtype=dtype, device=device)
                offset = 0
                for i in indices:
                    t = tensors[i]
                    view = flat[offset : offset + t.numel()].view_as(t)
                    view.copy_(t)
                    # `.data =` swaps the storage under the same Python object, so the Parameter
                    # that optimizers and DDP's reducer hold now reads and writes the flat buffer.
                    t.data = view
                    self.tensors.append(t)
                    self.names.append(names[i] if names is not None else f"tensor {i}")
                    self.slots.append((len(self.buffers), offset, t.numel()))
                    self._addresses.append(view.data_ptr())
                    offset += t.numel()
                self.buffers.append(flat)
                self.sizes.append(size)

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
        return [torch.zeros_like(flat) for flat in self.data]

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

    def intact(self) -> bool:
        """True while every tensor still lives in its slot of the flat buffers.

        Example::

            assert storage.intact(), "a parameter was given new storage (model.to()?)"
        """
        return list(map(torch.Tensor.data_ptr, self.tensors)) == self._addresses
