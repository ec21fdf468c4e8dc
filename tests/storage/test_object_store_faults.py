"""Object stores that misbehave: transient faults (5xx, timeouts, dropped connections) are retried with capped
exponential backoff and the save or load succeeds; permanent ones (403, a missing bucket) fail the save at once, with
the key named and nothing committed.

The store is the loopback S3 server (radosgw) behind the proxy of dcp_zarr/testing/s3_server.py, which injects the
faults; every test runs through both clients, obstore (the default) and s3fs (``client="fsspec"``). The clients' own
retries are turned off (obstore's by default, botocore ``total_max_attempts=1``, ``S3FileSystem.retries = 1``) so
that every fault reaches dcp_zarr's retry layer (dcp_zarr/storage/retry.py); one test keeps them on, as users will.
"""

from __future__ import annotations

import errno
import logging
import random
import re
import time
import uuid
import warnings

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_zarr import RetryPolicy as PublicRetryPolicy
from dcp_zarr import ZarrReader, ZarrSavePlanner, ZarrWriter, open_checkpoint
from dcp_zarr.storage import open_storage, retry, zarr_store
from dcp_zarr.storage.retry import ObjectStoreError, Retrying, RetryPolicy, call_with_retry, is_transient
from tests.support.compare import assert_state_equal
from tests.support.faults import causes, crash_state
from tests.support.states import load_full, save_plain

warnings.filterwarnings("ignore", message=".*torch.distributed is (disabled|unavailable|not initialized).*")

STATE = crash_state(11)
WRITER = {"inner_chunk_bytes": 2048}
FAST = RetryPolicy(attempts=6, initial_delay=0.01, max_delay=0.05)


def options(proxy, client_retries: bool = False) -> dict:
    opts = {"key": "testing", "secret": "testing", "client": proxy.client,
            "client_kwargs": {"endpoint_url": proxy.endpoint, "region_name": "us-east-1"},
            "config_kwargs": {"read_timeout": 1.0, "connect_timeout": 1.0}}
    if not client_retries:
        opts["config_kwargs"]["retries"] = {"total_max_attempts": 1, "mode": "standard"}
    return opts


@pytest.fixture(params=["obstore", "fsspec"])
def proxy(s3, monkeypatch, caplog, request):
    """The module's S3 server, its proxy injecting the faults; each test runs through both clients."""
    import s3fs

    s3.clear_faults()
    monkeypatch.setattr(s3, "client", request.param, raising=False)
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # s3fs's own retries of timeouts and dropped connections
    monkeypatch.setattr(retry, "DEFAULT_POLICY", FAST)
    caplog.set_level(logging.DEBUG, logger="dcp_zarr.storage")  # retries are logged at DEBUG
    yield s3
    s3.clear_faults()


_prefixes = iter(range(10**6))


def fresh_url(proxy) -> str:
    return f"s3://{proxy.bucket}/run{next(_prefixes)}-{uuid.uuid4().hex[:8]}/ckpt.zarr"


def _retries_logged(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "dcp_zarr.storage" and "attempt" in r.getMessage()]


def _assert_not_committed(url: str, opts: dict) -> None:
    storage = open_storage(url, opts)
    assert not storage.exists("zarr.json"), f"{url} was committed"
    with pytest.raises(CheckpointException, match="not a dcp_zarr checkpoint|incomplete"):
        dcp.load({"optim": {"lr": None}}, storage_reader=ZarrReader(url, storage_options=opts))


# -- transient faults: retried, the operation succeeds -----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.parametrize("action", ["503", "500", "429", "reset", "stall"])
def test_transient_faults_on_chunk_writes_are_retried_and_the_save_succeeds(proxy, caplog, action):
    times = 2 if action == "stall" else 8
    if action == "reset":
        # aiohttp retries a PUT on a dropped keep-alive connection once by itself, so 8 resets spread over the 32
        # requests in flight can all be absorbed there; 4 on one key outlast it and must reach dcp_zarr's retries.
        times = 4
        rule = proxy.inject(action, path=r"/ckpt\.zarr/model/ids/c\.0$", times=times, per_key=times)
    else:
        rule = proxy.inject(action, times=times, per_key=2)
    url, opts = fresh_url(proxy), options(proxy)
    save_plain(STATE, url, storage_options=opts, **WRITER)
    assert rule.served == times, "the faults were injected"
    # An HTTP error reaches dcp_zarr every time; aiohttp itself retries some dropped keep-alive connections.
    assert len(_retries_logged(caplog)) >= (times if action.isdigit() else 1), "dcp_zarr retried"
    assert_state_equal(load_full(url, STATE, storage_options=opts), STATE)


