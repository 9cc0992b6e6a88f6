"""The status page served over HTTP: :class:`StatusServer` reads the run's status every ``poll_s`` seconds in a thread
of its own and answers ``/`` (the page) and ``/status.json`` from the last read, so an answer never waits on the
store. Read-only: it answers GET and HEAD, nothing else.

Example::

    server = StatusServer(StatusReader(store), host="127.0.0.1", port=8080)
    server.start()   # http://127.0.0.1:8080/ until server.stop()
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from fabric_multimodel.status.page import HEADERS, as_json, render
from fabric_multimodel.status.snapshot import StatusReader

_log = logging.getLogger(__name__)


class StatusServer:
    """Serves ``reader``'s status on ``host:port`` (``port=0``: a free one, then its ``port``) until :meth:`stop`;
    ``on_read(status)`` after each read (a :class:`~fabric_multimodel.status.record.Recorder`).

    Example::

        with StatusServer(reader, port=0) as server:
            print(f"http://127.0.0.1:{server.port}/status.json")
    """

    def __init__(
        self,
        reader: StatusReader,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        poll_s: float = 0.5,
        on_read: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.reader, self.poll_s, self.on_read = reader, poll_s, on_read
        self._status: dict[str, Any] | None = None
        self._failing = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._http = ThreadingHTTPServer((host, port), _handler(self))
        self._http.daemon_threads = True
        self.host, self.port = host, self._http.server_address[1]
        self._threads = [
            threading.Thread(target=self._poll, name="status-reader", daemon=True),
            threading.Thread(target=self._http.serve_forever, name="status-http", daemon=True),
        ]

    @property
    def status(self) -> dict[str, Any] | None:
        """The last status read (None before the first read succeeds)."""
        with self._lock:
            return self._status

    def start(self) -> StatusServer:
        """Read once, then start reading every ``poll_s`` and serving; returns this server."""
        self._read()
        for thread in self._threads:
            thread.start()
        _log.info("status page on http://%s:%d/", self.host, self.port)
        return self

    def stop(self) -> None:
        """Stop serving and reading (the port is free again when this returns)."""
        self._stop.set()
        self._http.shutdown()
        self._http.server_close()
        for thread in self._threads:
            thread.join(timeout=5)

    def __enter__(self) -> StatusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._read()

    def _read(self) -> None:
        try:
            status = self.reader.read()
        except Exception as error:  # the store is out of reach: the last status stays, said once
            if not self._failing:
                _log.warning("status: the run's store did not answer (%s); showing the last read", error)
            self._failing = True
        else:
            self._failing = False
            with self._lock:
                self._status = status
            if self.on_read is not None:  # a Recorder: the run over time
                self.on_read(status)


def _handler(server: StatusServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            status = server.status
            if self.path not in ("/", "/status.json"):
                self._answer(404, "text/plain; charset=utf-8", b"not found: / or /status.json")
            elif status is None:
                self._answer(503, "text/plain; charset=utf-8", b"no status read yet: the store has not answered")
            elif self.path == "/status.json":
                self._answer(200, "application/json", as_json(status))
            else:
                self._answer(200, "text/html; charset=utf-8", render(status, refresh_s=2.0).encode())

        def do_HEAD(self) -> None:  # noqa: N802
            self.do_GET()

        def _answer(self, code: int, kind: str, body: bytes) -> None:
            self.send_response(code)
            for name, value in {**HEADERS, "Content-Type": kind, "Content-Length": str(len(body))}.items():
                self.send_header(name, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
            _log.debug("status: %s %s", self.address_string(), format % args)

    return Handler
