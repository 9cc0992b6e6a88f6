"""The coordinator of a run whose sites come and go: a store that every site reaches, and nothing else.

Run it on any stable host outside the training sites; it holds no training state, so the sites train on
through a restart of any of them, the first one started included::

    python -m fabric_multimodel.coordinator --port 29400 --status-port 8080   # the status page: http://127.0.0.1:8080/

and give each site its address (:class:`~fabric_multimodel.Membership`, the examples'
``--coordinator HOST:29400``). It is torch's ``TCPStore`` server: the sites' agreements are keys written once
with ``compare_set`` (see :mod:`fabric_multimodel.membership.membership`), and each epoch's process group meets there.
``--status-port`` serves a run's status beside it (:mod:`fabric_multimodel.status`): who trains, who went silent, who
waits, and each epoch's members; on 127.0.0.1 unless ``--status-host`` says otherwise; ``--status-record FILE`` keeps
it over time for a picture of the run (:mod:`fabric_multimodel.status.timeline`).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fabric_multimodel.status.server import StatusServer


def serve(port: int, stop: threading.Event, ready: threading.Event | None = None) -> None:
    """Serve the store on ``port`` (every interface) until ``stop`` is set; ``ready`` is set once it listens.

    Example::

        stop = threading.Event()
        threading.Thread(target=serve, args=(29400, stop), daemon=True).start()
    """
    import torch.distributed as dist

    store = dist.TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    if ready is not None:
        ready.set()
    stop.wait()
    del store


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fabric_multimodel.coordinator",
        description="Serve the store through which the sites of a run agree on who trains together.",
    )
    parser.add_argument("--port", type=int, default=29400, help="the TCP port to listen on (default: %(default)s)")
    parser.add_argument("--status-port", type=int, help="serve the run's status page (HTML and /status.json) here")
    parser.add_argument("--status-host", default="127.0.0.1", help="the status page's address (default: %(default)s)")
    parser.add_argument("--run", default="run", help="the run whose status the page shows (Membership's `run`)")
    parser.add_argument("--status-record", type=Path, help="with --status-port: append the status here, for a picture"
                        " of the run (python -m fabric_multimodel.status.timeline FILE)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.status_record is not None and args.status_port is None:
        parser.error("--status-record needs --status-port (the page's reader writes the record)")
    stop, closed = threading.Event(), threading.Event()  # a signal; then the store, once the page stopped reading it
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda *_: stop.set())
    ready = threading.Event()
    server = threading.Thread(target=serve, args=(args.port, closed, ready), daemon=True)
    server.start()
    while not ready.wait(0.1):
        if not server.is_alive():
            print(f"coordinator: could not listen on port {args.port}", file=sys.stderr)
            return 1
    print(f"coordinator: serving on port {args.port}; stop it with Ctrl-C or SIGTERM", flush=True)
    page = None
    if args.status_port is not None:
        page = status_page(args.port, args.run, args.status_host, args.status_port, args.status_record)
    if page is not None:
        print(f"coordinator: run {args.run}'s status on http://{args.status_host}:{page.port}/", flush=True)
    while not stop.wait(1.0):
        pass
    if page is not None:
        page.stop()
    closed.set()
    server.join(timeout=10)
    print("coordinator: stopped", flush=True)
    return 0


def status_page(port: int, run: str, host: str, status_port: int, record: Path | None = None) -> StatusServer:
    """The status page of ``run``, whose store this coordinator serves on ``port``, started on ``host:status_port``;
    each read also appended to ``record`` (:class:`~fabric_multimodel.status.record.Recorder`) when given.

    Example::

        page = status_page(29400, "run", "127.0.0.1", 8080, record=Path("run.jsonl"))
    """
    from fabric_multimodel.status.record import Recorder
    from fabric_multimodel.status.server import StatusServer
    from fabric_multimodel.status.snapshot import StatusReader

    reader = StatusReader.connect(f"127.0.0.1:{port}", run)
    on_read = None if record is None else Recorder(record)
    return StatusServer(reader, host=host, port=status_port, on_read=on_read).start()


if __name__ == "__main__":
    sys.exit(main())
