"""The Trainer adapter under real `Trainer.fit` runs in a 2-process gloo world, for both package families.

``lightning`` (``lightning.pytorch.Trainer`` with ``fabric_multimodel.lightning``) and the
standalone packages (``pytorch_lightning.Trainer`` with ``fabric_multimodel.pytorch_lightning``)
run the same tests; each test's ``family`` names one. Every Trainer here joins the session's live
world (tests/worlds.py): Lightning finds the process group already initialised and reuses it, so
one spawn serves every fit. Task functions catch the errors they expect and return them, which
keeps the world usable for the next test.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.utils.data import DataLoader, TensorDataset

from fabric_multimodel import frozen, replicas_in_sync
from fabric_multimodel.ring import ring_quality
from fabric_multimodel.rounds.header import Header
from fabric_multimodel.run.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "gan_trainer.py"
TIMEOUT_S = 240
Z_DIM, X_DIM, HIDDEN = 8, 16, 32
#: Each family by the name of its adapter module (``fabric_multimodel.<name>``) and its Trainer package.
TRAINER_PACKAGES = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}
FAMILIES = list(TRAINER_PACKAGES)


# --- the models --------------------------------------------------------------------------------------


@functools.cache
def family(name: str) -> SimpleNamespace:
    """A family's Trainer package (``pl``), our adapter for it, and this file's modules and callbacks built on it."""
    pl = importlib.import_module(TRAINER_PACKAGES[name])
    adapter = importlib.import_module(f"fabric_multimodel.{name}")

    class TutorialGAN(pl.LightningModule):
        """Lightning's GAN tutorial, small: a BatchNorm generator, manual optimization, G step then D step.

        ``freeze`` is how the generator step keeps the discriminator out of training: Lightning's
        ``toggle_optimizer`` (the tutorial) or ``frozen``. The latent of each batch is drawn from
        (epoch, batch, rank), so that a resumed run sees the same data as an uninterrupted one.
        """

        def __init__(self, freeze: str = "toggle", optimize_disc: bool = True) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.freeze, self.optimize_disc = freeze, optimize_disc
            self.generator = nn.Sequential(
                nn.Linear(Z_DIM, HIDDEN),
                nn.BatchNorm1d(HIDDEN, 0.8),
                nn.LeakyReLU(0.2),
                nn.Linear(HIDDEN, X_DIM),
                nn.Tanh(),
            )
            self.discriminator = nn.Sequential(nn.Linear(X_DIM, HIDDEN), nn.LeakyReLU(0.2), nn.Linear(HIDDEN, 1))

        def forward(self, z: torch.Tensor) -> torch.Tensor:
            return self.generator(z)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
            (imgs,) = batch
            opt_g, opt_d = self.optimizers()
            seed = hash((self.current_epoch, batch_idx, self.global_rank))
            z = torch.randn(imgs.shape[0], Z_DIM, generator=torch.Generator().manual_seed(seed)).type_as(imgs)
            valid, fake = torch.ones(imgs.shape[0], 1).type_as(imgs), torch.zeros(imgs.shape[0], 1).type_as(imgs)

            if self.freeze == "toggle":
                self.toggle_optimizer(opt_g)
                self.generated_imgs = self(z)  # the tutorial's extra forward (for logging): G runs twice, one backward
                g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self(z)), valid)
            else:
                generated = self(z)
                with frozen(self.discriminator):
                    g_loss = F.binary_cross_entropy_with_logits(self.discriminator(generated), valid)
            self.manual_backward(g_loss)
            opt_g.step()
            opt_g.zero_grad()
            if self.freeze == "toggle":
                self.untoggle_optimizer(opt_g)
                self.toggle_optimizer(opt_d)

            real_loss = F.binary_cross_entropy_with_logits(self.discriminator(imgs), valid)
            fake_loss = F.binary_cross_entropy_with_logits(self.discriminator(self(z).detach()), fake)
            self.manual_backward((real_loss + fake_loss) / 2)
            opt_d.step()
            opt_d.zero_grad()
            if self.freeze == "toggle":
                self.untoggle_optimizer(opt_d)

        def configure_optimizers(self) -> list[torch.optim.Optimizer]:
            opt_g = torch.optim.Adam(self.generator.parameters(), lr=1e-3, betas=(0.5, 0.999))
            disc = self.discriminator.parameters() if self.optimize_disc else [torch.zeros(1, requires_grad=True)]
            return [opt_g, torch.optim.Adam(disc, lr=1e-3, betas=(0.5, 0.999))]

    def count_and_allreduce(counter, bucket):  # unannotated: DDP checks a hook's annotations
        counter.bytes += bucket.buffer().numel() * bucket.buffer().element_size()
        return allreduce_hook(None, bucket)

    class GradientBytes(pl.Callback):
        """Bytes of gradient buckets this rank allreduces, from a comm hook on every DDP of the strategy."""

        def __init__(self) -> None:
            self.counter = SimpleNamespace(bytes=0)

        def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            strategy = trainer.strategy
            ddps = (
                strategy.ddp_modules.values()
                if isinstance(strategy, adapter.MultiModelDDPStrategy)
                else [strategy.model]
            )
            for ddp in ddps:
                ddp.register_comm_hook(self.counter, count_and_allreduce)

    class RoundLog(pl.Callback):
        """After ModelAveraging's own hook: (batch count, rounds so far) at every training batch."""

        def __init__(self, averaging) -> None:
            self.averaging, self.entries = averaging, []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.entries.append((self.averaging.steps, self.averaging.rounds))

    class Regression(pl.LightningModule):
        """One model and automatic optimization: what most Trainer users have."""

        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(X_DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return SimpleNamespace(
        name=name,
        pl=pl,
        adapter=adapter,
        TutorialGAN=TutorialGAN,
        GradientBytes=GradientBytes,
        RoundLog=RoundLog,
        Regression=Regression,
    )


def trainer(fam: SimpleNamespace, strategy, *callbacks, root: str | None = None, **options):
    options = {"max_epochs": 1, "enable_checkpointing": False, **options}
    return fam.pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        callbacks=list(callbacks),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        **options,
    )