@pytest.mark.s3
@pytest.mark.parametrize("action", ["503", "reset"])
def test_transient_faults_on_chunk_reads_are_retried_and_the_load_succeeds(proxy, caplog, action):
    url, opts = fresh_url(proxy), options(proxy)
    save_plain(STATE, url, storage_options=opts, **WRITER)
    if action == "reset":  # as for writes: 4 resets on one key outlast aiohttp's own retry of a dropped connection
        times, rule = 4, proxy.inject(action, methods=("GET",), path=r"/ckpt\.zarr/model/ids/c\.0$", times=4, per_key=4)
    else:
        times, rule = 10, proxy.inject(action, methods=("GET",), times=10, per_key=3)
    assert_state_equal(load_full(url, STATE, storage_options=opts), STATE)
    assert rule.served == times and len(_retries_logged(caplog)) >= (times if action.isdigit() else 1)


@pytest.mark.s3
def test_a_fault_on_the_commit_write_is_retried(proxy, caplog):
    rule = proxy.inject("503", path=r"/ckpt\.zarr/zarr\.json$", times=3)
    url, opts = fresh_url(proxy), options(proxy)
    save_plain(STATE, url, storage_options=opts, **WRITER)
    assert rule.served == 3
    assert_state_equal(load_full(url, STATE, storage_options=opts), STATE)


@pytest.mark.s3
def test_with_the_clients_own_retries_on_too_the_save_succeeds(proxy, monkeypatch):
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 5)
    rule = proxy.inject("503", times=12, per_key=4)
    url, opts = fresh_url(proxy), options(proxy, client_retries=True)
    save_plain(STATE, url, storage_options=opts, **WRITER)
    assert rule.served == 12
    assert_state_equal(load_full(url, STATE, storage_options=opts), STATE)


@pytest.mark.s3
def test_backoff_grows_exponentially_and_is_capped(proxy, caplog):
    proxy.inject("503", path=r"/ckpt\.zarr/model/ids/c\.0$", times=5)
    url, opts = fresh_url(proxy), options(proxy)
    save_plain(STATE, url, storage_options=opts, **WRITER)
    delays = [float(re.search(r"in ([0-9.]+) s", m).group(1)) for m in _retries_logged(caplog) if "model/ids/c.0" in m]
    assert len(delays) == 5
    for n, delay in enumerate(delays, 1):
        ceiling = min(FAST.max_delay, FAST.initial_delay * FAST.multiplier ** (n - 1))
        assert ceiling * (1 - FAST.jitter) - 1e-3 <= delay <= ceiling + 1e-3, (n, delays)


@pytest.mark.s3
def test_retries_are_logged_at_debug_and_nothing_reaches_stderr(proxy, caplog, capfd):
    rule = proxy.inject("503", times=6, per_key=2)
    url, opts = fresh_url(proxy), options(proxy)
    save_plain(STATE, url, storage_options=opts, **WRITER)
    assert rule.served == 6
    retried = [r for r in caplog.records if r.name == "dcp_zarr.storage"]
    assert len(retried) >= 6 and {r.levelno for r in retried} == {logging.DEBUG}, [r.levelname for r in retried]
    assert "attempt" not in capfd.readouterr().err, "a retry that succeeded printed something"


# -- a writer's and a reader's own retry policy ------------------------------------------------------------------------

TWO = PublicRetryPolicy(attempts=2, initial_delay=0.01, max_delay=0.01)  # the fixture's process-wide policy makes 6


def _attempts_on(proxy, key_pattern: str, method: str) -> int:
    return sum(1 for m, p, a in proxy.fault_log if m == method and re.search(key_pattern, p) and a == "503")


@pytest.mark.s3
def test_a_writers_retry_policy_is_used_for_its_calls(proxy):
    key = r"/ckpt\.zarr/model/ids/c\.0$"
    proxy.inject("503", path=key, times=float("inf"))
    url, opts = fresh_url(proxy), options(proxy)
    with pytest.raises(CheckpointException) as info:
        dcp.save(STATE, planner=ZarrSavePlanner(),
                 storage_writer=ZarrWriter(url, storage_options=opts, retry=TWO, **WRITER))
    cause = causes(info.value)[0]
    assert isinstance(cause, ObjectStoreError) and "gave up after 2 attempts" in str(cause), cause
    assert _attempts_on(proxy, key, "PUT") == 2


