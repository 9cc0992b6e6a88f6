"""One site of a churn run with torchft 0.2.0's own streaming DiLoCo: the peer, side by side (``elastic.py --churn``).

The LM example's model, data, learning-rate schedule and validation (``examples/lm_fabric.py``), trained the way a
torchft user would: each site one replica group of one process, with its own ``TCPStore``, a ``Manager``
(synchronous quorum, as DiLoCo requires) that meets the others through torchft's Lighthouse, and
``torchft.local_sgd.DiLoCo`` over 4 fragments of the model (embedding and block 0; block 1; block 2; block 3 and
the final norm) with the outer Nesterov step, ``--period`` inner steps per round of all fragments, each fragment's
merge ``--overlap-steps`` after its launch and half the local replica mixed back in (the Averager's settings for
``--fragments 4 --overlap-steps N``). A site that starts while the others train (new, or back after a kill) heals:
the Manager fetches the newest state (model, inner and outer optimizers, the step) from a member over HTTP, as
torchft does. The sites tool starts it like the live examples (``--coordinator HOST:PORT --site S`` appended):
here the coordinator is a Lighthouse (``elastic.py`` runs ``torchft_lighthouse`` in the coordinator's namespace).

Two things are the harness's, not torchft's: inside a simulated site the machine's hostname resolves to no site,
so this process advertises its site's address where torchft would use the hostname; and a site started after the
run ended (the churn restarts sites to the end) finds ``--out``'s parent marked finished and exits 0, where a
torchft replica would wait for a quorum that never comes.

It ends with ``final: steps=... val_loss=... val_bpb=... wall_s=... commits=... heals=... stalled_s=...
process_start=...``; ``stalled_s``: the seconds of this process's steps that took over ``STALL_S`` (a lost peer's
timeout, a quorum that waits, sending a joiner the state) once it has taken part in a round: its seconds not
training, as near as torchft lets one tell (its own start and heal are not counted, as live membership's
``membership_wait_s`` leaves out its own admission).
"""

from __future__ import annotations

import argparse
import math
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from lm_fabric import ByteLM, Stream, learning_rate, load_corpus, loss_of, validation_batches  # noqa: E402

from fabric_multimodel.run.progress import process_started  # noqa: E402

FINISHED = "finished"  # written beside the sites' folders by the first site to end
STALL_S = 2.0  # a step this long waited on the others: a normal one takes 15-40 ms, a round's wait under 1 s


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--period", type=int, default=128, help="inner steps per round of all fragments")
    p.add_argument("--fragments", type=int, default=4, choices=[4])
    p.add_argument("--overlap-steps", type=int, default=16, help="torchft's fragment_sync_delay")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--log-every", type=int, default=500)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds a round, commit or connection may take")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--coordinator", required=True, metavar="HOST:PORT", help="the Lighthouse")
    p.add_argument("--site", required=True)
    return p.parse_args(argv)


def own_address(coordinator: str) -> str:
    """The address this site reaches the coordinator from (its own, inside a simulated site)."""
    host, port = coordinator.rsplit(":", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, int(port)))  # UDP: no packet is sent
        return probe.getsockname()[0]


def main() -> int:
    args = parse_args()
    finished = args.out.parent / FINISHED
    if finished.exists():
        print(f"run ended: {finished} exists; nothing to join", flush=True)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    address = own_address(args.coordinator)
    socket.gethostname = lambda: address  # torchft's HTTP checkpoint server advertises the hostname

    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    corpus = load_corpus(None, args.context)
    torch.manual_seed(args.seed)
    model = ByteLM(64, 4, 4, args.context, "learned", True)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    inner = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        foreach=True,
    )
    blocks = list(model.blocks)
    fragments = [
        torch.nn.ModuleList([model.embed, model.positions, blocks[0]]),
        blocks[1],
        blocks[2],
        torch.nn.ModuleList([blocks[3], model.norm]),
    ]
    outer = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True) for f in fragments]
    site_rank = sum(map(ord, args.site))  # each site its own order of the text
    stream = Stream(corpus.train, args.context, args.seed, site_rank)
    progress = {"step": 0, "heals": 0}

    def state_dict() -> dict:
        return {"model": model.state_dict(), "inner": inner.state_dict(), "step": progress["step"]}

    def load_state_dict(state: dict) -> None:  # a heal: the newest member's state
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])
        progress["step"], progress["heals"] = state["step"], progress["heals"] + 1
        stream.position = state["step"] * args.batch_size
        print(f"healed: step {state['step']} from a member (unix time {time.time():.2f})", flush=True)

    timeout = timedelta(seconds=args.timeout)
    store = torch.distributed.TCPStore(address, 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=2,
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=120),
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr=address,
        store_port=store.port,
        lighthouse_addr=f"http://{args.coordinator}",
        replica_id=f"site{args.site}",
        hostname=address,
        init_sync=False,  # every site builds the same weights from --seed
    )
    eval_batches = validation_batches(corpus.val, args.eval_batches, args.context)
    print(f"torchft: site {args.site} at {address}, lighthouse {args.coordinator}", flush=True)
    wall, stalled = time.perf_counter(), 0.0
    try:
        with DiLoCo(
            manager, fragments, inner, outer, sync_every=args.period, backup_device=torch.device("cpu"),
            pin_memory=False, fragment_sync_delay=args.overlap_steps, fragment_update_alpha=0.5,
        ):  # fmt: skip
            while progress["step"] < args.steps:
                tick, member = time.perf_counter(), manager.current_step() > 0  # after its first round (or heal)
                progress["step"] += 1
                step = progress["step"]
                for group in inner.param_groups:
                    group["lr"] = learning_rate(step, args, args.steps)
                loss = loss_of(model, stream.next_batch(args.batch_size))
                inner.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                inner.step()  # DiLoCo's hook runs the rounds: quorum, heal, allreduce, commit
                took = time.perf_counter() - tick
                stalled += took if took > STALL_S and member else 0.0
                if step % args.log_every == 0:
                    print(f"step {step}/{args.steps} loss={loss.item():.3f} commits={manager.current_step()}")
    except Exception as error:  # a quorum that never comes once the others have ended
        if finished.exists():
            print(f"run ended: {type(error).__name__} after the others finished", flush=True)
            return 0
        raise
    wall = time.perf_counter() - wall
    finished.touch()
    with torch.no_grad():
        val_loss = sum(loss_of(model, b).item() for b in eval_batches) / len(eval_batches)
    print(
        f"final: steps={progress['step']} val_loss={val_loss:.4f} val_bpb={val_loss / math.log(2):.4f}"
        f" wall_s={wall:.1f} commits={manager.current_step()} heals={progress['heals']} stalled_s={stalled:.1f}"
        f" process_start={process_started() or math.nan:.1f}",
        flush=True,
    )
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
