"""Incremental saves on an object store (the loopback S3 server): the chunks that did not change are copied within
the server (CopyObject), their bytes never passing through the saving process; the changed ones are PUT; the new
checkpoint loads exactly once every key of the earlier one is deleted. What the server saw is counted per object
(``Traffic.copies``, ``put_bytes``, ``get_bytes``) and held against the writers' ``reuse_counts``."""

from __future__ import annotations

import os
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_zarr import IncrementalBaseError, ZarrReader, ZarrWriter
from dcp_zarr.format.encoding import CHECKSUM_BYTES
from dcp_zarr.store_io.chunk_reuse import ReuseCounts
from dcp_zarr.tools.cli import main as cli_main
from tests.support.compare import assert_state_equal
from tests.support.faults import shard_named
from tests.support.ranks import run_ranks

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
              pytest.mark.usefixtures("aws_environment")]

# rows of 256 float32: 64 rows a chunk; never aggregated (on S3 the arrays' halves, under 4 MiB, would be a block each)
WRITER_OPTIONS = {"inner_chunk_bytes": 64 << 10, "aggregate_below": 0}
# The rows save 2 changes, per array (every other array is as save 1 left it).
CHANGED_ROWS = {"model/layers.0.w": range(100, 110), "optim/exp_avg": [5, 300]}
_SHARDED = ("embed.weight", "layers.0.w", "exp_avg")


def full_state(changed: bool) -> dict:
    g = torch.Generator().manual_seed(11)
    state = {
        "model": {"embed.weight": torch.randn(512, 256, generator=g), "layers.0.w": torch.randn(384, 256, generator=g),
                  "norm.w": torch.randn(256, generator=g)},
        "optim": {"exp_avg": torch.randn(512, 256, generator=g)},
    }
    if changed:
        for node, rows in CHANGED_ROWS.items():
            group, name = node.split("/")
            state[group][name][list(rows)] += 1.0
    return state


def sharded_state(changed: bool, world_size: int) -> dict:
    return shard_named(full_state(changed), world_size, dict.fromkeys(_SHARDED, 0))


def _save_on_ranks(rank, world_size, url, options, changed, incremental_from):
    writer = ZarrWriter(url, storage_options=options, incremental=True, incremental_from=incremental_from,
                        **WRITER_OPTIONS)
    dcp.save(sharded_state(changed, world_size), storage_writer=writer)
    return writer.reuse_counts


def _urls(s3) -> tuple[str, str]:
    base = f"s3://{s3.bucket}/{uuid.uuid4().hex[:8]}"
    return f"{base}/a", f"{base}/b"


def _load(url: str, options: dict) -> dict:
    target = {group: {name: torch.zeros_like(v) for name, v in values.items()}
              for group, values in full_state(False).items()}
    dcp.load(target, storage_reader=ZarrReader(url, storage_options=options), no_dist=True)
    return target


def _expected_changed(fs, b: str) -> set[str]:
    """The chunk objects of ``b`` (``bucket/key``) that hold a changed row, from each array's chunk grid (rows only:
    every chunk spans the other dimensions whole)."""
    import json

    changed = set()
    for node, rows in CHANGED_ROWS.items():
        meta = json.loads(fs.cat(f"{b}/{node}/zarr.json"))
        chunk_shape = meta["chunk_grid"]["configuration"]["chunk_shape"]
        assert chunk_shape[1:] == meta["shape"][1:], meta
        changed |= {f"{b}/{node}/c.{row // chunk_shape[0]}.0" for row in rows}
    return changed


