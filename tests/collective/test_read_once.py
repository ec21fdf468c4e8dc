"""Reads done once (collective/): the root zarr.json is read by DCP's coordinator alone, a region several ranks need
(replicas, plain tensors every rank loads) and the small pieces of one stored chunk are read by one rank and sent
to the others; loads stay bit-exact at any layout, and a rank that cannot read fails every rank (real gloo ranks)."""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh

from dcp_zarr import ZarrReader, ZarrSavePlanner, ZarrWriter, open_checkpoint
from dcp_zarr.planning.dcp_internals import dcp_load_wrapper
from dcp_zarr.storage import LocalStorage
from dcp_zarr.testing.shardings import in_layout
from tests.support.compare import assert_state_equal
from tests.support.faults import causes
from tests.support.ranks import run_ranks

pytestmark = [pytest.mark.distributed]

ALWAYS = 1 << 40
SHAPES = {"a": (24, 5), "b": (7,), "c": (13, 3), "d": ()}


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {k: torch.randn(shape, generator=g) for k, shape in SHAPES.items()}


def blank(state: dict) -> dict:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def plain(state: dict) -> dict:
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}


def save(rank, world_size, path, layout):
    state = in_layout(layout, world_size, full_tensors())
    dcp.save(state, storage_writer=ZarrWriter(path, aggregate_below=ALWAYS), planner=ZarrSavePlanner())


def load_counting(rank, world_size, path, layout, options):
    """Rank program: a load in ``layout``; what it loaded, the bytes it read and its reads of the root zarr.json."""
    roots = []
    original = LocalStorage.read_range

    def counted(self, key, start, length):
        if key == "zarr.json":
            roots.append(key)
        return original(self, key, start, length)

    LocalStorage.read_range = counted
    target = blank(in_layout(layout, world_size, full_tensors()))
    reader = ZarrReader(path, **options)
    dcp.load(target, storage_reader=reader)
    return plain(target), reader.bytes_read, len(roots)


def tensor_bytes(path: str) -> int:
    entries = open_checkpoint(path).manifest.entries.values()
    return sum(math.prod(e.shape) * 4 for e in entries if e.kind == "tensor")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("read_once") / "ckpt.zarr")
    run_ranks(save, 4, path, "fsdp")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("layout, options, most", [
    ("fsdp", {"read_once": True, "read_once_below": ALWAYS}, 1.1),  # small pieces: each stored chunk read once
    ("hsdp", {"read_once": True}, 1.1),  # replicas: each shard read by one rank of its replica group
    ("ddp", {"read_once": True}, 1.1),  # every rank loads every tensor whole: read by one rank, sent to the others
    ("ddp", {}, 4.2),  # a machine's own file system by default: every rank reads everything (and its checksums)
])
def test_storage_serves_a_load_about_once_whatever_the_replicas(saved, layout, options, most):
    results = run_ranks(load_counting, 4, saved, layout, options)
    for loaded, _, _ in results:
        assert_state_equal(loaded, full_tensors())
    read = sum(r[1] for r in results)
    assert read <= most * tensor_bytes(saved), (read, tensor_bytes(saved))
    if options.get("read_once"):
        assert [r[2] for r in results] == [1, 0, 0, 0], "the root zarr.json is read by the coordinator alone"
    else:
        assert read >= 3.5 * tensor_bytes(saved)
        assert [r[2] for r in results] == [1, 1, 1, 1]


def load_deciding_apart(rank, world_size, path, coordinator_shares):
    """Rank program: the coordinator's reader shares reads or not, every other rank's decides the other way (as
    ranks that see the path on a machine's own file system and on NFS would)."""
    shares = coordinator_shares if rank == 0 else not coordinator_shares
    return load_counting(rank, world_size, path, "ddp", {"read_once": shares})


@pytest.mark.slow
@pytest.mark.parametrize("coordinator_shares", [True, False])
def test_ranks_that_decide_apart_whether_to_share_still_load(saved, coordinator_shares):
    # The coordinator decides for every rank whether the root is read once; the reads are shared only where every
    # rank would. Otherwise the ranks would wait in different collectives until run_ranks' timeout.
    results = run_ranks(load_deciding_apart, 3, saved, coordinator_shares, timeout=60)
    for loaded, _, _ in results:
        assert_state_equal(loaded, full_tensors())
    assert [r[2] for r in results] == ([1, 0, 0] if coordinator_shares else [1, 1, 1])
    assert sum(r[1] for r in results) >= 2.5 * tensor_bytes(saved), "every rank read the tensors for itself"


def load_below_apart(rank, world_size, path):
    """Rank program: every rank shares reads, but only rank 0 reads these small pieces a chunk at a time (1 byte:
    the others still describe their needs, so that the needs alone do not tell the ranks apart)."""
    return load_counting(rank, world_size, path, "fsdp", {"read_once": True, "read_once_below": ALWAYS if rank == 0
                                                          else 1})


