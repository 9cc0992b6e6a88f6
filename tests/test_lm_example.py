"""examples/lm_fabric.py: end to end under `fabric run --accelerator cpu --devices 2` with short schedules,
and its held-out split, data stream and flag checks in this process.

Each distributed run costs half a minute or more on 2 busy cores (mostly imports), so there are three,
in one module-scoped fixture that every end-to-end test reads: synchronous DDP, local SGD, and its resume.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import importlib.util
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from subprocess import PIPE
from types import ModuleType
from typing import NamedTuple

import pytest
import torch

from fabric_multimodel.rounds.header import Header
from fabric_multimodel.run import cli
from fabric_multimodel.run.launch import free_port, stop_process_tree
from fabric_multimodel.run.report import parse_final_line

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "examples/lm_fabric.py"
FABRIC = Path(sys.executable).parent / "fabric"
TIMEOUT_S = 240
KEYS = [
    "steps", "val_loss", "val_bpb", "wall_s", "iter_ms_median", "iter_ms_mean", "comm_bytes", "comm_bytes_per_iter",
    "rounds", "state_bytes",
]  # fmt: skip
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
BATCH = 4  # sequences per rank and step in the runs here: small, the schedule is what is tested
QUICK = ["--batch-size", str(BATCH), "--eval-batches", "2", "--checkpoint-every", "0"]
LOCAL = ["--period", "5", "--warmup-steps", "4"]


class Run(NamedTuple):
    out: Path
    stdout: str
    final: dict[str, float]


@pytest.fixture(scope="module")
def lm() -> ModuleType:
    """The example as a module (its folder on the path, as when it runs as a script)."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        return importlib.import_module("lm_fabric")
    finally:
        sys.path.remove(str(ROOT / "examples"))


class Launched(NamedTuple):
    out: Path
    proc: subprocess.Popen


def launch(out: Path, *flags: str, launcher: str = "fabric") -> Launched:
    """Start 2 processes of the example with ``flags``, writing to ``out``, by `fabric run` or torchrun."""
    if launcher == "fabric":
        cmd = [str(FABRIC), "run", "--accelerator", "cpu", "--devices", "2", "--main-port", str(free_port()), SCRIPT]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port"]
        cmd += [str(free_port()), SCRIPT, "--accelerator", "cpu"]
    cmd += ["--out", str(out), *QUICK, *flags]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LT_")}  # as if typed in a fresh shell
    return Launched(out, subprocess.Popen(cmd, cwd=ROOT, env=clean, stdout=PIPE, stderr=PIPE, text=True))


def finish(launched: Launched) -> Run:
    """Wait for a launched run (ending its processes if it takes too long) and read its final line."""
    try:
        stdout, stderr = launched.proc.communicate(timeout=TIMEOUT_S)
    except BaseException:
        stop_process_tree(launched.proc)
        raise
    assert launched.proc.returncode == 0, f"{launched.proc.args} failed:\n{stdout[-3000:]}\n{stderr[-5000:]}"
    assert stdout.strip().splitlines()[-1].startswith("final: "), stdout[-2000:]
    assert stdout.count("\nfinal: ") + stdout.startswith("final: ") == 1  # rank 0 only
    final = {k: float(v) for k, v in parse_final_line(stdout, KEYS).items()}
    return Run(launched.out, stdout, final)


def comm_parts(run: Run) -> dict[str, int]:
    """The ``comm: ddp_bytes=... round_bytes=... node_round_bytes=...`` line: the bytes by kind."""
    (line,) = [line for line in run.stdout.splitlines() if line.startswith("comm: ")]
    return {key: int(value) for key, value in (token.split("=") for token in line.split()[1:])}


def checkpoint(run: Run) -> dict:
    return torch.load(run.out / "checkpoint.pt", weights_only=True)


def param_bytes(saved: dict) -> int:
    """Bytes of the model's parameters: the tied embedding and output weight, one tensor, count once."""
    unique = {t.data_ptr(): t for t in saved["model"].values()}
    return sum(t.numel() * t.element_size() for t in unique.values())


def round_bytes(params: int, world: int) -> int:
    """What a rank sends in one round: parameters, AdamW's two moments, each rank's step count (fp32 slots)."""
    return 3 * params + 4 * Header.SLOTS * world


