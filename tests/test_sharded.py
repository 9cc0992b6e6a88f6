"""FSDP2 inside a site, the Averager across sites: each rank's shard is averaged with the same shard of the other
sites, for every kind of round, and the run equals the same run with DDP inside each site."""

from __future__ import annotations

import functools
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import DTensor

from fabric_multimodel import Averager, frozen, replicas_in_sync, setup_models
from fabric_multimodel.averaging.arguments import plain_module
from fabric_multimodel.checkpoints.files import CheckpointWriter, replica_path, save_checkpoint
from fabric_multimodel.checkpoints.sharded import load_sharded, resume_latest_sharded, save_sharded, saved_step
from fabric_multimodel.rounds.header import Header
from tests.gan import collectives, mlp

NESTEROV = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
NEVER_WRITTEN = Path(tempfile.gettempdir()) / "fabric-multimodel-never-written.pt"
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp4": torch.float4_e2m1fn_x2}


def sites_of_two(fabric):
    """Four ranks as two sites of two: this rank's site, and its peers across sites (the same local rank)."""
    sites = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    across = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return sites[fabric.global_rank // 2], across[fabric.global_rank % 2]


def train_step(fabric, model, optimizer, step: int) -> None:
    data = torch.Generator().manual_seed(100 * step + fabric.global_rank)
    x, y = torch.randn(6, 3, generator=data), torch.randn(6, 3, generator=data)
    fabric.backward(nn.functional.mse_loss(model(x), y))
    optimizer.step()
    optimizer.zero_grad()


def whole(model: nn.Module) -> list[torch.Tensor]:
    """The full parameters (an FSDP2 model's gathered inside its site), for comparing layouts."""
    return [p.full_tensor() if isinstance(p, DTensor) else p.detach().clone() for p in model.parameters()]


def sharded_and_islands(fabric, options: dict, steps: int):
    """The same run twice, DDP inside each site and FSDP2 inside each site; per round, whether the shards
    agree across sites; at the end, the largest difference between the two runs' full models (relative to the
    largest parameter)."""
    site, peers = sites_of_two(fabric)
    runs, checks, sent = {}, [], {}
    for layout in ("islands", "sharded"):
        torch.manual_seed(0)
        # 3 outputs: the last layer's rows shard unevenly (2 and 1), as real layers often do
        placement = {"process_group": site} if layout == "islands" else {"shard": site}
        (model,) = setup_models(fabric, m=mlp([3, 8, 8, 3]), **placement)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        averager = Averager(fabric, model, process_group=peers, **options)
        with averager:
            for step in range(1, steps + 1):
                train_step(fabric, model, optimizer, step)
                # A blocking round of the whole model leaves the sites' shards equal (of one fragment: that one).
                blocking_whole = not options["overlap_steps"] and options["fragments"] == 1
                if averager.step() and layout == "sharded" and blocking_whole:
                    checks.append(bool(replicas_in_sync(fabric, model, process_group=peers)))
        if layout == "sharded":
            checks.append(bool(replicas_in_sync(fabric, model, process_group=peers)))
        runs[layout] = whole(model)
        sent[layout] = averager.traffic.bytes
    difference = max((a - b).abs().max().item() for a, b in zip(runs["islands"], runs["sharded"]))
    return checks, difference / max(p.abs().max().item() for p in runs["islands"]), sent


@given(
    payload=st.sampled_from(["fp32", "bf16", "fp8", "fp4"]),
    outer=st.booleans(),
    fragments=st.sampled_from([1, 2]),
    overlap=st.sampled_from([0, 1]),
    warmup=st.integers(0, 2),
    feedback=st.booleans(),
)
@example(payload="fp4", outer=True, fragments=2, overlap=1, warmup=1, feedback=True)  # 2.25 steps apart
def test_sharded_rounds_keep_shards_in_sync_and_equal_ddp_islands(
    worlds, payload, outer, fragments, overlap, warmup, feedback
):
    options = {"period": 4, "warmup_steps": warmup, "fragments": fragments, "overlap_steps": overlap}
    options |= {"outer_optimizer": NESTEROV} if outer else {}
    options |= {"comm_dtype": DTYPES[payload]} if DTYPES[payload] else {}
    options |= {"error_feedback": True} if feedback and payload in ("fp8", "fp4") else {}
    for checks, difference, sent in worlds(4).run(sharded_and_islands, options, 11):
        assert checks and all(checks)  # every shard equals the same shard of the other site after each round
        # Block quantization cuts a shard's payload into other blocks than a replica's: the two runs differ by
        # what two quantizations of the largest value can (a first round after warm-up sends parameters, not
        # deltas: e4m3 keeps 3 mantissa bits, e2m1 one), and fp32 and bf16 payloads not at all. With error
        # feedback, the residual each run carries into the next round differs as well: one step more.
        steps = 3 if "error_feedback" in options else 2
        assert difference <= {"fp32": 1e-6, "bf16": 1e-6, "fp8": steps / 16, "fp4": steps / 6}[payload], difference
        assert sent["sharded"] > 0


def generator_step_collectives(fabric):
    """A GAN's generator step with both models sharded inside the site: the collectives it issues, per model."""
    site, _ = sites_of_two(fabric)
    torch.manual_seed(0)
    gen, disc = setup_models(fabric, shard=site, gen=mlp([4, 6, 5]), disc=mlp([5, 7, 1]))
    z = torch.randn(3, 4)

    def step(freeze: bool) -> None:
        if freeze:
            with frozen(disc):
                loss = disc(gen(z)).mean()
        else:
            loss = disc(gen(z)).mean()
        fabric.backward(loss)
        gen.zero_grad(set_to_none=True)
        disc.zero_grad(set_to_none=True)

    step(True)  # FSDP2's lazy init outside the count
    return {freeze: collectives(step, freeze) for freeze in (True, False)}


def test_frozen_keeps_its_promise_under_fsdp2(worlds):
    elements = {"gen": 4 * 6 + 6 + 6 * 5 + 5, "disc": 5 * 7 + 7 + 7 * 1 + 1}
    for counted in worlds(4).run(generator_step_collectives):
        # The gradients' reduce-scatter (an allreduce on gloo), one per model, of its padded gradients.
        reduced = {freeze: [n for name, n in found if "reduce" in name] for freeze, found in counted.items()}
        assert len(reduced[False]) == 2 and sum(reduced[False]) >= elements["gen"] + elements["disc"], counted
        assert len(reduced[True]) == 1 and elements["gen"] <= reduced[True][0] < elements["disc"] * 2, counted


def sharded_mistakes(fabric):
    """What each mistake with sharded models raises, on every rank, before any round."""
    site, peers = sites_of_two(fabric)
    (model,) = setup_models(fabric, m=mlp([3, 4, 2]), shard=site)
    (replica,) = setup_models(fabric, r=mlp([3, 4, 2]), process_group=site)
    attempts = {
        "node_period": lambda: Averager(fabric, model, period=4, node_period=2, node_group=site, process_group=peers),
        "mixed": lambda: Averager(fabric, [model, replica], period=4, process_group=peers),
        "averaged inside the site": lambda: Averager(fabric, model, period=4, process_group=site),
        "ddp_kwargs": lambda: setup_models(fabric, ddp_kwargs={"m": {}}, shard=site, m=mlp([3, 4, 2])),
        "not a group": lambda: setup_models(fabric, shard="node", m=mlp([3, 4, 2])),
        # One rank's file would keep one shard: refused on every rank (the writer's too), before save's barrier.
        "writer": lambda: CheckpointWriter(NEVER_WRITTEN, enabled=fabric.global_rank == 0).save({"m": model}),
        "save_checkpoint": lambda: save_checkpoint(fabric, NEVER_WRITTEN, {"m": model, "step": 1}),
        "save_sharded without shards": lambda: save_sharded(NEVER_WRITTEN, {"r": replica, "step": 1}),
        "load_sharded no folder": lambda: load_sharded(NEVER_WRITTEN, {"m": model}),
    }
    found = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            found[name] = None
        except (TypeError, ValueError) as error:
            found[name] = f"{type(error).__name__}: {error}"
    return found


def test_a_mistake_with_sharded_models_is_one_clear_error_on_every_rank(worlds):
    expected = {
        "node_period": "ValueError: Averager: with FSDP2 models",
        "mixed": "ValueError: Averager: with FSDP2 models, shard every model",
        "averaged inside the site": "ValueError: Averager: a sharded module's shards live on ranks",
        "ddp_kwargs": "ValueError: setup_models: `shard` wraps the models in FSDP2",
        "not a group": "TypeError: setup_models: `shard` must be a process group",
        "writer": f"CheckpointError: {NEVER_WRITTEN}: `m` holds FSDP2 shards",
        "save_checkpoint": f"CheckpointError: {NEVER_WRITTEN}: `m` holds FSDP2 shards",
        "save_sharded without shards": f"CheckpointError: {NEVER_WRITTEN}: a sharded checkpoint needs FSDP2 modules",
        "load_sharded no folder": f"CheckpointError: {NEVER_WRITTEN}: not a complete sharded checkpoint",
    }
    for found in worlds(4).run(sharded_mistakes):
        for name, start in expected.items():
            assert found[name] is not None and found[name].startswith(start), (name, found[name])


# --- sharded checkpoints: torch.distributed.checkpoint inside each site ------------------------------------

# fp8 pseudo-gradients with error feedback: each rank's residuals are kept too (a resume is bitwise only with them).
CHECKPOINTED = {
    "period": 4, "warmup_steps": 2, "outer_optimizer": NESTEROV, "fragments": 2,
    "comm_dtype": torch.float8_e4m3fn, "error_feedback": True,
}  # fmt: skip


def full_state(model, optimizer, averager) -> dict[str, torch.Tensor]:
    """Everything a sharded checkpoint keeps, gathered whole inside the site: parameters, Adam's moments, the
    anchors and the outer optimizer's momentum, by name."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    def gathered(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    state = {f"param {n}": gathered(p) for n, p in plain_module(model).named_parameters()}
    inner = get_optimizer_state_dict(model, optimizer)["state"]
    state |= {f"inner {n} {k}": gathered(v) for n, e in inner.items() for k, v in e.items() if v.dim()}
    saved = averager.state_dict()
    state |= {f"anchor {n}": gathered(v) for n, v in saved["anchor"].items()}
    outer = saved["outer_optimizer"]["state"]
    state |= {f"outer {n} {k}": gathered(v) for n, e in outer.items() for k, v in e.items() if v.dim()}
    return state


def sharded_setup(fabric, site, peers, seed: int = 0):
    torch.manual_seed(seed)
    (model,) = setup_models(fabric, m=mlp([3, 8, 8, 3]), shard=site)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, optimizer, Averager(fabric, model, process_group=peers, **CHECKPOINTED)


def sharded_save_and_resume(fabric, folder: str, save_at: int, steps: int):
    """2 sites x 2: train, save each site's replica at ``save_at`` (site 0 first, while site 1 waits: nothing
    crosses sites), go on to ``steps``; then a fresh run of other initial values loads its site's folder and goes
    on to ``steps`` too. Returns the saved state (gathered whole), the collectives of a save, and whether the
    resumed run ended bitwise equal to the uninterrupted one."""
    site, peers = sites_of_two(fabric)
    model, optimizer, averager = sharded_setup(fabric, site, peers)
    path = replica_path(Path(folder) / "checkpoint", averager.replica.index)
    with averager:
        for step in range(1, steps + 1):
            train_step(fabric, model, optimizer, step)
            averager.step()
            if step == save_at:
                saved = full_state(model, optimizer, averager)
                state = {"m": model, "opt": optimizer, "averager": averager, "step": step}
                found = None
                for turn in (0, 1):  # one site saves while the other waits for it here, outside any group
                    if averager.replica.index == turn:
                        found = collectives(save_sharded, path, state)
                    dist.barrier()
        uninterrupted = full_state(model, optimizer, averager)

    model, optimizer, averager = sharded_setup(fabric, site, peers, seed=1)
    values = load_sharded(path, {"m": model, "opt": optimizer, "averager": averager, "step": 0})
    loaded = full_state(model, optimizer, averager)
    with averager:
        for step in range(values["step"] + 1, steps + 1):
            train_step(fabric, model, optimizer, step)
            averager.step()
        resumed = full_state(model, optimizer, averager)
    equal = {name: torch.equal(uninterrupted[name], resumed[name]) for name in uninterrupted}
    return saved, found, values, {name: torch.equal(saved[name], loaded[name]) for name in saved}, equal


@pytest.fixture(scope="module")
def sharded_checkpoints(worlds, tmp_path_factory: pytest.TempPathFactory):
    """The folders of 2 sites x 2 (at step 9 of 13), and what each rank's run returned."""
    folder = tmp_path_factory.mktemp("sharded")
    return folder, worlds(4).run(sharded_save_and_resume, str(folder), 9, 13)


