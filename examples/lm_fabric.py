"""Train a small byte-level language model with DDP or local SGD / DiLoCo, on text that ships with Python.

Run it any of these ways::

    fabric run --accelerator cpu --devices 4 examples/lm_fabric.py              # 4 processes, synchronous DDP
    fabric run --accelerator cpu --devices 4 examples/lm_fabric.py --period 16  # local SGD, average every 16 steps
    python examples/lm_fabric.py --devices 4 --accelerator cpu                  # the script starts the processes
    python examples/lm_fabric.py                                                # one process
    python examples/lm_fabric.py --resume runs/lm/sync-seed0/checkpoint.pt --steps 3000  # continue to 3000 steps
    python examples/lm_fabric.py --data notes/ book.txt --d-model 256 --layers 6 --context 256  # your text, bigger

The model is a decoder-only transformer over bytes (256 symbols): pre-norm blocks, causal
self-attention (``scaled_dot_product_attention``), learned or sinusoidal positions, the output
layer tied to the byte embedding unless ``--no-tie-weights``. The default corpus is the running
interpreter's standard library (its ``.py`` files, without site-packages and test folders):
nothing to download. About 5% of the files, picked by a hash of each file's path relative to its
root, are held out for validation and never trained on. Each rank reads its own random order of
the training text (seeded by ``--seed`` and the rank); the checkpoint holds the position in it.

AdamW (weight decay on matrices only), a linear learning-rate warm-up over the first 5% of
``--steps``, then a cosine decay to 10% of ``--lr`` at ``--steps`` (a resume to a larger
``--steps`` stretches the rest of that curve). With ``--period N`` an ``Averager`` runs
``--warmup-steps`` synchronous steps, then local steps with no communication, averaging the
replicas (and AdamW's moments) every N steps; ``--outer nesterov`` makes the rounds DiLoCo's
(outer Nesterov steps on the averaged pseudo-gradients; AdamW's moments stay local).

Rank 0 writes ``OUT/checkpoint.pt``, CSV metrics under ``OUT/logs/`` (train loss, and every
``--log-every`` steps the validation loss of rank 0's replica and the bytes sent so far),
``val_loss.png`` (with matplotlib), prints a sample of generated text and ends with a
machine-readable line (wrapped here)::

    final: steps=2000 val_loss=1.4833 val_bpb=2.1400 wall_s=113.5 iter_ms_median=55.51
        iter_ms_mean=56.25 comm_bytes=1747968000 comm_bytes_per_iter=873984.0 rounds=0

That is the first command on a quiet 2-core CPU (4 processes, seed 0, the default
218,496-parameter model; 100-160 ms a step while other work loads the cores; one process takes
16.9 ms a step). The final validation loss is that of the averaged model (identical on every
rank), on the same ``--eval-batches`` held-out batches in every run; ``val_bpb`` is it in bits per
byte. With ``--period 16`` the same machine reached 1.5853 (2.2871 bits per byte) at 40.45 ms a
step in 117 rounds, sending 28% of the bytes.
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # before torch: its store client logs with C++ stack frames

import argparse
import hashlib
import math
import statistics
import sysconfig
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from common import (
    CoordinatorGuard,
    add_averaging_arguments,
    add_run_arguments,
    check_arguments,
    checkpoints,
    data_rank,
    fail,
    join_run,
    layout,
    link_line,
    main,
    mode_name,
    report_membership,
    run_config,
    run_folder,
    start_averager,
    stopped,
    summary,
    warmup_ended,
)
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger
from torch import nn

from fabric_multimodel import Loop, setup_models
from fabric_multimodel.run import cli
from fabric_multimodel.run.cli import Parser
from fabric_multimodel.run.progress import Progress, StartPhases
from fabric_multimodel.run.report import GradientBytes, final_line, state_bytes

#: The LM's settings a resumed run must share (beyond the examples' common ones).
SETTINGS = ("context", "clip", "d_model", "layers", "heads", "positions", "tie_weights", "shard")
HELD_OUT = 0.05  # share of files (by path hash) kept for validation
SKIPPED_FOLDERS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
EVAL_BATCH_SIZE = 32  # sequences per validation batch, whatever --batch-size is, so runs compare
LR_WARMUP = 0.05  # share of --steps with a linear learning-rate warm-up
LR_FLOOR = 0.1  # the cosine decays to this share of --lr
PROMPT = b"    def __init__(self"
SAMPLE_BYTES = 80
SAMPLE_TEMPERATURE = 0.7


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser("lm_fabric.py", "Train a small byte-level language model with DDP or local SGD / DiLoCo (the Averager).")
    p.add_argument(
        "--data",
        type=Path,
        nargs="+",
        metavar="PATH",
        help="text files or folders (default: the .py files of this Python's standard library)",
    )
    p.add_argument("--steps", type=int, default=2000, help="total iterations, counting those before --resume")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per process and step")
    p.add_argument("--context", type=int, default=32, help="bytes per sequence (the model's longest context)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's peak learning rate")
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping (0: off)")
    p.add_argument("--seed", type=int, default=0, help="initial weights and each rank's order of the text")
    g = p.add_argument_group("model")
    g.add_argument("--d-model", type=int, default=64, help="width of the residual stream")
    g.add_argument("--layers", type=int, default=4, help="transformer blocks")
    g.add_argument("--heads", type=int, default=4, help="attention heads (must divide --d-model)")
    g.add_argument("--positions", choices=["learned", "sinusoidal"], default="learned", help="position encoding")
    g.add_argument(
        "--tie-weights", action=argparse.BooleanOptionalAction, default=True, help="output layer = byte embedding"
    )
    add_averaging_arguments(p, warmup_steps=200)
    p.add_argument("--eval-batches", type=int, default=8, help=f"held-out batches of {EVAL_BATCH_SIZE} sequences")
    add_run_arguments(p)
    args = p.parse_args(argv)
    check_arguments(p, args)
    for flag in ("context", "d_model", "layers", "heads", "eval_batches"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.d_model % args.heads:
        p.error(f"--heads must divide --d-model, got {args.heads} and {args.d_model}")
    if args.d_model % 2 and args.positions == "sinusoidal":
        p.error(f"--positions sinusoidal needs an even --d-model, got {args.d_model}")
    if not (math.isfinite(args.clip) and args.clip >= 0):
        p.error(f"--clip must be a number >= 0, got {args.clip}")
    for path in args.data or ():
        if not path.exists():
            p.error(f"--data {path}: no such file or folder")
    args.out = run_folder(p, args, "lm", mode_name(args))
    return args


# --- data ------------------------------------------------------------------------------------


class Corpus(NamedTuple):
    """Training and validation text (bytes as uint8 tensors) and the files each came from."""

    train: torch.Tensor
    val: torch.Tensor
    train_files: list[str]
    val_files: list[str]

    def __str__(self) -> str:
        return (
            f"{len(self.train):,} training bytes in {len(self.train_files)} files, {len(self.val):,} held out in"
            f" {len(self.val_files)}"
        )


class CorpusError(ValueError):
    """The text cannot be used (too little of it, or no file to hold out); the message is one line."""


def corpus_files(paths: Sequence[Path] | None) -> list[tuple[Path, str]]:
    """``(file, key)`` for every file under ``paths`` (default: the standard library's ``.py`` files),
    sorted by key; the key is the path relative to its root (a file given directly: its name)."""
    if paths is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = [
            (f, f.relative_to(root).as_posix())
            for f in root.rglob("*.py")
            if f.is_file() and not SKIPPED_FOLDERS.intersection(f.relative_to(root).parts[:-1])
        ]
    else:
        files = []
        for path in paths:
            if path.is_file():
                files.append((path, path.name))
                continue
            for f in path.rglob("*"):
                parts = f.relative_to(path).parts
                if f.is_file() and not any(part.startswith(".") or part == "__pycache__" for part in parts):
                    files.append((f, f.relative_to(path).as_posix()))
    return sorted(files, key=lambda pair: (pair[1], str(pair[0])))


def held_out_share(key: str) -> float:
    """Where a file's key falls in [0, 1): the same on every machine and Python (unlike ``hash``)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64


def split_files(files: Sequence[tuple[Path, str]]) -> tuple[list[tuple[Path, str]], list[tuple[Path, str]]]:
    """Training and validation files: a file is held out when its key's hash falls in the first 5%.

    Few files may leave none there; then the file whose hash is lowest is held out, so that there
    is always something to validate on. A file is on one side only.
    """
    if len(files) < 2:
        raise CorpusError(f"{len(files)} file(s) found; the held-out split is by file, so give at least 2")
    val = [pair for pair in files if held_out_share(pair[1]) < HELD_OUT]
    if not val:
        val = [min(files, key=lambda pair: held_out_share(pair[1]))]
    train = [pair for pair in files if pair not in val]
    return train, val


def load_corpus(paths: Sequence[Path] | None, context: int) -> Corpus:
    """Read and split the text; both parts must hold at least two windows of ``context + 1`` bytes."""
    train, val = split_files(corpus_files(paths))
    texts = []
    for part, files in (("training", train), ("validation", val)):
        data = b"".join(f.read_bytes() for f, _ in files)
        if len(data) < 2 * context + 1:
            raise CorpusError(
                f"the {part} files hold {len(data)} bytes, too few for --context {context}; give more text"
            )
        texts.append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return Corpus(texts[0], texts[1], [key for _, key in train], [key for _, key in val])


def load_text(fabric: Fabric, args: argparse.Namespace) -> Corpus:
    """The text of ``--data`` (default: the standard library's); a problem is one line and exit code 2."""
    try:
        return load_corpus(args.data, args.context)
    except CorpusError as error:
        fail(fabric, f"--data: {error}")


class Stream:
    """One rank's training windows of ``context + 1`` bytes, read in a random order.

    Every epoch of the text gets its own order and its own offset of the window grid, drawn from
    ``(seed, rank, epoch)``. ``position`` (windows read so far) is all a checkpoint needs to
    continue exactly where the stream stopped.
    """

    def __init__(self, text: torch.Tensor, context: int, seed: int, rank: int, position: int = 0) -> None:
        self.text, self.context, self.seed, self.rank = text, context, seed, rank
        self.windows = (len(text) - 1) // context - 1  # a grid offset below `context` keeps the last one whole
        self.position = position
        self._epoch = -1
        self._starts = torch.empty(0, dtype=torch.long)

    def next_batch(self, size: int) -> torch.Tensor:
        """The next ``size`` windows, as a (size, context + 1) tensor of byte values (int64)."""
        starts = torch.empty(size, dtype=torch.long)
        for i in range(size):
            epoch, index = divmod(self.position + i, self.windows)
            if epoch != self._epoch:
                self._epoch, self._starts = epoch, self._epoch_starts(epoch)
            starts[i] = self._starts[index]
        self.position += size
        return self.text[starts[:, None] + torch.arange(self.context + 1)].long()

    def _epoch_starts(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(hash((self.seed, self.rank, epoch)))
        offset = int(torch.randint(self.context, (1,), generator=generator))
        return offset + self.context * torch.randperm(self.windows, generator=generator)


def validation_batches(text: torch.Tensor, count: int, context: int) -> list[torch.Tensor]:
    """``count`` batches of windows spread evenly over the validation text: the same in every run."""
    starts = torch.linspace(0, len(text) - context - 1, count * EVAL_BATCH_SIZE).long()
    windows = text[starts[:, None] + torch.arange(context + 1)].long()
    return list(windows.split(EVAL_BATCH_SIZE))


# --- model -----------------------------------------------------------------------------------


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then a 4x MLP, each added to the residual."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class ByteLM(nn.Module):
    """A decoder-only transformer over bytes: (batch, time) byte values -> (batch, time, 256) logits."""

    def __init__(self, d_model: int, layers: int, heads: int, context: int, positions: str, tie_weights: bool) -> None:
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(256, d_model)
        self.positions = nn.Embedding(context, d_model) if positions == "learned" else None
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, 256, bias=False)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.ndim == 2:
                # GPT-2's scheme: residual branches scaled down with depth, so the stream's variance stays put.
                deep = name.endswith(("proj.weight", "mlp.2.weight"))
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers) if deep else 0.02)
        if tie_weights:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        steps = torch.arange(tokens.shape[1], device=tokens.device)
        if self.positions is not None:
            x = x + self.positions(steps)
        else:
            # Computed on the fly, not a buffer: a buffer would be broadcast by DDP and averaged by the Averager.
            half = x.shape[-1] // 2
            freqs = torch.exp(torch.arange(half, device=x.device) * (-math.log(10000.0) / half))
            angles = steps[:, None] * freqs[None, :]
            x = x + torch.cat([angles.sin(), angles.cos()], dim=-1)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def loss_of(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats) of ``model`` on windows of ``context + 1`` bytes."""
    logits = model(windows[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())


@torch.no_grad()
def evaluate(model: nn.Module, batches: Sequence[torch.Tensor]) -> float:
    """Mean validation loss; rank 0 calls it alone, so it runs the plain module (DDP's forward may communicate)."""
    return statistics.fmean(loss_of(model.module, batch).item() for batch in batches)


@torch.no_grad()
def generate(model: nn.Module, prompt: bytes, length: int, device: torch.device) -> bytes:
    """``prompt`` continued by ``length`` bytes, sampled at a low temperature with a fixed seed."""
    module = model.module
    generator = torch.Generator().manual_seed(0)
    data = list(prompt)
    for _ in range(length):
        tokens = torch.tensor([data[-module.context :]], device=device)
        logits = module(tokens)[0, -1].float().cpu() / SAMPLE_TEMPERATURE
        data.append(int(torch.multinomial(logits.softmax(-1), 1, generator=generator)))
    return bytes(data)


def printable(data: bytes) -> str:
    """Bytes as text a terminal shows safely: ASCII, newlines and tabs kept, anything else ``?``."""
    return "".join(chr(b) if 32 <= b < 127 or b in (9, 10) else "?" for b in data)


def learning_rate(step: int, args: argparse.Namespace, last: int) -> float:
    """Linear warm-up over the first 5% of the ``last`` steps (a paced site's: its own), then a cosine decay to 10%
    of ``--lr``."""
    warmup = max(1, int(LR_WARMUP * last))
    if step <= warmup:
        return args.lr * step / warmup
    done = (step - warmup) / max(1, last - warmup)
    return args.lr * (LR_FLOOR + (1 - LR_FLOOR) * 0.5 * (1 + math.cos(math.pi * min(done, 1.0))))


def build(fabric: Fabric, args: argparse.Namespace, setup: dict[str, Any]) -> tuple[nn.Module, Any, GradientBytes]:
    torch.manual_seed(args.seed)  # same initial weights on every rank
    model = ByteLM(args.d_model, args.layers, args.heads, args.context, args.positions, args.tie_weights)
    (model,) = setup_models(fabric, model=model, **setup)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]  # biases and norms
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        foreach=True,  # one kernel per step for all tensors instead of one per tensor
    )
    return model, fabric.setup_optimizers(optimizer), GradientBytes([model])