@pytest.mark.slow
def test_ranks_whose_read_options_differ_each_read_for_themselves(saved):
    # The options that decide who reads what are in the digest the ranks compare: ranks that differ read alone.
    results = run_ranks(load_below_apart, 3, saved, timeout=60)
    for loaded, _, _ in results:
        assert_state_equal(loaded, full_tensors())
    assert [r[2] for r in results] == [1, 0, 0], "the root is still read once"


def load_alone(rank, world_size, path):
    """Rank program: only rank 0 loads, with no_dist=True, while a process group exists."""
    loaded = None
    if rank == 0:
        target = blank(full_tensors())
        dcp.load(target, storage_reader=ZarrReader(path), no_dist=True)
        loaded = target
    dist.barrier()
    return loaded


@pytest.mark.slow
def test_a_load_on_one_rank_alone_reads_everything_itself(saved):
    assert_state_equal(run_ranks(load_alone, 2, saved)[0], full_tensors())


def load_on_subgroup(rank, world_size, path):
    group = dist.new_group([0, 1])
    if rank > 1:
        return None
    mesh = init_device_mesh("cpu", (world_size,))
    del mesh
    target = blank(full_tensors())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.load(target, storage_reader=ZarrReader(path, read_once=True), process_group=group)
    return target, [str(w.message) for w in caught if "process group" in str(w.message)]


@pytest.mark.slow
def test_a_reader_on_another_group_than_the_loads_reads_alone_and_says_how_to_share(saved):
    results = run_ranks(load_on_subgroup, 3, saved)
    for loaded, _ in results[:2]:
        assert_state_equal(loaded, full_tensors())
    assert any("ZarrReader(process_group=...)" in text for text in results[0][1]), results[0][1]


def find_wrapper(rank, world_size, path):
    found = []

    class Looking(ZarrReader):
        def read_metadata(self, *args, **kwargs):
            wrapper = dcp_load_wrapper()
            found.append(None if wrapper is None else (wrapper.use_dist, wrapper.get_world_size()))
            return super().read_metadata(*args, **kwargs)

    dcp.load(blank(full_tensors()), storage_reader=Looking(path, read_once=True))
    return found


@pytest.mark.slow
def test_dcp_keeps_its_load_wrapper_where_the_reader_looks_for_it(saved):
    # If torch moves it, the root is read by every rank again: this test says so before the figures do.
    assert run_ranks(find_wrapper, 2, saved) == [[(True, 2)], [(True, 2)]]


def load_expecting_failure(rank, world_size, path, layout):
    try:
        dcp.load(blank(in_layout(layout, world_size, full_tensors())), storage_reader=ZarrReader(path, read_once=True))
    except CheckpointException as exc:
        return [f"{type(c).__name__}: {c}" for c in causes(exc)]
    return None


@pytest.mark.slow
def test_a_rank_that_cannot_read_its_shared_unit_fails_the_load_on_every_rank(saved, store_copy):
    damaged = store_copy(saved)
    chunk = damaged / "a" / "c.0.0"
    data = bytearray(chunk.read_bytes())
    data[10] ^= 0xFF
    chunk.write_bytes(bytes(data))
    results = run_ranks(load_expecting_failure, 2, str(damaged), "ddp")
    assert all(results), results
    text = "\n".join(results[0])
    assert "CorruptChunkError" in text and "'a'" in text and "crc32c" in text, text
    assert "CollectiveIOError" in text and "of the process group failed" in text, text


def load_differing(rank, world_size, path):
    """Rank program: rank 1 loads one key fewer (a partial load): the needs differ, each rank reads for itself."""
    full = full_tensors()
    target = blank(full)
    if rank == 1:
        del target["c"]
    reader = ZarrReader(path, read_once=True)
    dcp.load(target, storage_reader=reader)
    return target


@pytest.mark.slow
def test_ranks_that_need_different_keys_read_for_themselves(saved):
    results = run_ranks(load_differing, 2, saved)
    assert_state_equal(results[0], full_tensors())
    expected = full_tensors()
    del expected["c"]
    assert_state_equal(results[1], expected)
    assert os.path.isdir(saved)


def load_as_float64(rank, world_size, path):
    """Rank program: every rank loads every tensor whole, into float64 tensors (stored float32): the parts sent to
    a rank land in a staging buffer of the stored dtype, then are copied into its tensors."""
    target = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in full_tensors().items()}
    reader = ZarrReader(path, read_once=True)
    dcp.load(target, storage_reader=reader)
    return target, reader.bytes_read


@pytest.mark.slow
def test_shared_parts_reach_tensors_of_another_dtype_through_a_staging_copy(saved):
    results = run_ranks(load_as_float64, 2, saved)
    expected = {k: v.double() for k, v in full_tensors().items()}
    for loaded, _ in results:
        assert_state_equal(loaded, expected)
    assert sum(r[1] for r in results) <= 1.1 * tensor_bytes(saved)