def test_a_sharded_checkpoint_stays_in_its_site_and_resumes_bitwise(sharded_checkpoints):
    folder, results = sharded_checkpoints
    for saved, found, values, loaded, resumed in results:
        assert values == {"step": 9}
        # The outer optimizer has stepped fragment 0 (step 8) and not yet fragment 1: both kinds are kept.
        assert any(k.startswith("outer ") for k in saved) and any(k.startswith("anchor ") for k in saved)
        assert all(loaded.values()), loaded
        assert all(resumed.values()), resumed
        # DCP's plans and metadata, gathered to the site's first process and sent back, and the final barrier:
        # 10 collectives on torch 2.13, none of them across sites (one site saved while the other waited).
        assert 0 < len(found) <= 10, [name for name, _ in found]
    assert {p.name for p in folder.iterdir()} == {"checkpoint", "checkpoint.replica1"}  # no temporary left


def one_process_per_site(fabric, folder: str):
    """Every rank a site of its own resumes with ``resume_latest_sharded``: from the 2 x 2 run's folders; from a
    folder with none; from folders where site 1's own is older than site 0's (it rejoins from site 0's); and with
    each rank its own base folder, only rank 0's holding the checkpoint (the others receive it over the link)."""
    rank, world = fabric.global_rank, fabric.world_size
    sites = [dist.new_group([r]) for r in range(world)]
    model, optimizer, averager = sharded_setup(fabric, sites[rank], None, seed=1)
    state = {"m": model, "opt": optimizer, "averager": averager, "step": 0}
    base = Path(folder)
    found = resume_latest_sharded(fabric, base / "checkpoint", state)
    assert found is not None and found.bytes == 0
    resumed = (found.folder.name, found.values, full_state(model, optimizer, averager))

    nothing: list = []
    calls = collectives(lambda: nothing.append(resume_latest_sharded(fabric, base / f"empty{world}" / "x", state)))
    nothing.append([name for name, _ in calls])
    stale, hosts = base / f"stale{world}", base / f"host{world}-{rank}"
    if rank == 0:
        shutil.copytree(base / "checkpoint", stale / "checkpoint")
        shutil.copytree(base / "checkpoint", hosts / "checkpoint")
    dist.barrier()
    if rank == 1:  # site 1's own folder, 4 steps older than site 0's
        save_sharded(replica_path(stale / "checkpoint", 1), state | {"step": 5})
    dist.barrier()
    rejoined = resume_latest_sharded(fabric, stale / "checkpoint", state)
    assert rejoined is not None
    model, optimizer, averager = sharded_setup(fabric, sites[rank], None, seed=2)  # nothing loaded yet
    state = {"m": model, "opt": optimizer, "averager": averager, "step": 0}
    progress: list[tuple[int, int]] = []
    calls = collectives(
        lambda: progress.append(
            resume_latest_sharded(fabric, hosts / "checkpoint", state, progress=lambda d, t, _: progress.append((d, t)))
        )
    )
    received = progress.pop()
    folder = sorted(p.name for p in hosts.iterdir())
    transfer = (received.folder.name, received.source, received.bytes, progress, [n for n, _ in calls], folder)
    transfer += (received.values, averager.steps)
    return resumed, nothing, (rejoined.folder.name, rejoined.values), transfer, full_state(model, optimizer, averager)