def expected_rounds(start: int, end: int, warmup: int, period: int) -> int:
    """Rounds in steps start+1..end: every `period` steps after warm-up, one more on leaving after local steps."""
    scheduled = [s for s in range(start + 1, end + 1) if s > warmup and (s - warmup) % period == 0]
    last_synced = scheduled[-1] if scheduled else max(start, warmup)
    return len(scheduled) + (end > last_synced)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """A synchronous run, and meanwhile a local-SGD run and its resume: the runs mostly import and
    start up, so on a busy machine two at a time take little longer than one."""
    # torchrun, PyTorch's own launcher: its processes form one world (the bytes per step below say so).
    sync = launch(tmp_path_factory.mktemp("sync"), "--steps", "9", "--log-every", "3", launcher="torchrun")
    try:
        local = finish(launch(tmp_path_factory.mktemp("local"), "--steps", "12", "--log-every", "4", *LOCAL))
        resume = ["--steps", "20", "--log-every", "4", *LOCAL, "--resume", str(local.out / "checkpoint.pt")]
        resumed = finish(launch(tmp_path_factory.mktemp("resumed"), *resume))
        return {"sync": finish(sync), "local": local, "resumed": resumed}
    finally:
        if sync.proc.poll() is None:  # something above failed
            stop_process_tree(sync.proc)


@pytest.fixture(scope="module")
def sync_run(runs: dict[str, Run]) -> Run:
    return runs["sync"]


@pytest.fixture(scope="module")
def local_run(runs: dict[str, Run]) -> Run:
    return runs["local"]


@pytest.fixture(scope="module")
def resumed_run(runs: dict[str, Run]) -> Run:
    return runs["resumed"]


@pytest.mark.slow
def test_synchronous_run_sends_the_parameter_bytes_every_step(sync_run: Run) -> None:
    final, saved = sync_run.final, checkpoint(sync_run)
    assert final["steps"] == 9 and final["rounds"] == 0
    assert 0 < final["val_loss"] < math.log(256) + 0.5  # about uniform over bytes at worst, after 9 steps
    assert final["val_bpb"] == pytest.approx(final["val_loss"] / math.log(2), abs=2e-4)
    assert final["wall_s"] > 0 and final["iter_ms_median"] > 0 and final["iter_ms_mean"] > 0
    assert final["comm_bytes_per_iter"] == param_bytes(saved) > 0
    assert final["comm_bytes"] == 9 * param_bytes(saved)
    assert comm_parts(sync_run) == {"ddp_bytes": 9 * param_bytes(saved), "round_bytes": 0, "node_round_bytes": 0}


@pytest.mark.slow
def test_run_writes_checkpoint_metrics_plot_and_a_sample(sync_run: Run, lm: ModuleType) -> None:
    saved = checkpoint(sync_run)
    assert set(saved) == {
        "model",
        "optimizer",
        "step",
        "data_position",
        "grad_bytes",
        "history",
        "config",
        "world_size",
    }
    assert saved["step"] == 9 and saved["data_position"] == 9 * BATCH
    assert saved["grad_bytes"] == sync_run.final["comm_bytes"]
    assert saved["config"]["period"] == 0 and saved["config"]["data"] == "python-stdlib"
    assert [row[0] for row in saved["history"]] == [3, 6, 9]
    _, sent, val_loss = saved["history"][-1]
    assert sent == sync_run.final["comm_bytes"] and val_loss == pytest.approx(sync_run.final["val_loss"], abs=1e-4)

    files = sorted(sync_run.out.glob("logs/version_*/metrics.csv"))
    assert len(files) == 1, files
    with files[0].open() as f:
        rows = list(csv.DictReader(f))
    assert [int(row["step"]) for row in rows] == [3, 6, 9]  # one row per logged step, the last one included
    for row in rows:
        assert float(row["train_loss"]) > 0 and float(row["val_loss"]) > 0 and int(row["comm_bytes"]) > 0
    assert float(rows[-1]["val_loss"]) == pytest.approx(sync_run.final["val_loss"], abs=1e-4)

    plot = sync_run.out / "val_loss.png"
    if HAS_MATPLOTLIB:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not plot.exists() and "pip install 'fabric-multimodel[plot]'" in sync_run.stdout
    lines = sync_run.stdout.splitlines()
    sample = lines.index(next(line for line in lines if line.startswith("sample (")))
    generated = "\n".join(line[4:] for line in lines[sample + 1 :] if line.startswith("  | "))
    assert generated.startswith(lm.PROMPT.decode()) and len(generated) == len(lm.PROMPT) + lm.SAMPLE_BYTES
    assert all(c.isprintable() or c in "\t\n" for c in generated)


