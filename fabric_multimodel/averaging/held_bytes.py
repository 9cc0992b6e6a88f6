"""The bytes of tensor storage an object of this library holds: what ``Averager.state_bytes`` reports."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch.optim import Optimizer


def held_bytes(roots: Sequence[Any], exclude: Collection[int] = ()) -> int:
    """Bytes of the distinct tensor storages reachable from ``roots`` through this library's objects, their lists
    and dicts and optimizers' state, except the storages at the addresses in ``exclude``. DTensors are the
    modules' FSDP2 parameters, referred to, not held."""
    from torch.distributed.tensor import DTensor

    storages: dict[int, int] = {}
    seen: set[int] = set()
    pending = list(roots)
    while pending:
        item = pending.pop()
        if isinstance(item, DTensor):
            continue
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            storages.setdefault(storage.data_ptr(), storage.nbytes())
            continue
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, (list, tuple, set)):
            pending.extend(item)
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, Optimizer):
            pending.extend(item.state.values())
        elif type(item).__module__.startswith("fabric_multimodel.") and hasattr(item, "__dict__"):
            pending.extend(vars(item).values())
    return sum(size for address, size in storages.items() if address not in exclude)
