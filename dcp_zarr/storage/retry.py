"""Retrying object-store calls: transient faults (timeouts, dropped connections, 5xx, throttling) are retried with
capped exponential backoff; anything else fails at once, re-raised naming the store and key.

Every call wrapped here is idempotent (a whole-key put, a get, an existence check, a prefix delete), so repeating
one after a fault whose outcome is unknown is safe. The client libraries retry a little themselves (botocore: up to
5 attempts on 5xx; s3fs: 5 on timeouts); this layer bounds the whole operation no matter which backend fsspec picked.
"""

from __future__ import annotations

import errno
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from dcp_zarr.errors import ZarrCheckpointError

log = logging.getLogger("dcp_zarr.storage")
T = TypeVar("T")


class ObjectStoreError(ZarrCheckpointError, OSError):
    """An object-store call failed permanently (or kept failing transiently); ``__cause__`` is the client's error."""


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts`` tries in all; before try ``n + 1`` wait ``min(max_delay, initial_delay * multiplier ** (n - 1))``,
    scaled by a random factor in ``[1 - jitter, 1]`` so that ranks hitting one throttled store spread out."""

    attempts: int = 8
    initial_delay: float = 0.2
    max_delay: float = 10.0
    multiplier: float = 2.0
    jitter: float = 0.5

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
_TRANSIENT_ERRNOS = frozenset({
    errno.EBUSY,  # s3fs: 503 ServiceUnavailable / SlowDown
    getattr(errno, "EREMOTEIO", errno.EIO),  # s3fs: 500 InternalError
    errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED, errno.ECONNREFUSED, errno.EPIPE,
    errno.ENETUNREACH, errno.EHOSTUNREACH,
})
_PERMANENT_TYPES = (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError, NotADirectoryError,
                    ValueError, TypeError, KeyError, NotImplementedError)


def _chain(exc: BaseException):
    seen = set()
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
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether trying the same call again may succeed."""
    status = http_status(exc)
    if status is not None:
        return status >= 500 or status in _TRANSIENT_STATUS
    if isinstance(exc, _PERMANENT_TYPES):
        return False
    for link in _chain(exc):
        if any(cls.__name__ in _TRANSIENT_NAMES for cls in type(link).__mro__):
            return True
    return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS


def call_with_retry(operation: Callable[[], T], *, what: str, key: str, url: str, policy: RetryPolicy | None = None,
                    sleep: Callable[[float], None] = time.sleep) -> T:
    """``operation()``, retried while it fails transiently; ``ObjectStoreError`` naming ``key`` when it cannot succeed."""
    policy = policy or DEFAULT_POLICY
    attempt = 1
    while True:
        try:
            return operation()
        except Exception as exc:
            transient = is_transient(exc)
            if not transient or attempt >= policy.attempts:
                why = f"gave up after {attempt} attempts" if transient else "not retried: the error is permanent"
                raise ObjectStoreError(
                    getattr(exc, "errno", None) or errno.EIO,
                    f"{url}: {what} {key!r} failed ({why}): {type(exc).__name__}: {exc}",
                ) from exc
            delay = policy.delay(attempt)
            log.warning("%s: %s %r failed (%s: %s); attempt %d of %d in %.2f s",
                        url, what, key, type(exc).__name__, exc, attempt + 1, policy.attempts, delay)
            sleep(delay)
            attempt += 1