def images(batches: int, batch: int = 8) -> DataLoader:
    """``batches`` batches per rank of 2 (Lightning gives each rank its half)."""
    data = torch.randn(2 * batches * batch, X_DIM, generator=torch.Generator().manual_seed(0)).tanh()
    return DataLoader(TensorDataset(data), batch_size=batch)


def parameters(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


# --- gradient bytes: |G| + |D| per iteration, against twice that for one DDP -------------------------


def strategy_of(fam: SimpleNamespace, name: str):
    if name == "per-model":
        return fam.adapter.MultiModelDDPStrategy()
    if name == "per-model, unused-parameter search":
        # With DDP's unused-parameter search on too, a model that gets no gradient starts no reduction.
        return fam.adapter.MultiModelDDPStrategy(find_unused_parameters=True)
    if name == "one DDP":
        return fam.pl.strategies.DDPStrategy(find_unused_parameters=True)  # what the tutorial needs
    return fam.pl.strategies.DDPStrategy()  # "one plain DDP": what the tutorial fails with


def gradient_bytes(fabric, family_name, strategy_name, freeze, checkpoint):
    fam = family(family_name)
    torch.manual_seed(0)
    gan = fam.TutorialGAN(freeze)
    before = parameters(gan)
    counter, batches = fam.GradientBytes(), 5
    fit = trainer(fam, strategy_of(fam, strategy_name), counter)
    try:
        fit.fit(gan, images(batches))
    except RuntimeError as error:  # the test asserts on the message
        check = torch.ones(1)
        dist.all_reduce(check)  # every rank failed alike and can still communicate
        return str(error), check.item()
    if checkpoint:
        fit.save_checkpoint(checkpoint)
    model_bytes = sum(p.numel() * p.element_size() for p in gan.parameters())
    trained = all(not torch.equal(p, q) for p, q in zip(before, gan.parameters()))
    in_sync = bool(replicas_in_sync(fabric, [gan.generator, gan.discriminator], buffers=False))
    return counter.counter.bytes / batches, model_bytes, trained, in_sync, type(gan.generator.forward).__name__


@pytest.mark.parametrize("family_name", FAMILIES)
def test_tutorial_gan_allreduces_each_model_once_per_iteration(worlds, tmp_path, family_name):
    checkpoint = str(tmp_path / "gan.ckpt")
    world = worlds(2)
    cases = [("per-model", "toggle"), ("per-model", "frozen"), ("per-model, unused-parameter search", "toggle")]
    for strategy_name, freeze in cases:
        saved = checkpoint if freeze == "frozen" else None
        for per_iteration, model_bytes, trained, in_sync, forward in world.run(
            gradient_bytes, family_name, strategy_name, freeze, saved
        ):
            assert per_iteration == model_bytes > 0, (strategy_name, freeze)  # |G| + |D|: each model's, once
            assert trained and in_sync, (strategy_name, freeze)
            assert forward == "method", "the model's forward is its own again after fit"
    for per_iteration, model_bytes, trained, in_sync, _ in world.run(
        gradient_bytes, family_name, "one DDP", "toggle", None
    ):
        assert per_iteration == 2 * model_bytes  # both models' buckets in both steps
        assert trained and in_sync
    # What the strategy fixes: Lightning's own DDP around the tutorial GAN, without the unused-parameter search.
    for message, check in world.run(gradient_bytes, family_name, "one plain DDP", "toggle", None):
        assert "parameters that were not used in producing the loss" in message and check == 2
    # The checkpoint keeps the plain names and loads into a module that never saw the strategy.
    state = torch.load(checkpoint, weights_only=False)["state_dict"]
    TutorialGAN = family(family_name).TutorialGAN
    assert sorted(state) == sorted(TutorialGAN().state_dict())
    TutorialGAN().load_state_dict(state)
    TutorialGAN.load_from_checkpoint(checkpoint)


# --- convergence: the example's ring GAN reaches all eight modes --------------------------------------


def load_example():
    if str(EXAMPLE.parent) not in sys.path:  # the example imports its neighbour examples/common.py
        sys.path.insert(0, str(EXAMPLE.parent))
    spec = importlib.util.spec_from_file_location("gan_trainer", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ring_gan_quality(fabric, steps, period):
    example = load_example()  # written for the `lightning` package, as most users install it
    fam = family("lightning")
    fam.pl.seed_everything(0, verbose=False)
    gan = example.RingGAN(batch_size=64, seed=0, steps=steps)
    untrained = ring_quality(gan.sample(2500))
    # Warm-up 98: the batches after it are no multiple of the period, so only the round on leaving fit syncs the end.
    averaging = fam.adapter.ModelAveraging
    callbacks = [averaging(period, warmup_steps=98, average_optimizer_state=True)] if period else []
    trainer(fam, fam.adapter.MultiModelDDPStrategy(), *callbacks, limit_train_batches=steps).fit(gan)
    in_sync = bool(replicas_in_sync(fabric, [gan.generator, gan.discriminator]))
    return untrained, ring_quality(gan.sample(2500)), in_sync


@pytest.mark.parametrize("period", [0, 4], ids=["synchronous", "local-sgd"])
def test_ring_gan_captures_all_eight_modes(worlds, period):
    for untrained, trained, in_sync in worlds(2).run(ring_gan_quality, 400, period):
        assert untrained.modes_captured < 8 and untrained.high_quality < 0.05
        assert trained.modes_captured == 8, trained
        assert trained.high_quality >= 0.1, trained
        assert in_sync


# --- ModelAveraging: checkpoint and resume -----------------------------------------------------------

COUNTERS = ("steps", "rounds", "synced_at_step", "elements_communicated", "bytes_communicated")


def averaging(fam: SimpleNamespace, kind: str):
    ModelAveraging = fam.adapter.ModelAveraging
    if kind == "mean":
        return ModelAveraging(period=4, warmup_steps=2, average_optimizer_state=True)
    if kind == "diloco":  # the Averager's options pass through: the anchor and outer momentum must resume too
        nesterov = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
        return ModelAveraging(4, 2, average_optimizer_state=True, outer_optimizer=nesterov, comm_dtype=torch.bfloat16)
    return ModelAveraging(period=4, warmup_steps=2, overlap_steps=1)  # Adam's moments stay rank-local


def averaged_run(fabric, family_name, kind, root, resume_from, epochs):
    """Epochs of 6 batches, warm-up 2, period 4: rounds at batches 6, 10, 14, 18 (epoch 1 ends on a round)."""
    fam = family(family_name)
    torch.manual_seed(1 if resume_from else 0)  # a resumed run must get its weights from the checkpoint
    gan = fam.TutorialGAN("toggle")
    callback, counter = averaging(fam, kind), fam.GradientBytes()
    log = fam.RoundLog(callback)
    every_epoch = fam.pl.callbacks.ModelCheckpoint(
        dirpath=root, save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=True
    )
    fit = trainer(
        fam,
        fam.adapter.MultiModelDDPStrategy(),
        callback,
        log,
        counter,
        every_epoch,
        max_epochs=epochs,
        enable_checkpointing=True,
    )
    fit.fit(gan, images(6), ckpt_path=resume_from)
    in_sync = bool(replicas_in_sync(fabric, [gan.generator, gan.discriminator]))
    counters = {name: callback.state_dict()[name] for name in COUNTERS}
    warmup_gradients = counter.counter.bytes / sum(p.numel() * p.element_size() for p in gan.parameters())
    return log.entries, parameters(gan) + [b.clone() for b in gan.buffers()], in_sync, counters, warmup_gradients


@pytest.mark.parametrize(
    "family_name, kind",
    [("lightning", "mean"), ("lightning", "diloco"), ("lightning", "overlap"), ("pytorch_lightning", "diloco")],
)
def test_resume_continues_the_schedule_and_equals_the_uninterrupted_run(worlds, tmp_path, family_name, kind):
    world = worlds(2)
    full = world.run(averaged_run, family_name, kind, str(tmp_path / "full"), None, 3)
    log, final, in_sync, counters, warmup_gradients = full[0]
    assert warmup_gradients == 2  # each model's gradients in batches 1-2, none in the local phase
    assert [steps for steps, _ in log] == list(range(1, 19))
    rounds_at = [steps for (steps, rounds), (_, before) in zip(log, [(0, 0), *log]) if rounds > before]
    assert rounds_at == [6, 10, 14, 18]  # counted at launch (overlap: merged a batch later)
    assert in_sync and all(r[2] for r in full)
    # Leaving fit: overlap merges the round launched at batch 18, then the Averager's closing round
    # counts as one more (its stamp sees no round finished at 18); blocking rounds leave nothing to do.
    final_rounds = 5 if kind == "overlap" else 4
    assert counters["steps"] == 18 and counters["rounds"] == final_rounds
    assert all(torch.equal(a, b) for a, b in zip(final, full[1][1]))  # replicas identical, buffers too

    after_epoch = {epoch: next((tmp_path / "full").glob(f"epoch={epoch}-*.ckpt")) for epoch in (0, 1)}
    saved = torch.load(after_epoch[0], weights_only=False)["callbacks"]["ModelAveraging"]
    assert (saved["steps"], saved["rounds"]) == (6, 1)
    assert ("anchor" in saved and "outer_optimizer" in saved) == (kind == "diloco")

    # Resumed after a round (epoch 1 ends at batch 6): the same rounds and counters and, when every
    # rank's optimizer state is rank 0's after a round, bitwise the uninterrupted run.
    resumed = world.run(averaged_run, family_name, kind, str(tmp_path / "resumed"), str(after_epoch[0]), 3)
    for (log_b, final_b, in_sync_b, counters_b, gradients_b), (_, final_a, *_) in zip(resumed, full):
        assert log_b == log[6:] and gradients_b == 0
        assert in_sync_b and counters_b == counters
        if kind != "overlap":
            assert all(torch.equal(a, b) for a, b in zip(final_a, final_b))

    # Resumed in the middle of a period (batch 12): the schedule still continues exactly.
    mid_period = world.run(averaged_run, family_name, kind, str(tmp_path / "mid"), str(after_epoch[1]), 3)
    for log_c, _, in_sync_c, counters_c, _ in mid_period:
        assert log_c == log[12:] and in_sync_c and counters_c["rounds"] == final_rounds


# --- automatic optimization: one model, gradient accumulation -----------------------------------------


def accumulated(fabric, family_name, strategy_name):
    fam = family(family_name)
    torch.manual_seed(0)
    model, counter = fam.Regression(), fam.GradientBytes()
    strategy = fam.adapter.MultiModelDDPStrategy() if strategy_name == "per-model" else fam.pl.strategies.DDPStrategy()
    trainer(fam, strategy, counter, accumulate_grad_batches=2).fit(model, images(4))
    return counter.counter.bytes, sum(p.numel() * p.element_size() for p in model.parameters()), parameters(model)


@pytest.mark.parametrize("family_name", FAMILIES)
def test_automatic_optimization_with_accumulation_is_ddp(worlds, family_name):
    world = worlds(2)
    ours_all = world.run(accumulated, family_name, "per-model")
    for ours, lightnings in zip(ours_all, world.run(accumulated, family_name, "one DDP")):
        assert ours[0] == lightnings[0] == 2 * ours[1]  # 4 batches: gradients allreduced on the 2nd and 4th
        assert all(torch.equal(p, q) for p, q in zip(ours[2], lightnings[2]))


# --- bad configuration: one clear error on every rank ---------------------------------------------


def bad_configuration(fabric, family_name, case):
    fam = family(family_name)
    MultiModelDDPStrategy = fam.adapter.MultiModelDDPStrategy
    torch.manual_seed(0)
    gan, callbacks = fam.TutorialGAN("toggle"), []
    if case == "unknown model":
        strategy = MultiModelDDPStrategy(models=["generator", "disc"])
    elif case == "unknown ddp_kwargs model":
        strategy = MultiModelDDPStrategy(ddp_kwargs={"gen": {"broadcast_buffers": False}})
    elif case == "model in no optimizer":
        strategy, gan = MultiModelDDPStrategy(), fam.TutorialGAN("toggle", optimize_disc=False)
    elif case == "optimized model not wrapped":
        strategy = MultiModelDDPStrategy(models=["generator"])
    elif case == "models share parameters":
        strategy = MultiModelDDPStrategy()
        gan.critic = nn.Sequential(gan.discriminator[0], nn.Linear(HIDDEN, 1))
    elif case == "models differ across ranks":
        strategy = MultiModelDDPStrategy()
        if fabric.global_rank == 1:
            gan.discriminator = nn.Sequential(nn.Linear(X_DIM, 1))
    elif case == "parameter unused in forward":
        strategy = MultiModelDDPStrategy()
        gan.generator[1].spare = nn.Linear(1, 1)  # trained by opt_g, never used: DDP waits for its gradient
    elif case == "callback of the other family":
        other = family(next(name for name in FAMILIES if name != family_name))
        strategy, callbacks = MultiModelDDPStrategy(), [other.adapter.ModelAveraging(period=4)]
    else:  # "callback under DDPStrategy"
        strategy, callbacks = fam.pl.strategies.DDPStrategy(), [fam.adapter.ModelAveraging(period=4)]
    start = time.monotonic()
    try:
        trainer(fam, strategy, *callbacks).fit(gan, images(2))
    except Exception as error:  # the test asserts on the type and message
        outcome = type(error).__name__, str(error), time.monotonic() - start
    else:
        outcome = None, None, time.monotonic() - start
    check = torch.ones(1)
    dist.all_reduce(check)  # nothing was left half-issued: every rank can still communicate
    return outcome, check.item()


@pytest.mark.parametrize("family_name", FAMILIES)
@pytest.mark.parametrize(
    "case, words",
    [
        ("unknown model", ["`models`", "'disc'", "generator", "discriminator"]),
        ("unknown ddp_kwargs model", ["`ddp_kwargs`", "'gen'", "generator"]),
        ("model in no optimizer", ["'discriminator'", "no optimizer", "configure_optimizers", "`models`"]),
        ("optimized model not wrapped", ["discriminator.0.weight", "`models`"]),
        ("models share parameters", ["'discriminator' and 'critic'", "`models`"]),
        ("models differ across ranks", ["differ across ranks", "rank 0:", "rank 1:"]),
        ("parameter unused in forward", ["finished reduction", "frozen", "find_unused_parameters': True"]),
        (
            "callback under DDPStrategy",
            ["ModelAveraging", "DDPStrategy", "MultiModelDDPStrategy()", "fabric_multimodel."],
        ),
        ("callback of the other family", ["ModelAveraging", "Trainer", "import it from fabric_multimodel."]),
    ],
)
def test_bad_configuration_is_one_clear_error_on_every_rank(worlds, family_name, case, words):
    expected = {"parameter unused in forward": "RuntimeError", "callback of the other family": "TypeError"}
    for (kind, message, seconds), check in worlds(2).run(bad_configuration, family_name, case):
        assert kind == expected.get(case, "ValueError"), (kind, message)
        assert all(word in message for word in words), message
        if "fabric_multimodel." in words:  # the adapter named is the one of this Trainer's family
            assert f"fabric_multimodel.{family_name})" in message or f"from fabric_multimodel.{family_name}." in message
        assert seconds < 20 and check == 2


@pytest.mark.parametrize("family_name", FAMILIES)
def test_callback_without_a_distributed_strategy_is_refused(tmp_path, family_name):
    fam = family(family_name)
    fit = fam.pl.Trainer(
        accelerator="cpu",
        devices=1,
        callbacks=[fam.adapter.ModelAveraging(period=4)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        max_epochs=1,
    )
    with pytest.raises(ValueError, match=r"ModelAveraging: needs a distributed strategy.*MultiModelDDPStrategy\(\)"):
        fit.fit(fam.TutorialGAN(), images(2))


@pytest.mark.parametrize("family_name", FAMILIES)
@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda a: a.MultiModelDDPStrategy(models="generator"), TypeError, ["`models`", "list"]),
        (lambda a: a.MultiModelDDPStrategy(models=["g", "g"]), ValueError, ["`models`", "once"]),
        (lambda a: a.MultiModelDDPStrategy(ddp_kwargs={"g": 1}), TypeError, ["`ddp_kwargs`"]),
        (lambda a: a.MultiModelDDPStrategy(["g"], ddp_kwargs={"d": {}}), ValueError, ["`ddp_kwargs`", "'d'"]),
        (lambda a: a.MultiModelDDPStrategy(bucket_cap=25), ValueError, ["bucket_cap", "DistributedDataParallel"]),
        (lambda a: a.MultiModelDDPStrategy(ddp_kwargs={"g": {"device_ids": [0]}}), ValueError, ["device_ids"]),
        (lambda a: a.MultiModelDDPStrategy(model_averaging_period=4), ValueError, ["ModelAveraging"]),
        (lambda a: a.ModelAveraging(period=0), ValueError, ["`period`", ">= 1"]),
        (lambda a: a.ModelAveraging(period=4, warmup_steps=-1), ValueError, ["`warmup_steps`"]),
        (lambda a: a.ModelAveraging(period=4, overlap_steps=4), ValueError, ["`overlap_steps`", "`period`"]),
        (lambda a: a.ModelAveraging(4, overlap_steps=1, average_optimizer_state=True), ValueError, ["overlap_steps"]),
        (lambda a: a.ModelAveraging(period=4, average_buffers=1), TypeError, ["`average_buffers`"]),
    ],
)
def test_bad_arguments_are_refused_at_construction(family_name, make, error, words):
    with pytest.raises(error) as info:
        make(family(family_name).adapter)
    assert all(word in str(info.value) for word in words), info.value


