"""A run's status as a person reads it: one HTML page, whole on the server (it needs no script, works with
JavaScript off and asks nothing of the internet), that reloads itself; and as JSON for machines.

Every text in it came from the store (:mod:`.snapshot`: already cut to length), so every one is escaped here, in
text and in attributes alike; the page's Content-Security-Policy (:data:`HEADERS`) forbids scripts and any request
beyond the page itself, so a name that slipped through could still run nothing.

Example::

    html = render(reader.read(), refresh_s=2)
"""

from __future__ import annotations

import json
import time
from html import escape
from typing import Any

#: The headers every answer carries: no script, no request to anywhere (inline styles only), no sniffing.
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src data:",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }
th { background: #f3f3f3; }
td.in { background: #4c9a5f; } td.out { background: #fff; } td.new { background: #86c58f; }
.silent { color: #a33; } .small { color: #666; font-size: 12px; }
"""


def as_json(status: dict[str, Any]) -> bytes:
    """The status as JSON bytes (UTF-8; every text already a str).

    Example::

        body = as_json(reader.read())
    """
    return json.dumps(status, ensure_ascii=True, allow_nan=False).encode()


def render(status: dict[str, Any], refresh_s: float = 2.0) -> str:
    """The page: the members (and the silent ones), the registrations that wait, and a timeline of the epochs.

    Example::

        totals = {"epochs": 0, "registrations": 0, "finished": False, "unreadable": 0}
        page = render({"run": "", "epoch": None, "members": [], "silent": [], "waiting": [], "passed_over": [],
                       "history": [], "totals": totals, "time": 0})
    """
    totals = status["totals"]
    title = f"run {status['run'] or '(no id yet)'}: epoch {status['epoch'] if status['epoch'] is not None else '-'}"
    count = len(status["members"])
    state = "finished" if totals["finished"] else f"{count} site{'' if count == 1 else 's'} training"
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<meta http-equiv='refresh' content='{float(refresh_s):g}'>",
        f"<title>{escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        f"<p>{escape(state)}; {totals['epochs']} epochs, {totals['registrations']} registrations"
        f"{'; ' + str(totals['unreadable']) + ' unreadable values ignored' if totals['unreadable'] else ''}."
        f" <span class='small'>At {escape(time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(status['time'])))};"
        f" this page reloads every {float(refresh_s):g} s; <a href='status.json'>status.json</a></span></p>",
        _members(status),
        _timeline(status["history"]),
        "</body></html>",
    ]
    return "\n".join(parts)


def _members(status: dict[str, Any]) -> str:
    head = "".join(f"<th>{title}</th>" for title in ("site", "token", "epoch", "heartbeat", *_TITLES, "reported"))
    rows = [f"<h2>Members</h2><table id='members'><tr>{head}</tr>"]
    for kind in ("members", "silent"):
        for m in status[kind]:
            age = "-" if m["heartbeat_s"] is None else f"{m['heartbeat_s']:g} s ago"
            css = " class='silent'" if kind == "silent" else ""
            rows.append(
                f"<tr{css}><td>{escape(m['site'])}</td><td>{escape(m['token'])}</td><td>{m['epoch']}</td>"
                f"<td>{escape(age)}{' (silent)' if kind == 'silent' else ''}</td>{_figures(m['figures'])}</tr>"
            )
    rows.append("</table>")
    for key, what in (("waiting", "Waiting to be admitted"), ("passed_over", "Passed over (gone before admitted)")):
        if status[key]:
            rows.append(f"<p id='{key}'>{what}: " + ", ".join(escape(t) for t in status[key]) + "</p>")
    return "\n".join(rows)


#: The figures the members' table shows a column of, in its order, and how each is written; the others a site
#: reported share the last column.
_COLUMNS = {"step": "{:,.0f}", "rounds": "{:,.0f}", "bytes": "{:,.0f}", "round_s": "{:,.3f}", "wait_s": "{:,.2f}",
            "loss": "{:.4g}"}  # fmt: skip
_TITLES = ("step", "rounds", "bytes sent", "last round s", "membership s", "loss")


def _figures(figures: dict[str, float | None]) -> str:
    """A member's published figures as cells (``-`` for one it has not published, ``not finite`` for a NaN)."""
    cells = [_figure(figures.get(name, "-"), form) for name, form in _COLUMNS.items()]
    others = [f"{name}={_figure(value, '{:.4g}')}" for name, value in figures.items() if name not in _COLUMNS]
    return "".join(f"<td>{escape(cell)}</td>" for cell in [*cells, " ".join(others)])


def _figure(value: float | str | None, form: str) -> str:
    return "not finite" if value is None else value if isinstance(value, str) else form.format(value)


def _timeline(history: list[dict[str, Any]]) -> str:
    """One row per token, one column per epoch (newest right): a filled cell where the token was a member."""
    if not history:
        return "<h2>Epochs</h2><p>No epoch yet.</p>"
    tokens: list[str] = []
    for epoch in history:
        tokens += [t for t in epoch["members"] if t not in tokens]
    head = "".join(f"<th>{e['epoch']}</th>" for e in history)
    rows = [f"<h2>Epochs</h2><table id='timeline'><tr><th>member</th>{head}</tr>"]
    for token in tokens:
        cells = []
        for epoch in history:
            kind = ("new" if token in epoch["joined"] else "in") if token in epoch["members"] else "out"
            cells.append(f"<td class='{kind}'></td>")
        rows.append(f"<tr><td>{escape(token)}</td>{''.join(cells)}</tr>")
    rows.append("</table>")
    changes = [f"epoch {e['epoch']} (seen {time.strftime('%H:%M:%S', time.localtime(e['seen']))}): {_change(e)}"
               for e in reversed(history)]  # fmt: skip
    return "\n".join(rows) + "<ul>" + "".join(f"<li>{c}</li>" for c in changes) + "</ul>"


def _change(epoch: dict[str, Any]) -> str:
    """Who joined and who left at ``epoch``, and why they left when the survivors of a failed round said so."""
    lost = " (lost: a round failed and the others went on)" if epoch["left"] and epoch["after_loss"] else ""
    joined, left = (", ".join(map(escape, epoch[key])) or "none" for key in ("joined", "left"))
    return f"joined {joined}; left {left}{lost}"
