"""End to end: the real `fabric run` / `python` commands on examples/gan_fabric.py, with short schedules.

Each distributed run starts real processes (about 10-20 s on 2 cores), so runs are module-scoped
fixtures and several tests read the same run.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from fabric_multimodel.rounds.header import Header
from fabric_multimodel.run.launch import free_port, stop_process_tree

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "examples/gan_fabric.py"
FABRIC = Path(sys.executable).parent / "fabric"
TIMEOUT_S = 240
FINAL = re.compile(
    r"^final: steps=(?P<steps>\d+) modes_captured=(?P<modes>\d+)/8 high_quality=(?P<hq>\d\.\d{3})"
    r" wall_s=(?P<wall>\d+\.\d) iter_ms_median=(?P<iter_ms>\d+\.\d{2})"
    r" iter_ms_mean=(?P<iter_ms_mean>\d+\.\d{2}) comm_bytes=(?P<comm>\d+)"
    r" comm_bytes_per_iter=(?P<per_iter>\d+\.\d) rounds=(?P<rounds>\d+) state_bytes=(?P<state_bytes>\d+)$"
)
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
HAS_SKLEARN = importlib.util.find_spec("sklearn") is not None
PLOT_HINT = "pip install 'fabric-multimodel[plot]'"


def load_script(path: str):
    """An example script as a module (its folder on the path, as when it runs as a script)."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "examples"))


@pytest.fixture(scope="module")
def example():
    """examples/gan_fabric.py as a module."""
    return load_script(SCRIPT)


class Run(NamedTuple):
    out: Path
    stdout: str
    stderr: str
    final: dict[str, float]


def run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LT_")}  # as if typed in a fresh shell
    return subprocess.run(
        cmd, cwd=ROOT, env={**clean, **(env or {})}, capture_output=True, text=True, timeout=TIMEOUT_S
    )


