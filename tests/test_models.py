"""setup_models and frozen: per-model DDP is DDP, and costs each model's gradients once."""

from __future__ import annotations

import copy
import functools
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from lightning_fabric import Fabric
from lightning_fabric.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn

from fabric_multimodel import Averager, Models, ddp_of, frozen, replicas_in_sync, setup_models
from tests.gan import collectives, gan_iteration, make_gan
from tests.worlds import errors_of, in_step


def _no_freeze(module):
    return nullcontext()


# --- invariant 1: N ranks with batch b == one process with batch N*b -------------------------------


def train_gan_both_ways(fabric, seed, hidden, batch, steps, lr):
    """Train the same GAN with setup_models+frozen on every rank and, on each rank, as one process
    on the concatenated global batch; return the largest parameter difference."""
    z_dim, x_dim = 3, 2
    gen, disc = make_gan(seed, z_dim, x_dim, hidden)
    ref_gen, ref_disc = copy.deepcopy(gen), copy.deepcopy(disc)
    gen, disc = setup_models(fabric, gen=gen, disc=disc)
    opt_g, opt_d = fabric.setup_optimizers(
        torch.optim.SGD(gen.parameters(), lr=lr), torch.optim.SGD(disc.parameters(), lr=lr)
    )
    ref_opt_g = torch.optim.SGD(ref_gen.parameters(), lr=lr)
    ref_opt_d = torch.optim.SGD(ref_disc.parameters(), lr=lr)
    world, rank = fabric.world_size, fabric.global_rank
    data = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        real = torch.randn(world * batch, x_dim, generator=data)
        z = torch.randn(world * batch, z_dim, generator=data)
        mine = slice(rank * batch, (rank + 1) * batch)
        gan_iteration(fabric, gen, disc, opt_g, opt_d, real[mine], z[mine], frozen)
        gan_iteration(None, ref_gen, ref_disc, ref_opt_g, ref_opt_d, real, z, frozen)
    pairs = [*zip(gen.parameters(), ref_gen.parameters()), *zip(disc.parameters(), ref_disc.parameters())]
    return max((p - q).abs().max().item() for p, q in pairs)


@pytest.mark.parametrize("size", [2, 3])
@given(
    seed=st.integers(0, 2**16),
    hidden=st.lists(st.integers(1, 12), min_size=1, max_size=3),
    batch=st.integers(1, 6),
    steps=st.integers(1, 4),
    lr=st.sampled_from([0.01, 0.1]),
)
def test_per_model_ddp_trains_like_one_process_on_the_whole_batch(worlds, size, seed, hidden, batch, steps, lr):
    differences = worlds(size).run(train_gan_both_ways, seed, hidden, batch, steps, lr)
    assert max(differences) < 1e-5


# --- invariant 2: each model's gradients are allreduced once per GAN iteration ---------------------


class Container(nn.Module):
    """What users do today without per-model DDP: one module holding both, one DDP around it."""

    def __init__(self, gen, disc):
        super().__init__()
        self.gen, self.disc = gen, disc

    def forward(self, z, real=None):
        fake = self.gen(z)
        return fake, self.disc(real if real is not None else fake), self.disc(fake.detach())


