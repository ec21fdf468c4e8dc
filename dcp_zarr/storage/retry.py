"""Retrying object-store calls: transient faults (timeouts, dropped connections, 5xx, throttling) are retried with
capped exponential backoff; anything else fails at once, re-raised naming the store and key.

Every call wrapped here is idempotent (a whole-key put, a get, an existence check, a prefix delete), so repeating
one after a fault whose outcome is unknown is safe. This is meant to be the one retry layer: ``open_storage`` turns
botocore's own retries off unless the caller configured them (s3fs still retries a few timeouts itself).

A connection that could not be made at all (refused, a host name that does not resolve, a connect timeout) to a
store that has never answered this writer or reader is a wrong endpoint, not a fault that passes: it fails at once
(``RetryPolicy.unreachable_attempts``), in one line naming the store and the endpoint. Once the store has answered,
the same errors are retried like any other transient fault (a server restarting, a load balancer failing over).
"""

from __future__ import annotations

import errno
import logging
import random
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

from dcp_zarr.errors import ObjectStoreError

log = logging.getLogger("dcp_zarr.storage")
T = TypeVar("T")




@dataclass(frozen=True)
class RetryPolicy:
    """``attempts`` tries in all; before try ``n + 1`` wait ``min(max_delay, initial_delay * multiplier ** (n - 1))``,
    scaled by a random factor in ``[1 - jitter, 1]`` so that ranks hitting one throttled store spread out."""

    attempts: int = 8
    initial_delay: float = 0.2
    max_delay: float = 10.0
    multiplier: float = 2.0
    jitter: float = 0.5
    # Attempts when no connection can be made to a store that has not answered yet (see the module docstring).
    unreachable_attempts: int = 1

    def __post_init__(self):
        if self.attempts < 1 or self.unreachable_attempts < 1:
            raise ValueError(f"RetryPolicy: attempts={self.attempts} and unreachable_attempts="
                             f"{self.unreachable_attempts} must be at least 1")

    def delay(self, failed_attempts: int, rng: random.Random | None = None) -> float:
        base = min(self.max_delay, self.initial_delay * self.multiplier ** (failed_attempts - 1))
        return base * (1.0 - self.jitter * (rng or random).random())


DEFAULT_POLICY = RetryPolicy()

# HTTP statuses worth another try: request timeout, throttling, and every server-side error.
_TRANSIENT_STATUS = frozenset({408, 429})
# Client-library exception classes, matched by name so that none of those libraries has to be importable here
# (botocore, aiohttp, urllib3, fsspec, http.client).
_TRANSIENT_NAMES = frozenset({
    "TimeoutError", "ConnectionError", "HTTPClientError", "ClientConnectionError", "ClientPayloadError",
    "ServerTimeoutError", "ResponseParserError", "IncompleteRead", "FSTimeoutError", "RemoteDisconnected",
})
# Error codes in an S3 response body that botocore would retry (its throttling and transient lists): S3 sends
# RequestTimeout as a 400, so the status alone would call it permanent.
_TRANSIENT_CODES = frozenset({
    "RequestTimeout", "RequestTimeoutException", "PriorRequestNotComplete", "Throttling", "ThrottlingException",
    "ThrottledException", "RequestThrottledException", "TooManyRequestsException", "RequestLimitExceeded",
    "BandwidthLimitExceeded", "LimitExceededException", "RequestThrottled", "SlowDown",
})
_THROTTLING_CODES = _TRANSIENT_CODES - {"RequestTimeout", "RequestTimeoutException", "PriorRequestNotComplete"}
# No connection was made: aiohttp's connector errors (DNS failures are a subclass), botocore's wrappers of them,
# urllib3's, and the OS errors underneath. Matched by name, like _TRANSIENT_NAMES.
_NO_CONNECTION_NAMES = frozenset({
    "ClientConnectorError", "EndpointConnectionError", "ConnectTimeoutError", "ConnectionTimeoutError",
    "NewConnectionError", "NameResolutionError", "ConnectionRefusedError", "gaierror",
})
_NO_CONNECTION_ERRNOS = frozenset({errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH})
_TRANSIENT_ERRNOS = frozenset({
    errno.EBUSY,  # s3fs: 503 ServiceUnavailable / SlowDown
    getattr(errno, "EREMOTEIO", errno.EIO),  # s3fs: 500 InternalError
    errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED, errno.ECONNREFUSED, errno.EPIPE,
    errno.ENETUNREACH, errno.EHOSTUNREACH,
})
_PERMANENT_TYPES = (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError, NotADirectoryError,
                    ValueError, TypeError, KeyError, NotImplementedError)


