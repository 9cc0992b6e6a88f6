"""Lose a node, keep training: two torchrun elastic agents on 127.0.0.1 run the LM example with streaming DiLoCo
(two fragments, each merged two steps after its launch; each replica writes its own checkpoint after a merge).

Agent B's whole process tree is killed once the run has written a round checkpoint; agent A's
workers fail at their next round, A restarts them into a world of one, and they go on from the
newest checkpoint (``--resume auto``). Then B starts again, A's agent restarts its workers into a
world of two, and the run finishes with both. Also: ``resume_latest`` and ``CheckpointWriter`` on
their own.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fabric_multimodel.checkpoints.files import CheckpointWriter, read_checkpoint
from fabric_multimodel.checkpoints.resume import resume_latest
from fabric_multimodel.run.launch import descendants, free_port
from fabric_multimodel.run.report import parse_final_line

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "lm_fabric.py"
KEYS = [
    "steps", "val_loss", "val_bpb", "wall_s", "iter_ms_median", "iter_ms_mean", "comm_bytes", "comm_bytes_per_iter",
    "rounds", "state_bytes",
]  # fmt: skip
STEPS, PERIOD = 2500, 16
TIMEOUT_S = 240
# Heartbeats every second and a 3 s last call: a lost agent is noticed, and a smaller world formed, in seconds.
RDZV_CONF = "join_timeout=60,last_call_timeout=3,close_timeout=5,keep_alive_interval=1"
RESUMED = re.compile(r"--resume auto: step (\d+) from \S+ into (\d+) processes")


def agent(port: int, out: Path, log: Path, host: bool) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test",
        "--rdzv-conf", f"{RDZV_CONF},is_host={int(host)}", "--max-restarts", "3", "--monitor-interval", "0.5",
        str(SCRIPT), "--steps", str(STEPS), "--period", str(PERIOD), "--warmup-steps", "4", "--outer", "nesterov",
        "--fragments", "2", "--overlap-steps", "2",  # streaming: a checkpoint after each merge
        "--d-model", "32", "--layers", "1", "--heads", "2", "--context", "16", "--batch-size", "8",
        "--eval-batches", "1", "--log-every", "250", "--checkpoint-every", "0",
        "--checkpoint-rounds", "--resume", "auto", "--timeout", "30", "--accelerator", "cpu", "--out", str(out),
    ]  # fmt: skip
    # Without sharing the rendezvous store, an agent that joins a later round learns the workers' address.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LT_", "TORCHELASTIC_"))}
    # One OpenMP thread: torchrun sets it only with several processes per node, and both nodes share 2 cores.
    env.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    handle = log.open("w")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)


def kill_tree(proc: subprocess.Popen) -> None:
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def wait_for(condition, deadline: float, what: str) -> None:
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.mark.slow
def test_a_lost_node_costs_at_most_a_period_and_the_world_grows_back(tmp_path):
    port, out = free_port(), tmp_path / "run"
    logs = {name: tmp_path / f"{name}.log" for name in ("a", "b", "b-again")}
    deadline = time.monotonic() + TIMEOUT_S
    a = agent(port, out, logs["a"], host=True)
    b = agent(port, out, logs["b"], host=False)
    agents = [a, b]
    try:
        checkpoint = out / "checkpoint.pt"
        wait_for(lambda: checkpoint.is_file(), deadline, "the first round checkpoint")
        time.sleep(1.0)  # a few rounds more
        lost_at = int(torch.load(checkpoint, weights_only=True)["step"])
        kill_tree(b)  # the whole node: its agent and its worker
        text = lambda: logs["a"].read_text()  # noqa: E731
        wait_for(lambda: len(RESUMED.findall(text())) >= 1, deadline, "A's workers to resume alone")
        step, world = map(int, RESUMED.findall(text())[0])
        assert world == 1 and step >= lost_at and (step - 4) % (PERIOD // 2) == 2  # a merged round's checkpoint
        b = agent(port, out, logs["b-again"], host=False)
        agents.append(b)
        wait_for(lambda: a.poll() is not None, deadline, "the run to finish")
        assert a.returncode == 0, text()[-3000:]
        b.wait(timeout=max(1, deadline - time.monotonic()))
        assert b.returncode == 0, logs["b-again"].read_text()[-3000:]
    finally:
        for proc in agents:
            kill_tree(proc)
    resumes = [(int(s), int(w)) for s, w in RESUMED.findall(text())]
    assert [w for _, w in resumes][:2] == [1, 2], resumes  # alone after the loss, both again after the rejoin
    final = parse_final_line(text(), KEYS)
    assert int(final["steps"]) == STEPS
    saved = read_checkpoint(checkpoint, expected=["model", "averager", "step"])
    assert saved["step"] == STEPS and saved["world_size"] == 2
    leftover = [pid for proc in agents for pid in descendants(proc.pid)]
    assert not leftover


# --- the pieces on their own -------------------------------------------------------------------------


def newest_checkpoint_reaches_every_rank(fabric, folder):
    path = Path(folder) / f"rank{fabric.global_rank}.pt"
    steps = {0: 8, 1: 12}  # rank 1's copy is newer: it travels to rank 0
    writer = CheckpointWriter(path)
    writer.save({"step": steps[fabric.global_rank], "weights": torch.full((3,), float(fabric.global_rank))})
    writer.close()
    state = {"step": 0, "weights": None}
    resumed = resume_latest(fabric, path, state)  # each rank reads its own copy
    fresh = resume_latest(fabric, Path(folder) / "none.pt", {"step": 0})
    return resumed, state["step"], state["weights"].tolist(), fresh, len(writer.seconds)


def test_resume_latest_brings_the_newest_checkpoint_to_every_rank(worlds, tmp_path):
    for resumed, loaded, weights, fresh, writes in worlds(2).run(newest_checkpoint_reaches_every_rank, str(tmp_path)):
        assert (resumed.step, resumed.source, resumed.broadcast) == (12, 1, True)
        assert list(resumed.seconds) == ["read", "agree", "transfer", "load"]
        assert resumed.kept == () and resumed.bytes > 0  # no Averager: the whole newest copy travels
        assert loaded == 12 and weights == [1.0, 1.0, 1.0]
        assert fresh is None and writes == 1


def test_a_background_write_is_whole_and_never_sees_later_changes(tmp_path):
    weights = torch.zeros(1000)
    writer = CheckpointWriter(tmp_path / "c.pt")
    writer.save({"weights": weights, "step": 1})
    weights.add_(1)  # after save() returned: must not reach the file
    writer.save({"weights": weights, "step": 2})  # waits for the first write
    writer.close()
    saved = read_checkpoint(tmp_path / "c.pt", expected=["weights", "step"])
    assert saved["step"] == 2 and torch.equal(saved["weights"], torch.ones(1000))
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temporary left behind
    disabled = CheckpointWriter(tmp_path / "d.pt", enabled=False)
    disabled.save({"step": 1})
    disabled.close()
    assert not (tmp_path / "d.pt").exists()


def test_a_failed_background_write_is_reported_on_the_training_thread(tmp_path):
    (tmp_path / "file").write_text("x")
    writer = CheckpointWriter(tmp_path / "file" / "c.pt")  # a folder that cannot be made
    writer.save({"step": 1})
    with pytest.raises(Exception, match="the background write failed"):
        writer.close()
