"""``python -m fabric_multimodel.status --coordinator ADDRESS``: the status page of a live run whose coordinator is
any store the sites reach (an etcd cluster, ``etcd://host:port,...``, or a ``python -m fabric_multimodel.coordinator``
elsewhere), served here on ``--host:--port``.

Example::

    python -m fabric_multimodel.status --coordinator etcd://10.0.0.1:2379,10.0.0.2:2379 --port 8080
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from fabric_multimodel.membership.stores import check_coordinator


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fabric_multimodel.status", description=__doc__.splitlines()[0])
    parser.add_argument("--coordinator", required=True, help="the run's store: host:port or etcd://host:port,...")
    parser.add_argument("--run", default="run", help="the run's name (Membership's `run`; default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="the page's address (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8080, help="the page's port (default: %(default)s)")
    parser.add_argument("--record", type=Path, help="also append the status here (python -m"
                        " fabric_multimodel.status.timeline FILE draws it)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        check_coordinator(args.coordinator)
    except ValueError as error:
        parser.error(f"--coordinator must be host:port or etcd://host:port,...; {error}")
    from fabric_multimodel.status.record import Recorder
    from fabric_multimodel.status.server import StatusServer
    from fabric_multimodel.status.snapshot import StatusReader

    try:
        reader = StatusReader.connect(args.coordinator, args.run)
    except RuntimeError as error:
        print(
            f"status: the coordinator {args.coordinator} did not answer: {str(error).splitlines()[0]}", file=sys.stderr
        )
        return 1
    stop = threading.Event()
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda *_: stop.set())
    on_read = None if args.record is None else Recorder(args.record)
    with StatusServer(reader, host=args.host, port=args.port, on_read=on_read) as server:
        print(f"status: run {args.run} at {args.coordinator} on http://{args.host}:{server.port}/", flush=True)
        while not stop.wait(1.0):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
