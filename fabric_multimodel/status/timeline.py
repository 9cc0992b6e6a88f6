"""A picture of a run, from its status record (:mod:`fabric_multimodel.status.record`): one row per member (a
site's token) with the spans it trained in and went silent in, its joins and losses marked; under it each
member's seconds per round, and its reported loss, on the same clock. Needs matplotlib (``pip install
'fabric-multimodel[plot]'``); torch-free.

Example::

    python -m fabric_multimodel.status.timeline run.jsonl --out run.png
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fabric_multimodel.status.record import read_record


@dataclass
class Member:
    """What a record says of one member over the run: its spans (start, end, silent), and its figures in time."""

    token: str
    spans: list[tuple[float, float, bool]] = field(default_factory=list)
    joined: float | None = None
    lost: float | None = None  # when it went silent or left, the run unfinished
    round_s: list[tuple[float, float]] = field(default_factory=list)  # (time, seconds of a round)
    loss: list[tuple[float, float]] = field(default_factory=list)


def members_of(record: Sequence[dict[str, Any]]) -> tuple[list[Member], float]:
    """The members a record shows, in the order they first appear, and the seconds the record spans; times are
    seconds since its first line.

    Example::

        members, seconds = members_of(read_record("run.jsonl"))
    """
    if not record:
        return [], 0.0
    start = float(record[0]["time"])
    found: dict[str, Member] = {}
    last_rounds: dict[str, tuple[float, float]] = {}  # per member: when its round count last moved, and to what
    for index, line in enumerate(record):
        now = float(line["time"]) - start
        until = float(record[index + 1]["time"]) - start if index + 1 < len(record) else now
        finished = bool(line.get("finished"))
        for token, silent in [(t, False) for t in line["members"]] + [(t, True) for t in line["silent"]]:
            if silent and finished:  # the run ended: its last members stopped beating, none was lost
                continue
            member = found.setdefault(token, Member(token, joined=now if index else None))
            _extend(member, now, until, silent)
            if silent and member.lost is None:
                member.lost = now
        for token, member in found.items():
            if token not in line["members"] and token not in line["silent"] and member.lost is None and not finished:
                member.lost = now
        for token, figures in line["members"].items():
            loss = figures.get("loss")
            if isinstance(loss, (int, float)):
                found[token].loss.append((now, float(loss)))
            rounds, before = figures.get("rounds"), last_rounds.get(token)
            if not isinstance(rounds, (int, float)) or (before is not None and rounds == before[1]):
                continue
            if before is not None and rounds > before[1]:  # the last round's, else the time the count took to move
                last = figures.get("round_s")
                seconds = last if isinstance(last, (int, float)) else (now - before[0]) / (rounds - before[1])
                found[token].round_s.append((now, float(seconds)))
            last_rounds[token] = (now, rounds)
    return list(found.values()), float(record[-1]["time"]) - start


def _extend(member: Member, now: float, until: float, silent: bool) -> None:
    """Continue ``member``'s last span when it is of the same kind and ends at ``now``, else start one."""
    if member.spans and member.spans[-1][1] == now and member.spans[-1][2] == silent:
        member.spans[-1] = (member.spans[-1][0], until, silent)
    else:
        member.spans.append((now, until, silent))


def draw_timeline(record: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Draw ``record`` (:func:`~fabric_multimodel.status.record.read_record`) as a PNG at ``path``: membership,
    seconds per round, loss, on one clock.

    Example::

        draw_timeline(read_record("run.jsonl"), "run.png", title="3 sites, one killed twice")
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    members, seconds = members_of(record)
    if not members:
        raise ValueError("the record holds no member: nothing to draw (did the run's sites reach the coordinator?)")
    height = 1.2 + 0.35 * len(members)
    figure, (rows, rounds, losses) = plt.subplots(
        3, 1, sharex=True, figsize=(10, height + 4.5), gridspec_kw={"height_ratios": [height, 2.2, 2.2]}
    )
    for y, member in enumerate(members):
        for begin, end, silent in member.spans:
            rows.barh(y, max(end - begin, seconds / 500), left=begin, height=0.6,
                      color="#d9a441" if silent else "#4c9a5f")  # fmt: skip
        if member.joined is not None:
            rows.plot(member.joined, y, marker=">", color="#1f5f99", markersize=8)
        if member.lost is not None:
            rows.plot(member.lost, y, marker="x", color="#b22222", markersize=9, markeredgewidth=2)
        color = f"C{y % 10}"
        if member.round_s:
            rounds.plot(*zip(*member.round_s), marker=".", linewidth=1, color=color, label=member.token)
        if member.loss:
            losses.plot(*zip(*member.loss), linewidth=1.2, color=color, label=member.token)
    rows.set_yticks(range(len(members)), [m.token for m in members])
    rows.invert_yaxis()
    rows.set_title(title or "members (green: training, amber: silent; > joined, x lost)", loc="left")
    rounds.set_ylabel("seconds a round")
    losses.set_ylabel("reported loss")
    losses.set_xlabel("seconds since the record began")
    for axes in (rounds, losses):
        axes.grid(alpha=0.3)
    if len(members) <= 24 and (rounds.get_lines() or losses.get_lines()):  # beside the curves, not on them
        (rounds if rounds.get_lines() else losses).legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fabric_multimodel.status.timeline",
        description="Draw a run's status record (membership, seconds a round, loss) as a PNG.",
    )
    parser.add_argument("record", type=Path, help="the status record (the coordinator's --status-record)")
    parser.add_argument("--out", type=Path, help="the PNG to write (default: the record's name, .png)")
    parser.add_argument("--title", default="", help="the picture's title")
    args = parser.parse_args(argv)
    if not args.record.is_file():
        parser.error(f"record: no such file: {args.record}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        parser.error("the timeline needs matplotlib: pip install 'fabric-multimodel[plot]'")
    record = read_record(args.record)
    try:
        out = draw_timeline(record, args.out or args.record.with_suffix(".png"), args.title)
    except ValueError as error:
        print(f"timeline: {error}", file=sys.stderr)
        return 1
    members, seconds = members_of(record)
    print(f"timeline: {out} ({len(record)} lines, {len(members)} members, {seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
