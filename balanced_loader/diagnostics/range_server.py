"""A small HTTP server for a local folder that honours ``Range`` and counts the bytes it serves.

For tests and ``tools/bench_remote.py``: serve a shard folder on localhost and measure what a
remote reader transfers. Stdlib only::

    with RangeServer("shards/") as server:       # http://127.0.0.1:PORT/
        src = balanced_loader.open_source(server.url)
        ...
        server.total_bytes()                     # body bytes served, all files

``ranges=False`` imitates a server that ignores ``Range`` (always ``200`` with the whole file).
Faults, for the retry tests: ``errors=N`` answers the next N requests ``503 Service Unavailable``,
``drops=N`` closes the connection of the next N requests without an answer, ``stall_s`` makes every
request wait that long before its answer (a stalled server).
Also ``python -m balanced_loader.diagnostics.range_server DIR [PORT]``.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as real servers; clients reuse connections
    server: _Server

    def setup(self) -> None:
        super().setup()
        # no Nagle delay between the header and body writes (with the client's delayed ACK it costs 40 ms a request)
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _file(self) -> str | None:
        rel = unquote(urlsplit(self.path).path).lstrip("/")
        path = os.path.realpath(os.path.join(self.server.root, rel))
        if not path.startswith(self.server.root + os.sep) or not os.path.isfile(path):
            return None
        return path

    def _send(self, status: int, headers: dict[str, str], body: bytes = b"", *, head: bool = False,
              length: int | None = None) -> None:
        """Answer ``status``; ``head``: headers only, with Content-Length ``length`` (default ``len(body)``)."""
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        if not head and body:
            self.server.count(self.path, len(body))  # before sending: a client that has the answer sees it counted
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def do_GET(self) -> None:
        self._serve(head=False)

    def _serve(self, head: bool) -> None:
        if self.server.latency_s:
            time.sleep(self.server.latency_s)
        fault = self.server.take_fault()
        if fault == "error":
            self._send(503, {"Retry-After": "0"}, b"busy")
            return
        if fault == "drop":  # the connection ends before any answer (a restarting server, a dropped link)
            self.close_connection = True
            self.request.shutdown(socket.SHUT_RDWR)
            return
        path = self._file()
        if path is None:
            self._send(404, {}, b"not found")
            return
        size = os.path.getsize(path)
        rng = _RANGE.match(self.headers.get("Range", "").strip()) if self.server.ranges else None
        if rng is None or not (rng.group(1) or rng.group(2)):
            if head:
                self._send(200, {"Accept-Ranges": "bytes" if self.server.ranges else "none"}, head=True,
                           length=size)
                return
            with open(path, "rb") as f:
                self._send(200, {}, f.read())
            return
        a, b = rng.group(1), rng.group(2)
        if a:
            start, end = int(a), min(int(b) + 1 if b else size, size)
        else:  # a suffix range: the last N bytes
            start, end = max(0, size - int(b)), size
        if start >= size or end <= start:
            self._send(416, {"Content-Range": f"bytes */{size}"})
            return
        with open(path, "rb") as f:
            f.seek(start)
            body = f.read(end - start)
        self._send(206, {"Content-Range": f"bytes {start}-{end - 1}/{size}"}, body, head=head)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # a concurrent prefetch opens dozens of connections at once: with socketserver's backlog of 5, a loaded
    # machine's accept queue overflows and a client whose connection looks open waits for an answer that
    # never comes (until its read timeout)
    request_queue_size = 256

    def __init__(self, root: str, port: int, ranges: bool, latency_s: float) -> None:
        self.root = os.path.realpath(root)
        self.ranges = ranges
        self.latency_s = latency_s
        self.faults = {"error": 0, "drop": 0}  # answers still to be spoiled, by kind
        self.faults_served = 0
        self.bytes_served: dict[str, int] = {}  # URL path -> body bytes sent
        self.requests = 0
        self._count_lock = threading.Lock()
        super().__init__(("127.0.0.1", port), _Handler)

    def take_fault(self) -> str | None:
        with self._count_lock:
            for kind, left in self.faults.items():
                if left:
                    self.faults[kind] = left - 1
                    self.faults_served += 1
                    return kind
        return None

    def count(self, path: str, n: int) -> None:
        with self._count_lock:
            key = urlsplit(path).path
            self.bytes_served[key] = self.bytes_served.get(key, 0) + n
            self.requests += 1


class RangeServer:
    """Serve ``root`` on ``127.0.0.1:port`` (0: any free port) in a background thread until ``close()``.

    ``latency_ms``: each request waits this long before it is answered (a network round trip;
    requests are served concurrently, one thread each).
    """

    def __init__(self, root: str, *, port: int = 0, ranges: bool = True, latency_ms: float = 0.0,
                 errors: int = 0, drops: int = 0, stall_s: float = 0.0) -> None:
        self._server = _Server(root, port, ranges, latency_ms / 1000 + stall_s)
        self.fail_next(errors=errors, drops=drops)
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="range-server", daemon=True)
        self._thread.start()

    @property
    def bytes_served(self) -> dict[str, int]:
        """Body bytes sent per URL path (``/index.json``, ``/shard-000000.tar``, ...)."""
        return dict(self._server.bytes_served)

    @property
    def requests(self) -> int:
        return self._server.requests

    def fail_next(self, *, errors: int = 0, drops: int = 0) -> None:
        """Spoil the next ``errors`` answers with 503 and then ``drops`` by closing the connection."""
        with self._server._count_lock:
            self._server.faults = {"error": int(errors), "drop": int(drops)}

    @property
    def faults_served(self) -> int:
        return self._server.faults_served

    def total_bytes(self) -> int:
        return sum(self._server.bytes_served.values())

    def reset(self) -> None:
        with self._server._count_lock:
            self._server.bytes_served.clear()
            self._server.requests = 0

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> RangeServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


if __name__ == "__main__":
    server = RangeServer(sys.argv[1], port=int(sys.argv[2]) if len(sys.argv) > 2 else 8000)
    print(f"serving {sys.argv[1]} at {server.url} (Ctrl-C to stop)")
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.close()