@pytest.mark.slow
def test_local_sgd_counts_rounds_and_bytes(local_run: Run, sync_run: Run) -> None:
    final, saved = local_run.final, checkpoint(local_run)
    rounds = expected_rounds(0, 12, warmup=4, period=5)
    assert rounds == 2 and final["rounds"] == rounds  # at step 9, and leaving after steps 10-12
    assert saved["averager"]["steps"] == 12 and saved["averager"]["rounds"] == rounds
    params = param_bytes(saved)
    assert final["comm_bytes"] == 4 * params + rounds * round_bytes(params, world=2)
    parts = {"ddp_bytes": 4 * params, "round_bytes": rounds * round_bytes(params, world=2), "node_round_bytes": 0}
    assert comm_parts(local_run) == parts  # warm-up: gradients; after it, rounds only
    assert final["comm_bytes_per_iter"] < sync_run.final["comm_bytes_per_iter"]


@pytest.mark.slow
def test_resume_continues_steps_rounds_bytes_and_stream(local_run: Run, resumed_run: Run) -> None:
    final, saved = resumed_run.final, checkpoint(resumed_run)
    more = expected_rounds(12, 20, warmup=4, period=5)
    assert more == 3  # at steps 14 and 19, and leaving after step 20
    assert final["steps"] == 20 and final["rounds"] == local_run.final["rounds"] + more
    assert final["comm_bytes"] == local_run.final["comm_bytes"] + more * round_bytes(param_bytes(saved), world=2)
    assert saved["step"] == 20 and saved["averager"]["steps"] == 20
    assert saved["data_position"] == 20 * BATCH
    # The plot's history goes on from the first run's.
    assert [row[0] for row in saved["history"]] == [4, 8, 12, 16, 20]
    assert saved["history"][:3] == checkpoint(local_run)["history"]


def test_stream_resumes_exactly_and_differs_by_rank(lm: ModuleType) -> None:
    text = torch.arange(1000)  # each "byte" its position, so windows show where they start; epochs end often
    first = lm.Stream(text, 16, seed=3, rank=0)
    read = [first.next_batch(7) for _ in range(20)]  # 140 windows: more than two epochs of 61
    assert first.windows == 61 and all(b.shape == (7, 17) for b in read)
    again = lm.Stream(text, 16, seed=3, rank=0)
    again.position = 7 * 12  # what a checkpoint after 12 steps holds
    assert all(torch.equal(again.next_batch(7), batch) for batch in read[12:])
    # Every window is a slice of the text; an epoch reads each grid window once.
    epoch = torch.cat(read)[:61]
    assert all(torch.equal(w, text[int(w[0]) : int(w[0]) + 17]) for w in epoch)
    assert len({int(w[0]) for w in epoch}) == 61
    other = lm.Stream(text, 16, seed=3, rank=1)
    assert not torch.equal(other.next_batch(7), read[0])


@pytest.mark.parametrize("positions", ["learned", "sinusoidal"])
def test_model_is_causal_and_tied(lm: ModuleType, positions: str) -> None:
    torch.manual_seed(0)
    model = lm.ByteLM(32, 2, 4, 16, positions, tie_weights=True)
    assert model.head.weight is model.embed.weight
    tokens = torch.randint(256, (2, 16))
    changed = tokens.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 256
    before, after = model(tokens), model(changed)
    assert before.shape == (2, 16, 256)
    assert torch.equal(before[:, :9], after[:, :9]) and not torch.equal(before[:, 9:], after[:, 9:])


