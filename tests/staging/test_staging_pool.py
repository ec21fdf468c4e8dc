"""The process's staging pool (dcp_zarr/staging/pool.py): ``dcp.async_save(sd, storage_writer=ZarrWriter(path))``,
a new writer each save, copies into the buffers the first save made; bounded, released on request, new buffers when
the shapes change, and two saves in flight never share buffers."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_zarr
from dcp_zarr import ZarrWriter
from dcp_zarr.staging.pool import POOL
from tests.support.compare import assert_state_equal
from tests.support.states import blank_like, load_full

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(autouse=True)
def empty_pool():
    """Each test starts and ends with nothing kept, at the default limit."""
    limit = POOL.limit
    dcp_zarr.release_staging_memory()
    yield
    dcp_zarr.release_staging_memory()
    POOL.limit = limit


class _Recording(ZarrWriter):
    """Notes the data pointer of each tensor it staged."""

    pointers: list[list[int]] = []

    def stage(self, state_dict):
        staged = super().stage(state_dict)
        _Recording.pointers.append([staged["model"]["w"].data_ptr(), staged["model"]["b"].data_ptr()])
        return staged


def _state(rows: int = 64) -> dict:
    return {"model": {"w": torch.randn(rows, 32), "b": torch.arange(rows, dtype=torch.int64)}, "step": 3}


def _async_saves(tmp_path, sd, count: int, **writer_kwargs) -> list[list[int]]:
    _Recording.pointers = []
    for i in range(count):
        dcp.async_save(sd, storage_writer=_Recording(tmp_path / f"{i}.zarr", **writer_kwargs), no_dist=True).result()
        assert_state_equal(load_full(str(tmp_path / f"{i}.zarr"), blank_like(sd)), sd)
        sd["model"]["w"].add_(1)  # training goes on between saves
    return _Recording.pointers


def test_async_saves_with_a_new_writer_each_copy_into_the_first_saves_buffers(tmp_path):
    sd = _state()
    nbytes = 64 * 32 * 4 + 64 * 8

    pointers = _async_saves(tmp_path, sd, 5)

    assert all(p == pointers[0] for p in pointers), pointers  # no new staging memory after the first save
    assert dcp_zarr.staging_memory_held() == nbytes
    assert pointers[0][0] != sd["model"]["w"].data_ptr()


def test_without_caching_each_save_stages_into_memory_freed_with_it(tmp_path):
    _async_saves(tmp_path, _state(), 2, cache_staged_state_dict=False)

    assert dcp_zarr.staging_memory_held() == 0


def test_new_shapes_get_new_buffers_and_the_old_ones_are_released(tmp_path):
    _async_saves(tmp_path / "a", _state(64), 1)
    _async_saves(tmp_path / "b", _state(100), 1)  # the same keys, other shapes

    assert dcp_zarr.staging_memory_held() == 100 * 32 * 4 + 100 * 8


def test_a_save_that_would_copy_into_buffers_a_save_in_flight_uses_is_refused(tmp_path):
    sd = _state()
    first = ZarrWriter(tmp_path / "0.zarr").stage(sd)  # staged, its save not started: still in flight
    first_w = first["model"]["w"].clone()

    with pytest.raises(RuntimeError, match="buffers this one would copy into has staged its copy but not started"):
        ZarrWriter(tmp_path / "1.zarr").stage(sd)
    assert torch.equal(first["model"]["w"], first_w)  # the first save's copy is untouched
    del first
    assert ZarrWriter(tmp_path / "1.zarr").stage(sd)["model"]["b"].equal(sd["model"]["b"])  # its save let go


def test_the_limit_bounds_what_is_kept_and_a_larger_state_dict_is_staged_without_being_kept(tmp_path):
    dcp_zarr.set_staging_memory_limit(1024)  # smaller than the state dict

    _async_saves(tmp_path, _state(), 2)

    assert dcp_zarr.staging_memory_held() == 0  # staged and freed with each save


def test_lowering_the_limit_releases_idle_buffers_and_release_frees_them_all(tmp_path):
    _async_saves(tmp_path / "a", _state(), 1)
    other = {"model": {"w": torch.ones(10, 32), "b": torch.arange(5), "c": torch.ones(3)}}  # other keys: its own
    _async_saves(tmp_path / "b", other, 1)
    second = 10 * 32 * 4 + 5 * 8 + 3 * 4
    both = dcp_zarr.staging_memory_held()
    assert both == 64 * 32 * 4 + 64 * 8 + second

    dcp_zarr.set_staging_memory_limit(both - 1)  # the least recently staged set goes first
    assert dcp_zarr.staging_memory_held() == second
    assert dcp_zarr.release_staging_memory() == second
    assert dcp_zarr.staging_memory_held() == 0


def test_a_writers_close_releases_its_state_dicts_buffers(tmp_path):
    writer = ZarrWriter(tmp_path / "0.zarr")
    dcp.async_save(_state(), storage_writer=writer, no_dist=True).result()
    assert dcp_zarr.staging_memory_held() > 0

    writer.close()
    assert dcp_zarr.staging_memory_held() == 0


@pytest.mark.parametrize("limit", [-1, 1.5, "1GB"])
def test_a_limit_that_is_not_a_number_of_bytes_is_refused(limit):
    with pytest.raises(ValueError, match="expected a number of bytes"):
        dcp_zarr.set_staging_memory_limit(limit)


def test_pinning_is_only_for_kept_buffers_of_cuda_tensors():
    from dcp_zarr.staging.pool import pinned_staging

    assert pinned_staging(["cuda", "cpu"], True) and not pinned_staging(["cpu"], True)
    assert not pinned_staging(["cuda"], False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a CPU save never asks torch to pin (it would warn where CUDA is missing)
        _, buffers = POOL.stage(_state())
    assert not buffers.pinned and buffers.kept


def test_buffers_a_save_in_flight_holds_are_not_released(tmp_path):
    staged = ZarrWriter(tmp_path / "0.zarr").stage(_state())  # its save not started: in flight
    held = dcp_zarr.staging_memory_held()

    assert dcp_zarr.release_staging_memory() == 0 and dcp_zarr.staging_memory_held() == held > 0
    del staged  # its save let go
    assert dcp_zarr.release_staging_memory() == held