def gradient_elements_per_iteration(fabric, hidden):
    """Elements allreduced in a steady-state GAN iteration: setup_models+frozen, setup_models
    without frozen, and one DDP around both models with find_unused_parameters=True."""
    gen, disc = make_gan(0, 3, 2, hidden)
    sizes = {
        "gen": sum(p.numel() for p in gen.parameters()),
        "disc": sum(p.numel() for p in disc.parameters()),
        "tensors": len([*gen.parameters(), *disc.parameters()]),
    }
    results = {"sizes": sizes}
    for label, freeze in [("separate_frozen", frozen), ("separate_unfrozen", _no_freeze)]:
        g, d = setup_models(fabric, gen=copy.deepcopy(gen), disc=copy.deepcopy(disc))
        opt_g, opt_d = fabric.setup_optimizers(
            torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.SGD(d.parameters(), lr=0.1)
        )
        real, z = torch.randn(4, 2), torch.randn(4, 3)
        for _ in range(2):  # DDP rebuilds its buckets (one broadcast) in the first iterations
            gan_iteration(fabric, g, d, opt_g, opt_d, real, z, freeze)
        results[label] = collectives(gan_iteration, fabric, g, d, opt_g, opt_d, real, z, freeze)
    (both,) = setup_models(
        fabric,
        both=Container(copy.deepcopy(gen), copy.deepcopy(disc)),
        ddp_kwargs={"both": {"find_unused_parameters": True}},
    )
    opt_g, opt_d = fabric.setup_optimizers(
        torch.optim.SGD(both.module.gen.parameters(), lr=0.1), torch.optim.SGD(both.module.disc.parameters(), lr=0.1)
    )

    def container_iteration():
        bce = nn.BCEWithLogitsLoss()
        ones = torch.ones(4, 1)
        _, d_real, d_fake = both(z, real)
        fabric.backward(bce(d_real, ones) + bce(d_fake, torch.zeros_like(ones)))
        opt_d.step()
        opt_d.zero_grad()
        _, d_of_fake, _ = both(z)
        fabric.backward(bce(d_of_fake, ones))
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()

    for _ in range(2):
        container_iteration()
    results["one_ddp_find_unused"] = collectives(container_iteration)
    return results


@given(hidden=st.lists(st.integers(1, 16), min_size=1, max_size=3))
def test_frozen_gan_iteration_allreduces_each_model_once(worlds, hidden):
    results = worlds(2).run(gradient_elements_per_iteration, hidden)[0]
    g, d = results["sizes"]["gen"], results["sizes"]["disc"]
    ours = results["separate_frozen"]
    assert {name for name, _ in ours} == {"gloo:all_reduce"}, ours
    assert sum(n for _, n in ours) == g + d
    # Without frozen, the G step computes and allreduces D's gradients a second time.
    assert sum(n for _, n in results["separate_unfrozen"]) == g + 2 * d
    # find_unused_parameters also allreduces a map of one int per parameter tensor, every backward.
    container = [n for name, n in results["one_ddp_find_unused"] if name == "gloo:all_reduce"]
    used_maps = [n for n in container if n == results["sizes"]["tensors"]]
    assert len(used_maps) == 2
    assert sum(container) - sum(used_maps) == 2 * (g + d)


# --- ddp_kwargs, Models, frozen flags --------------------------------------------------------------


def per_model_options(fabric):
    a, b = nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    strategy_kwargs = dict(fabric.strategy._ddp_kwargs)
    models = setup_models(fabric, a=a, b=b, ddp_kwargs={"b": {"broadcast_buffers": False, "bucket_cap_mb": 1}})
    return {
        "types": [type(ddp_of(m)).__name__ for m in models],
        "broadcast_buffers": [ddp_of(m).broadcast_buffers for m in models],
        "bucket_bytes_cap": [ddp_of(m).bucket_bytes_cap for m in models],
        "names": list(models._fields),
        "asdict": list(models._asdict()),
        "is_models": isinstance(models, Models) and isinstance(models, tuple),
        "same_object": models.a is models[0],
        "distinct_ddps": ddp_of(models.a) is not ddp_of(models.b),
        "strategy_kwargs_unchanged": fabric.strategy._ddp_kwargs == strategy_kwargs,
    }


def test_ddp_kwargs_reach_only_the_named_model(worlds):
    result = worlds(2).run(per_model_options)[0]
    assert result["types"] == ["DistributedDataParallel", "DistributedDataParallel"]
    assert result["broadcast_buffers"] == [True, False]
    assert result["bucket_bytes_cap"][1] == 1024 * 1024
    assert result["bucket_bytes_cap"][0] != result["bucket_bytes_cap"][1]
    assert result["names"] == result["asdict"] == ["a", "b"]
    assert result["is_models"] and result["same_object"] and result["distinct_ddps"]
    assert result["strategy_kwargs_unchanged"]


def frozen_inside_ddp(fabric):
    """frozen on a DDP module: no reduction prepared inside, DDP's flag and requires_grad restored after."""
    (model,) = setup_models(fabric, m=nn.Linear(3, 1))
    ddp = ddp_of(model)
    x = torch.randn(2, 3, requires_grad=True)
    with frozen(model):
        inside = (ddp.require_backward_grad_sync, [p.requires_grad for p in model.parameters()])
        model(x).sum().backward()
    return {
        "inside": inside,
        "after": (ddp.require_backward_grad_sync, [p.requires_grad for p in model.parameters()]),
        "input_grad": x.grad is not None,
        "param_grads": [p.grad is None for p in model.parameters()],
    }


