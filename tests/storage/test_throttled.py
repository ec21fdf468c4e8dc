"""ThrottledStorage (dcp_zarr/testing/throttled.py): the storage contract over a local directory, reached by its
``throttled://`` location, and a link that holds its bandwidth (checked on the bytes charged and the sleeps asked
for, on a clock of the test's own: never on wall time)."""

from __future__ import annotations

import threading

import pytest

from dcp_zarr.storage import LocalStorage, local, open_storage, storage_class, unregister_storage
from dcp_zarr.testing.storage_contract import FAST_RETRY, StorageContract
from dcp_zarr.testing.throttled import Link, ThrottledStorage, register_throttled


class FakeClock:
    """Time that moves only when the link sleeps, or when a test advances it; the sleeps asked for are kept."""

    def __init__(self) -> None:
        self.now, self.sleeps = 0.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def registered():
    register_throttled()
    yield
    unregister_storage("throttled")


class TestThrottledStorage(StorageContract):
    writes_at_offsets = True  # as the local directory inside
    retries_transient_faults = False

    @pytest.fixture(autouse=True)
    def _root(self, tmp_path, registered):
        self.root = tmp_path

    def make_storage(self, name, retry=FAST_RETRY):
        return ThrottledStorage(LocalStorage(str(self.root / name)), Link(1e15))

    def storage_options(self):
        return {"bytes_per_second": 1e15}

    def break_next_calls(self, storage, count, error, monkeypatch):
        real, left = local.os.pwritev, [count]

        def pwritev(fd, buffers, offset):
            if left[0] > 0:
                left[0] -= 1
                raise error
            return real(fd, buffers, offset)

        monkeypatch.setattr(local.os, "pwritev", pwritev)
        return None


def test_a_link_returns_each_transfer_when_its_bytes_have_crossed_at_the_rate(clock):
    link = Link(1000, clock=clock, sleep=clock.sleep)
    link.charge(500, start=0.0)
    assert clock.sleeps == [0.5]
    link.charge(2000, start=0.5)
    assert clock.sleeps == [0.5, 2.0] and link.carried == 2500 and link.waited == pytest.approx(2.5)


def test_a_transfer_queues_behind_the_ones_charged_before_it(clock):
    """Two threads' transfers, both begun at 0: the second crosses after the first (a shared link)."""
    link = Link(100, clock=clock, sleep=lambda s: None)
    link.charge(100, start=0.0)
    link.charge(100, start=0.0)
    assert link.waited == pytest.approx(1.0 + 2.0)


def test_a_transfer_slower_than_the_link_waits_for_nothing(clock):
    link = Link(1000, clock=clock, sleep=clock.sleep)
    clock.now = 5.0  # the transfer itself took 5 s for 1,000 bytes: slower than the link
    link.charge(1000, start=0.0)
    assert clock.sleeps == [] and link.carried == 1000


def test_every_byte_written_and_read_is_charged_once(tmp_path, clock):
    link = Link(1 << 20, clock=clock, sleep=clock.sleep)
    storage = ThrottledStorage(LocalStorage(str(tmp_path / "c")), link)
    storage.write("a/c.0", [b"x" * 1000, bytearray(24)])
    storage.write_at("shard", 8, [b"y" * 8])
    assert link.carried == 1032
    assert storage.read("a/c.0") == b"x" * 1000 + bytes(24) and link.carried == 2056
    assert storage.read_range("a/c.0", 0, 10) == b"x" * 10 and storage.read_tail("a/c.0", 4) == bytes(4)
    into = bytearray(6)
    assert storage.read_range_into("shard", 10, [memoryview(into)]) == 6
    with storage.open_value("shard") as value:
        assert value.read_tail(2) == b"yy"
    assert link.carried == 2056 + 10 + 4 + 6 + 2
    assert storage.exists("a/c.0") and storage.size("a/c.0") == 1024 and len(storage.first_keys(10)) == 2
    storage.remove("a/c.0")
    assert link.carried == 2078, "metadata calls are free"
    assert sum(clock.sleeps) == pytest.approx(2078 / (1 << 20))


def test_threads_share_the_link_and_together_wait_for_all_their_bytes(tmp_path):
    slept: list[float] = []
    lock = threading.Lock()

    def sleep(seconds: float) -> None:
        with lock:
            slept.append(seconds)

    link = Link(1e6, clock=lambda: 0.0, sleep=sleep)  # every transfer instant, begun at 0
    storage = ThrottledStorage(LocalStorage(str(tmp_path / "c")), link)
    threads = [threading.Thread(target=storage.write, args=(f"k{i}", [bytes(100_000)])) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert link.carried == 800_000
    assert sorted(slept) == pytest.approx([0.1 * (i + 1) for i in range(8)]), "each after those before it"


def test_a_throttled_location_opens_its_inner_storage_at_the_rate_given(tmp_path, registered):
    assert storage_class(f"throttled://{tmp_path}/c") is ThrottledStorage
    storage = open_storage(f"throttled://{tmp_path}/c", {"bytes_per_second": 1e12})
    assert type(storage) is ThrottledStorage and type(storage.inner) is LocalStorage
    assert storage.inner.root == str(tmp_path / "c") and storage.link.rate == 1e12
    assert storage.writes_at_offsets and storage.location("x") == f"throttled://{tmp_path}/c/x"
    again = open_storage(f"throttled://{tmp_path}/d", {"bytes_per_second": 1e12})
    assert again.link is storage.link, "one link per rate in a process"
    with pytest.raises(ValueError, match="bytes_per_second"):
        open_storage(f"throttled://{tmp_path}/c")


def test_a_checkpoint_saved_and_loaded_through_a_throttled_location_is_whole(tmp_path, registered):
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_zarr import ZarrReader, ZarrWriter
    from dcp_zarr.testing.throttled import link

    state = {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64), "step": 3}
    location, options = f"throttled://{tmp_path}/ckpt", {"bytes_per_second": 123e9}
    before = link(123e9).carried
    dcp.save(state, storage_writer=ZarrWriter(location, storage_options=options), no_dist=True)
    written = link(123e9).carried - before
    assert written >= 4096 * 4
    loaded = {"w": torch.zeros(64, 64), "step": 0}
    dcp.load(loaded, storage_reader=ZarrReader(location, storage_options=options), no_dist=True)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3
    assert link(123e9).carried - before - written >= 4096 * 4, "the load's reads were charged too"
