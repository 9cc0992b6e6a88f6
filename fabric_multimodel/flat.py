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
    ``param.data = ...``) detaches it from the buffer, which :meth:`intact` detects.

    Example::

        storage = FlatStorage(list(model.parameters()))
        torch.distributed.all_reduce(storage.buffers[0])  # reduces every parameter at once
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.device, t.dtype), []).append(t)
        self.tensors: list[torch.Tensor] = []
        self.buffers: list[torch.Tensor] = []
        self._addresses: list[int] = []
        with torch.no_grad():
            for (device, dtype), group in groups.items():
                flat = torch.empty(sum(t.numel() for t in group), dtype=dtype, device=device)
                offset = 0
                for t in group:
                    view = flat[offset : offset + t.numel()].view_as(t)
                    view.copy_(t)
                    # `.data =` swaps the storage under the same Python object, so the Parameter
                    # that optimizers and DDP's reducer hold now reads and writes the flat buffer.
                    t.data = view
                    self.tensors.append(t)
                    self._addresses.append(view.data_ptr())
                    offset += t.numel()
                self.buffers.append(flat)

    def intact(self) -> bool:
        """True while every tensor still lives in its slot of the flat buffers.

        Example::

            assert storage.intact(), "a parameter was given new storage (model.to()?)"
        """
        return list(map(torch.Tensor.data_ptr, self.tensors)) == self._addresses