def _check_traffic(s3, traffic, a: str, b: str, counts: list[ReuseCounts]) -> dict:
    """Every chunk object of ``b`` either copied from ``a``'s on the server (no body put, none read but the tail
    the save checks, in two requests) or, where it holds a changed row, PUT whole; the writers' counts agree.
    Returns the figures."""
    fs = s3.filesystem()
    a, b = a.removeprefix("s3://"), b.removeprefix("s3://")
    chunks = {key: fs.size(key) for key in fs.find(b) if not key.endswith("zarr.json")}
    changed = _expected_changed(fs, b)
    assert changed < set(chunks), (changed, sorted(chunks))
    for key, size in chunks.items():
        if key in changed:
            assert traffic.put_bytes[key] == size and not traffic.copies[(a + key[len(b):], key)], key
        else:
            assert traffic.copies[(a + key[len(b):], key)] == 1 and traffic.put_bytes[key] == 0, key
            assert traffic.get_bytes[key] <= CHECKSUM_BYTES, (key, traffic.get_bytes[key])
            # two requests: the copy, and one ranged GET that checks its size and crc32c; none of the earlier object
            asked = {(m, o): n for (m, o), n in traffic.object_requests.items() if o in (key, a + key[len(b):])}
            assert asked == {("PUT", key): 1, ("GET", key): 1}, (key, asked)
    assert sum(traffic.copies.values()) == len(chunks) - len(changed), traffic.copies
    # Nothing else crossed: every other body put is a zarr.json, no chunk of the earlier store was read, and none of
    # the new one beyond its tail (the other GETs are of zarr.json documents, and listings: GETs of the bucket).
    assert all(key in changed or key.endswith("zarr.json") for key in traffic.put_bytes), sorted(traffic.put_bytes)
    read = {key: n for key, n in traffic.get_bytes.items() if key.startswith((f"{a}/", f"{b}/"))
            and not key.endswith("zarr.json")}
    assert all(n <= (CHECKSUM_BYTES if key.startswith(f"{b}/") else 0) for key, n in read.items()), read
    linked_bytes = sum(size for key, size in chunks.items() if key not in changed)
    written_bytes = sum(chunks[key] for key in changed)
    assert ReuseCounts(*map(sum, zip(*counts))) == ReuseCounts(len(chunks) - len(changed), linked_bytes,
                                                               len(changed), written_bytes), counts
    return {"copies": sum(traffic.copies.values()), "copied bytes": linked_bytes, "chunks put": len(changed),
            "chunk bytes put": written_bytes, "bytes in": traffic.bytes_in, "bytes out": traffic.bytes_out,
            "requests": dict(traffic.requests)}


def _delete_and_load(s3, a: str, b: str) -> None:
    fs = s3.filesystem()
    fs.rm(a.removeprefix("s3://"), recursive=True)
    assert fs.find(a.removeprefix("s3://")) == []
    assert_state_equal(_load(b, s3.storage_options()), full_state(True))


@pytest.mark.s3
def test_an_incremental_save_on_s3_copies_unchanged_chunks_on_the_server_and_puts_the_changed_ones(s3, capsys):
    a, b = _urls(s3)
    options = s3.storage_options()
    dcp.save(full_state(False), storage_writer=ZarrWriter(a, storage_options=options, incremental=True,
                                                          **WRITER_OPTIONS), no_dist=True)
    writer = ZarrWriter(b, storage_options=options, incremental_from=a, **WRITER_OPTIONS)
    with s3.counting() as traffic:
        dcp.save(full_state(True), storage_writer=writer, no_dist=True)
    assert writer.reuse_counts is not None
    figures = _check_traffic(s3, traffic, a, b, [writer.reuse_counts])
    print(f"\nincremental save to S3, one process: {figures}")
    cli_options = ["-o", f"endpoint_url={s3.endpoint}", "-o", "key=testing", "-o", "secret=testing"]
    assert cli_main(["inspect", b, *cli_options]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert f"copied within the store from {a}" in said and "linked from" not in said, said
    _delete_and_load(s3, a, b)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.s3
def test_two_ranks_save_incrementally_on_s3_copying_unchanged_chunks_on_the_server(s3):
    a, b = _urls(s3)
    options = s3.storage_options()
    run_ranks(_save_on_ranks, 2, a, options, False, None)
    with s3.counting() as traffic:
        counts = run_ranks(_save_on_ranks, 2, b, options, True, a)
    assert all(c.linked_chunks > 0 for c in counts), counts
    figures = _check_traffic(s3, traffic, a, b, counts)
    print(f"\nincremental save to S3, 2 ranks: {figures}; per rank {counts}")
    _delete_and_load(s3, a, b)


@pytest.mark.s3
@pytest.mark.parametrize("earlier_on", ["s3", "local"])
def test_an_earlier_checkpoint_on_other_storage_is_refused_naming_both_before_anything_is_written(
        s3, tmp_path, earlier_on):
    a, b = _urls(s3)
    local = str(tmp_path / "ckpt.zarr")
    earlier, path = (a, local) if earlier_on == "s3" else (local, b)
    options = s3.storage_options()
    dcp.save(full_state(False), storage_writer=ZarrWriter(earlier, storage_options=options, incremental=True,
                                                          **WRITER_OPTIONS), no_dist=True)
    with pytest.raises(IncrementalBaseError) as failed:  # as the writer is made, before any save
        ZarrWriter(path, storage_options=options, incremental_from=earlier)
    refused = failed.value
    assert earlier in str(refused) and path in str(refused), refused
    assert os.listdir(tmp_path) == ([] if earlier_on == "s3" else ["ckpt.zarr"]), "the refused save wrote locally"
    assert s3.filesystem().find(b.removeprefix("s3://")) == [], "the refused save wrote to S3"
