"""checkpoints.py: atomic saves that survive kills, and loads that refuse damaged files in one line."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from lightning_fabric import Fabric
from torch import nn

from fabric_multimodel.checkpoints.files import (
    CheckpointError,
    load_checkpoint,
    load_state,
    read_checkpoint,
    remove_stale_temporaries,
    same_settings,
    save_checkpoint,
)
from fabric_multimodel.run.launch import process_context


def write_forever(path: str, version: int, conn) -> None:
    """Save a ~48 MB checkpoint to ``path`` over and over, each with its own version, telling ``conn``, until killed."""
    fabric = Fabric(accelerator="cpu", devices=1)
    weights = torch.randn(12_000_000)
    while True:
        version += 1
        save_checkpoint(fabric, path, {"weights": weights, "version": version})
        conn.send(version)


def test_a_writer_killed_mid_save_leaves_a_whole_checkpoint_and_no_leak(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    fabric = Fabric(accelerator="cpu", devices=1)
    save_checkpoint(fabric, path, {"weights": torch.zeros(3), "version": 0})
    rng = random.Random(0)
    ctx = process_context()
    versions = [0]
    for attempt in range(3):
        # Its own process (forked from the worlds' server, which imported torch and Lightning already).
        saved, conn = ctx.Pipe(duplex=False)
        writer = ctx.Process(target=write_forever, args=(str(path), 1000 * (attempt + 1), conn), daemon=True)
        writer.start()
        conn.close()
        try:
            assert saved.poll(120), "the writer finished no save"  # one finished: the next one is under way
            time.sleep(rng.uniform(0.0, 0.6))
            writer.kill()  # SIGKILL
            writer.join(timeout=30)
        finally:
            if writer.is_alive():
                writer.kill()
        checkpoint = read_checkpoint(path, expected=["weights", "version"])  # whole: CRCs and keys check out
        assert checkpoint["version"] > versions[-1]
        versions.append(checkpoint["version"])
        leftovers = sorted(p.name for p in tmp_path.iterdir() if p != path)
        assert all(name.startswith(".checkpoint.pt.tmp-") for name in leftovers), leftovers
        removed = remove_stale_temporaries(tmp_path)
        assert sorted(p.name for p in removed) == leftovers
        assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


def damaged_files(folder: Path) -> dict[str, Path]:
    good = folder / "good.pt"
    torch.save({"model": {"weight": torch.ones(64, 64)}, "step": 3}, good)
    data = good.read_bytes()
    files = {name: folder / f"{name}.pt" for name in ("empty", "truncated", "text", "flipped", "nan", "missing")}
    files["empty"].write_bytes(b"")
    files["truncated"].write_bytes(data[: len(data) // 2])
    files["text"].write_text("step=3\n")
    middle = data.index(b"data/0") + 400
    files["flipped"].write_bytes(data[:middle] + bytes([data[middle] ^ 0x01]) + data[middle + 1 :])
    torch.save({"model": {"weight": torch.full((64, 64), float("nan"))}, "step": 3}, files["nan"])
    torch.save({"model": {"weight": torch.ones(64, 64)}}, files["missing"])
    files["good"] = good
    return files


@pytest.mark.parametrize(
    "kind, reason",
    [
        ("empty", "the file is empty"),
        ("truncated", "not a complete PyTorch checkpoint"),
        ("text", "not a complete PyTorch checkpoint"),
        ("flipped", "corrupted (the CRC of"),
        ("nan", "holds NaN or Inf in model.weight"),
        ("missing", "not written by this script (it has no step)"),
    ],
)
def test_damaged_files_are_one_line_errors_naming_the_file(tmp_path: Path, kind: str, reason: str) -> None:
    path = damaged_files(tmp_path)[kind]
    with pytest.raises(CheckpointError) as error:
        read_checkpoint(path, expected=["model", "step"])
    message = str(error.value)
    assert message.startswith(str(path)) and reason in message and "\n" not in message, message


def test_load_refuses_other_shapes_before_changing_anything(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    save_checkpoint(fabric, tmp_path / "ckpt.pt", {"model": nn.Linear(3, 2), "step": 5})
    model = nn.Linear(4, 2)
    before = [p.detach().clone() for p in model.parameters()]
    state = {"model": model, "step": 0}
    with pytest.raises(CheckpointError, match=r"`model` does not match this model \(weight is \(2, 3\) in the file"):
        load_checkpoint(fabric, tmp_path / "ckpt.pt", state)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and state["step"] == 0
    same = nn.Linear(3, 2)
    state = {"model": same, "step": 0}
    assert load_checkpoint(fabric, tmp_path / "ckpt.pt", state) == {}
    assert state["step"] == 5


def test_a_save_leaves_no_temporary_and_replaces_the_old_file(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    path = tmp_path / "deep" / "ckpt.pt"
    for version in (1, 2):
        save_checkpoint(fabric, path, {"version": version})
    assert read_checkpoint(path)["version"] == 2
    assert os.listdir(path.parent) == ["ckpt.pt"]


@given(
    saved=st.dictionaries(st.sampled_from(["lr", "period", "comm_dtype", "seed"]), st.integers(0, 3)),
    now=st.dictionaries(st.sampled_from(["lr", "period", "comm_dtype", "seed"]), st.integers(0, 3)),
)
def test_same_settings_names_every_setting_both_runs_have_that_differs(saved, now) -> None:
    validate = same_settings(now, spell=lambda key: "--" + key.replace("_", "-"))
    differ = [k for k in now if k in saved and saved[k] != now[k]]  # in the order of this run's settings
    if not differ:
        validate({"config": saved})  # settings one side lacks are not compared
        return
    with pytest.raises(CheckpointError) as error:
        validate({"config": saved})
    message = str(error.value)
    assert message.endswith("; resume with the same settings") and "\n" not in message
    assert [k for k in now if f"--{k.replace('_', '-')} {saved.get(k)!r} (now {now[k]!r})" in message] == differ


def test_same_settings_refuses_a_checkpoint_with_none_and_load_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="holds no `config`: not written by this script"):
        same_settings({"lr": 1})({"model": {}})
    path = tmp_path / "checkpoint.pt"
    torch.save({"step": 3, "config": {"lr": 2}}, path)
    with pytest.raises(CheckpointError) as error:
        load_state(path, read_checkpoint(path), {"step": 0}, validate=same_settings({"lr": 1}))
    assert str(error.value) == f"{path}: written with lr 2 (now 1); resume with the same settings"