def test_split_by_file_is_disjoint_stable_and_never_trained_on(lm: ModuleType, tmp_path: Path) -> None:
    for i in range(300):
        path = tmp_path / "corpus" / f"pkg{i % 7}" / f"file{i}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"<{i}>" * 20)
    (tmp_path / "corpus" / ".hidden").write_text("<hidden>")
    files = lm.corpus_files([tmp_path / "corpus"])
    assert len(files) == 300 and all(not key.startswith(".") for _, key in files)
    train, val = lm.split_files(files)
    assert not {key for _, key in train} & {key for _, key in val}
    assert len(train) + len(val) == 300 and 5 <= len(val) <= 30  # about 5%
    # Keys are relative to the root: the same files elsewhere split the same way.
    (tmp_path / "corpus").rename(tmp_path / "moved")
    assert [key for _, key in lm.split_files(lm.corpus_files([tmp_path / "moved"]))[1]] == [key for _, key in val]
    corpus = lm.load_corpus([tmp_path / "moved"], context=8)
    trained = bytes(corpus.train.tolist()).decode()
    assert corpus.val_files == [key for _, key in val]
    assert not any(f"<{key.split('file')[1].removesuffix('.txt')}>" in trained for key in corpus.val_files)


def test_split_holds_out_a_file_when_few(lm: ModuleType, tmp_path: Path) -> None:
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text(name * 100)
    train, val = lm.split_files(lm.corpus_files([tmp_path / "a.txt", tmp_path / "b.txt"]))
    assert len(train) == len(val) == 1
    with pytest.raises(lm.CorpusError, match="at least 2"):
        lm.split_files(lm.corpus_files([tmp_path / "a.txt"]))
    with pytest.raises(lm.CorpusError, match="too few for --context 4096"):
        lm.load_corpus([tmp_path], context=4096)


def test_default_corpus_is_the_standard_library_without_tests(lm: ModuleType) -> None:
    files = lm.corpus_files(None)
    keys = [key for _, key in files]
    assert len(files) > 100 and all(key.endswith(".py") for key in keys)
    assert not any({"site-packages", "test", "tests"} & set(key.split("/")[:-1]) for key in keys)
    train, val = lm.split_files(files)
    assert not {key for _, key in train} & {key for _, key in val}
    assert 0.02 < len(val) / len(files) < 0.1


