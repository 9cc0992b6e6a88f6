"""A run's status over time, for the picture after it: :class:`Recorder` appends what each read of the store says
(:class:`~fabric_multimodel.status.snapshot.StatusReader`) to a file of JSON lines, one line when the members change
and at most one a ``every_s`` seconds otherwise; :func:`read_record` reads it back for
:mod:`fabric_multimodel.status.timeline`. Torch-free, so the sites tool and a laptop can read a record.

Each line: ``{"time": ..., "epoch": ..., "finished": ..., "members": {token: {"site": ..., "step": ..., "rounds":
..., "loss": ..., ...}}, "silent": [token, ...]}``: what the status page showed then, its figures as the sites
published them.

Example::

    python -m fabric_multimodel.coordinator --port 29400 --status-port 8080 --status-record run.jsonl
    python -m fabric_multimodel.status.timeline run.jsonl --out run.png
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

_log = logging.getLogger(__name__)


class Recorder:
    """Appends ``status`` dicts (``StatusReader.read()``) to ``path`` as JSON lines: at once when the epoch, the
    members, the silent ones or the end changed, else at most one line every ``every_s`` seconds (of the status's
    own ``time``). A line is whole or absent: each is written and flushed in one call.

    Example::

        server = StatusServer(reader, on_read=Recorder("run.jsonl"))
    """

    def __init__(self, path: str | Path, every_s: float = 1.0) -> None:
        if not every_s >= 0:
            raise ValueError(f"Recorder: `every_s` must be >= 0 seconds, got {every_s!r}.")
        self.path, self.every_s = Path(path), every_s
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._last: tuple[Any, ...] | None = None
        self._last_time = -float("inf")
        self._figures: list[dict[str, Any]] = []
        #: Lines written so far.
        self.lines = 0

    def __call__(self, status: dict[str, Any]) -> None:
        line = {
            "time": status["time"],
            "epoch": status["epoch"],
            "finished": status["totals"]["finished"],
            "members": {m["token"]: {"site": m["site"], **m["figures"]} for m in status["members"]},
            "silent": [m["token"] for m in status["silent"]],
        }
        shape = (line["epoch"], line["finished"], tuple(line["members"]), tuple(line["silent"]))
        figures = [m["figures"] for m in status["members"]]
        if shape == self._last and (status["time"] - self._last_time < self.every_s or figures == self._figures):
            return
        self._last, self._last_time, self._figures = shape, status["time"], figures
        self._file.write(json.dumps(line, separators=(",", ":"), allow_nan=False) + "\n")
        self._file.flush()
        self.lines += 1

    def close(self) -> None:
        """Close the file (what was written stays)."""
        self._file.close()


def read_record(path: str | Path) -> list[dict[str, Any]]:
    """The lines :class:`Recorder` wrote to ``path``, oldest first; a line that is not one (a run killed in the
    middle of a write, another file) is skipped and counted in the log.

    Example::

        record = read_record("run.jsonl")
        print(len(record), "reads;", record[-1]["members"].keys())
    """
    lines, skipped = [], 0
    with Path(path).open(encoding="utf-8", errors="replace") as file:
        for text in file:
            try:
                line = json.loads(text)
                if not isinstance(line, dict) or not isinstance(line.get("members"), dict):
                    raise ValueError("not a status line")
                float(line["time"])
                line.setdefault("silent", [])
            except (ValueError, KeyError, TypeError):
                skipped += 1
                continue
            lines.append(line)
    if skipped:
        _log.warning("%s: %d lines that are not status lines were skipped", path, skipped)
    return lines