def save_plot(path: Path, history: Sequence[Sequence[float]]) -> None:
    """Validation loss against steps and against bytes sent, from ``[step, comm_bytes, val_loss]`` rows."""
    try:
        import matplotlib
    except ImportError:
        print(f"no plot: pip install 'fabric-multimodel[plot]' to get {path}")
        return
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    steps, sent, losses = zip(*history)
    fig, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    by_step.plot(steps, losses, marker="o")
    by_step.set_xlabel("step")
    by_step.set_ylabel("validation loss (nats per byte)")
    by_bytes.plot([b / 2**20 for b in sent], losses, marker="o")
    by_bytes.set_xlabel("MiB sent per rank")
    for ax in (by_step, by_bytes):
        ax.grid(alpha=0.3)
    fig.suptitle("last point: the averaged model; earlier ones: rank 0's replica", fontsize=9)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def train(args: argparse.Namespace) -> int | None:
    torch.set_num_threads(1)  # several processes share the cores; more threads each only contend
    phases = StartPhases()
    fabric = cli.start_fabric(Fabric, args, loggers=CSVLogger(root_dir=args.out, name="logs"))
    phases.mark("fabric")
    corpus = load_text(fabric, args)
    phases.mark("data")
    placement = layout(fabric, args)
    sharded = args.shard == "node"  # every process of a site then takes part in its forwards (evaluation too)
    phases.mark("groups")
    model, optimizer, grad_bytes = build(fabric, args, placement.setup)
    phases.mark("models")
    averager = start_averager(fabric, args, model, placement, [optimizer])  # None: synchronous DDP
    phases.mark("averager")
    config = run_config(args, *SETTINGS, data=[str(path) for path in args.data or ()] or "python-stdlib")
    # history: [step, bytes sent, validation loss] rows for the plot; a site that joins starts at the others' step
    state: dict[str, Any] = {
        "model": model, "optimizer": optimizer, "data_position": 0, "grad_bytes": 0, "history": [], "config": config,
        **({"averager": averager, "step": averager.steps} if averager else {"step": 0}),
    }  # fmt: skip
    checkpointer = checkpoints(fabric, args, state, averager, phases)  # resumed: the values in `state`
    join_run(fabric, averager, state)  # --coordinator: this site joins the run (the newest state any holds)
    grad_bytes.bytes = state["grad_bytes"]
    stream = Stream(corpus.train, args.context, args.seed, data_rank(fabric, args), state["data_position"])
    eval_batches = [b.to(fabric.device) for b in validation_batches(corpus.val, args.eval_batches, args.context)]

    def sent() -> int:
        return grad_bytes.bytes + (averager.traffic.bytes if averager is not None else 0)

    def checkpoint() -> dict[str, Any]:  # what a checkpoint holds, at the loop's step
        return state | dict(step=loop.step, data_position=stream.position, grad_bytes=grad_bytes.bytes,
                            world_size=fabric.world_size)  # fmt: skip

    def log(step: int, loss: torch.Tensor | None, elapsed_s: float) -> float:  # elapsed_s: time-to-target curves
        metrics = {"lr": learning_rate(step, args, loop.last), "comm_bytes": sent(), "elapsed_s": elapsed_s}
        metrics |= {"train_loss": loss.item()} if loss is not None else {}
        if fabric.is_global_zero or sharded:  # rank 0's replica: no collective, the other ranks go on
            metrics["val_loss"] = evaluate(model, eval_batches)
        if fabric.is_global_zero:
            state["history"].append([step, sent(), metrics["val_loss"]])
        fabric.log_dict(metrics, step=step)
        return metrics.get("val_loss", math.nan)

    loop = Loop(averager, args.steps, checkpointer=checkpointer, state=checkpoint, start=state["step"],
                checkpoint_every=args.checkpoint_every, checkpoint_rounds=args.checkpoint_rounds)  # fmt: skip
    fabric.print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters; text: {corpus}")
    progress = Progress(loop.last, loop.step, args.log_every, fabric.is_global_zero, unit="tok")
    tokens = args.batch_size * args.context * fabric.world_size  # per step, for the rate
    iter_seconds: list[float] = []
    loss: torch.Tensor | None = None  # the last step's, logged at the end
    memory = 0  # state_bytes, measured at the last step
    wall = time.perf_counter()
    end = (wall, sent())  # after the last step: what leaving the block costs is measured from here
    if averager is not None and loop.step >= args.warmup_steps:  # resumed past warm-up: the pace is known
        warmup_ended(fabric, averager, loop, progress)
    epoch_seen = report_membership(fabric, averager, (0, None))
    with CoordinatorGuard() as guard, averager or nullcontext():
        for step in loop:
            tick = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, args, loop.last)
            loss = loss_of(model, stream.next_batch(args.batch_size).to(fabric.device))
            fabric.backward(loss)
            if args.clip:
                # Local under DDP: the gradients are already reduced, so every rank clips them alike.
                fabric.clip_gradients(model, optimizer, max_norm=args.clip)
            optimizer.step()
            if step == loop.last:  # the persistent state at its largest: before zero_grad frees the gradients
                memory = state_bytes([model], [optimizer], averager)
            optimizer.zero_grad()
            if averager is not None:
                if averager.membership is not None:  # the status page's loss column, read at the next boundary
                    averager.membership.report(loss=loss)
                averager.step()
                epoch_seen = report_membership(fabric, averager, epoch_seen)
                if step == args.warmup_steps:
                    warmup_ended(fabric, averager, loop, progress)
            if averager is None or step > args.warmup_steps:  # time the steady state only
                iter_seconds.append(time.perf_counter() - tick)
            progress(step, lambda loss=loss: {"loss": loss.item()}, scale=tokens)
            if step % args.log_every == 0 and step < loop.last:  # the last step is logged after the block
                log(step, loss, time.perf_counter() - wall)
            end = (time.perf_counter(), sent())
    if loop.stopped or guard.error:  # every rank stopped at one step, after a checkpoint
        return stopped(fabric, loop, guard)
    # Leaving the Averager's block averaged once more: all replicas are identical now.
    wall = time.perf_counter() - wall
    end_round = (time.perf_counter() - end[0], sent() - end[1])
    progress.close()
    val_loss = log(loop.last, loss, wall)
    checkpointer.save(checkpoint())  # leaving the block averaged already
    round_checkpoints = loop.close()
    fabric.logger.finalize("success")
    sample = printable(generate(model, PROMPT, SAMPLE_BYTES, fabric.device)) if fabric.is_global_zero or sharded else ""
    if not fabric.is_global_zero:
        return None
    link = link_line(averager, *end_round) if averager is not None else ""
    quality = f"val_loss={val_loss:.4f} val_bpb={val_loss / math.log(2):.4f}"
    lines = summary(args, grad_bytes, averager, "val_loss.png", round_checkpoints, link)
    final = final_line(loop.last, quality, wall_s=wall, iter_seconds=iter_seconds, comm_bytes=sent(),
                       state_bytes=memory, averager=averager)  # fmt: skip
    report(args, state["history"], sample, lines, final)
    return None


def report(args: argparse.Namespace, history: list[list[float]], sample: str, *lines: str) -> None:
    """Rank 0, at the end: the plot of the validation loss, a sample of generated text, then ``lines``."""
    save_plot(args.out / "val_loss.png", history)
    print(f"sample (temperature {SAMPLE_TEMPERATURE}, prompt {PROMPT.decode()!r}):")
    print("\n".join(f"  | {line}" for line in sample.split("\n")))  # "| ": no generated line looks like "final:"
    for line in lines:
        print(line, flush=True)


if __name__ == "__main__":
    main(lambda: train(parse_args()))
