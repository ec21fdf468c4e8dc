"""A locally planned save's plan is a value (planning/write_plan.py): kept under one key naming every input, reused
while they are the same, made anew when any differs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dcp_zarr import ZarrSavePlanner
from dcp_zarr.errors import PlanMismatchError
from dcp_zarr.format.compression import Compression
from dcp_zarr.planning.protocol import PLAN_OPTIONS, PlanOptions, Summary, Ticket, check_summaries
from dcp_zarr.planning.rank_planning import RankPlanning
from dcp_zarr.planning.write_plan import PlanKey

_OPTIONS = PlanOptions(1 << 20, 0, 1 << 20, None)


def _plan(options: PlanOptions, array_shards: bool = True, stored_plain: frozenset[str] = frozenset()):
    state = {"w": torch.arange(4096.0).reshape(64, 64), "b": torch.zeros(64), "step": 3}
    planner = ZarrSavePlanner()
    planner.set_up_planner(state, None, True)
    local = RankPlanning(planner.create_local_plan().planner_data, 0, True, "small", 1 << 20, options)
    local.rank_writes(Ticket("id", "somewhere", False, frozenset(), stored_plain), array_shards)
    return local.plan


def test_a_plan_is_reused_while_its_inputs_are_the_same():
    assert _plan(_OPTIONS) is _plan(_OPTIONS)


def test_a_plan_is_made_anew_when_any_option_or_input_differs():
    first = _plan(_OPTIONS)
    for name in ("inner_chunk_bytes", "aggregate_below", "exchange_bytes"):
        assert _plan(_OPTIONS._replace(**{name: getattr(_OPTIONS, name) + 512})) is not first, name
    compressing = _OPTIONS._replace(compression=Compression(min_bytes=0, min_ratio=0))
    compressed = _plan(compressing)
    assert compressed is not first and compressed.specs["w"].layout.codec is not None
    plain = _plan(compressing, stored_plain=frozenset({"w"}))
    assert plain is not compressed and plain.specs["w"].layout.codec is None
    assert _plan(_OPTIONS, array_shards=False) is not first
    small_chunks = _OPTIONS._replace(inner_chunk_bytes=4096)  # w (16 KiB) in inner chunks of 16 rows
    assert _plan(small_chunks).specs["w"].layout.sharded
    recording = _plan(small_chunks._replace(records_chunks=True))
    assert recording is not _plan(small_chunks)
    assert recording.specs["w"].layout.chunk_shape == (16, 64) and not recording.specs["w"].layout.sharded
    whole = _plan(small_chunks._replace(records_chunks=True, whole_arrays=frozenset({"w"})))
    full_save = _plan(small_chunks, array_shards=False)  # as on storage that cannot write at offsets
    assert whole is not recording and whole.specs["w"].layout == full_save.specs["w"].layout
    assert whole.specs["b"].layout == recording.specs["b"].layout


def test_the_plan_key_names_every_option_the_ranks_must_agree_on():
    key_fields = {f.name for f in dataclasses.fields(PlanKey)}
    assert "options" in key_fields and set(PLAN_OPTIONS) == set(PlanOptions._fields)
    assert _OPTIONS.summarized()[:5] == (1 << 20, 0, 1 << 20, None, False)
    # the whole arrays travel as their count and a digest, which tells any two sets apart
    whole = [_OPTIONS._replace(whole_arrays=frozenset(names)).summarized()[5]
             for names in ((), ("w",), ("b",), ("b", "w"), ("w", "b"))]
    assert whole[0] is None and whole[1].startswith("1 array (") and whole[3].startswith("2 arrays (")
    assert whole[3] == whole[4]
    assert len(set(whole[:4])) == 4


def test_ranks_that_read_different_whole_arrays_from_the_earlier_checkpoint_are_refused_naming_it():
    """Every rank reads the earlier checkpoint's record itself; ranks that found different arrays changed whole (it
    was replaced between their reads) would lay them out differently."""
    recording = _OPTIONS._replace(records_chunks=True)
    summaries = [Summary(rank, 2, "digest", (), options.summarized())
                 for rank, options in enumerate([recording._replace(whole_arrays=frozenset({"w"})), recording])]
    with pytest.raises(PlanMismatchError) as raised:
        check_summaries(summaries)
    message = str(raised.value)
    assert "whole_arrays: " in message and "1 array (" in message and "None on rank 1" in message
    assert "pass every rank the same incremental_from" in message and "inner_chunk_bytes" not in message


def test_a_kept_plan_never_carries_a_save_s_key_order_into_the_next(tmp_path):
    """The key stands for the entries' structure, which sorts them: two state dicts of one structure in another key
    order share a plan, and each store still holds its own state dict's order (the root's attributes, the manifest,
    the optimizer tables' numbering), byte for byte what a process that never planned the first would write."""
    import torch.distributed.checkpoint as dcp

    from dcp_zarr import ZarrWriter
    from dcp_zarr.planning.recent_plans import recent_plans

    def state(order):
        values = {"x": torch.arange(6.0), "y": torch.ones(4), "n": 3}
        return {key: values[key] for key in order}

    def root_document(path):
        import re

        text = (path / "zarr.json").read_text()
        return re.sub(r'"save_id": ?"[0-9a-f]+"', "", text)

    dcp.save(state("xyn"), storage_writer=ZarrWriter(tmp_path / "first"), no_dist=True)
    dcp.save(state("nyx"), storage_writer=ZarrWriter(tmp_path / "after"), no_dist=True)
    recent_plans.clear()
    dcp.save(state("nyx"), storage_writer=ZarrWriter(tmp_path / "fresh"), no_dist=True)

    assert root_document(tmp_path / "after") == root_document(tmp_path / "fresh")
    assert root_document(tmp_path / "after") != root_document(tmp_path / "first")
