"""A real S3-compatible server for tests: moto's ThreadedMotoServer on 127.0.0.1, on a port the kernel picks.

It also counts requests in flight, so a test can see whether a writer's uploads overlap. tests/conftest.py's ``s3``
fixture starts one per test module, with a bucket of its own (``S3Server.bucket``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter

from moto.server import ThreadedMotoServer

from tests.support import marks

CREDENTIALS = {"key": "testing", "secret": "testing"}
# The same credentials in the environment, as users usually have them (tests/conftest.py's ``aws_environment``);
# no real AWS account is ever reachable from the tests.
AWS_ENVIRONMENT = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                   "AWS_DEFAULT_REGION": "us-east-1"}


class Traffic:
    """What the server served while counted: requests by method, bytes received (PUT bodies) and sent (GET
    bodies), and GETs by key (the last path component's parent and name: ``zarr.json``, ``w/c.0``)."""

    def __init__(self):
        self.requests: Counter = Counter()
        self.bytes_in = 0
        self.bytes_out = 0
        self.gets: Counter = Counter()

    def __repr__(self) -> str:
        return f"Traffic({dict(self.requests)}, in {self.bytes_in} B, out {self.bytes_out} B)"


class _InFlight:
    """WSGI middleware: counts concurrent PUTs and can hold each one for a while, to make overlap observable; and
    counts what is served while a ``Traffic`` is set (``S3Server.counting``)."""

    def __init__(self, app):
        self.app = app
        self.lock = threading.Lock()
        self.current = 0
        self.peak = 0
        self.put_delay = 0.0
        self.traffic: Traffic | None = None

    def __call__(self, environ, start_response):
        traffic = self.traffic
        if traffic is not None:
            return self._counted(traffic, environ, start_response)
        return self._served(environ, start_response)

    def _counted(self, traffic: Traffic, environ, start_response):
        method = environ.get("REQUEST_METHOD", "?")
        with self.lock:
            traffic.requests[method] += 1
            if method == "PUT":
                traffic.bytes_in += int(environ.get("CONTENT_LENGTH") or 0)
            if method == "GET":
                traffic.gets["/".join(environ.get("PATH_INFO", "").split("/")[-2:])] += 1
        body = self._served(environ, start_response)
        if method != "GET":
            return body

        def counted():
            for piece in body:
                with self.lock:
                    traffic.bytes_out += len(piece)
                yield piece
            close = getattr(body, "close", None)
            if close is not None:
                close()

        return counted()

    def _served(self, environ, start_response):
        if environ.get("REQUEST_METHOD") != "PUT":
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


class S3Server:
    def __init__(self):
        marks.require("s3", "starts the loopback S3 server")
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self._counter = _InFlight(self._server._server.app)
        self._server._server.app = self._counter  # werkzeug looks the app up per request
        self.bucket: str | None = None  # the bucket tests/conftest.py's ``s3`` fixture made for its module

    def storage_options(self, **extra) -> dict:
        return {"endpoint_url": self.endpoint, **CREDENTIALS, **extra}

    def filesystem(self):
        import s3fs

        # No instance cache or listings cache: the test must see what the ranks wrote, not a stale listing.
        return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **self.storage_options())

    def make_bucket(self, name: str) -> str:
        self.filesystem().mkdir(name)
        return name

    @contextlib.contextmanager
    def slow_puts(self, seconds: float):
        """Hold every PUT for ``seconds``; yields a function returning the most PUTs seen in flight at once."""
        self._counter.peak, self._counter.put_delay = 0, seconds
        try:
            yield lambda: self._counter.peak
        finally:
            self._counter.put_delay = 0.0

    @contextlib.contextmanager
    def counting(self):
        """Count what the server serves inside the block; yields the ``Traffic``, filled as requests come."""
        traffic = Traffic()
        self._counter.traffic = traffic
        try:
            yield traffic
        finally:
            self._counter.traffic = None

    def stop(self) -> None:
        self._server.stop()