def start(out: Path, *flags: str, devices: int = 4, launcher: str = "fabric") -> tuple[Path, subprocess.Popen]:
    """Start the example by `fabric run` (or as a script that starts its own processes), writing to ``out``."""
    if launcher == "fabric":
        cmd = [str(FABRIC), "run", "--accelerator", "cpu", "--devices", str(devices), "--main-port", str(free_port())]
        cmd += [SCRIPT]
    else:  # the script starts its own processes (or runs as one)
        cmd = [sys.executable, SCRIPT] + (["--devices", str(devices), "--accelerator", "cpu"] if devices > 1 else [])
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LT_")}  # as if typed in a fresh shell
    cmd += ["--out", str(out), *flags]
    return out, subprocess.Popen(cmd, cwd=ROOT, env=clean, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(started: tuple[Path, subprocess.Popen]) -> Run:
    """Wait for a started run (ending its processes if it takes too long) and read its final line."""
    out, proc = started
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except BaseException:
        stop_process_tree(proc)
        raise
    assert proc.returncode == 0, f"{proc.args} failed:\n{stdout[-3000:]}\n{stderr[-5000:]}"
    return Run(out, stdout, stderr, final_of(stdout))


def train(out: Path, *flags: str, devices: int = 4, launcher: str = "fabric") -> Run:
    return finish(start(out, *flags, devices=devices, launcher=launcher))


def final_of(stdout: str) -> dict[str, float]:
    """The figures of the run's one ``final:`` line (rank 0's), which must be its last line."""
    lines = stdout.strip().splitlines()
    assert sum(line.startswith("final:") for line in lines) == 1, stdout  # rank 0 only
    match = FINAL.match(lines[-1])  # the benchmarks parse the last line
    assert match, f"last line is not the final line: {lines[-1]!r}"
    return {k: float(v) for k, v in match.groupdict().items()}


def model_bytes(checkpoint: dict) -> int:
    """Bytes of the generator's and discriminator's parameters (what one synchronous iteration allreduces)."""
    return sum(t.numel() * t.element_size() for name in ("gen", "disc") for t in checkpoint[name].values())


def round_bytes(params: int, world: int) -> int:
    """Bytes a rank sends in one of the example's rounds: parameters, Adam's two moments, and the
    round's header (each rank's step count, in fp32 slots)."""
    return 3 * params + 4 * Header.SLOTS * world


def expected_rounds(start: int, end: int, warmup: int, period: int) -> int:
    """Averaging rounds in steps start+1..end: every `period` steps after warm-up, plus one on leaving
    the block when local steps happened since the last round."""
    scheduled = [s for s in range(start + 1, end + 1) if s > warmup and (s - warmup) % period == 0]
    last_synced = scheduled[-1] if scheduled else max(start, warmup)
    return len(scheduled) + (end > last_synced)


def metrics_rows(out: Path) -> list[dict[str, str]]:
    files = sorted(out.glob("logs/version_*/metrics.csv"))
    assert len(files) == 1, files
    with files[0].open() as f:
        return list(csv.DictReader(f))


LOCAL_SGD = ["--period", "4", "--warmup-steps", "10", "--checkpoint-every", "0"]  # a periodic checkpoint adds a round
LOCAL_WORLD = 2
SHARDED = ["--period", "4", "--warmup-steps", "4", "--checkpoint-every", "0", "--shard", "node", "--checkpoint-rounds"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The example's runs, at once (every process costs seconds of imports on 2 cores, mostly on one): by `fabric
    run`, a synchronous run of 30 steps in 4 processes (the README's command), a local-SGD run of 40 steps in 2 and
    its resume to 80, and the sharded run and its resume (``sharded_runs``); 10 steps in 2 processes by torchrun;
    20 steps in 2 processes the script starts itself."""
    sync = start(tmp_path_factory.mktemp("sync"), "--steps", "30", "--log-every", "10")
    try:
        with ThreadPoolExecutor(3) as pool:
            sharded = pool.submit(sharded_pair, tmp_path_factory.mktemp("sharded"))
            torchrun = pool.submit(torchrun_run, tmp_path_factory.mktemp("torchrun"))
            own = tmp_path_factory.mktemp("python")
            python = pool.submit(train, own, "--steps", "20", devices=2, launcher="python")
            local = train(tmp_path_factory.mktemp("period"), "--steps", "40", *LOCAL_SGD, devices=LOCAL_WORLD)
            resume = ["--steps", "80", *LOCAL_SGD, "--resume", str(local.out / "checkpoint.pt")]
            resumed = train(tmp_path_factory.mktemp("resumed"), *resume, devices=LOCAL_WORLD)
            later = {"sharded": sharded.result(), "torchrun": torchrun.result(), "python": python.result()}
            return {"sync": finish(sync), "local": local, "resumed": resumed, **later}
    finally:
        if sync[1].poll() is None:  # something above failed
            stop_process_tree(sync[1])


@pytest.fixture(scope="module")
def sync_run(runs: dict[str, Any]) -> Run:
    return runs["sync"]


@pytest.fixture(scope="module")
def local_sgd_run(runs: dict[str, Any]) -> Run:
    return runs["local"]


@pytest.mark.slow
def test_fabric_run_synchronous(sync_run: Run) -> None:
    final = sync_run.final
    assert final["steps"] == 30
    assert 0 <= final["modes"] <= 8
    assert 0.0 <= final["hq"] <= 1.0
    assert final["rounds"] == 0
    assert final["iter_ms"] > 0 and final["iter_ms_mean"] > 0 and final["wall"] > 0
    # frozen(disc) in the G step: each model's gradients are allreduced exactly once per iteration.
    checkpoint = torch.load(sync_run.out / "checkpoint.pt", weights_only=True)
    assert final["comm"] == 30 * model_bytes(checkpoint) > 0
    assert final["per_iter"] == pytest.approx(final["comm"] / 30, abs=0.05)
    # Parameters, Adam's two moments and its step counters (fp32), and the gradients of the larger model: the
    # state peaks after D's step (D's gradients) or G's (G's); the other's were freed by zero_grad.
    sizes = [sum(t.numel() * t.element_size() for t in checkpoint[name].values()) for name in ("gen", "disc")]
    counters = 4 * sum(len(checkpoint[name]) for name in ("gen", "disc"))  # the ring GAN has no buffers
    assert final["state_bytes"] == 3 * sum(sizes) + max(sizes) + counters


@pytest.mark.slow
def test_fabric_run_writes_checkpoint_metrics_and_picture(sync_run: Run) -> None:
    checkpoint = torch.load(sync_run.out / "checkpoint.pt", weights_only=True)
    assert set(checkpoint) == {"gen", "disc", "opt_g", "opt_d", "step", "grad_bytes", "config", "world_size"}
    assert checkpoint["world_size"] == 4
    assert checkpoint["config"]["period"] == 0 and checkpoint["config"]["dataset"] == "ring"
    assert checkpoint["step"] == 30
    assert checkpoint["grad_bytes"] == sync_run.final["comm"]

    rows = metrics_rows(sync_run.out)
    assert [int(row["step"]) for row in rows] == [10, 20, 30]
    for row in rows:
        assert set(row) >= {"d_loss", "g_loss", "modes_captured", "high_quality"}
        assert float(row["d_loss"]) > 0 and float(row["g_loss"]) > 0
        assert 0 <= int(row["modes_captured"]) <= 8 and 0 <= float(row["high_quality"]) <= 1

    picture = sync_run.out / "samples.png"
    if HAS_MATPLOTLIB:
        assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not picture.exists()
        assert PLOT_HINT in sync_run.stdout


@pytest.mark.slow
def test_fabric_run_local_sgd_communicates_less(local_sgd_run: Run, sync_run: Run) -> None:
    final = local_sgd_run.final
    assert final["steps"] == 40
    # 30 local steps: a round every 4, and one more when leaving the block for the last 2 steps.
    assert final["rounds"] == expected_rounds(0, 40, warmup=10, period=4) == 8
    checkpoint = torch.load(local_sgd_run.out / "checkpoint.pt", weights_only=True)
    assert checkpoint["averager"]["steps"] == 40 and checkpoint["averager"]["rounds"] == final["rounds"]
    params = model_bytes(checkpoint)
    # Warm-up: gradients every step. A round: parameters plus Adam's two moments, plus the header.
    assert final["comm"] == 10 * params + final["rounds"] * round_bytes(params, world=LOCAL_WORLD)
    assert final["per_iter"] < sync_run.final["per_iter"]


@pytest.mark.slow
def test_resume_continues_to_the_total_steps(local_sgd_run: Run, runs: dict[str, Any]) -> None:
    resumed = runs["resumed"]
    final = resumed.final
    assert final["steps"] == 80
    assert 0 <= final["modes"] <= 8
    # The schedule and the byte counts continue where the first run stopped: 40 more local steps,
    # rounds when (step - warmup) % period == 0 (42, 46, ..., 78) and one more on leaving.
    more = expected_rounds(40, 80, warmup=10, period=4)
    assert more == 11
    assert final["rounds"] == local_sgd_run.final["rounds"] + more
    params = model_bytes(torch.load(resumed.out / "checkpoint.pt", weights_only=True))
    assert final["comm"] == local_sgd_run.final["comm"] + more * round_bytes(params, world=LOCAL_WORLD)
    assert torch.load(resumed.out / "checkpoint.pt", weights_only=True)["step"] == 80


def sharded_pair(out: Path) -> tuple[Run, Run]:
    """--shard node in one node of 2 processes (FSDP2 over both, rounds across the one node): 12 steps, then
    --resume FOLDER (the checkpoint folder given) to 16. (--resume auto with FSDP2 sites: test_sites.)"""
    first = train(out, "--steps", "12", *SHARDED, devices=2)
    return first, train(out, "--steps", "16", *SHARDED, "--resume", str(out / "checkpoint"), devices=2)


@pytest.fixture(scope="module")
def sharded_runs(runs: dict[str, Any]) -> tuple[Run, Run]:
    return runs["sharded"]


@pytest.mark.slow
def test_both_models_shard_with_fsdp2_and_resume_from_their_folder(sharded_runs: tuple[Run, Run]) -> None:
    first, resumed = sharded_runs
    assert "layout=islands (FSDP2 inside each node, rounds of its shards across nodes)" in first.stdout
    assert first.final["steps"] == 12 and first.final["rounds"] == expected_rounds(0, 12, warmup=4, period=4) == 2
    assert 0 <= first.final["modes"] <= 8 and first.final["state_bytes"] > 0
    # A round checkpoint after each round (steps 8 and 12), written by both processes into the node's folder.
    assert "checkpoints after rounds: 2 sharded saves, training thread " in first.stdout
    assert f"run folder: {first.out} (checkpoint/ (a folder per site), logs/, " in first.stdout
    assert (first.out / "checkpoint" / ".metadata").is_file() and not (first.out / "checkpoint.pt").exists()
    assert resumed.final["steps"] == 16 and resumed.final["rounds"] == 2 + expected_rounds(12, 16, 4, 4) == 3


@pytest.mark.slow
def test_script_launches_its_own_processes(runs: dict[str, Any]) -> None:
    result = runs["python"]
    assert result.final["steps"] == 20
    assert result.final["comm"] > 0


def train_here(example, capsys, *argv: str) -> tuple[int, str, str]:
    """The script's ``train`` as one process, in this one (no interpreter to start): (exit code, stdout, stderr)."""
    try:
        code = example.train(example.parse_args(list(argv))) or 0
    except SystemExit as exit:
        code = exit.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_single_process_communicates_nothing(tmp_path: Path, example, capsys) -> None:
    flags = ["--steps", "20", "--period", "4", "--warmup-steps", "5", "--checkpoint-every", "0"]
    code, stdout, stderr = train_here(example, capsys, "--out", str(tmp_path), *flags)
    assert code == 0, stderr
    final = final_of(stdout)
    assert final["steps"] == 20
    assert final["comm"] == 0
    assert final["rounds"] == expected_rounds(0, 20, warmup=5, period=4)
    assert (tmp_path / "checkpoint.pt").is_file()


@pytest.mark.parametrize(
    "flags, mentions",
    [
        (["--period", "-1"], "--period"),
        (["--steps", "0"], "--steps"),
        (["--warmup-steps", "-1"], "--warmup-steps"),
        (["--lr", "nan"], "--lr"),
        (["--timeout", "0"], "--timeout"),
        (["--overlap-steps", "2"], "need --period"),
        (["--period", "4", "--overlap-steps", "4"], "smaller than --period"),
        (["--resume", "no/such/checkpoint.pt"], "no/such/checkpoint.pt"),
        (["--shard", "node", "--period", "4"], "start several (--devices N), this run has one"),
        (["--shard", "node", "--period", "4", "--devices", "2", "--resume", "x.pt"], "--resume x.pt: no such folder"),
        (["--steps", "many"], "'many'"),  # argparse's own errors are one line too
        (["--coordinator", "h:1", "--site", "a", "--period", "4", "--layout", "islands", "--devices", "2"], "--layout"),
        (["--coordinator", "h:1", "--site", "a", "--period", "4", "--node-period", "2", "--devices", "2"], "--node"),
        (["--coordinator", "h:1", "--site", "a#b", "--period", "4"], "--site NAME"),
        (["--coordinator", "h:1", "--site", "a"], "--coordinator needs --period"),
    ],
)
def test_bad_flags_exit_with_one_line(flags: list[str], mentions: str, tmp_path: Path, example, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:  # in this process: the script's own parse_args
        example.parse_args(["--out", str(tmp_path), *flags])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and mentions in lines[0], lines
    assert not (tmp_path / "checkpoint.pt").exists()


@pytest.mark.slow
def test_a_bad_flag_stops_the_real_script_with_one_line(tmp_path: Path) -> None:
    proc = run([sys.executable, SCRIPT, "--out", str(tmp_path), "--period", "-1"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == ["gan_fabric.py: error: --period must be >= 0, got -1"]


@pytest.mark.slow
def test_devices_belong_to_fabric_run_under_the_cli(tmp_path: Path) -> None:
    # `fabric run` marks its processes with LT_CLI_USED=1; the flag must then go to `fabric run`.
    proc = run([sys.executable, SCRIPT, "--out", str(tmp_path), "--devices", "2"], env={"LT_CLI_USED": "1"})
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "fabric run" in proc.stderr


def fabric_run(*args: str) -> subprocess.CompletedProcess:
    return run([str(FABRIC), "run", "--accelerator", "cpu", "--main-port", str(free_port()), *args])


@pytest.mark.slow
def test_fabric_run_takes_its_flags_anywhere_and_a_failure_ends_on_the_one_line(tmp_path: Path) -> None:
    # What the README says: `fabric run` reads --devices wherever it stands, also after the script path (a); after
    # `--` the flag reaches the script, which refuses it (b). Both at once: each mostly imports, on one core.
    with ThreadPoolExecutor(2) as pool:
        anywhere = pool.submit(
            fabric_run, "--devices", "1", SCRIPT, "--devices", "2", "--steps", "3", "--out", str(tmp_path / "a")
        )
        refused = pool.submit(
            fabric_run, "--devices", "1", SCRIPT, "--", "--devices", "2", "--out", str(tmp_path / "b")
        )
        proc = anywhere.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "comm: ddp_bytes=0 " not in proc.stdout  # two processes, communicating
    # The last line of the screen says why the script refused it.
    proc = refused.result()
    assert proc.returncode != 0
    last = [line for line in proc.stderr.strip().splitlines() if line.strip("= ")][-1]
    assert last.strip() == (
        "traceback : gan_fabric.py: error: --devices: fabric run started the processes; give --devices to fabric"
        " run instead"
    ), proc.stderr[-2000:]


def torchrun_run(out: Path) -> tuple[subprocess.CompletedProcess, Path]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    return run([*cmd, SCRIPT, "--steps", "10", "--out", str(out)]), out


@pytest.mark.slow
def test_torchrun_processes_form_one_world(runs: dict[str, Any], example, capsys) -> None:
    proc, out = runs["torchrun"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert sum(line.startswith("final:") for line in lines) == 1, proc.stdout  # one world, rank 0 reports
    params = model_bytes(torch.load(out / "checkpoint.pt", weights_only=True))
    assert float(FINAL.match(lines[-1])["comm"]) == 10 * params  # each step's gradients crossed the world
    # A second run into the same folder is refused as its flags are read (every rank, before any collective): it
    # would write over the first run's checkpoint.
    with pytest.raises(SystemExit) as exit_info:
        example.parse_args(["--steps", "10", "--out", str(out)])
    assert exit_info.value.code == 2
    assert f"{out} holds an earlier run's checkpoint.pt; continue it with --resume" in capsys.readouterr().err
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == 10


@pytest.mark.slow
def test_resuming_says_when_nothing_is_left_and_when_the_world_changed(
    sync_run: Run, tmp_path: Path, example, capsys
) -> None:
    checkpoint = str(sync_run.out / "checkpoint.pt")
    code, stdout, stderr = train_here(example, capsys, "--steps", "30", "--log-every", "10", "--resume", checkpoint)
    assert code == 0 and "is at step 30 already: nothing to train" in stdout, stderr
    assert "final:" not in stdout
    flags = ["--steps", "33", "--log-every", "10", "--resume", checkpoint, "--out", str(tmp_path)]
    code, stdout, stderr = train_here(example, capsys, *flags)
    assert code == 0, stderr
    assert "was written by 4 processes and resumes into 1" in stdout


def resume_refused(example, capsys, checkpoint: Path, steps: int, out: Path, *flags: str) -> str:
    """Resume ``checkpoint`` with ``--period 4`` up to ``steps``; it must fail with one clean line, writing nothing."""
    argv = ["--out", str(out), "--steps", str(steps), "--period", "4", *flags, "--resume", str(checkpoint)]
    code, _, stderr = train_here(example, capsys, *argv)
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert not (out / "checkpoint.pt").exists()
    return stderr.strip()


@pytest.mark.slow
def test_resume_beyond_steps_is_refused(local_sgd_run: Run, tmp_path: Path, example, capsys) -> None:
    line = resume_refused(example, capsys, local_sgd_run.out / "checkpoint.pt", 20, tmp_path, "--warmup-steps", "10")
    assert "beyond --steps 20" in line, line


@pytest.mark.slow
def test_resume_with_other_flags_is_refused(sync_run: Run, tmp_path: Path, example, capsys) -> None:
    # A synchronous run's checkpoint has no averager state to resume --period from; 4 processes wrote it.
    line = resume_refused(example, capsys, sync_run.out / "checkpoint.pt", 40, tmp_path)
    assert line.endswith("checkpoint.pt: written with --period 0 (now 4); resume with the same settings"), line


def damaged(checkpoint: Path, folder: Path) -> dict[str, Path]:
    """Copies of a good checkpoint, each broken in one way a real file breaks."""
    data = checkpoint.read_bytes()
    files = {name: folder / f"{name}.pt" for name in ("truncated", "empty", "foreign", "flipped", "nan", "text")}
    files["truncated"].write_bytes(data[: len(data) // 2])
    files["empty"].write_bytes(b"")
    torch.save({"weights": torch.zeros(3)}, files["foreign"])
    middle = data.index(b"data/0") + 200  # inside the first tensor's bytes
    files["flipped"].write_bytes(data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :])
    poisoned = torch.load(checkpoint, weights_only=True)
    next(iter(poisoned["gen"].values())).view(-1)[0] = float("nan")
    torch.save(poisoned, files["nan"])
    files["text"].write_text("not a checkpoint\n")
    return files


@pytest.mark.parametrize(
    "kind, reason",
    [
        ("truncated", "not a complete PyTorch checkpoint"),
        ("empty", "the file is empty"),
        ("foreign", "not written by this script"),
        ("flipped", "corrupted (the CRC of"),
        ("nan", "holds NaN or Inf in gen."),
        ("text", "not a complete PyTorch checkpoint"),
    ],
)
def test_bad_resume_files_fail_with_one_line_naming_the_file(
    sync_run: Run, tmp_path: Path, kind, reason, example, capsys
) -> None:
    path = damaged(sync_run.out / "checkpoint.pt", tmp_path)[kind]
    args = example.parse_args(["--out", str(tmp_path / "out"), "--steps", "40", "--resume", str(path)])
    with pytest.raises(SystemExit) as exit_info:  # one process, in this one: the same checks as 4 processes
        example.train(args)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and reason in lines[0], lines
    assert not (tmp_path / "out" / "checkpoint.pt").exists()


def test_default_run_folders_are_per_dataset_mode_and_seed(tmp_path: Path, example, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # one process, in this one: the folders are relative to where it runs
    for flags, folder in [
        ([], "ring-sync-seed0"),
        (["--period", "2", "--warmup-steps", "2", "--seed", "3"], "ring-period2-warmup2-seed3"),
    ]:
        example.train(example.parse_args(["--steps", "6", *flags]))
        assert (tmp_path / "runs" / "gan" / folder / "checkpoint.pt").is_file()
        assert f"run folder: runs/gan/{folder}" in capsys.readouterr().out
    # --resume without --out continues in the checkpoint's folder.
    example.train(example.parse_args(["--steps", "9", "--resume", "runs/gan/ring-sync-seed0/checkpoint.pt"]))
    assert torch.load(tmp_path / "runs/gan/ring-sync-seed0/checkpoint.pt", weights_only=True)["step"] == 9


@pytest.mark.slow
def test_sigterm_writes_a_checkpoint_and_stops(tmp_path: Path) -> None:
    cmd = [sys.executable, SCRIPT, "--out", str(tmp_path), "--steps", "100000", "--log-every", "20"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LT_")}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env={**clean, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        first = proc.stdout.readline()  # the first progress line: training is under way
        assert first.startswith("step 20/100000"), first
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, stderr
    stopped = stdout.strip().splitlines()[-1]
    assert stopped.startswith("stopped by SIGTERM at step ") and "--resume" in stopped, stdout
    step = int(stopped.split("at step ")[1].split(";")[0])
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == step
    assert not list(tmp_path.glob(".checkpoint.pt.tmp-*"))


def test_digits(tmp_path: Path, example, capsys) -> None:
    if not HAS_SKLEARN:  # the optional extra is missing: the script says how to get it
        code, _, stderr = train_here(example, capsys, "--out", str(tmp_path), "--dataset", "digits")
        assert code != 0 and stderr.strip().splitlines() == [stderr.strip()]
        assert "pip install 'fabric-multimodel[digits]'" in stderr
        return
    code, stdout, stderr = train_here(example, capsys, "--out", str(tmp_path), "--dataset", "digits", "--steps", "10")
    assert code == 0, stderr
    last = stdout.strip().splitlines()[-1]
    assert re.match(
        r"^final: steps=10 dataset=digits wall_s=\S+ iter_ms_median=\S+ iter_ms_mean=\S+"
        r" comm_bytes=0 comm_bytes_per_iter=0.0 rounds=0 state_bytes=\d+$",
        last,
    ), last
    assert (tmp_path / "digits.png").is_file() == HAS_MATPLOTLIB


@pytest.mark.slow
def test_a_default_length_run_captures_every_mode_with_high_quality(tmp_path: Path, example, capsys) -> None:
    # The recipe's quality at the default length (the sweep reports 4 processes: 8/8 modes and at least 0.90
    # high quality on 5 seeds), checked here in one process: 39 s on a loaded 2-core machine, against 108 s
    # for the 4-process run alone.
    code, stdout, stderr = train_here(example, capsys, "--out", str(tmp_path), "--checkpoint-every", "0")
    assert code == 0, stderr
    final = final_of(stdout)
    assert final["steps"] == 3000
    assert final["modes"] == 8 and final["hq"] >= 0.85, final


@pytest.mark.parametrize("script", [SCRIPT, "examples/lm_fabric.py"])
def test_help_states_every_default_in_plain_text(script: str, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps to the terminal, as in a plain shell
    with pytest.raises(SystemExit) as exit_info:  # in this process: the script's own parser
        load_script(script).parse_args(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    options = text.split("options:", 1)[1]
    blocks = re.split(r"\n(?=  -)", options)  # one block per option, its help text included
    for block in filter(str.strip, blocks):
        name = block.split()[0]
        if name in ("-h,", "--resume", "--help"):  # nothing to default to
            continue
        assert "(default" in block, block
    assert "``" not in text and ":class:" not in text