@pytest.mark.parametrize("family_name", FAMILIES)
def test_each_family_gets_its_own_strategy_and_callback(family_name):
    fam = family(family_name)
    assert isinstance(fam.adapter.MultiModelDDPStrategy(), fam.pl.strategies.DDPStrategy)
    assert isinstance(fam.adapter.ModelAveraging(period=4), fam.pl.Callback)
    other = family(next(name for name in FAMILIES if name != family_name))
    assert not isinstance(fam.adapter.MultiModelDDPStrategy(), other.pl.strategies.Strategy)
    assert fam.adapter.MultiModelDDPStrategy.__doc__ == other.adapter.MultiModelDDPStrategy.__doc__  # one definition


# --- the example -------------------------------------------------------------------------------------

FINAL = re.compile(
    r"^final: steps=(?P<steps>\d+) modes_captured=(?P<modes>\d+)/8 high_quality=(?P<hq>\d\.\d{3})"
    r" wall_s=(?P<wall>\d+\.\d) iter_ms_median=(?P<iter_ms>\d+\.\d{2})"
    r" iter_ms_mean=(?P<iter_ms_mean>\d+\.\d{2}) comm_bytes=(?P<comm>\d+)"
    r" comm_bytes_per_iter=(?P<per_iter>\d+\.\d) rounds=(?P<rounds>\d+)$"
)