@pytest.mark.s3
def test_a_readers_retry_policy_is_used_for_its_calls(proxy):
    url, opts = fresh_url(proxy), options(proxy)
    save_plain(STATE, url, storage_options=opts, **WRITER)
    key = r"/ckpt\.zarr/model/ids/c\.0$"
    proxy.inject("503", methods=("GET",), path=key, times=float("inf"))
    with pytest.raises(CheckpointException, match="gave up after 2 attempts"):
        load_full(url, STATE, storage_options=opts, retry=TWO)
    assert _attempts_on(proxy, key, "GET") == 2
    proxy.fault_log.clear()
    with pytest.raises(ObjectStoreError, match="gave up after 3 attempts"):
        open_checkpoint(url, opts, retry=RetryPolicy(attempts=3, initial_delay=0.01)).read("model.ids")
    assert _attempts_on(proxy, key, "GET") == 3
    proxy.fault_log.clear()
    with pytest.raises(CheckpointException, match=f"gave up after {FAST.attempts} attempts"):
        load_full(url, STATE, storage_options=opts)  # no retry=: the process-wide policy
    assert _attempts_on(proxy, key, "GET") == FAST.attempts


def test_a_retry_option_that_is_not_a_policy_is_refused():
    with pytest.raises(TypeError, match="retry=.*RetryPolicy"):
        ZarrWriter("s3://b/x.zarr", retry=3)
    with pytest.raises(ValueError, match="attempts=0"):
        RetryPolicy(attempts=0)


# -- permanent faults and exhausted retries: the save fails at once, nothing is committed --------------------------


@pytest.mark.s3
def test_a_transient_fault_that_never_ends_fails_the_save_after_the_last_attempt(proxy):
    sentinel, opts = fresh_url(proxy), options(proxy)
    save_plain(crash_state(12), sentinel, storage_options=opts, **WRITER)
    rule = proxy.inject("503", path=r"/layers\.0\.w/c\.", times=float("inf"))
    url = fresh_url(proxy)
    started = time.monotonic()
    with pytest.raises(CheckpointException) as info:
        save_plain(STATE, url, storage_options=opts, **WRITER)
    cause = causes(info.value)[0]
    assert isinstance(cause, ObjectStoreError) and f"gave up after {FAST.attempts} attempts" in str(cause), cause
    assert re.search(r"'model/layers\.0\.w/c\.\d+\.\d+'", str(cause)), "the key is named"
    assert "throttled by the store (503 SlowDown)" in str(cause), "throttling is named as such"
    assert rule.served % FAST.attempts == 0 and time.monotonic() - started < 20
    proxy.clear_faults()
    _assert_not_committed(url, opts)
    assert_state_equal(load_full(sentinel, crash_state(12), storage_options=opts), crash_state(12))


@pytest.mark.s3
@pytest.mark.parametrize("where", ["chunk", "commit"])
def test_access_denied_fails_the_save_at_once_with_the_key_named(proxy, where):
    path = r"/c(\.|$)" if where == "chunk" else r"/ckpt\.zarr/zarr\.json$"
    rule = proxy.inject("403", path=path, times=float("inf"))
    url, opts = fresh_url(proxy), options(proxy)
    with pytest.raises(CheckpointException) as info:
        save_plain(STATE, url, storage_options=opts, **WRITER)
    cause = causes(info.value)[0]
    assert isinstance(cause, ObjectStoreError) and isinstance(cause.__cause__, PermissionError), repr(cause)
    assert "not retried" in str(cause) and url in str(cause) and "'" in str(cause)
    failed_keys = [p for m, p, a in proxy.fault_log if a == "403"]
    assert len(failed_keys) == len(set(failed_keys)) == rule.served, "a permanent error is never retried"
    proxy.clear_faults()
    _assert_not_committed(url, opts)


@pytest.mark.s3
def test_a_missing_bucket_fails_the_save_at_once(proxy, caplog):
    opts = options(proxy)
    with pytest.raises(CheckpointException) as info:
        save_plain(STATE, "s3://no-such-bucket/ckpt.zarr", storage_options=opts, **WRITER)
    cause = causes(info.value)[0]
    assert isinstance(cause, ObjectStoreError) and isinstance(cause.__cause__, FileNotFoundError), repr(cause)
    assert "no-such-bucket" in str(cause) and "not retried" in str(cause)
    assert _retries_logged(caplog) == []


