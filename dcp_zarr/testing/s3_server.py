"""A real S3 server on 127.0.0.1 for tests and benchmarks: Ceph's radosgw (``radosgw.py``), behind a small HTTP proxy
of ours that counts what it serves, can slow it down and can inject faults.

The server behind the proxy is chosen once per process (``backend``): radosgw where Ceph is installed; moto's server
(a mock, in Python) only where it is not and ``CI`` is unset, with ``FALLBACK_NOTE`` saying so and how to get the
real one; ``DCP_ZARR_S3_SERVER=radosgw|moto`` forces one. In CI a missing radosgw is an error, never a fallback.

The proxy forwards every request unchanged (the Host header too, which S3's signatures cover) and, while a
``Traffic`` is set (``S3Server.counting()``), counts requests by method, the bytes of PUT bodies received and of GET
bodies sent (in all and per object), GETs by key, and the copies made within the server (CopyObject and
UploadPartCopy: a PUT naming its source in ``x-amz-copy-source``, with no body); it counts PUTs in flight
(``slow_puts``: can a writer's uploads overlap?), sleeps ``latency_s`` before every request (concurrent sleeps
overlap: a distant server, not a slow one) and answers the requests a fault rule claims (``inject``) with an error,
a stall or a reset. Processes other than the server's (the ranks of a benchmark) reach the controls over HTTP under
``/__control__/``: ``latency?ms=N``, ``counts`` and ``reset`` (each answers the counts since the last reset).
``direct_endpoint`` is the server without the proxy, for timings that need neither.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import socket
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["AWS_ENVIRONMENT", "CREDENTIALS", "FALLBACK_NOTE", "S3Server", "Traffic", "backend", "control"]

CREDENTIALS = {"key": "testing", "secret": "testing"}  # radosgw.py's user; moto takes any
# The same credentials in the environment, as users usually have them; no real AWS account is ever reachable.
AWS_ENVIRONMENT = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                   "AWS_DEFAULT_REGION": "us-east-1"}
CONTROL = "/__control__/"
_ERROR = b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>%s</Code><Message>%s</Message></Error>'
FAULTS = {
    "503": (503, b"SlowDown", b"Please reduce your request rate."),
    "500": (500, b"InternalError", b"We encountered an internal error"),
    "429": (429, b"TooManyRequests", b"Too many requests"),
    "403": (403, b"AccessDenied", b"Access denied (injected)"),
}
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "expect", "te", "trailer", "upgrade"})
FALLBACK_NOTE: str | None = None  # set when this process fell back to moto


class Traffic:
    """What the server served while counted: requests by method, bytes received (PUT bodies) and sent (GET
    bodies), GETs by key (the last path component's parent and name: ``zarr.json``, ``w/c.0``); and per object
    (``bucket/key``): the requests by method (``object_requests``: ``(method, object)`` -> count), the bytes of the
    PUT bodies it received (``put_bytes``), of the GET bodies it sent (``get_bytes``), and the copies made within the
    server, ``(source, destination)`` -> count (``copies``; a copy is a PUT too, with no body)."""

    def __init__(self, server_cpu=time.process_time) -> None:
        self.server_cpu = server_cpu
        self.cpu_at_start = server_cpu()
        self.requests: Counter = Counter()
        self.bytes_in = 0
        self.bytes_out = 0
        self.gets: Counter = Counter()
        self.object_requests: Counter = Counter()
        self.put_bytes: Counter = Counter()
        self.get_bytes: Counter = Counter()
        self.copies: Counter = Counter()

    def to_json(self) -> dict[str, Any]:
        return {"methods": dict(self.requests), "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                "copies": sum(self.copies.values()), "server_cpu_s": self.server_cpu() - self.cpu_at_start}

    def count_request(self, method: str, path: str, body_bytes: int, copy_source: str | None) -> None:
        self.requests[method] += 1
        self.object_requests[(method, _object(path))] += 1
        if method == "PUT":
            self.bytes_in += body_bytes
            if copy_source is not None:
                self.copies[(_object(copy_source), _object(path))] += 1
            else:
                self.put_bytes[_object(path)] += body_bytes
        if method == "GET":
            self.gets["/".join(path.split("?", 1)[0].split("/")[-2:])] += 1

    def count_sent(self, path: str, body_bytes: int) -> None:
        self.bytes_out += body_bytes
        self.get_bytes[_object(path)] += body_bytes

    def __repr__(self) -> str:
        return (f"Traffic({dict(self.requests)}, in {self.bytes_in} B, out {self.bytes_out} B, "
                f"{sum(self.copies.values())} copies)")


def _object(path: str) -> str:
    """``bucket/key`` of a request's path (path-style addressing, as on 127.0.0.1) or of an ``x-amz-copy-source``
    header (URL-encoded, may start with ``/`` and end with ``?versionId=``)."""
    return urllib.parse.unquote(path.split("?", 1)[0]).lstrip("/")


class FaultRule:
    """``action`` (a key of ``FAULTS``, ``"stall"`` or ``"reset"``) for ``times`` requests of ``methods`` whose path
    matches ``path``, after letting ``skip`` through, at most ``per_key`` times for any one key; ``served`` counts."""

    def __init__(self, action: str, methods, path: str, times: float, skip: int, per_key: float) -> None:
        self.action, self.methods, self.path = action, frozenset(methods), re.compile(path)
        self.remaining, self.skip, self.per_key, self.served = times, skip, per_key, 0
        self.hits: Counter = Counter()

    def claims(self, method: str, path: str) -> bool:
        if not (self.remaining and method in self.methods and self.path.search(path)):
            return False
        if self.skip:
            self.skip -= 1
            return False
        if self.hits[path] >= self.per_key:
            return False
        self.hits[path] += 1
        self.remaining -= 1
        self.served += 1
        return True


class _QuietServer(ThreadingHTTPServer):
    # socketserver's default backlog is 5: 8 ranks with 32 requests in flight each (the floor) overflowed it, and the
    # kernel reset the connections it had no room for ("error sending request")
    request_queue_size = 1024

    def handle_error(self, request, client_address) -> None:
        """A client that drops its connection (a killed rank, a reset fault) is no error of the proxy's."""
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


class _Proxy:
    """The front: forwards to ``upstream`` (``host:port``), one kept-alive upstream connection per client connection."""

    def __init__(self, upstream: str, server_cpu) -> None:
        self.upstream = upstream
        self.server_cpu = server_cpu
        self.lock = threading.Lock()
        self.current = self.peak = 0
        self.put_delay = self.latency_s = self.stall_s = 0.0
        self.traffic: Traffic | None = None
        self.rules: list[FaultRule] = []
        self.log: list[tuple[str, str, str]] = []  # (method, path, action or "forwarded") while rules are set
        self.server = _QuietServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True, name="s3-proxy").start()

    def claim(self, method: str, path: str) -> str | None:
        with self.lock:
            action = next((rule.action for rule in self.rules if rule.claims(method, path)), None)
            if self.rules:
                self.log.append((method, path, action or "forwarded"))
        return action

    def control(self, what: str, query: str) -> bytes:
        if what == "latency":
            self.latency_s = float(query.removeprefix("ms=")) / 1000
        with self.lock:
            body = json.dumps((self.traffic or Traffic(self.server_cpu)).to_json()).encode()
            if what == "reset" or self.traffic is None:
                self.traffic = Traffic(self.server_cpu)
        return body


