"""A real S3-compatible server on 127.0.0.1: moto's ThreadedMotoServer on a port the kernel picks, behind a front
that counts what it serves and can slow it down.

The front counts, while a ``Traffic`` is set (``S3Server.counting()``), requests by method, the bytes of PUT bodies
received and of GET bodies sent (in all and per object), GETs by key, and the copies made within the server (S3's
CopyObject and UploadPartCopy: a PUT naming its source in ``x-amz-copy-source``, with no body, which moto carries
out on its side); it counts PUTs in flight (``slow_puts``: can a writer's uploads overlap?); and it sleeps
``latency_s`` before every request (concurrent sleeps overlap: a distant server, not a slow
one). Processes other than the server's (the ranks of a benchmark) reach the same controls over HTTP, under
``/__control__/``: ``latency?ms=N``, ``counts`` and ``reset`` (which also answer with the counts since the last reset
and the server process's CPU time). moto is imported when a server starts: it comes with the test extras.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter
from typing import Any

__all__ = ["AWS_ENVIRONMENT", "CREDENTIALS", "S3Server", "Traffic", "control"]

CREDENTIALS = {"key": "testing", "secret": "testing"}
# The same credentials in the environment, as users usually have them; no real AWS account is ever reachable.
AWS_ENVIRONMENT = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                   "AWS_DEFAULT_REGION": "us-east-1"}
CONTROL = "/__control__/"


class Traffic:
    """What the server served while counted: requests by method, bytes received (PUT bodies) and sent (GET
    bodies), GETs by key (the last path component's parent and name: ``zarr.json``, ``w/c.0``); and per object
    (``bucket/key``): the requests by method (``object_requests``: ``(method, object)`` -> count), the bytes of the
    PUT bodies it received (``put_bytes``), of the GET bodies it sent (``get_bytes``), and the copies made within the
    server, ``(source, destination)`` -> count (``copies``; a copy is a PUT too, with no body)."""

    def __init__(self) -> None:
        self.requests: Counter = Counter()
        self.bytes_in = 0
        self.bytes_out = 0
        self.gets: Counter = Counter()
        self.object_requests: Counter = Counter()
        self.put_bytes: Counter = Counter()
        self.get_bytes: Counter = Counter()
        self.copies: Counter = Counter()
        self.cpu_at_start = time.process_time()

    def to_json(self) -> dict[str, Any]:
        return {"methods": dict(self.requests), "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                "copies": sum(self.copies.values()), "server_cpu_s": time.process_time() - self.cpu_at_start}

    def __repr__(self) -> str:
        return (f"Traffic({dict(self.requests)}, in {self.bytes_in} B, out {self.bytes_out} B, "
                f"{sum(self.copies.values())} copies)")


def _object(path: str) -> str:
    """``bucket/key`` of a request's path (path-style addressing, as on 127.0.0.1) or of an ``x-amz-copy-source``
    header (URL-encoded, may start with ``/`` and end with ``?versionId=``)."""
    return urllib.parse.unquote(path.split("?", 1)[0]).lstrip("/")


class _Front:
    """WSGI middleware in front of moto: counting, latency, PUTs in flight, and the HTTP controls."""

    def __init__(self, app) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.current = self.peak = 0
        self.put_delay = self.latency_s = 0.0
        self.traffic: Traffic | None = None

    def __call__(self, environ, start_response):
        path, method = environ.get("PATH_INFO", ""), environ.get("REQUEST_METHOD", "?")
        if path.startswith(CONTROL):
            return self._control(path.removeprefix(CONTROL), environ.get("QUERY_STRING", ""), start_response)
        traffic = self.traffic
        if traffic is not None:
            with self.lock:
                traffic.requests[method] += 1
                traffic.object_requests[(method, _object(path))] += 1
                if method == "PUT":
                    size = int(environ.get("CONTENT_LENGTH") or 0)
                    traffic.bytes_in += size
                    source = environ.get("HTTP_X_AMZ_COPY_SOURCE")
                    if source is not None:
                        traffic.copies[(_object(source), _object(path))] += 1
                    else:
                        traffic.put_bytes[_object(path)] += size
                if method == "GET":
                    traffic.gets["/".join(path.split("/")[-2:])] += 1
        if self.latency_s:
            time.sleep(self.latency_s)
        body = self._served(method, environ, start_response)
        return self._counted(traffic, _object(path), body) if traffic is not None and method == "GET" else body

    def _counted(self, traffic: Traffic, name: str, body):
        for piece in body:
            with self.lock:
                traffic.bytes_out += len(piece)
                traffic.get_bytes[name] += len(piece)
            yield piece
        close = getattr(body, "close", None)
        if close is not None:
            close()

    def _served(self, method: str, environ, start_response):
        if method != "PUT":
            return self.app(environ, start_response)
        with self.lock:
            self.current += 1
            self.peak = max(self.peak, self.current)
        try:
            if self.put_delay:
                time.sleep(self.put_delay)
            return self.app(environ, start_response)
        finally:
            with self.lock:
                self.current -= 1

    def _control(self, what: str, query: str, start_response):
        if what == "latency":
            self.latency_s = float(query.removeprefix("ms=")) / 1000
        with self.lock:
            body = json.dumps((self.traffic or Traffic()).to_json()).encode()
            if what == "reset" or self.traffic is None:
                self.traffic = Traffic()
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]


def control(endpoint: str, what: str) -> dict[str, Any]:
    """Ask the server at ``endpoint``, from any process: ``latency?ms=N``, ``counts`` or ``reset`` (each answers the
    counts since the last reset, as ``Traffic.to_json``)."""
    with urllib.request.urlopen(f"{endpoint}{CONTROL}{what}", timeout=30) as response:
        return json.loads(response.read())


class S3Server:
    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        wsgi = self._server._server
        assert wsgi is not None  # start() made it
        self._front = _Front(wsgi.app)
        wsgi.app = self._front  # werkzeug looks the app up per request
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
        self._front.peak, self._front.put_delay = 0, seconds
        try:
            yield lambda: self._front.peak
        finally:
            self._front.put_delay = 0.0

    @contextlib.contextmanager
    def counting(self):
        """Count what the server serves inside the block; yields the ``Traffic``, filled as requests come."""
        traffic = Traffic()
        self._front.traffic = traffic
        try:
            yield traffic
        finally:
            self._front.traffic = None

    def stop(self) -> None:
        self._server.stop()
