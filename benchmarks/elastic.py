"""What losing a site costs: the LM example under torchrun's elastic agent, 2 simulated sites, one dropped mid-run.

Two runs of ``examples/lm_fabric.py`` (DiLoCo, ``--checkpoint-rounds --resume auto``) as 2 sites of
``--devices`` processes behind a ``--bandwidth`` link (``fabric_multimodel.sites --launcher torchrun``):
one uninterrupted, and one in which site 1 is killed (SIGKILL to its agent and workers) ``--at`` seconds
in and, with ``--back``, started again later. Reported: the time from the kill to the survivors' failed
round (the agent's log), from there to training again (the example's ``--resume auto`` line: rendezvous,
worker start, checkpoint load), the steps lost (the failed round's step minus the resumed one), when the
site rejoined (and where the rejoining site's start went, phase by phase), and the final validation losses side
by side. With ``--join-at``, no site is dropped: a third site starts that many seconds in and joins the run.

With ``--live``, the same drop twice more beside the torchrun runs, in live membership (``--launcher live``:
``--sites`` sites (3) of ``--devices`` processes (1; 2: islands, DDP inside each site), each a world of its own, the
coordinator in a namespace of its own): an uninterrupted
live run and one in which the same site is killed and started again. Read from the examples' ``membership:``
lines: the kill to the survivors' next epoch (training again, no process restarted), the return to the epoch
that takes the site back, the state it received, and the survivors' ``membership_wait_s``. ``--drop-site 0``
drops the first site (live runs only: torchrun's site 0 hosts its rendezvous).

With ``--churn EVERY:DOWN`` (3 sites x 1, 10,000 steps: 5 to 7 minutes a run), sites come and go the whole run: every
EVERY seconds one is killed and started again DOWN seconds later, under torchrun (from site 1: its site 0 hosts
the rendezvous) and in live membership (from site 0), each beside its uninterrupted run. The training efficiency
is the uninterrupted run's wall-clock over the churned one's, for the same steps: the steps made over the steps
the uninterrupted rate would have made. On 2 cores fewer sites also train faster, which flatters both churned runs,
so the table also gives a survivor's seconds not training: torchrun's, from each kill and each return to its
workers' next ``--resume auto`` line; live, its ``membership_wait_s``. Where torchft is installed (``pip install -e
'.[peers]'``), the same churn once more with torchft 0.2.0's own streaming DiLoCo (``benchmarks/torchft_lm.py``:
the LM's model and data, 4 fragments, the same period, overlap and mixing; its Lighthouse in the coordinator's
namespace, min_replicas 2), uninterrupted and churned (from site 0): the peer side by side.

Usage::

    python benchmarks/elastic.py [--quick] [--out DIR] [--bandwidth 100mbit] [--at 40] [--back 80] [--streaming]
    python benchmarks/elastic.py --streaming --period 128 --bandwidth 10mbit --join-at 50  # a third site joins
    python benchmarks/elastic.py --live --streaming --period 128 --bandwidth 10mbit --at 30 --back 50
    python benchmarks/elastic.py --live --sites 2 --devices 2 --drop-site 0 --streaming --period 128 \
        --bandwidth 10mbit --at 30 --back 50  # islands
    python benchmarks/elastic.py --churn 60:20 --streaming --period 128 --bandwidth 10mbit  # about 25 minutes
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from fabric_multimodel.run.report import parse_final_line  # noqa: E402
from fabric_multimodel.sites import Churn, Drop, Join, run_sites  # noqa: E402

NAME = "elastic"
RESUMED = re.compile(r"--resume auto: step (\d+) from \S+ into (\d+) processes \(unix time ([\d.]+)")
# The same line's phases: "seconds: start=9.1 fabric=2.0 ... transfer=6.1 load=0.2".
PHASES = re.compile(r"--resume auto: step \d+ from \S+ into (\d+) processes .*seconds: ([^;\n]*)", re.MULTILINE)
RECEIVED = re.compile(r"--resume auto: step \d+ from \S+ into (\d+) processes .*; received ([\d.]+) MB")
FAILED_ROUND = re.compile(r"averaging round \d+ at step (\d+)(?: \(fragment \d+ of \d+\))? failed")
# torch elastic's log prefix, e.g. "E1201 22:28:35.218000 18922 .../api.py:1002] failed (exitcode: 1)"
AGENT_FAILED = re.compile(r"^[EW](\d{4} \d\d:\d\d:\d\d\.\d+) \d+ .*failed \(exitcode")
MEMBERSHIP_KEYS = [*common.LM_KEYS, "membership_wait_s", "process_start"]
#: --paths: each path's two runs (their folders' names) and their columns in the churn table.
PATHS = {
    "torchrun": ("uninterrupted", "churn"),
    "live": ("live-uninterrupted", "live-churn"),
    "torchft": ("torchft-uninterrupted", "torchft-churn"),
}
COLUMNS = {"uninterrupted": "torchrun", "churn": "torchrun, churn", "live-uninterrupted": "live"}
COLUMNS |= {"live-churn": "live, churn", "torchft-uninterrupted": "torchft", "torchft-churn": "torchft, churn"}
TORCHFT_KEYS = ["steps", "val_loss", "val_bpb", "wall_s", "commits", "heals", "stalled_s", "process_start"]
HAS_TORCHFT = importlib.util.find_spec("torchft") is not None


def lighthouse() -> list[str]:
    """torchft's Lighthouse, as its docs start it (``torchft_lighthouse --min_replicas 2 --join_timeout_ms 10000``:
    a quorum needs 2 of the 3 sites), by this interpreter (the script's own argv is what the server parses)."""
    script = shutil.which("torchft_lighthouse") or str(Path(sys.executable).with_name("torchft_lighthouse"))
    return [sys.executable, script, "--bind", "[::]:{port}", "--min_replicas", "2", "--join_timeout_ms", "10000"]


def live_run(args: Any, label: str, drop: Drop | None, churn: Churn | None = None) -> dict[str, Any]:
    """A live-membership run of ``--sites`` x ``--devices`` (``--launcher live``), and what its ``membership:`` lines
    say (site 0's first process's, and each site's)."""
    folder = fresh_folder(args, label)
    script = [
        "--steps", str(args.steps), "--period", str(args.period), "--warmup-steps", "0", "--outer", "nesterov",
        "--checkpoint-every", "0", "--timeout", "60", "--min-sites", str(args.sites),
        "--out", str(folder / "site{site}"),
        *streaming_flags(args, live=True), *args.example_args,
    ]  # fmt: skip
    result = run_sites(
        common.REPO / "examples" / "lm_fabric.py",
        script,
        sites=args.sites,
        devices=args.devices,
        bandwidth=args.bandwidth,
        out=folder / "sites",
        launcher="live",
        drop=drop,
        churn=churn,
        stream=False,
        timeout=args.run_timeout,
    )
    texts = [out.read_text() for out, _ in result.logs]
    # the sites that ended the run (with churn, a site started after its last round has no final line)
    ended = [site for site, text in enumerate(texts) if "final:" in text and (drop is None or site != drop.site)]
    row: dict[str, Any] = {"run": label, "code": result.code, "sites_wall_s": result.wall_s}
    row["timeline"] = str(result.timeline) if result.timeline else None  # the coordinator's record, drawn
    row["kills"], row["epochs"] = len(result.churned), max(len(_membership(text)) for text in texts)
    if result.code == 0 and ended:
        finals = {site: parse_final_line(texts[site], MEMBERSHIP_KEYS) for site in ended}
        row.update({k: float(v) for k, v in finals[ended[0]].items()})
        row["membership_wait_s"] = max(float(final["membership_wait_s"]) for final in finals.values())
        row["not_training_s"] = row["membership_wait_s"]  # no process restarts: a survivor only waits
        row["losses"] = [float(final["val_loss"]) for final in finals.values()]
    survivor = ended[0] if ended else 0
    if drop is None or result.dropped_at is None:
        return row
    killed = result.started + result.dropped_at
    lines = _membership(texts[survivor])
    gone = next((e for e in lines if str(drop.site) in e["left"].split(",") and e["time"] > killed), None)
    if gone:
        row["kill_to_training_s"] = gone["time"] - killed
        row["steps_lost"] = 0  # no process restarted: every survivor's step() count went on
    if result.back_at is not None:
        back = result.started + result.back_at
        taken = next((e for e in lines if str(drop.site) in e["joined"].split(",") and e["time"] > back), None)
        if taken:
            row["back_to_training_s"] = taken["time"] - back
        arrived = [e for e in _membership(texts[drop.site]) if e["time"] > back]
        if arrived:
            row["received_mb"] = arrived[0]["state_bytes"] / 1e6
            started = float(parse_final_line(texts[drop.site], MEMBERSHIP_KEYS)["process_start"])
            row["start_to_training_s"] = arrived[0]["time"] - started  # its own process: imports, data, model, join
    return row


def torchft_run(args: Any, label: str, drop: None, churn: Churn | None = None) -> dict[str, Any]:
    """The same sites with torchft's own streaming DiLoCo (``benchmarks/torchft_lm.py``), its Lighthouse as the
    coordinator: how long the run took, and the final lines of the sites that ended it."""
    folder = fresh_folder(args, label)
    script = [
        "--steps", str(args.steps), "--period", str(args.period), "--overlap-steps", str(args.period // 8),
        "--out", str(folder / "site{site}"),
    ]  # fmt: skip
    result = run_sites(
        common.REPO / "benchmarks" / "torchft_lm.py",
        script,
        sites=args.sites,
        devices=1,
        bandwidth=args.bandwidth,
        out=folder / "sites",
        launcher="live",
        churn=churn,
        stream=False,
        timeout=args.run_timeout,
        coordinator=lighthouse(),
    )
    texts = [out.read_text() for out, _ in result.logs]
    ended = [site for site, text in enumerate(texts) if "final:" in text]
    row: dict[str, Any] = {"run": label, "code": result.code, "sites_wall_s": result.wall_s}
    row["kills"] = len(result.churned)
    if result.code == 0 and ended:
        finals = [parse_final_line(texts[site], TORCHFT_KEYS) for site in ended]
        row.update({k: float(v) for k, v in finals[0].items()})
        row["heals"] = sum(text.count("healed: step") for text in texts)
        row["not_training_s"] = max(float(final["stalled_s"]) for final in finals)  # steps that waited over 2 s
        row["losses"] = [float(final["val_loss"]) for final in finals]
    return row


def _membership(text: str) -> list[dict[str, Any]]:
    """The ``membership:`` lines of a site's output, with their numbers as numbers."""
    lines = []
    for line in text.splitlines():
        if line.startswith("membership: epoch="):
            fields = dict(field.split("=", 1) for field in line.split()[1:])
            lines.append({**fields, "time": float(fields["time"]), "state_bytes": int(fields["state_bytes"])})
    return lines


def fresh_folder(args: Any, label: str) -> Path:
    """The run's folder, emptied."""
    folder = args.out / f"{NAME}_runs" / label
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return folder


def run(
    args: Any, label: str, drop: Drop | None, join: Join | None = None, churn: Churn | None = None
) -> dict[str, Any]:
    folder = fresh_folder(args, label)
    script = [
        "--steps", str(args.steps), "--period", str(args.period), "--warmup-steps", "20", "--outer", "nesterov",
        "--checkpoint-rounds", "--resume", "auto", "--checkpoint-every", "0", "--timeout", "60",
        "--out", str(folder / "run"), *streaming_flags(args), *args.example_args,
    ]  # fmt: skip
    result = run_sites(
        common.REPO / "examples" / "lm_fabric.py",
        script,
        sites=args.sites,
        devices=args.devices,
        bandwidth=args.bandwidth,
        out=folder / "sites",
        launcher="torchrun",
        drop=drop,
        join=join,
        churn=churn,
        max_restarts=1000 if churn else 3,  # every kill and every return restarts the survivors' workers
        stream=False,
        timeout=args.run_timeout,
    )
    out, err = (path.read_text() for path in result.logs[0])
    row: dict[str, Any] = {"run": label, "code": result.code, "sites_wall_s": result.wall_s}
    if result.code == 0:
        row.update({k: float(v) for k, v in parse_final_line(out, common.LM_KEYS).items()})
    resumes = [(int(s), int(w), float(t)) for s, w, t in RESUMED.findall(out)]
    row["resumes"], row["kills"] = resumes, len(result.churned)
    if result.churned:  # the survivors stop at each kill and at each return: until their workers train again
        events = [at for _, killed, back in result.churned for at in (killed, back) if at is not None]
        again = [next((t for _, _, t in resumes if t > result.started + at), None) for at in events]
        row["not_training_s"] = sum(t - (result.started + at) for t, at in zip(again, events) if t is not None)
    if join is not None and result.joined_at is not None:
        joined = result.started + result.joined_at
        grown = next(((s, w, t) for s, w, t in resumes if t > joined and w == 3 * args.devices), None)
        if grown:
            row["back_to_training_s"] = grown[2] - joined
        row.update(_phases(result.logs[join.site][0], 3 * args.devices))
    if drop is not None and result.dropped_at is not None:
        killed = result.started + result.dropped_at
        failures = [_agent_time(m.group(1), killed) for line in err.splitlines() if (m := AGENT_FAILED.match(line))]
        detected = next((t for t in failures if t >= killed), None)
        sites = args.sites
        again = next(((s, w, t) for s, w, t in resumes if t > killed and w == (sites - 1) * args.devices), None)
        failed_at = [int(s) for s in FAILED_ROUND.findall(out + err)]
        row.update(
            killed_after_s=result.dropped_at,
            detect_s=detected - killed if detected else None,
            restart_s=again[2] - detected if again and detected else None,
            kill_to_training_s=again[2] - killed if again else None,
            resumed_step=again[0] if again else None,
            failed_step=failed_at[0] if failed_at else None,
        )
        if again and failed_at:
            row["steps_lost"] = failed_at[0] - again[0]
        grown = next(((s, w, t) for s, w, t in resumes if t > killed and w == sites * args.devices), None)
        if grown and result.back_at is not None:
            row["back_to_training_s"] = grown[2] - (result.started + result.back_at)
        row.update(_phases(result.logs[drop.site][0], sites * args.devices))
    return row


def _phases(log: Any, world: int) -> dict[str, Any]:
    """Where a site's start into a world of ``world`` went: its first process's ``--resume auto`` line, the last one,
    and what it received."""
    text = log.read_text()
    lines = [p for w, p in PHASES.findall(text) if int(w) == world]
    received = [float(mb) for w, mb in RECEIVED.findall(text) if int(w) == world]
    row: dict[str, Any] = {"received_mb": received[-1]} if received else {}
    if lines:
        row["rejoin_phases"] = {k: float(v) for k, v in (item.split("=") for item in lines[-1].split())}
    return row


def streaming_flags(args: Any, live: bool = False) -> list[str]:
    """``--streaming``: (islands) streaming DiLoCo, 4 fragments, each merged period / 8 steps after its launch; a
    live site's processes are islands by themselves (its own world)."""
    if not args.streaming:
        return []
    return [*([] if live else ["--layout", "islands"]), "--fragments", "4", "--overlap-steps", str(args.period // 8)]


def _agent_time(stamp: str, near: float) -> float:
    """A torch elastic log time ("MMDD HH:MM:SS.ffffff", local time, no year) as unix time, in ``near``'s year."""
    year = datetime.fromtimestamp(near).year
    return datetime.strptime(f"{year}{stamp}", "%Y%m%d %H:%M:%S.%f").timestamp()


def main(argv: list[str] | None = None) -> None:
    common.start_clock()
    p = common.parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--bandwidth", default="100mbit", help="the link between the sites")
    p.add_argument("--devices", type=int, default=None, help="processes per site (default 2; quick and --live 1)")
    p.add_argument("--sites", type=int, default=None, help="sites (default 2; --live and --join-at 3)")
    p.add_argument("--steps", type=int, default=None, help="LM steps (default 2000; quick 600)")
    p.add_argument("--period", type=int, default=32, help="DiLoCo period")
    p.add_argument(
        "--streaming", action="store_true", help="islands streaming DiLoCo (4 fragments, overlap period / 8)"
    )
    p.add_argument("--at", type=float, default=None, help="seconds after the start to kill site 1 (default 45)")
    p.add_argument("--back", type=float, default=None, help="seconds after the start to bring it back (default 80)")
    p.add_argument(
        "--join-at", type=float, default=None, help="instead of a drop: a third site starts this many seconds in"
    )
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds before a run is abandoned")
    p.add_argument(
        "--live",
        action="store_true",
        help="the same drop in live membership (--launcher live) beside torchrun's (3 sites x 1 process by default)",
    )
    p.add_argument("--drop-site", type=int, default=1, help="the site to drop (0: live runs only; default 1)")
    p.add_argument(
        "--churn",
        metavar="EVERY:DOWN",
        help="instead of one drop: kill a site every EVERY s, back DOWN s later, under torchrun and live (3 sites x 1)",
    )
    p.add_argument(
        "--paths",
        nargs="+",
        choices=list(PATHS),
        default=list(PATHS),
        help="with --churn: which paths to run, each uninterrupted and churned (torchft: when installed)",
    )
    p.add_argument("example_args", nargs="*", help="more flags for the example, after `--`")
    args = p.parse_args(argv)
    args.live = args.live or bool(args.churn)  # churn: the torchrun and live paths side by side
    args.devices = args.devices or (1 if args.quick or args.live else 2)
    args.sites = args.sites or (3 if args.live or args.join_at else 2)
    if args.live and args.join_at:
        p.error("--live drops a site (no --join-at)")
    if args.join_at and args.sites != 3:
        p.error("--join-at starts a third site: --sites 3")
    if args.drop_site == 0 and not args.live:
        p.error("--drop-site 0 needs --live: torchrun's site 0 hosts the rendezvous")
    args.steps = args.steps or (600 if args.quick else 10000 if args.churn else 2000)
    if args.churn:
        every, _, down = args.churn.partition(":")
        churn = Churn(float(every), float(down))
        if "torchft" in args.paths and not (HAS_TORCHFT and args.streaming and args.devices == 1):
            p.error("--paths torchft needs torchft (pip install -e '.[peers]'), --streaming and --devices 1")
        rows, runners = [], {"torchrun": run, "live": live_run, "torchft": torchft_run}
        for path in args.paths:
            for label, kill in ((PATHS[path][0], None), (PATHS[path][1], churn)):
                rows.append(runners[path](args, label, None, churn=kill))
                common.progress(f"{label}: exit code {rows[-1]['code']}, {rows[-1]['sites_wall_s']:.0f} s")
        print_churn(args, churn, rows, common.machine_info())
        return
    if args.streaming and (args.period % 32 or (args.devices < 2 and not args.live)):
        p.error("--streaming needs a --period that 32 divides and --devices >= 2 (islands; --live: any)")
    at = args.at or (25.0 if args.quick else 45.0)
    back = args.back if args.back is not None else (45.0 if args.quick else 80.0)
    info = common.machine_info()
    rows = [run(args, "uninterrupted", None)]
    common.progress(f"uninterrupted: exit code {rows[0]['code']}, {rows[0]['sites_wall_s']:.0f} s")
    if args.join_at:
        rows.append(run(args, "site-2-joins", None, Join(site=2, at=args.join_at)))
    else:
        torchrun_site = args.drop_site or 1
        rows.append(run(args, f"site-{torchrun_site}-dropped", Drop(site=torchrun_site, at=at, back=back or None)))
    if args.live:
        rows.append(live_run(args, "live-uninterrupted", None))
        common.progress(f"live uninterrupted: exit code {rows[-1]['code']}, {rows[-1]['sites_wall_s']:.0f} s")
        rows.append(live_run(args, f"live-site-{args.drop_site}-dropped", Drop(args.drop_site, at, back or None)))
        common.progress(f"live, site {args.drop_site} dropped: exit code {rows[-1]['code']}")
        print_live(args, at, back, rows, info)
        return
    whole, changed = rows
    label = "site 2 joins" if args.join_at else "site 1 dropped"
    common.progress(f"{label}: exit code {changed['code']}, {changed['sites_wall_s']:.0f} s")
    print(f"# {'A site joining' if args.join_at else 'Losing a site'} under torchrun's elastic agent"
          f"{' (QUICK)' if args.quick else ''}\n")  # fmt: skip
    print(common.machine_line(info, bandwidth=args.bandwidth, processes_per_site=args.devices, steps=args.steps))
    mode = f"islands streaming DiLoCo {args.period} (4 fragments, overlap {args.period // 8})" if args.streaming else ""
    event = (
        f"site 2 starts at {args.join_at:.0f} s"
        if args.join_at
        else f"site 1 killed at {at:.0f} s" + (f", back at {back:.0f} s" if back else "")
    )
    print(
        f"\nexamples/lm_fabric.py, {mode or f'DiLoCo period {args.period}'}, {3 if args.join_at else 2} sites x"
        f" {args.devices} processes behind"
        f" {args.bandwidth}; {event}.\n"
    )

    def cell(value: Any, fmt: str = "{:.1f}") -> str:
        return "-" if value is None else fmt.format(value)

    table = [
        ["exit codes (site 0)", whole["code"], changed["code"]],
        ["steps finished", cell(whole.get("steps"), "{:g}"), cell(changed.get("steps"), "{:g}")],
        ["final validation loss", cell(whole.get("val_loss"), "{:.4f}"), cell(changed.get("val_loss"), "{:.4f}")],
        ["wall-clock s (the tool's, start to end)", cell(whole["sites_wall_s"]), cell(changed["sites_wall_s"])],
        ["wall-clock s (the example's, its last start)", cell(whole.get("wall_s")), cell(changed.get("wall_s"))],
    ]
    if not args.join_at:
        table += [
            ["kill -> survivors' round fails, s", "-", cell(changed.get("detect_s"))],
            ["failed round -> training again, s", "-", cell(changed.get("restart_s"))],
            ["kill -> training again, s", "-", cell(changed.get("kill_to_training_s"))],
            ["steps lost (failed round - resumed)", "-", cell(changed.get("steps_lost"), "{:g}")],
        ]
    arrived = "site starts -> training with all 3, s" if args.join_at else "site back -> training with both, s"
    table += [
        [arrived, "-", cell(changed.get("back_to_training_s"))],
        ["MB the arriving site received", "-", cell(changed.get("received_mb"), "{:.2f}")],
    ]
    if whole.get("val_loss") and changed.get("val_loss"):
        table.append(["loss vs uninterrupted", "-", f"{100 * (changed['val_loss'] / whole['val_loss'] - 1):+.2f}%"])
    print(common.markdown_table(["", "uninterrupted", label], table))
    print(f"\nresumes (step, processes): {[(s, w) for s, w, _ in changed['resumes']]}")
    if changed.get("rejoin_phases"):
        phases = " ".join(f"{name} {seconds:.1f}" for name, seconds in changed["rejoin_phases"].items())
        print(f"the arriving site's start, seconds per phase: {phases}")
    common.write_json(args.out / f"{NAME}.json", {"machine": info, "args": vars(args), "rows": rows, "at": time.time()})


def print_live(args: Any, at: float, back: float, rows: list[dict[str, Any]], info: dict[str, Any]) -> None:
    """The torchrun path and live membership side by side: one table."""
    print(
        f"# Losing a site and taking it back: torchrun's elastic agent and live membership{' (QUICK)' * args.quick}\n"
    )
    print(common.machine_line(info, bandwidth=args.bandwidth, processes_per_site=args.devices, steps=args.steps))
    mode = f"streaming DiLoCo {args.period} (4 fragments, overlap {args.period // 8})" if args.streaming else ""
    print(
        f"\nexamples/lm_fabric.py, {mode or f'DiLoCo period {args.period}'}, {args.sites} sites x {args.devices}"
        f" process{'es' * (args.devices > 1)} behind"
        f" {args.bandwidth}; site {args.drop_site or 1} (torchrun) and site {args.drop_site} (live) killed"
        f" at {at:.0f} s, back at {back:.0f} s.\n"
    )

    def cell(row: dict[str, Any], key: str, fmt: str = "{:.1f}") -> str:
        value = row.get(key)
        return "-" if value is None else fmt.format(value)

    spec = [
        ("exit code", "code", "{}"),
        ("steps finished", "steps", "{:g}"),
        ("final validation loss", "val_loss", "{:.4f}"),
        ("wall-clock s (the tool's, start to end)", "sites_wall_s", "{:.1f}"),
        ("kill -> survivors training again, s", "kill_to_training_s", "{:.1f}"),
        ("steps lost", "steps_lost", "{:g}"),
        (f"site back -> training with all {args.sites}, s", "back_to_training_s", "{:.1f}"),
        ("  of which its process's start -> in the epoch, s", "start_to_training_s", "{:.1f}"),
        ("MB the returning site received", "received_mb", "{:.2f}"),
        ("survivors' membership_wait_s (most)", "membership_wait_s", "{:.2f}"),
    ]
    table = [[name, *(cell(row, key, fmt) for row in rows)] for name, key, fmt in spec]
    for base, changed in zip(rows[::2], rows[1::2]):
        if base.get("val_loss") and changed.get("val_loss"):
            changed["loss_vs_uninterrupted"] = 100 * (changed["val_loss"] / base["val_loss"] - 1)
    table.append(["loss vs uninterrupted, %", *(cell(row, "loss_vs_uninterrupted", "{:+.2f}") for row in rows)])
    print(common.markdown_table(["", "torchrun", "torchrun, dropped", "live", "live, dropped"], table))
    for row in rows[2:]:
        if row.get("losses"):
            print(f"{row['run']}: every site's final validation loss {row['losses']}")
    common.write_json(args.out / f"{NAME}.json", {"machine": info, "args": vars(args), "rows": rows, "at": time.time()})


def print_churn(args: Any, churn: Churn, rows: list[dict[str, Any]], info: dict[str, Any]) -> None:
    """Training under churn, the torchrun path and live membership side by side: one table."""
    print(f"# Sites that come and go: torchrun's elastic agent and live membership{' (QUICK)' * args.quick}\n")
    print(common.machine_line(info, bandwidth=args.bandwidth, processes_per_site=args.devices, steps=args.steps))
    mode = f"streaming DiLoCo {args.period} (4 fragments, overlap {args.period // 8})" if args.streaming else ""
    print(
        f"\nexamples/lm_fabric.py, {mode or f'DiLoCo period {args.period}'}, {args.sites} sites x {args.devices}"
        f" behind {args.bandwidth}; every {churn.every:g} s a site is killed and started again {churn.down:g} s later"
        " (live: round robin from site 0; torchrun: from site 1, as its site 0 hosts the rendezvous).\n"
    )
    for base, changed in zip(rows[::2], rows[1::2]):
        if changed.get("code") == 0 and base.get("code") == 0:
            # steps made over the steps the uninterrupted run makes in the same time (both make --steps)
            changed["efficiency"] = 100 * base["sites_wall_s"] / changed["sites_wall_s"]
            if "not_training_s" in changed:
                changed["training_share"] = 100 * (1 - changed["not_training_s"] / changed["sites_wall_s"])
            if base.get("val_loss") and changed.get("val_loss"):
                changed["loss_vs_uninterrupted"] = 100 * (changed["val_loss"] / base["val_loss"] - 1)

    def cell(row: dict[str, Any], key: str, fmt: str) -> str:
        value = row.get(key)
        return "-" if value is None else fmt.format(value)

    spec = [
        ("exit code", "code", "{}"),
        ("steps finished", "steps", "{:g}"),
        ("sites killed (and started again)", "kills", "{}"),
        ("wall-clock s (the tool's, start to end)", "sites_wall_s", "{:.1f}"),
        ("training efficiency, % (uninterrupted wall / this wall)", "efficiency", "{:.1f}"),
        ("a survivor's s not training (restarts; live: waits; torchft: steps over 2 s)", "not_training_s", "{:.1f}"),
        ("a survivor's share of the wall-clock training, %", "training_share", "{:.1f}"),
        ("final validation loss", "val_loss", "{:.4f}"),
        ("loss vs uninterrupted, %", "loss_vs_uninterrupted", "{:+.2f}"),
        ("survivors' membership_wait_s (most)", "membership_wait_s", "{:.2f}"),
        ("epochs (live) / resumes (torchrun) / heals (torchft)", "changes", "{}"),
    ]
    for row in rows:
        row["changes"] = row.get("epochs", row.get("heals", len(row.get("resumes", []))))
    table = [[name, *(cell(row, key, fmt) for row in rows)] for name, key, fmt in spec]
    print(common.markdown_table(["", *(COLUMNS[row["run"]] for row in rows)], table))
    for row in rows:
        if row.get("timeline"):
            print(f"\n{COLUMNS[row['run']]}: its timeline (the coordinator's status record, drawn): {row['timeline']}")
    common.write_json(args.out / f"{NAME}.json", {"machine": info, "args": vars(args), "rows": rows, "at": time.time()})


if __name__ == "__main__":
    main()