@pytest.mark.parametrize(
    "flags, mentions",
    [
        (["--heads", "3"], "--heads must divide --d-model"),
        (["--context", "0"], "--context must be >= 1"),
        (["--data", "no/such/folder"], "no/such/folder"),
        (["--clip", "-1"], "--clip"),
        (["--period", "-1"], "--period"),
        (["--outer", "nesterov"], "need --period"),
        (["--layout", "islands"], "need --period"),
        (["--positions", "sinusoidal", "--d-model", "63", "--heads", "1"], "even --d-model"),
        (["--steps", "many"], "'many'"),
        (["--shard", "node"], "--shard node needs --period"),
        (["--period", "auto", "--warmup-steps", "1"], "--period auto times the warm-up's steps"),
        (["--period", "soon"], "a whole number of steps or 'auto'"),
        (["--period", "8", "--overlap-steps", "auto"], "--overlap-steps auto is chosen with the period"),
        (["--period", "auto", "--overlap-steps", "soon"], "a whole number of steps or 'auto'"),
        (["--shard", "node", "--period", "4", "--layout", "flat"], "drop --layout flat"),
        (["--shard", "node", "--period", "4"], "start several (--devices N), this run has one"),
        (["--layout", "islands", "--period", "4"], "need several processes (--devices N)"),
        (["--period", "4", "--node-period", "2"], "need several processes (--devices N)"),
        (["--pace", "speed"], "--pace speed needs --period N"),
        (["--pace", "speed", "--period", "8", "--fragments", "2"], "no --fragments, --overlap-steps"),
        (["--pace", "speed", "--period", "8", "--warmup-steps", "1"], "--warmup-steps >= 2"),
        (["--shard", "node", "--period", "4", "--devices", "2", "--resume", "no/such/folder"], "no such folder"),
    ],
)
def test_bad_flags_exit_with_one_line(
    lm: ModuleType, flags: list[str], mentions: str, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setattr(sys, "argv", ["lm_fabric.py", *flags])
    with pytest.raises(SystemExit) as exit_info:
        lm.parse_args()
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and mentions in lines[0], lines


def test_unusable_text_is_one_line_after_fabric_started(
    lm: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    # train() itself (one process, here): the text is read after Fabric started, so this goes through common.fail.
    (tmp_path / "only.txt").write_text("x" * 1000)
    flags = ["--out", str(tmp_path / "out"), "--data", str(tmp_path / "only.txt")]
    monkeypatch.setattr(sys, "argv", ["lm_fabric.py", *flags])
    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit) as exit_info:
            lm.train(lm.parse_args())
    finally:
        torch.set_num_threads(threads)  # train() sets one thread per process
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lm_fabric.py: error: --data") and "at least 2" in lines[0], lines
    assert not (tmp_path / "out" / "checkpoint.pt").exists()


def test_parse_args_defaults(lm: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["lm_fabric.py"])
    args = lm.parse_args()
    assert isinstance(args, argparse.Namespace) and args.out == Path("runs/lm/sync-seed0")
    model = lm.ByteLM(args.d_model, args.layers, args.heads, args.context, args.positions, args.tie_weights)
    assert 100_000 <= sum(p.numel() for p in model.parameters()) <= 300_000  # sized for 2 CPU cores


@pytest.mark.parametrize(
    "flags, layout",
    [
        (["--period", "8", "--num-nodes", "2", "--devices", "1"], "islands"),  # warm-up never crosses nodes
        (["--period", "8", "--num-nodes", "2", "--devices", "1", "--layout", "flat"], "flat"),
        (["--period", "8", "--num-nodes", "2", "--devices", "1", "--node-period", "4"], "flat"),  # two-level
        (["--num-nodes", "2", "--devices", "1"], "flat"),  # synchronous: DDP over the world
        (["--period", "8", "--devices", "2"], "flat"),  # one node: local SGD among its processes
    ],
)
def test_the_default_layout_keeps_warm_up_inside_each_node(
    lm: ModuleType, flags: list[str], layout: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(sys, "argv", ["lm_fabric.py", "--out", str(tmp_path / "run"), *flags])
    args = lm.parse_args()
    assert args.layout == layout


@pytest.mark.slow
def test_sigterm_stops_every_rank_within_a_few_steps(tmp_path: Path) -> None:
    """Two processes, checks far apart (--log-every 50000): a SIGTERM to both (as torchrun's agent sends it) stops
    them at the same step soon after, with a checkpoint of that step; it used to wait for the next check."""
    cmd = [sys.executable, SCRIPT, "--devices", "2", "--steps", "100000", "--log-every", "50000"]
    cmd += ["--checkpoint-every", "0", "--out", str(tmp_path), "--eval-batches", "1"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("LT_", "TORCHELASTIC_"))}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env={**clean, "PYTHONUNBUFFERED": "1"}, stdout=PIPE, stderr=PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        first = proc.stdout.readline()  # rank 0's first line: its world and model are built
        assert first.startswith("model: "), first + proc.stderr.read()
        time.sleep(3)  # well into training
        os.killpg(proc.pid, signal.SIGTERM)
        signalled = time.monotonic()
        stdout, stderr = proc.communicate(timeout=60)
        seconds = time.monotonic() - signalled
    finally:
        stop_process_tree(proc)
    assert proc.returncode == 143, stderr[-3000:]
    stopped = stdout.strip().splitlines()[-1]
    assert stopped.startswith("stopped by SIGTERM at step "), stdout[-2000:]
    step = int(stopped.split("at step ")[1].split(";")[0])
    assert 0 < step < 50000 and torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == step
    assert seconds < 30, seconds  # a few steps, the checkpoint and the exit: not the next check


@pytest.mark.parametrize(
    "flags, mixing",
    [
        (["--fragments", "4", "--overlap-steps", "16"], 0.5),  # streaming: measured best on two seeds
        (["--fragments", "4", "--overlap-steps", "16", "--mixing", "progress"], None),  # the other merge, asked for
        (["--fragments", "4", "--overlap-steps", "16", "--mixing", "0.25"], 0.25),
        (["--overlap-steps", "16"], None),  # no fragments: global + local progress
    ],
)
def test_streaming_rounds_mix_half_by_default(
    lm: ModuleType, flags: list[str], mixing: float | None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    argv = ["lm_fabric.py", "--out", str(tmp_path / "run"), "--period", "128", "--outer", "nesterov", *flags]
    monkeypatch.setattr(sys, "argv", argv)
    args = lm.parse_args()
    options = cli.averager_options(args, [])
    assert options.get("mixing") == mixing