def test_saved_step_reads_a_complete_folder_and_nothing_else(tmp_path):
    """The step of a complete folder, read by one process; -1 for a folder that is missing, incomplete,
    unreadable, or whose step is not an int."""
    import torch.distributed.checkpoint as dcp

    with pytest.warns(UserWarning):  # DCP's note that it saves in a single process
        dcp.save({"step": 9, "w": torch.ones(3), "when": "late"}, checkpoint_id=tmp_path / "ok", no_dist=True)
    assert saved_step(tmp_path / "ok") == 9
    assert saved_step(tmp_path / "ok", step_key="when") == saved_step(tmp_path / "ok", step_key="w") == -1
    assert saved_step(tmp_path / "ok", step_key="nothing") == -1
    assert saved_step(tmp_path / "missing") == -1
    shutil.copytree(tmp_path / "ok", tmp_path / "torn")
    for data in (tmp_path / "torn").glob("*.distcp"):
        data.write_bytes(b"torn")
    assert saved_step(tmp_path / "torn") == -1
    (tmp_path / "ok" / ".metadata").unlink()
    assert saved_step(tmp_path / "ok") == -1


@pytest.mark.parametrize("sites", [2, 4])
def test_a_sharded_checkpoint_reshards_into_fewer_devices_and_more_sites(sharded_checkpoints, worlds, sites):
    """Written by 2 processes per site, loaded by 1 (``resume_latest_sharded``): the same state, bitwise. A site
    with no folder of its own (4 sites where 2 saved), or an older one, loads site 0's and starts from the
    anchors, the global model; a site that can read no folder at the newest step receives one over the link."""
    folder, results = sharded_checkpoints
    saved = [results[0][0], results[2][0]]  # by site
    results = worlds(sites).run(one_process_per_site, str(folder))
    for rank, (resumed, nothing, rejoined, transfer, received) in enumerate(results):
        name, values, state = resumed
        own = rank < 2
        assert name == replica_path(Path("checkpoint"), rank if own else 0).name and values == {"step": 9}
        expected = saved[rank] if own else saved[0]
        if not own:
            expected = expected | {f"param {k[7:]}": v for k, v in saved[0].items() if k.startswith("anchor ")}
        assert set(state) == set(expected)
        assert all(torch.equal(state[k], expected[k]) for k in state), [
            k for k in state if not torch.equal(state[k], expected[k])
        ]
        assert nothing == [None, ["gloo:all_gather"]]  # what each process sees, gathered once; nothing loaded
        assert rejoined == ("checkpoint", {"step": 9})  # site 1's own folder is at step 5
        # Each rank its own base folder: site 0 loads its own; every other site receives it from rank 0, writes it
        # as its folder, and starts from its anchors.
        name, source, size, progress, issued, written, values, steps = transfer
        assert (name, source, values, steps) == ("checkpoint", 0, {"step": 9}, 9)  # site 0's folder and counters
        assert written == (["checkpoint"] if rank == 0 else [])  # a received folder is loaded, then removed
        # DiLoCo past warm-up: the anchors and the outer momentum travel, not the parameters and Adam's moments.
        folder_bytes = sum(f.stat().st_size for f in (folder / "checkpoint").iterdir())
        assert 0 < size < 0.6 * folder_bytes and progress[-1] == (size, size), (size, folder_bytes)
        assert size == results[1][3][2]  # what rank 0 sent (to each other site) is what each received
        # First the all-gather that agrees; then, point to point, the size and the state (under 1 MiB: one message)
        # to each other site; DCP's collectives stay inside each site (here one process).
        assert issued[0] == "gloo:all_gather"
        moved = issued.count("gloo:send") if rank == 0 else issued.count("gloo:recv")
        assert moved == (2 * (sites - 1) if rank == 0 else 2), issued
        expected = saved[0]
        if rank:  # the parameters from the anchors; the inner optimizer as built (its moments zero, never stepped)
            expected = expected | {f"param {k[7:]}": v for k, v in saved[0].items() if k.startswith("anchor ")}
            expected |= {k: torch.zeros_like(v) for k, v in saved[0].items() if k.startswith("inner ")}
        assert set(received) == set(expected)
        assert all(torch.equal(received[k], expected[k]) for k in received)


