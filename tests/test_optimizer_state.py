"""Optimizer state in flat storage: training is unchanged, a round averages it in place with one allreduce per
buffer, and state that the optimizer makes later or replaces (load_state_dict) is found again."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from fabric_multimodel import Averager, setup_models
from fabric_multimodel.rounds.optimizer_state import OptimizerStateStorage, optimizer_state
from tests.gan import collectives, mlp

OPTIMIZERS = {
    "adam": lambda params, foreach: torch.optim.Adam(params, lr=0.01, foreach=foreach),
    "adamw-amsgrad": lambda params, foreach: torch.optim.AdamW(params, lr=0.01, amsgrad=True, foreach=foreach),
    "sgd-momentum": lambda params, foreach: torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=foreach),
}


def _one_storage(tensors: list[torch.Tensor]) -> bool:
    return len({t.untyped_storage().data_ptr() for t in tensors}) == 1


@given(
    seed=st.integers(0, 2**16),
    hidden=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    name=st.sampled_from(sorted(OPTIMIZERS)),
    foreach=st.booleans(),
    steps=st.integers(1, 6),
)
def test_rehomed_state_trains_bit_for_bit_like_the_optimizer_alone(seed, hidden, name, foreach, steps):
    torch.manual_seed(seed)
    model = mlp([3, *hidden, 2])
    twin = copy.deepcopy(model)
    opt, twin_opt = OPTIMIZERS[name](model.parameters(), foreach), OPTIMIZERS[name](twin.parameters(), foreach)
    state = OptimizerStateStorage([opt])
    assert state.refresh() == (0, "")  # no state before the first step
    for _ in range(steps):
        x = torch.randn(5, 3)
        for m, o in ((model, opt), (twin, twin_opt)):
            nn.functional.mse_loss(m(x), torch.ones(5, 2)).backward()
            o.step()
            o.zero_grad()
        state.refresh()
        assert _one_storage(optimizer_state([opt]))
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    for a, b in zip(optimizer_state([opt]), optimizer_state([twin_opt])):
        assert torch.equal(a, b)


def _moments(opt) -> torch.Tensor:
    return torch.cat([t.detach().double().reshape(-1) for t in optimizer_state([opt])])


def _mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.stack(out).mean(0)


def _same_on_every_rank(t: torch.Tensor) -> bool:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return all(torch.equal(out[0], o) for o in out[1:])


class _LateLayer(nn.Module):
    def __init__(self, hidden: list[int]) -> None:
        super().__init__()
        self.body, self.late = mlp([3, *hidden, 2]), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, late: bool) -> torch.Tensor:
        return self.late(self.body(x)) if late else self.body(x)


def rounds_average_the_state(fabric, seed, hidden, name):
    """Rounds of an Averager with the optimizer: the moments become their mean, in place, with one allreduce for
    all of them; state made later (a layer used only from step 4) and state replaced by load_state_dict (after
    step 6) are found again."""
    torch.manual_seed(seed)
    (model,) = setup_models(fabric, model=_LateLayer(hidden))
    opt = OPTIMIZERS[name](model.parameters(), False)
    report = {}
    with Averager(fabric, model, period=2, optimizers=[opt]) as averager:
        data = torch.Generator().manual_seed(seed + fabric.global_rank)
        for step in range(1, 11):
            # `late` gets its first gradient, and the optimizer its first state for it, at step 4.
            model(torch.randn(4, 3, generator=data), late=step >= 4).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if step % 2:
                assert not averager.step()
                continue
            expected = _mean_over_ranks(_moments(opt))
            found = collectives(averager.step)
            moments = _moments(opt)
            report[step] = {
                "error": (moments - expected).abs().max().item(),
                "same": _same_on_every_rank(moments),
                "one_storage": _one_storage(optimizer_state([opt])),
                "allreduces": [n for kind, n in found if kind == "gloo:all_reduce"],
                "state_elements": moments.numel(),
            }
            if step == 6:  # replaced state: the optimizer's own, plus a rank-dependent value, loaded
                saved = copy.deepcopy(opt.state_dict())
                for per_param in saved["state"].values():
                    for key, value in per_param.items():
                        if key != "step" and value.is_floating_point():
                            value.add_(fabric.global_rank + 1.0)
                opt.load_state_dict(saved)
    return report


@given(
    seed=st.integers(0, 2**16),
    hidden=st.lists(st.integers(1, 9), min_size=1, max_size=2),
    name=st.sampled_from(sorted(OPTIMIZERS)),
)
def test_rounds_average_the_optimizer_state_in_place(worlds, seed, hidden, name):
    for report in worlds(2).run(rounds_average_the_state, seed, hidden, name):
        for step in (2, 4, 6, 8, 10):
            r = report[step]
            assert r["error"] <= 1e-6 and r["same"] and r["one_storage"], (step, r)
            # One allreduce of the parameters (and the header), one of every moment: none per tensor.
            assert len(r["allreduces"]) == 2, (step, r)
            assert r["allreduces"][1] == r["state_elements"], (step, r)
        assert report[2]["state_elements"] < report[4]["state_elements"]  # `late`'s state, made at step 4