def test_frozen_prepares_no_reduction_and_restores_ddp(worlds):
    result = worlds(2).run(frozen_inside_ddp)[0]
    assert result["inside"] == (False, [False, False])
    assert result["after"] == (True, [True, True])
    assert result["input_grad"] and result["param_grads"] == [True, True]


@given(flags=st.lists(st.booleans(), min_size=1, max_size=8), fail=st.booleans())
def test_frozen_restores_every_requires_grad_flag(flags, fail):
    model = nn.Sequential(*[nn.Linear(2, 2, bias=False) for _ in flags])
    for layer, flag in zip(model, flags):
        layer.weight.requires_grad_(flag)
    x = torch.randn(3, 2, requires_grad=True)
    with pytest.raises(ZeroDivisionError) if fail else nullcontext():
        with frozen(model, model[0]):  # overlapping modules: each parameter restored once, correctly
            assert not any(p.requires_grad for p in model.parameters())
            model(x).sum().backward()
            if fail:
                raise ZeroDivisionError
    assert [layer.weight.requires_grad for layer in model] == flags
    assert x.grad is not None and all(layer.weight.grad is None for layer in model)


# --- single process and other strategies ----------------------------------------------------------


def test_single_process_is_plain_setup_module():
    fabric = Fabric(accelerator="cpu", devices=1)
    gen, disc = setup_models(
        fabric, gen=nn.Linear(2, 2), disc=nn.Linear(2, 1), ddp_kwargs={"disc": {"broadcast_buffers": False}}
    )
    assert ddp_of(gen) is None and ddp_of(disc) is None
    assert isinstance(gen.module, nn.Linear)
    with frozen(disc):
        disc(gen(torch.randn(1, 2))).sum().backward()
    assert gen.weight.grad is not None and disc.weight.grad is None


def test_ddp_kwargs_rejected_under_a_sharding_strategy():
    # FSDP refuses to run on CPU; ModelParallelStrategy is the sharding strategy Fabric allows here.
    fabric = Fabric(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(parallelize_fn=lambda m, mesh: m))
    with pytest.raises(ValueError, match="only applies to DDP strategies.*ModelParallelStrategy"):
        setup_models(fabric, gen=nn.Linear(2, 2), ddp_kwargs={"gen": {"broadcast_buffers": False}})


class WrapsItsOwnModules(DDPStrategy):
    """A DDPStrategy subclass that wraps modules its own way, as Fabric's DeepSpeedStrategy does."""

    def setup_module(self, module: nn.Module) -> nn.Module:
        return module


def test_ddp_subclasses_that_wrap_their_own_way_are_left_to_fabric():
    # DeepSpeedStrategy subclasses DDPStrategy but builds its own engine: ddp_kwargs cannot apply there.
    fabric = Fabric(accelerator="cpu", devices=2, strategy=WrapsItsOwnModules())
    with pytest.raises(ValueError, match="only applies to DDP strategies.*WrapsItsOwnModules"):
        setup_models(fabric, gen=nn.Linear(2, 2), ddp_kwargs={"gen": {"bucket_cap_mb": 1}})
    with pytest.raises(ValueError, match="`process_group` only applies to DDP strategies"):
        setup_models(fabric, gen=nn.Linear(2, 2), process_group=object())


def untrainable_teacher(fabric):
    """A frozen teacher beside a trained student: no DDP for the teacher, training works, averaging too."""
    torch.manual_seed(0)
    teacher = nn.Linear(3, 3)
    teacher.requires_grad_(False)
    student, teacher = setup_models(fabric, student=nn.Linear(3, 3), teacher=teacher)
    opt = fabric.setup_optimizers(torch.optim.SGD(student.parameters(), lr=0.1))
    with Averager(fabric, [student, teacher], period=2) as averager:
        for _ in range(3):
            x = torch.randn(4, 3)
            fabric.backward(nn.functional.mse_loss(student(x), teacher(x)))
            opt.step()
            opt.zero_grad()
            averager.step()
    return {
        "ddp": [ddp_of(student) is not None, ddp_of(teacher) is not None],
        "fabric_module": type(teacher).__name__,
        "in_sync": bool(replicas_in_sync(fabric, [student, teacher])),
    }


