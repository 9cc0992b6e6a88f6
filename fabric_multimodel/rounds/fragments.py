"""How the averaged parameters split into fragments, for rounds that send one fragment at a time.

Streaming DiLoCo's idea: instead of the whole model every ``period`` steps, one fragment every
``period / F`` steps, so that a round sends ``1/F`` of the model. An int ``F`` splits the
parameters, in module order, into ``F`` runs of consecutive tensors with about equal element
counts; a list of groups (modules or parameters) lets the user choose, e.g. strided transformer
blocks.

Example::

    fragment_indices(params, names, 2)                                    # [[0, 1, 2], [3, 4]]
    fragment_indices(params, names, [model.blocks[0::2], model.blocks[1::2]])
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

Fragments = int | Sequence[Any]


def fragment_indices(
    params: Sequence[torch.Tensor], names: Sequence[str], fragments: Any, caller: str = "Averager"
) -> list[list[int]]:
    """The positions in ``params`` of each fragment's parameters; raises a clear error for bad ``fragments``.

    Example::

        fragment_indices([w1, b1, w2, b2], ["w1", "b1", "w2", "b2"], 2)  # [[0, 1], [2, 3]] for equal sizes
    """
    if isinstance(fragments, bool) or not isinstance(fragments, (int, Sequence)) or isinstance(fragments, str):
        raise TypeError(
            f"{caller}: `fragments` must be an int >= 1 or a list of parameter groups (lists of modules or"
            f" parameters), got {fragments!r}."
        )
    if isinstance(fragments, int):
        return _equal_runs(params, fragments, caller)
    return _groups(params, names, fragments, caller)


def _equal_runs(params: Sequence[torch.Tensor], count: int, caller: str) -> list[list[int]]:
    if count < 1:
        raise ValueError(f"{caller}: `fragments` must be >= 1, got {count}.")
    if count > len(params):
        raise ValueError(
            f"{caller}: `fragments` ({count}) is more than the {len(params)} parameter tensors; fragments end at"
            " tensor boundaries, so use at most that many."
        )
    sizes = [p.numel() for p in params]
    total, cuts, done = sum(sizes), [0], 0
    cumulative = [sum(sizes[: j + 1]) for j in range(len(sizes))]
    for k in range(1, count):
        # The boundary nearest to k/F of the elements, leaving at least one tensor for every later fragment.
        low, high = cuts[-1] + 1, len(params) - (count - k)
        done = min(range(low, high + 1), key=lambda j: abs(cumulative[j - 1] - k * total / count))
        cuts.append(done)
    cuts.append(len(params))
    return [list(range(a, b)) for a, b in zip(cuts, cuts[1:])]


def _groups(
    params: Sequence[torch.Tensor], names: Sequence[str], groups: Sequence[Any], caller: str
) -> list[list[int]]:
    if not groups:
        raise ValueError(f"{caller}: `fragments` is an empty list; give at least one group, or an int.")
    position = {id(p): i for i, p in enumerate(params)}
    owner: dict[int, int] = {}
    result = []
    for g, group in enumerate(groups):
        members = _parameters_of(group)
        if not members:
            raise ValueError(f"{caller}: `fragments[{g}]` holds no parameter; every group needs at least one.")
        indices = []
        for p in members:
            if id(p) not in position:
                raise ValueError(
                    f"{caller}: `fragments[{g}]` holds a parameter of shape {tuple(p.shape)} that is not among the"
                    " averaged modules' parameters; group the modules' own submodules or parameters."
                )
            i = position[id(p)]
            if i in owner and owner[i] != g:
                raise ValueError(
                    f"{caller}: parameter {names[i]} is in both `fragments[{owner[i]}]` and `fragments[{g}]`; put"
                    " each parameter in one group."
                )
            if i not in owner:
                owner[i] = g
                indices.append(i)
        result.append(sorted(indices))
    missing = [names[i] for i in range(len(params)) if i not in owner]
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ValueError(f"{caller}: parameters in no group of `fragments`: {shown}; add them to a group.")
    return result


def _parameters_of(group: Any) -> list[torch.Tensor]:
    """The parameters of a group: a module, a parameter, or an iterable of those (each parameter once)."""
    items = [group] if isinstance(group, (nn.Module, torch.Tensor)) else group
    if not isinstance(items, Iterable):
        raise TypeError(f"a group of `fragments` must hold modules or parameters, got {type(group).__name__}.")
    found: dict[int, torch.Tensor] = {}
    for item in items:
        if isinstance(item, nn.Module):
            found.update((id(p), p) for p in item.parameters())
        elif isinstance(item, torch.Tensor):
            found[id(item)] = item
        else:
            raise TypeError(f"a group of `fragments` must hold modules or parameters, got {type(item).__name__}.")
    return list(found.values())