# -- overwriting in place: the old commit marker goes first -----------------------------------------------------------


class _Killed(BaseException):
    """Stands for the process dying: nothing after it runs."""


@pytest.mark.s3
def test_an_overwrite_killed_while_deleting_the_old_checkpoint_never_leaves_one_that_looks_complete(proxy, monkeypatch):
    opts, url = options(proxy), fresh_url(proxy)
    sibling = url.replace("ckpt.zarr", "ckpt.zarr2")  # shares the prefix: must survive the overwrite's deletes
    save_plain(crash_state(13), sibling, storage_options=opts, **WRITER)
    save_plain(STATE, url, storage_options=opts, **WRITER)
    def remove_half_then_die(self):  # sorted keys: "model/..." first, the root "zarr.json" last
        keys = sorted(self.first_keys(10**6))
        for key in keys[: len(keys) // 2]:
            self.remove(key)
        raise _Killed()

    backend = type(open_storage(url, opts))
    real_remove_all = backend.remove_all
    monkeypatch.setattr(backend, "remove_all", remove_half_then_die)
    with pytest.raises(BaseException) as info:
        save_plain(crash_state(14), url, storage_options=opts, overwrite=True, **WRITER)
    assert any(isinstance(c, _Killed) for c in causes(info.value)), info.value
    monkeypatch.setattr(backend, "remove_all", real_remove_all)
    _assert_not_committed(url, opts)
    assert_state_equal(load_full(sibling, crash_state(13), storage_options=opts), crash_state(13))
    save_plain(STATE, url, storage_options=opts, overwrite=True, **WRITER)  # a new save over the remains
    assert_state_equal(load_full(url, STATE, storage_options=opts), STATE)


@pytest.mark.s3
@pytest.mark.parametrize("after", [0, 4, 8])  # of the 9 chunk writes (the step: in its fill_value)
def test_an_overwrite_that_fails_while_writing_commits_nothing(proxy, after):
    opts, url = options(proxy), fresh_url(proxy)
    save_plain(STATE, url, storage_options=opts, **WRITER)
    proxy.inject("403", times=float("inf"), skip=after)
    with pytest.raises(CheckpointException):
        save_plain(crash_state(14), url, storage_options=opts, overwrite=True, **WRITER)
    proxy.clear_faults()
    _assert_not_committed(url, opts)  # object stores replace in place: the old checkpoint is gone, never half-mixed


# -- the retry policy itself -------------------------------------------------------------------------------------------


def _client_error(status: int, code: str) -> Exception:
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    return translate_boto_error(ClientError({"Error": {"Code": code, "Message": code},
                                             "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject"))


def test_errors_are_classified_as_transient_or_permanent():
    from aiohttp import ServerDisconnectedError
    from botocore.exceptions import ConnectTimeoutError, EndpointConnectionError, ReadTimeoutError

    transient = [_client_error(503, "SlowDown"), _client_error(500, "InternalError"), _client_error(502, "BadGateway"),
                 _client_error(429, "TooManyRequests"), _client_error(408, "RequestTimeout"),
                 ReadTimeoutError(endpoint_url="http://x"), ConnectTimeoutError(endpoint_url="http://x"),
                 EndpointConnectionError(endpoint_url="http://x"), ServerDisconnectedError(), ConnectionResetError(),
                 TimeoutError(), OSError(errno.EBUSY, "busy")]
    permanent = [_client_error(403, "AccessDenied"), _client_error(404, "NoSuchBucket"),
                 _client_error(400, "InvalidArgument"), PermissionError(), FileNotFoundError(), ValueError("bad"),
                 OSError(errno.ENOSPC, "full"), OSError(errno.EINVAL, "bad")]
    assert [e for e in transient if not is_transient(e)] == []
    assert [e for e in permanent if is_transient(e)] == []


def _refused() -> Exception:
    """What s3fs raises for a refused connection: botocore's EndpointConnectionError over aiohttp's connector error."""
    from types import SimpleNamespace

    from aiohttp import ClientConnectorError
    from botocore.exceptions import EndpointConnectionError

    key = SimpleNamespace(host="127.0.0.1", port=9, ssl=False)
    try:
        try:
            raise ClientConnectorError(key, ConnectionRefusedError(errno.ECONNREFUSED, "Connect call failed"))
        except ClientConnectorError as inner:
            raise EndpointConnectionError(endpoint_url="http://127.0.0.1:9/b/k", error=inner) from inner
    except EndpointConnectionError as outer:
        return outer


def test_a_refused_connection_fails_at_once_until_the_store_has_answered_then_it_is_retried():
    slept, calls = [], []

    def refused():
        calls.append(1)
        raise _refused()

    retrying = Retrying(FAST)
    with pytest.raises(ObjectStoreError, match=r"s3://b/x: cannot reach the object store at http://127\.0\.0\.1:9 "
                                                r"\(connection refused\) to read 'k'") as info:
        retrying.call(refused, what="read", key="k", url="s3://b/x", sleep=slept.append)
    assert len(calls) == 1 and slept == [] and "\n" not in str(info.value) and "Errno" not in str(info.value)
    assert retrying.call(lambda: "ok", what="read", key="k", url="s3://b/x") == "ok"  # the store answers
    calls.clear()
    with pytest.raises(ObjectStoreError, match=f"gave up after {FAST.attempts} attempts"):
        retrying.call(refused, what="read", key="k", url="s3://b/x", sleep=slept.append)
    assert len(calls) == FAST.attempts, "a store that answered before and now refuses may be restarting"
    patient = Retrying(RetryPolicy(attempts=6, unreachable_attempts=3, initial_delay=0.01))
    calls.clear()
    with pytest.raises(ObjectStoreError, match="cannot reach"):
        patient.call(refused, what="read", key="k", url="s3://b/x", sleep=slept.append)
    assert len(calls) == 3


def test_s3_error_codes_that_botocore_retries_are_transient_whatever_the_status():
    assert is_transient(_client_error(400, "RequestTimeout"))  # S3 sends it as a 400
    assert is_transient(_client_error(400, "SlowDown")) and not is_transient(_client_error(400, "InvalidArgument"))


def test_the_default_policy_backs_off_exponentially_to_a_cap():
    policy = retry.RetryPolicy()
    rng = random.Random(0)
    ceilings = [min(policy.max_delay, policy.initial_delay * policy.multiplier ** n)
                for n in range(policy.attempts - 1)]
    delays = [policy.delay(n + 1, rng) for n in range(policy.attempts - 1)]
    assert ceilings == sorted(ceilings) and ceilings[-1] == policy.max_delay
    assert all(c * (1 - policy.jitter) <= d <= c for c, d in zip(ceilings, delays))
    assert 10 < sum(ceilings) < 60, "a throttled store gets tens of seconds, not hours, before the save fails"


def test_call_with_retry_sleeps_between_attempts_and_names_the_key():
    slept, calls = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise _client_error(503, "SlowDown")
        return "done"

    result = call_with_retry(flaky, what="write", key="m/w/c/0", url="s3://b/x", policy=FAST, sleep=slept.append)
    assert result == "done"
    assert len(calls) == 3 and len(slept) == 2 and slept[0] <= FAST.initial_delay < slept[1] * 2 + 1e-9

    def denied():
        raise _client_error(403, "AccessDenied")

    with pytest.raises(ObjectStoreError, match=r"s3://b/x: write 'm/w/c/0' failed \(not retried") as info:
        call_with_retry(denied, what="write", key="m/w/c/0", url="s3://b/x", policy=FAST, sleep=slept.append)
    assert isinstance(info.value, OSError) and isinstance(info.value.__cause__, PermissionError)
    assert len(slept) == 2, "no sleep before a permanent failure"


def test_the_zarr_store_backend_routes_every_call_through_the_retry_layer(monkeypatch):
    """write, read, ranged reads, exists, remove and remove_all: none bypasses call_with_retry."""
    seen = []
    real = zarr_store.call_with_retry

    def spy(operation, *, what, key, url, **kwargs):
        seen.append(what)
        return real(operation, what=what, key=key, url=url, **kwargs)

    monkeypatch.setattr(zarr_store, "call_with_retry", spy)
    storage = open_storage("memory://dcp-zarr-retry-spy/ckpt.zarr")
    storage.write("a/c/0", [b"abcdef"])
    storage.read("a/c/0"), storage.read_range("a/c/0", 1, 2), storage.read_tail("a/c/0", 2), storage.exists("a/c/0")
    storage.remove("a/c/0")
    storage.remove_all()
    assert seen == ["write", "read", "read", "read", "look up", "delete", "delete everything under"]