def _handler(proxy: _Proxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        upstream: http.client.HTTPConnection | None = None

        def log_message(self, *args) -> None:
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() != "chunked":
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))
            pieces = []
            while size := int(self.rfile.readline().split(b";")[0], 16):
                pieces.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                pass
            return b"".join(pieces)

        def _handle(self) -> None:
            body = self._body()
            if self.path.startswith(CONTROL):
                what, _, query = self.path.removeprefix(CONTROL).partition("?")
                return self._send(200, [("Content-Type", "application/json")], proxy.control(what, query))
            action = proxy.claim(self.command, self.path)
            traffic = proxy.traffic
            if traffic is not None:
                with proxy.lock:
                    traffic.count_request(self.command, self.path, len(body), self.headers.get("x-amz-copy-source"))
            if proxy.latency_s:
                time.sleep(proxy.latency_s)
            if action in FAULTS:
                status, code, message = FAULTS[action]
                return self._send(status, [("Content-Type", "application/xml")], _ERROR % (code, message))
            if action == "stall":  # longer than the client's read timeout; the request never reaches the server
                time.sleep(proxy.stall_s)
                self.close_connection = True
                return None
            if action == "reset":
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return None
            if self.command == "PUT":
                with proxy.lock:
                    proxy.current += 1
                    proxy.peak = max(proxy.peak, proxy.current)
                try:
                    time.sleep(proxy.put_delay)
                    status, headers, data = self._forward(body)
                finally:
                    with proxy.lock:
                        proxy.current -= 1
            else:
                status, headers, data = self._forward(body)
            if traffic is not None and self.command == "GET":
                with proxy.lock:
                    traffic.count_sent(self.path, len(data))
            return self._send(status, headers, data)

        def _forward(self, body: bytes) -> tuple[int, list, bytes]:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            headers["Content-Length"] = str(len(body))
            for attempt in (1, 2):  # a kept-alive upstream connection the server closed: once more on a new one
                if self.upstream is None:
                    host, port = proxy.upstream.rsplit(":", 1)
                    self.upstream = http.client.HTTPConnection(host, int(port), timeout=300)
                try:
                    self.upstream.request(self.command, self.path, body=body, headers=headers)
                    response = self.upstream.getresponse()
                    data = response.read()
                    return response.status, response.getheaders(), data
                except (http.client.HTTPException, OSError):
                    self.upstream.close()
                    self.upstream = None
                    if attempt == 2:
                        raise
            raise AssertionError("unreachable")

        def _send(self, status: int, headers: list, data: bytes) -> None:
            self.send_response_only(status)
            length = None
            for key, value in headers:
                if key.lower() == "content-length":
                    length = value
                elif key.lower() not in _HOP_BY_HOP:
                    self.send_header(key, value)
            # a HEAD's Content-Length is the object's size, not the (empty) body's
            self.send_header("Content-Length", length if self.command == "HEAD" and length else str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

    return Handler


def control(endpoint: str, what: str) -> dict[str, Any]:
    """Ask the proxy at ``endpoint``, from any process: ``latency?ms=N``, ``counts`` or ``reset`` (each answers the
    counts since the last reset, as ``Traffic.to_json``)."""
    with urllib.request.urlopen(f"{endpoint}{CONTROL}{what}", timeout=30) as response:
        return json.loads(response.read())


def backend() -> str:
    """``"radosgw"`` or ``"moto"``: the server this process's ``S3Server``s put behind their proxies."""
    from dcp_zarr.testing import radosgw

    forced = os.environ.get("DCP_ZARR_S3_SERVER", "")
    if forced not in ("", "radosgw", "moto"):
        raise ValueError(f"DCP_ZARR_S3_SERVER={forced!r}: expected 'radosgw' or 'moto'")
    missing = radosgw.missing_daemons()
    if forced == "moto" or (not forced and missing and not os.environ.get("CI")):
        global FALLBACK_NOTE
        if forced != "moto":
            FALLBACK_NOTE = (f"the S3 tests ran on moto, a mock, not on radosgw ({', '.join(missing)} not "
                             "installed): `sudo bash .ci/install-ceph` installs Ceph's radosgw from Debian's packages")
        return "moto"
    if missing:
        raise RuntimeError(f"no S3 server: {', '.join(missing)} not installed, and in CI the S3 tests run on radosgw "
                           "(.ci/install-ceph installs it)")
    return "radosgw"


_MOTO: Any = None  # moto's server, one per process (its backend is in-process and shared by every server anyway)


def _upstream(kind: str) -> str:
    """``http://host:port`` of this process's server of ``kind``, started on first use."""
    global _MOTO
    if kind == "radosgw":
        from dcp_zarr.testing import radosgw

        return radosgw.shared().endpoint
    if _MOTO is None:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
        _MOTO = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        _MOTO.start()
    host, port = _MOTO.get_host_and_port()
    return f"http://{host}:{port}"


def _server_cpu(kind: str):
    """The CPU time of the server's processes so far: the cluster's daemons, or this process (moto runs in it)."""
    if kind == "radosgw":
        from dcp_zarr.testing import radosgw

        return radosgw.shared().cpu_seconds
    return time.process_time


class S3Server:
    """A proxy of our own in front of this process's S3 server (``backend()``); ``stop`` stops the proxy only."""

    def __init__(self) -> None:
        self.backend = backend()
        self.direct_endpoint = _upstream(self.backend)
        self._proxy = _Proxy(self.direct_endpoint.removeprefix("http://"), _server_cpu(self.backend))
        self.endpoint = self._proxy.endpoint
        self.bucket: str | None = None  # a bucket the owner made for its own use (tests/conftest.py's ``s3``)

    def storage_options(self, **extra) -> dict:
        return {"endpoint_url": self.endpoint, **CREDENTIALS, **extra}

    def filesystem(self):
        import s3fs  # type: ignore[import-untyped]

        # No instance cache or listings cache: the caller must see what the ranks wrote, not a stale listing.
        return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **self.storage_options())

    def make_bucket(self, name: str) -> str:
        self.filesystem().mkdir(name)
        return name

    @contextlib.contextmanager
    def slow_puts(self, seconds: float):
        """Hold every PUT for ``seconds``; yields a function returning the most PUTs seen in flight at once."""
        self._proxy.peak, self._proxy.put_delay = 0, seconds
        try:
            yield lambda: self._proxy.peak
        finally:
            self._proxy.put_delay = 0.0

    @contextlib.contextmanager
    def counting(self):
        """Count what the server serves inside the block; yields the ``Traffic``, filled as requests come."""
        traffic = Traffic(self._proxy.server_cpu)
        self._proxy.traffic = traffic
        try:
            yield traffic
        finally:
            self._proxy.traffic = None

    def inject(self, action: str, methods=("PUT",), path: str = r"/c(\.|$|\?)", times: float = 1, skip: int = 0,
               per_key: float = float("inf"), stall_s: float = 2.5) -> FaultRule:
        """Answer ``times`` requests (``float("inf")``: all) that match with ``action`` instead of forwarding them:
        an HTTP error of ``FAULTS``, ``"stall"`` (no answer for ``stall_s``, then the connection closes) or
        ``"reset"`` (the connection is dropped). See ``FaultRule``; ``fault_log`` lists what came while rules were
        set."""
        rule = FaultRule(action, methods, path, times, skip, per_key)
        with self._proxy.lock:
            self._proxy.stall_s = stall_s
            self._proxy.rules.append(rule)
        return rule

    @property
    def fault_log(self) -> list[tuple[str, str, str]]:
        return self._proxy.log

    def clear_faults(self) -> None:
        with self._proxy.lock:
            self._proxy.rules.clear()
            self._proxy.log.clear()

    def stop(self) -> None:
        self._proxy.server.shutdown()
        self._proxy.server.server_close()