def averager_memory(fabric, options: dict):
    """Per layout, this rank's parameter bytes (its shards when sharded) and the Averager's ``state_bytes``."""
    site, peers = sites_of_two(fabric)
    found = {}
    for layout in ("islands", "sharded"):
        torch.manual_seed(0)
        placement = {"process_group": site} if layout == "islands" else {"shard": site}
        (model,) = setup_models(fabric, m=mlp([3, 8, 8, 3]), **placement)
        averager = Averager(fabric, model, process_group=peers, period=4, **options)
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * 4 for p in model.parameters())
        found[layout] = (local, averager.state_bytes)
    return found


def test_state_bytes_counts_what_the_averager_keeps_beside_the_modules(worlds):
    header = Header.SLOTS * 2 * 4  # fp32 slots for the 2 ranks of a round, at the end of the storage
    for options, extra in [({"outer_optimizer": NESTEROV}, 1), ({"overlap_steps": 1}, 2)]:
        for found in worlds(4).run(averager_memory, options):
            local, held = found["islands"]
            # Islands: the parameters live in the Averager's flat storage (theirs, not counted); DiLoCo keeps an
            # anchor (no momentum before its first outer step), overlap a snapshot and a send buffer.
            assert held == {1: local, 2: 2 * local + header}[extra], (options, found)
            local, held = found["sharded"]
            # Sharded: the same; the copy of the shards that rounds work on exists only inside a round's step.
            assert held == {1: local, 2: 2 * local + header}[extra], (options, found)