# obstore (a Rust client) raises its errors with their causes in the message text: the HTTP status, the S3 error
# body, the kind of connection failure and the request's URL. Read from there, as the attributes of the Python
# clients' errors are read.
_OBSTORE_STATUS = re.compile(r"non-2xx status code: (\d{3})")
_OBSTORE_CODE = re.compile(r"<Code>(\w+)</Code>")
_OBSTORE_URL = re.compile(r"Error performing \w+ (\S+)")
_OBSTORE_NO_CONNECTION = (("dns error", "the host name does not resolve"),
                          ("ConnectionRefused", "connection refused"),
                          ("Connection refused", "connection refused"))
_OBSTORE_TRANSIENT = ("error sending request", "error decoding response body", "connection closed", "timed out",
                      "connection reset", "ConnectionReset", "broken pipe", "IncompleteMessage")


def _obstore_text(exc: BaseException) -> str | None:
    return str(exc) if type(exc).__module__.startswith("obstore") else None


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen and len(seen) < 16:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def http_status(exc: BaseException) -> int | None:
    """The HTTP status behind ``exc`` (botocore ClientError, aiohttp ClientResponseError, gcsfs HttpError), if any."""
    for link in _chain(exc):
        response = getattr(link, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(status, int):
                return status
        for attribute in ("status", "code"):
            status = getattr(link, attribute, None)
            if isinstance(status, int) and 100 <= status <= 599:
                return status
        found = _OBSTORE_STATUS.search(_obstore_text(link) or "")
        if found:
            return int(found.group(1))
    return None


def error_code(exc: BaseException) -> str | None:
    """The error code of an S3-style response behind ``exc`` (botocore ClientError: ``SlowDown``), if any."""
    for link in _chain(exc):
        response = getattr(link, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            if isinstance(code, str):
                return code
        found = _OBSTORE_CODE.search(_obstore_text(link) or "")
        if found:
            return found.group(1)
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether trying the same call again may succeed."""
    if error_code(exc) in _TRANSIENT_CODES:
        return True
    status = http_status(exc)
    if status is not None:
        return status >= 500 or status in _TRANSIENT_STATUS
    if isinstance(exc, _PERMANENT_TYPES):
        return False
    for link in _chain(exc):
        if any(cls.__name__ in _TRANSIENT_NAMES for cls in type(link).__mro__):
            return True
        text = _obstore_text(link)
        if text is not None and any(sign in text for sign in _OBSTORE_TRANSIENT):
            return True
    return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS


def no_connection(exc: BaseException) -> str | None:
    """Why no connection could be made (``"connection refused"``, ...), if that is what ``exc`` is; else None."""
    if http_status(exc) is not None:
        return None  # something answered
    found = None
    for link in _chain(exc):
        text = _obstore_text(link)
        if text is not None and "kind: Connect" in text:
            return next((why for sign, why in _OBSTORE_NO_CONNECTION if sign in text), "no connection could be made")
        names = {cls.__name__ for cls in type(link).__mro__}
        if "ClientConnectorDNSError" in names or "gaierror" in names or "NameResolutionError" in names:
            return "the host name does not resolve"
        if "ConnectionRefusedError" in names or getattr(link, "errno", None) == errno.ECONNREFUSED:
            return "connection refused"
        if names & {"ConnectTimeoutError", "ConnectionTimeoutError"}:
            return "connecting timed out"
        if names & _NO_CONNECTION_NAMES or getattr(link, "errno", None) in _NO_CONNECTION_ERRNOS:
            found = found or "no connection could be made"
    return found


def endpoint_of(exc: BaseException) -> str | None:
    """The endpoint a failed connection was for: botocore's ``endpoint_url``, or aiohttp's host and port."""
    for link in _chain(exc):
        kwargs = getattr(link, "kwargs", None)
        url = kwargs.get("endpoint_url") if isinstance(kwargs, dict) else None
        if isinstance(url, str):
            parts = urlsplit(url)
            return f"{parts.scheme}://{parts.netloc}" if parts.netloc else url
        host, port = getattr(link, "host", None), getattr(link, "port", None)
        if isinstance(host, str) and isinstance(port, int):
            return f"{host}:{port}"
        found = _OBSTORE_URL.search(_obstore_text(link) or "")
        if found:
            parts = urlsplit(found.group(1))
            return f"{parts.scheme}://{parts.netloc}"
    return None


class Retrying:
    """The retries of one writer or reader: its policy (None: ``DEFAULT_POLICY`` at the time of each call), and
    whether the store has answered any of its calls yet. Shared by every Storage that writer or reader opens."""

    def __init__(self, policy: RetryPolicy | None = None):
        if policy is not None and not isinstance(policy, RetryPolicy):
            raise TypeError(f"retry={policy!r}: expected a dcp_zarr.RetryPolicy")
        self.policy = policy
        self.answered = False  # a bool set from several threads: each write is atomic, and only ever sets True

    def __repr__(self) -> str:
        return f"Retrying({self.policy!r})"

    def call(self, operation: Callable[[], T], *, what: str, key: str, url: str,
             sleep: Callable[[float], None] = time.sleep) -> T:
        """``operation()``, retried while it fails transiently; ``ObjectStoreError`` naming ``key`` when it cannot
        succeed. Retries are logged at DEBUG: a retry that succeeds is nothing the user has to act on."""
        policy = self.policy or DEFAULT_POLICY
        attempt = 1
        while True:
            try:
                result = operation()
                self.answered = True
                return result
            except Exception as exc:
                unreachable = no_connection(exc)
                if unreachable is None:
                    self.answered = True  # an HTTP error, or any other outcome of a request that got through
                if unreachable is not None and not self.answered:
                    if attempt >= policy.unreachable_attempts:
                        endpoint = endpoint_of(exc)
                        raise ObjectStoreError(
                            getattr(exc, "errno", None) or errno.EHOSTUNREACH,
                            f"{url}: cannot reach the object store{f' at {endpoint}' if endpoint else ''} "
                            f"({unreachable}) to {what} {key!r}; not retried, since it has not answered yet: check "
                            f"the URL and endpoint_url ({type(exc).__name__}: {_one_line(exc)})",
                        ) from exc
                    transient = True
                else:
                    transient = is_transient(exc)
                if not transient or attempt >= policy.attempts:
                    why = f"gave up after {attempt} attempts{_throttled(exc)}" if transient else \
                        "not retried: the error is permanent"
                    raise ObjectStoreError(
                        getattr(exc, "errno", None) or errno.EIO,
                        f"{url}: {what} {key!r} failed ({why}): {type(exc).__name__}: {_one_line(exc)}",
                    ) from exc
                delay = policy.delay(attempt)
                log.debug("%s: %s %r failed (%s: %s); attempt %d of %d in %.2f s",
                          url, what, key, type(exc).__name__, exc, attempt + 1, policy.attempts, delay)
                sleep(delay)
                attempt += 1


def _throttled(exc: BaseException) -> str:
    """``", throttled by the store (503 SlowDown)"`` where the last failure was the store asking for fewer requests."""
    status, code = http_status(exc), error_code(exc)
    if code in _THROTTLING_CODES or (code is None and status in (429, 503)):
        return f", throttled by the store ({status or '?'} {code or 'throttling'}): fewer ranks or requests in flight"
    return ""


def _one_line(exc: BaseException) -> str:
    # obstore appends a multi-line "Debug source:" dump after a blank line: the first paragraph says it all
    return " ".join(str(exc).split("\n\n")[0].split())


def call_with_retry(operation: Callable[[], T], *, what: str, key: str, url: str, policy: RetryPolicy | None = None,
                    sleep: Callable[[float], None] = time.sleep, retrying: Retrying | None = None) -> T:
    """``operation()`` with retries: through ``retrying`` (a writer's or reader's), else a fresh one with ``policy``."""
    return (retrying or Retrying(policy)).call(operation, what=what, key=key, url=url, sleep=sleep)
