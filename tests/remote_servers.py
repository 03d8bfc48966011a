"""Real servers on localhost for the remote-data tests: an HTTP file server with byte ranges (Python's http.server,
which serves none by itself) that can fail on purpose, and moto's S3 server over HTTP (as s3fs tests itself)."""

from __future__ import annotations

import functools
import http.server
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class Faults:
    """What the HTTP server does wrong next: ``fail`` requests answered 503 (S3's SlowDown), then ``drop`` replies
    cut off mid-body (the connection closed); ``latency_s`` before every reply (a distant store);
    ``requests`` logs (method, path, Range header) of every request."""

    def __init__(self) -> None:
        self.fail = 0
        self.drop = 0
        self.latency_s = 0.0
        self.requests: list[tuple[str, str, str]] = []
        self.lock = threading.Lock()

    def take(self) -> str | None:
        with self.lock:
            if self.fail:
                self.fail -= 1
                return "fail"
            if self.drop:
                self.drop -= 1
                return "drop"
        return None


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Files with byte ranges (206, Content-Range, 416), an ETag from the file's size and modification time, and the
    faults of :class:`Faults`; ``ranges=False`` ignores Range headers as the stdlib server does."""

    faults: Faults
    ranges = True
    protocol_version = "HTTP/1.1"  # connections kept alive, as a store's are

    def log_message(self, *args: Any) -> None:
        pass

    def send_head(self) -> Any:
        self.faults.requests.append((self.command, self.path, self.headers.get("Range", "")))
        if self.faults.latency_s:
            time.sleep(self.faults.latency_s)
        self._range: tuple[int, int] | None = None
        self._fault = self.faults.take() if self.command == "GET" else None
        if self._fault == "fail":
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        path = self.translate_path(self.path)
        if os.path.isdir(path):
            return super().send_head()
        try:
            f = open(path, "rb")  # returned to the server, which closes it
        except OSError:
            self.send_error(404)
            return None
        st = os.fstat(f.fileno())
        size, start, end = st.st_size, 0, st.st_size - 1
        m = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range", "").strip()) if self.ranges else None
        if m and (m[1] or m[2]):
            start, end = (int(m[1]), min(int(m[2]) if m[2] else size - 1, size - 1)) if m[1] else \
                (max(size - int(m[2]), 0), size - 1)
            if start >= size or start > end:
                f.close()
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            self._range = (start, end - start + 1)
        else:
            self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{st.st_mtime_ns:x}-{size:x}"')
        self.end_headers()
        return f

    def copyfile(self, source: Any, outputfile: Any) -> None:
        start, left = self._range if self._range is not None else (0, os.fstat(source.fileno()).st_size)
        source.seek(start)
        if self._fault == "drop":
            left //= 2
        while left > 0:
            chunk = source.read(min(left, 1 << 16))
            if not chunk:
                break
            outputfile.write(chunk)
            left -= len(chunk)
        if self._fault == "drop":
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)  # the reply is cut short: the client sees the connection drop


class _QuietServer(http.server.ThreadingHTTPServer):
    """A client that goes away with its connections kept alive (a loader worker's end) is no error to print."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError | OSError):
            super().handle_error(request, client_address)


@contextmanager
def http_server(root: Path, ranges: bool = True) -> Iterator[tuple[str, Faults]]:
    """Serve ``root`` on a free localhost port: yields its base URL and its :class:`Faults`."""
    faults = Faults()
    handler = type("Handler", (RangeHandler,), {"faults": faults, "ranges": ranges})
    server = _QuietServer(("127.0.0.1", 0), functools.partial(handler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", faults
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def s3_server() -> Iterator[dict[str, Any]]:
    """moto's S3 server on a free localhost port: yields the storage options that reach it (endpoint and dummy
    credentials)."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield {"endpoint_url": f"http://{host}:{port}", "key": "testing-key", "secret": "testing-secret"}
    finally:
        server.stop()