def example(*flags: str, launcher: list[str] = ()) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *launcher, str(EXAMPLE), *flags], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S
    )


@pytest.mark.slow
def test_example_local_sgd_run_under_torchrun(tmp_path):
    torchrun = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    proc = example(
        "--accelerator",
        "cpu",
        "--steps",
        "40",
        "--period",
        "4",
        "--warmup-steps",
        "10",
        "--out",
        str(tmp_path),
        launcher=torchrun,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    lines = proc.stdout.strip().splitlines()
    assert sum(line.startswith("final:") for line in lines) == 1, proc.stdout  # rank 0 only
    assert f"run folder: {tmp_path} (checkpoint.ckpt, logs/)" in lines
    # Lightning's deprecation notices from inside Lightning are not the user's concern: none reach the screen.
    assert "LeafSpec" not in proc.stderr and "weights_only" not in proc.stderr, proc.stderr[-3000:]
    final = {k: float(v) for k, v in FINAL.match(lines[-1]).groupdict().items()}
    checkpoint = torch.load(tmp_path / "checkpoint.ckpt", weights_only=False)
    params = sum(t.numel() * t.element_size() for t in checkpoint["state_dict"].values())
    header = 4 * Header.SLOTS * 2  # a round's header: each of the 2 ranks' step count and stamp, fp32 slots
    # Warm-up: each model's gradients once per batch. Then rounds (parameters and Adam's two moments)
    # at batches 14, 18, ..., 38, and one on leaving fit for batches 39-40.
    assert final["steps"] == 40 and final["rounds"] == 8
    assert final["comm"] == 10 * params + 8 * (3 * params + header)
    assert checkpoint["callbacks"]["ModelAveraging"]["steps"] == 40
    # Plain parameter names: the example's module loads it without the strategy.
    load_example().RingGAN().load_state_dict(checkpoint["state_dict"])


@pytest.mark.parametrize(
    "flags, mentions",
    [
        (["--period", "-1"], "--period"),
        (["--devices", "0"], "--devices"),
        (["--lr", "nan"], "--lr"),
        (["--steps", "many"], "'many'"),  # argparse's own errors are one line too
    ],
)
def test_example_bad_flags_are_one_line(flags, mentions, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_example().parse_args(flags)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and mentions in lines[0], lines


@pytest.mark.slow
def test_example_bad_flag_stops_the_script_before_any_process_starts():
    proc = example("--devices", "2", "--period", "-1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == ["gan_trainer.py: error: --period must be >= 0, got -1"]


def test_example_run_folders_are_named_after_the_settings(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the folders are relative to where it runs
    module = load_example()
    assert module.parse_args([]).out == Path("runs/gan_trainer/sync-seed0")
    settings = module.parse_args(["--period", "8", "--warmup-steps", "100", "--seed", "2"])
    assert settings.out == Path("runs/gan_trainer/period8-warmup100-seed2")
    # An earlier run's checkpoint is never written over: one line says what to do instead.
    (tmp_path / "runs/gan_trainer/sync-seed0").mkdir(parents=True)
    (tmp_path / "runs/gan_trainer/sync-seed0/checkpoint.ckpt").write_bytes(b"earlier")
    with pytest.raises(SystemExit) as exit_info:
        module.parse_args([])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "runs/gan_trainer/sync-seed0 holds an earlier run's checkpoint.ckpt" in line and "--out" in line