def test_a_model_with_no_trainable_parameters_is_set_up_without_ddp(worlds):
    for result in worlds(2).run(untrainable_teacher):
        assert result["ddp"] == [True, False]
        assert result["fabric_module"] == "_FabricModule" and result["in_sync"]


def alone_in_a_group(fabric):
    """Each rank's DDP over a group of its own (islands with one device per node) beside the same model
    unwrapped: the collectives of the training steps, and whether both trained to bitwise the same values;
    then an Averager across the ranks, and whether the replicas end equal."""
    own = [dist.new_group([rank]) for rank in range(fabric.world_size)][fabric.global_rank]
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    (model,) = setup_models(fabric, m=copy.deepcopy(plain), process_group=own)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, plain)]

    def steps(module, optimizer):
        for step in range(3):
            data = torch.Generator().manual_seed(10 * step + fabric.global_rank)
            x, y = torch.randn(5, 3, generator=data), torch.randn(5, 2, generator=data)
            nn.functional.mse_loss(module(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()

    issued = collectives(steps, model, optimizers[0])
    steps(plain, optimizers[1])
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))
    with Averager(fabric, model, period=2) as averager:
        steps(model, optimizers[0])
        averager.step()
    return {"issued": issued, "same": same, "in_sync": bool(replicas_in_sync(fabric, model))}


def test_a_ddp_over_one_process_costs_nothing(worlds):
    for result in worlds(2).run(alone_in_a_group):
        assert result["issued"] == [], result["issued"]  # no allreduce, no buffer broadcast
        assert result["same"] and result["in_sync"], result


# --- bad input raises on every rank, before any collective ----------------------------------------


BAD_INPUTS = {
    "no models": lambda f: setup_models(f),
    "not a module": lambda f: setup_models(f, gen=torch.zeros(2)),
    "already set up": lambda f: setup_models(f, gen=f.setup_module(nn.Linear(2, 2))),
    "same module twice": lambda f: setup_models(f, gen=(m := nn.Linear(2, 2)), disc=m),
    "unknown ddp_kwargs name": lambda f: setup_models(f, gen=nn.Linear(2, 2), ddp_kwargs={"dsic": {}}),
    "ddp_kwargs not a mapping": lambda f: setup_models(f, gen=nn.Linear(2, 2), ddp_kwargs=[("gen", {})]),
    "ddp_kwargs value not a mapping": lambda f: setup_models(f, gen=nn.Linear(2, 2), ddp_kwargs={"gen": True}),
    "unknown DDP option": lambda f: setup_models(f, gen=nn.Linear(2, 2), ddp_kwargs={"gen": {"broadcast_buffer": 1}}),
    "reserved DDP option": lambda f: setup_models(f, gen=nn.Linear(2, 2), ddp_kwargs={"gen": {"device_ids": [0]}}),
    "fabric not a Fabric": lambda f: setup_models(None, gen=nn.Linear(2, 2)),
    "frozen of a tensor": lambda f: frozen(torch.zeros(1)).__enter__(),
}
EXPECTED_WORDS = {
    "no models": "at least one model",
    "not a module": "'gen'",
    "already set up": "already set up",
    "same module twice": "same module",
    "unknown ddp_kwargs name": "dsic",
    "ddp_kwargs not a mapping": "`ddp_kwargs` must map",
    "ddp_kwargs value not a mapping": "ddp_kwargs['gen']",
    "unknown DDP option": "broadcast_buffer",
    "reserved DDP option": "device_ids",
    "fabric not a Fabric": "`fabric`",
    "frozen of a tensor": "frozen",
}


def raise_bad_inputs(fabric):
    return errors_of({case: functools.partial(call, fabric) for case, call in BAD_INPUTS.items()}), in_step()


def test_bad_input_raises_on_every_rank_before_any_collective(worlds):
    results = worlds(2).run(raise_bad_inputs)
    for errors, total in results:
        assert total == 2
        for case, words in EXPECTED_WORDS.items():
            assert errors[case] is not None, f"{case} did not raise"
            assert words in errors[case][1], (case, errors[case])
    assert results[0][0] == results[1][0]
