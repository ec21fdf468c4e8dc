"""Incremental saves (``ZarrWriter(incremental_from=...)``): what is linked and what is written anew, and that every
store of a chain loads exactly on its own, the earlier one deleted: LoRA-like FSDP2 training on gloo ranks loaded at
other world sizes, many small tensors aggregated into a full save's files (and objects on S3), their unchanged blocks
linked without their bytes travelling, frozen weights changed in place, embedding rows, full fine-tunes, DCP's own
planning, compression, S3's server-side copies, every kind of value, zarr-python reading the store alone, the tools,
and CheckpointManager.
test_incremental_bases.py: the earlier checkpoint refused, unrecorded, damaged, or on another file system."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import uuid
import warnings

import crc32c
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import zarr
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

import dcp_zarr.writer
from dcp_zarr import Compression, ZarrReader, ZarrWriter
from dcp_zarr.collective import aggregated_writes, transfer
from dcp_zarr.errors import IncrementalSaveWarning
from dcp_zarr.format.chunk_record import UNHASHED, ChunkRecord, data_digest
from dcp_zarr.saving.dcp_planned_save import DcpPlannedSave
from dcp_zarr.store_io import chunk_reuse
from dcp_zarr.testing.planners import DCPsPlanning
from dcp_zarr.tools.cli import main
from dcp_zarr.tools.inspection import human_bytes
from tests.support.compare import assert_state_equal
from tests.support.models import full_state
from tests.support.ranks import run_ranks
from tests.support.states import load_full, random_bits
from tests.support.stores import chunk_files, file_identities, new_files, root_manifest, store_bytes

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# Data XORed with this 33-bit multiple of crc32c's polynomial (LSB first, at any offset) keeps its crc32c
CRC32C_MULTIPLE = (0x82F63B78 << 1) | 1


def save(state, path, **writer_options) -> ZarrWriter:
    """``dcp.save`` in this process, no process group; the writer, for its ``reuse_counts``."""
    writer = ZarrWriter(path, **writer_options)
    dcp.save(state, storage_writer=writer, no_dist=True)
    return writer


def tensor_nodes(path) -> set[str]:
    """The arrays that store chunks: every tensor's but those kept in their fill_value (one-element tensors)."""
    return {e["node"] for e in root_manifest(path)["entries"].values() if e["kind"] == "tensor" and "fill" not in e}


def chunks_under(files, node: str) -> set[str]:
    """The chunk files of the array at ``node`` among ``files`` (paths relative to a store)."""
    return {f for f in files if os.path.dirname(f) == node and os.path.basename(f) != "zarr.json"}


# -- LoRA: a frozen base, trained adapters, FSDP2 ----------------------------------------------------------------------

DIM, RANK, LAYERS = 512, 2, 4  # base 4 MiB; adapters and their AdamW state 96 KiB


class LoraLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(DIM, DIM, bias=False)
        self.base.weight.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(RANK, DIM) / DIM)
        self.lora_b = nn.Parameter(torch.randn(DIM, RANK) / RANK)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


class LoraModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LoraLinear() for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return x


def _lora(world_size: int, seed: int, train_base: bool = False):
    torch.manual_seed(seed)
    model = LoraModel()
    for layer in model.layers:
        layer.base.weight.requires_grad_(train_base)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _lora_step(model, optim, batch: int) -> None:
    generator = torch.Generator().manual_seed(batch)
    x, target = torch.randn(8, DIM, generator=generator), torch.randn(8, DIM, generator=generator)
    optim.zero_grad()
    nn.functional.mse_loss(model(x), target).backward()
    optim.step()


def _lora_state(model, optim) -> dict:
    model_state, optim_state = get_state_dict(model, optim)
    return {"model": model_state, "optim": optim_state}


def _lora_train_and_save(rank, world_size, root):
    model, optim = _lora(world_size, seed=0)
    _lora_step(model, optim, 0)
    dcp.save(_lora_state(model, optim), storage_writer=ZarrWriter(f"{root}/1.zarr", incremental=True))
    _lora_step(model, optim, 1)
    writer = ZarrWriter(f"{root}/2.zarr", incremental_from=f"{root}/1.zarr")
    dcp.save(_lora_state(model, optim), storage_writer=writer)
    dcp.save(_lora_state(model, optim), storage_writer=ZarrWriter(f"{root}/full.zarr"))
    return full_state(model, optim), writer.reuse_counts


def _lora_load(rank, world_size, paths, train_base=False):
    loaded = []
    for path in paths:
        model, optim = _lora(world_size, seed=1, train_base=train_base)
        state = _lora_state(model, optim)  # a stateless optimizer: DCP gives every adapter state to load into
        dcp.load(state, storage_reader=ZarrReader(path))
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        loaded.append(full_state(model, optim))
    return loaded


@pytest.mark.slow
@pytest.mark.distributed
def test_lora_training_links_the_frozen_base_and_loads_alone_at_other_world_sizes(tmp_path):
    (trained, counts0), (_, counts1) = run_ranks(_lora_train_and_save, 2, str(tmp_path))
    first, second, full = (str(tmp_path / name) for name in ("1.zarr", "2.zarr", "full.zarr"))

    earlier, later = file_identities(first), file_identities(second)
    bases = {layer: chunks_under(later, f"model/layers.{layer}.base.weight") for layer in range(LAYERS)}
    base_bytes = sum(os.path.getsize(f"{second}/{f}") for chunks in bases.values() for f in chunks)
    assert base_bytes >= 0.95 * store_bytes(second), "a LoRA-like state: the frozen base is nearly all of it"
    for layer, chunks in bases.items():
        assert chunks and all(later[f] == earlier[f] for f in chunks), f"layer {layer}'s frozen base is not linked"
    written = new_files(second, first)
    adapters = {f for f in later if "lora_" in f and os.path.basename(f) != "zarr.json"}
    assert {f for f in adapters if f.startswith("model/")} and {f for f in adapters if f.startswith("optim/")}
    assert adapters <= set(written), "every adapter's and optimizer state's chunk is a new file"
    assert sum(written.values()) <= 0.05 * store_bytes(second)
    assert counts0.linked_chunks > 0 and counts1.linked_chunks > 0  # each rank links the base blocks it aggregates
    record = root_manifest(second)["chunks"]
    assert record["incremental_from"]["reused_chunks"] == counts0.linked_chunks + counts1.linked_chunks
    assert record["arrays"].keys() == tensor_nodes(second), "every array recorded, for the next save"

    shutil.rmtree(first)
    assert main(["verify", second]) == 0
    at_three = run_ranks(_lora_load, 3, [second, full])[0]
    assert_state_equal(at_three[0], at_three[1])
    assert_state_equal(at_three[0], trained)
    assert_state_equal(load_full(second, trained), load_full(full, trained))
    assert_state_equal(load_full(second, trained), trained)


FINE_TUNE_CHUNK = 64 << 10


def _fine_tune_chain(rank, world_size, root):
    """Four saves of a chain, each after a step that changes everything: (the state, [(chunks hashed, counts)])."""
    hashed = []
    digest = chunk_reuse.data_digest
    chunk_reuse.data_digest = aggregated_writes.data_digest = lambda buffer: (hashed.append(1), digest(buffer))[1]
    model, optim = _lora(world_size, seed=0, train_base=True)
    saves = []
    for step in range(4):
        _lora_step(model, optim, step)
        hashed.clear()
        more = {"incremental": True} if step == 0 else {"incremental_from": f"{root}/{step - 1}.zarr"}
        writer = ZarrWriter(f"{root}/{step}.zarr", inner_chunk_bytes=FINE_TUNE_CHUNK, **more)
        dcp.save(_lora_state(model, optim), storage_writer=writer)
        saves.append((len(hashed), writer.reuse_counts))
    return full_state(model, optim), saves


@pytest.mark.slow
@pytest.mark.distributed
def test_a_full_fine_tune_s_later_saves_store_an_object_per_rank_s_box_and_load_at_other_world_sizes(tmp_path):
    """FSDP2 with every weight trained: the chain's first two saves store an object per 64 KiB chunk (nothing is
    known yet; then everything is found changed); from the third on, every array changed whole in the save before,
    and is stored as a full save on object storage stores it, one object per rank's box, with nothing hashed. The
    adapters, in pieces smaller than a chunk, are aggregated in every save: one object each."""
    (trained, saves0), (_, saves1) = run_ranks(_fine_tune_chain, 2, str(tmp_path))
    paths = [str(tmp_path / f"{step}.zarr") for step in range(4)]
    boxes = {}  # node -> the objects a full save on object storage stores it in
    for entry in root_manifest(paths[3])["entries"].values():
        if entry["kind"] == "tensor" and "fill" not in entry:  # (AdamW's steps: in their fill_value, no chunk)
            with open(os.path.join(paths[3], entry["node"], "zarr.json")) as f:
                shape = json.load(f)["shape"]
            piece_bytes = -(-shape[0] // 2) * math.prod(shape[1:]) * 4 if shape else 0
            boxes[entry["node"]] = 1 if not shape or piece_bytes < FINE_TUNE_CHUNK else min(2, shape[0])
    assert 1 < sum(boxes.values()) - len(boxes) < len(boxes), "some arrays aggregated, some saved per rank's box"
    for step, path in enumerate(paths):
        files = chunk_files(path)
        per_node = {node: len(chunks_under(files, node)) for node in boxes}
        if step < 2:
            assert sum(per_node.values()) > 2 * sum(boxes.values()), f"save {step}: an object per chunk"
        else:
            assert per_node == boxes, f"save {step}: an object per rank's box"
            assert saves0[step][0] == saves1[step][0] == 0, f"save {step} hashed chunks"
        if step:
            assert saves0[step][1].linked_chunks == saves1[step][1].linked_chunks == 0
            assert new_chunks(path, paths[step - 1]) == set(files), f"save {step}: every chunk written anew"
    assert root_manifest(paths[3])["chunks"]["arrays"].keys() == tensor_nodes(paths[3])
    for path in paths[:3]:
        shutil.rmtree(path)
    assert main(["verify", paths[3]]) == 0
    at_three = run_ranks(_lora_load, 3, [paths[3]], train_base=True)[0]
    assert_state_equal(at_three[0], trained)
    assert_state_equal(load_full(paths[3], trained), trained)
    group = zarr.open_group(paths[3], mode="r")
    np.testing.assert_array_equal(group["model/layers.0.base.weight"][...],
                                  trained["model"]["layers.0.base.weight"].numpy())


# -- many small tensors: aggregated as in a full save, blocks linked whole ---------------------------------------------

BASE_BYTES = LAYERS * DIM * DIM * 4


def _many_small_tensors(rank, world_size, root):
    """A LoRA chain whose every array is held in pieces smaller than a chunk (the frozen bases' halves are 512 KiB):
    the chain's start, a full save of the next step, the same step saved incrementally (what this rank sent over the
    process group meanwhile), then a step after which one rank's half of layer 1's frozen base changed in place."""
    sent = []
    exchange = transfer.Group.exchange

    def counted(self, sends, receives):
        sent.append(sum(buffer.numel() for buffers in sends.values() for buffer in buffers))
        return exchange(self, sends, receives)

    transfer.Group.exchange = counted
    model, optim = _lora(world_size, seed=0)
    _lora_step(model, optim, 0)
    dcp.save(_lora_state(model, optim), storage_writer=ZarrWriter(f"{root}/1.zarr", incremental=True))
    _lora_step(model, optim, 1)
    dcp.save(_lora_state(model, optim), storage_writer=ZarrWriter(f"{root}/full.zarr"))
    sent.clear()
    writer = ZarrWriter(f"{root}/2.zarr", incremental_from=f"{root}/1.zarr")
    dcp.save(_lora_state(model, optim), storage_writer=writer)
    sent_by_the_second, counts = sum(sent), writer.reuse_counts
    _lora_step(model, optim, 2)
    if rank == 1:
        with torch.no_grad():
            model.layers[1].base.weight.to_local()[0, 0] += 1
    dcp.save(_lora_state(model, optim), storage_writer=ZarrWriter(f"{root}/3.zarr", incremental_from=f"{root}/2.zarr"))
    return full_state(model, optim), sent_by_the_second, counts


@pytest.mark.slow
@pytest.mark.distributed
def test_many_small_tensors_are_as_many_files_as_in_a_full_save_and_unchanged_blocks_never_travel(tmp_path):
    """Each array is aggregated into one block, as a full save on object storage stores it: the incremental store
    has a full save's files (on a local disk, where a full save aggregates nothing, as many as its one shard per
    array), the frozen bases' blocks are hard links, and what the ranks sent is the adapters and 16-byte digests,
    not the bases. A base changed in place on one rank is written anew; the stores load exactly on their own."""
    (trained, sent0, counts0), (_, sent1, counts1) = run_ranks(_many_small_tensors, 2, str(tmp_path))
    first, second, third, full = (str(tmp_path / name) for name in ("1.zarr", "2.zarr", "3.zarr", "full.zarr"))
    assert file_identities(second).keys() == file_identities(full).keys()
    bases = [f"model/layers.{layer}.base.weight/c.0.0" for layer in range(LAYERS)]
    earlier, later, last = file_identities(first), file_identities(second), file_identities(third)
    assert all(later[base] == earlier[base] for base in bases), "an unchanged base's block is linked"
    assert counts0.linked_chunks + counts1.linked_chunks == LAYERS
    assert counts0.linked_bytes + counts1.linked_bytes == BASE_BYTES + LAYERS * 4  # each block's crc32c
    assert sent0 + sent1 < BASE_BYTES / 20, "the bases' bytes travelled to their aggregators"
    assert {base for base in bases if last[base] != later[base]} == {bases[1]}, "only the changed base is written"
    for path in (first, second, full):
        shutil.rmtree(path)
    assert main(["verify", third]) == 0
    assert_state_equal(load_full(third, trained), trained)
    group = zarr.open_group(third, mode="r")
    np.testing.assert_array_equal(group["model/layers.1.base.weight"][...],
                                  trained["model"]["layers.1.base.weight"].numpy())


def _lora_saved(rank, world_size, path, earlier):
    """The untrained LoRA model (the same at any world size), saved into ``path`` from ``earlier``."""
    model, optim = _lora(world_size, seed=0)
    more = {"incremental_from": earlier} if earlier else {"incremental": True}
    writer = ZarrWriter(path, **more)
    dcp.save(_lora_state(model, optim), storage_writer=writer)
    return full_state(model, optim), writer.reuse_counts


@pytest.mark.slow
@pytest.mark.distributed
def test_a_block_saved_by_another_world_size_is_written_anew_then_linked_again(tmp_path):
    """A block's digest is of its parts, which are the saving ranks' pieces: saved by 3 ranks, the unchanged blocks
    that 2 ranks held in other pieces are written anew (the bases' 512 rows, in halves then thirds), those held in
    the same pieces are linked (``lora_a``'s 2 rows, one a rank either way); the next save by 3 ranks links every
    block again."""
    paths = [str(tmp_path / f"{n}.zarr") for n in range(3)]
    state = run_ranks(_lora_saved, 2, paths[0], None)[0][0]
    run_ranks(_lora_saved, 3, paths[1], paths[0])
    written = new_chunks(paths[1], paths[0])
    for layer in range(LAYERS):
        assert {f"model/layers.{layer}.{name}/c.0.0" for name in ("base.weight", "lora_b")} <= written
        assert f"model/layers.{layer}.lora_a/c.0.0" not in written
    again = run_ranks(_lora_saved, 3, paths[2], paths[1])
    assert new_chunks(paths[2], paths[1]) == set()
    assert sum(counts.linked_chunks for _, counts in again) == len(chunk_files(paths[2]))
    for path in paths[:2]:
        shutil.rmtree(path)
    assert_state_equal(load_full(paths[2], state), state)


def _lora_chain(rank, world_size, root, options, saves):
    """The LoRA model after one step and after two, each saved as ``saves`` names: ``first`` (a chain's start, after
    one), ``full`` and ``second`` (from ``first``, after two); the trained state and the last writer's counts."""
    model, optim = _lora(world_size, seed=0)
    _lora_step(model, optim, 0)
    if "first" in saves:
        dcp.save(_lora_state(model, optim), storage_writer=ZarrWriter(f"{root}/1.zarr", incremental=True, **options))
    _lora_step(model, optim, 1)
    writer = None
    if "full" in saves:
        dcp.save(_lora_state(model, optim), storage_writer=ZarrWriter(f"{root}/full.zarr", **options))
    if "second" in saves:
        writer = ZarrWriter(f"{root}/2.zarr", incremental_from=f"{root}/1.zarr", **options)
        dcp.save(_lora_state(model, optim), storage_writer=writer)
    return full_state(model, optim), writer and writer.reuse_counts


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.s3
def test_on_s3_many_small_tensors_are_a_full_save_s_objects_and_unchanged_blocks_are_copied_by_the_server(s3):
    """On an object store both saves aggregate the arrays held in pieces under 4 MiB: the incremental store has the
    full save's objects; each frozen base's block is one CopyObject on the server (and a ranged GET that checks it),
    no byte of it PUT."""
    root = f"s3://{s3.bucket}/{uuid.uuid4().hex[:8]}"
    options = {"storage_options": s3.storage_options()}
    trained = run_ranks(_lora_chain, 2, root, options, ("first", "full"))[0][0]
    with s3.counting() as traffic:
        counts = [c for _, c in run_ranks(_lora_chain, 2, root, options, ("second",))]
    fs = s3.filesystem()
    bucket_root = root.removeprefix("s3://")
    objects = {name: {key.removeprefix(f"{bucket_root}/{name}/") for key in fs.find(f"{bucket_root}/{name}")}
               for name in ("1.zarr", "2.zarr", "full.zarr")}
    assert objects["2.zarr"] == objects["full.zarr"]
    bases = [f"model/layers.{layer}.base.weight/c.0.0" for layer in range(LAYERS)]
    for base in bases:
        source, copy = (f"{bucket_root}/{name}/{base}" for name in ("1.zarr", "2.zarr"))
        assert traffic.copies[(source, copy)] == 1 and traffic.put_bytes[copy] == 0, base
    assert sum(traffic.copies.values()) == sum(c.linked_chunks for c in counts) == LAYERS
    assert traffic.bytes_in < BASE_BYTES / 20
    fs.rm(f"{bucket_root}/1.zarr", recursive=True)
    assert_state_equal(load_full(f"{root}/2.zarr", trained, storage_options=s3.storage_options()), trained)


# -- what changed is written, what did not is linked -------------------------------------------------------------------


@pytest.mark.parametrize("how", ["no_grad", "data"])
def test_a_frozen_weight_changed_in_place_is_saved_anew(tmp_path, how):
    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    model.weight.requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    save(model.state_dict(), tmp_path / "1.zarr", incremental=True, inner_chunk_bytes=16 << 10)
    if how == "no_grad":
        with torch.no_grad():
            model.weight[100] += 1
    else:
        model.weight.data[100] += 1  # bypasses autograd and the version counter
    save(model.state_dict(), tmp_path / "2.zarr", incremental_from=tmp_path / "1.zarr", inner_chunk_bytes=16 << 10)

    rows = zarr.open_array(tmp_path / "2.zarr" / "weight", mode="r").chunks[0]
    chunks = chunks_under(file_identities(tmp_path / "2.zarr"), "weight")
    assert chunks_under(new_files(tmp_path / "2.zarr", tmp_path / "1.zarr"), "weight") == {f"weight/c.{100 // rows}.0"}
    assert len(chunks) == 256 // rows
    assert_state_equal(load_full(str(tmp_path / "1.zarr"), before), before)  # the linked files were not written into
    shutil.rmtree(tmp_path / "1.zarr")
    assert_state_equal(load_full(str(tmp_path / "2.zarr"), before), model.state_dict())


ROWS, COLUMNS = 16384, 256
ROW_CHUNK_BYTES = 64 << 10  # 64 rows a chunk: 256 chunks
# 1% of the rows: 100 new tokens at the end and 64 rows anywhere
CHANGED_ROWS = sorted({*range(ROWS - 100, ROWS), *random.Random(5).sample(range(ROWS - 100), 64)})


def _table(changed: bool) -> torch.Tensor:
    table = torch.randn(ROWS, COLUMNS, generator=torch.Generator().manual_seed(3))
    if changed:
        table[CHANGED_ROWS] += 1.0
    return table


def _save_embedding_twice(rank, world_size, root):
    mesh = init_device_mesh("cpu", (world_size,))
    for name, changed, options in (("1", False, {"incremental": True}),
                                   ("2", True, {"incremental_from": f"{root}/1.zarr"})):
        shard = DTensor.from_local(_table(changed).chunk(world_size)[rank], mesh, [Shard(0)])
        writer = ZarrWriter(f"{root}/{name}.zarr", inner_chunk_bytes=ROW_CHUNK_BYTES, **options)
        dcp.save({"embed": shard}, storage_writer=writer)


@pytest.mark.slow
@pytest.mark.distributed
def test_embedding_rows_changed_cost_the_chunks_that_hold_them(tmp_path):
    run_ranks(_save_embedding_twice, 2, str(tmp_path))
    first, second = tmp_path / "1.zarr", tmp_path / "2.zarr"

    rows = zarr.open_array(second / "embed", mode="r").chunks[0]
    changed = {f"embed/c.{row // rows}.0" for row in CHANGED_ROWS}
    written = new_files(second, first)
    assert chunks_under(written, "embed") == changed
    assert len(changed) < ROWS // rows / 2  # the bound below means something
    assert sum(written.values()) <= 2 * sum(os.path.getsize(second / f) for f in changed)
    shutil.rmtree(first)
    expected = {"embed": _table(changed=True)}
    assert_state_equal(load_full(str(second), expected), expected)


def _fine_tune_state(seed: int) -> dict:
    return {"model": {"w": random_bits((300, 100), torch.float32, seed), "b": random_bits((100,), torch.float32, seed),
                      "e": random_bits((64, 32), torch.bfloat16, seed)},
            # bfloat16: a 0-d tensor stored as a chunk (a float32 one is kept in its array's fill_value, no chunk)
            "optim": {"step": torch.tensor(float(seed), dtype=torch.bfloat16)}}


def test_a_full_fine_tune_links_nothing_and_loads_exactly(tmp_path):
    save(_fine_tune_state(1), tmp_path / "1.zarr", incremental=True, inner_chunk_bytes=16 << 10)
    changed = _fine_tune_state(2)
    writer = save(changed, tmp_path / "2.zarr", incremental_from=tmp_path / "1.zarr", inner_chunk_bytes=16 << 10)

    assert new_files(tmp_path / "2.zarr", tmp_path / "1.zarr").keys() == file_identities(tmp_path / "2.zarr").keys()
    assert writer.reuse_counts.linked_chunks == 0
    assert writer.reuse_counts.written_chunks == len(chunk_files(tmp_path / "2.zarr")) > 4
    shutil.rmtree(tmp_path / "1.zarr")
    assert_state_equal(load_full(str(tmp_path / "2.zarr"), changed), changed)


def new_chunks(path, earlier) -> set[str]:
    """The chunk files of ``path`` not linked from ``earlier`` (every ``zarr.json`` is written anew)."""
    return {f for f in new_files(path, earlier) if os.path.basename(f) != "zarr.json"}


def _recorded_digests(path) -> dict[str, list[bytes]]:
    record = ChunkRecord.from_json(root_manifest(path)["chunks"], str(path))
    return {node: [c.digest for c in array.chunks] for node, array in record.arrays.items()}


def _counting_hashes(monkeypatch) -> list[int]:
    """Count the chunks the chunk reuse hashes (a list of the bytes of each)."""
    hashed: list[int] = []

    def counted(buffer):
        hashed.append(memoryview(buffer).nbytes)
        return data_digest(buffer)

    monkeypatch.setattr(chunk_reuse, "data_digest", counted)
    return hashed


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_chain_hashes_only_the_chunks_that_may_be_linked(tmp_path, monkeypatch, compression):
    """The chain's start hashes every chunk; a chunk found changed is recorded unhashed, and the next save tells it by
    its crc32c without hashing it; one unchanged since is confirmed by its bytes, linked, and hashed again (plain
    chunks, and compressed ones, whose crc32c is of the compressed bytes)."""
    options = {"inner_chunk_bytes": 16 << 10, "compression": compression}
    hashed = _counting_hashes(monkeypatch)
    paths = [tmp_path / f"{step}.zarr" for step in range(4)]
    save(_fine_tune_state(1), paths[0], incremental=True, **options)
    chunks = len(chunk_files(paths[0]))
    assert len(hashed) == chunks > 4 and UNHASHED not in sum(_recorded_digests(paths[0]).values(), [])

    hashed.clear()  # everything changes: hashed once more (each had a digest), and recorded unhashed
    save(_fine_tune_state(2), paths[1], incremental_from=paths[0], **options)
    assert len(hashed) == chunks
    assert set(sum(_recorded_digests(paths[1]).values(), [])) == {UNHASHED}

    hashed.clear()  # everything changes again: nothing hashed at all
    writer = save(_fine_tune_state(3), paths[2], incremental_from=paths[1], **options)
    assert hashed == [] and writer.reuse_counts.linked_chunks == 0

    hashed.clear()  # "model" unchanged since the last save, "optim" changed: the first linked, by its bytes, and hashed
    kept = {"model": _fine_tune_state(3)["model"], "optim": _fine_tune_state(4)["optim"]}
    writer = save(kept, paths[3], incremental_from=paths[2], **options)
    linked = len(chunk_files(paths[3])) - 1
    assert writer.reuse_counts.linked_chunks == linked == len(hashed) and writer.reuse_counts.written_chunks == 1
    assert new_chunks(paths[3], paths[2]) == {"optim/step/c"}
    digests = _recorded_digests(paths[3])
    assert digests.pop("optim/step") == [UNHASHED] and UNHASHED not in sum(digests.values(), [])
    for earlier in paths[:3]:
        shutil.rmtree(earlier)
    assert_state_equal(load_full(str(paths[3]), kept), kept)


@pytest.mark.parametrize("changed_whole", [False, True], ids=["split", "whole"])
def test_a_chunk_changed_under_the_same_crc32c_is_written_not_linked(tmp_path, changed_whole):
    """Bytes XORed with crc32c's polynomial keep the chunk's size and crc32c: the comparison of bytes catches it, in a
    chunk of its own (the earlier save changed the first chunk only) and in one shard of the whole array (the earlier
    save changed every chunk: a chunk record of the crc32c's of its inner chunks)."""
    options = {"inner_chunk_bytes": 16 << 10}
    first = random_bits((256, 64), torch.float32, 1)
    save({"w": first}, tmp_path / "0.zarr", incremental=True, **options)
    earlier = {"w": random_bits((256, 64), torch.float32, 2)}
    if not changed_whole:
        earlier["w"][64:] = first[64:]  # the first chunk's 64 rows changed, the other three not
    save(earlier, tmp_path / "1.zarr", incremental_from=tmp_path / "0.zarr", **options)  # changed: recorded unhashed
    if changed_whole:  # laid out whole now, and recorded so; the save after it compares with that
        earlier = {"w": random_bits((256, 64), torch.float32, 3)}
        save(earlier, tmp_path / "1w.zarr", incremental_from=tmp_path / "1.zarr", **options)
        assert _recorded_digests(tmp_path / "1w.zarr") == {"w": [UNHASHED]}
        shutil.rmtree(tmp_path / "1.zarr")
        os.rename(tmp_path / "1w.zarr", tmp_path / "1.zarr")
    forged = earlier["w"].clone()
    forged.view(torch.uint8).view(-1)[100:105] ^= torch.tensor(list(CRC32C_MULTIPLE.to_bytes(5, "little")),
                                                                dtype=torch.uint8)
    chunk = forged.view(torch.uint8).view(-1)[: 16 << 10]
    assert crc32c.crc32c(chunk.numpy().tobytes()) == crc32c.crc32c(earlier["w"].view(torch.uint8).view(-1)[
        : 16 << 10].numpy().tobytes()) and not torch.equal(forged, earlier["w"])

    writer = save({"w": forged}, tmp_path / "2.zarr", incremental_from=tmp_path / "1.zarr", **options)
    assert new_chunks(tmp_path / "2.zarr", tmp_path / "1.zarr") == {"w/c.0.0"}
    if changed_whole:  # one shard of 4 inner chunks, each with its crc32c, and its index
        assert writer.reuse_counts == (0, 0, 1, 256 * 64 * 4 + 4 * (4 + 16) + 4)
    else:
        assert writer.reuse_counts.linked_chunks == 3 and writer.reuse_counts.written_chunks == 1
    shutil.rmtree(tmp_path / "1.zarr")
    assert_state_equal(load_full(str(tmp_path / "2.zarr"), {"w": forged}), {"w": forged})


def _whole_chain_state(step: int, w_from: int) -> dict:
    """``w`` (48 KiB) as of step ``w_from``; ``e`` with row 37 * step changed at each step (one 16 KiB chunk a save);
    ``f`` frozen."""
    embedding = random_bits((256, 64), torch.float32, 100)
    for k in range(1, step + 1):
        embedding[37 * k] += 1
    return {"w": random_bits((192, 64), torch.float32, w_from), "e": embedding,
            "f": random_bits((256, 64), torch.float32, 200)}


def _chunk_shape(path, node: str) -> list[int]:
    with open(os.path.join(path, node, "zarr.json")) as f:
        return json.load(f)["chunk_grid"]["configuration"]["chunk_shape"]


@pytest.mark.parametrize("planning", ["local", "dcp"])
def test_arrays_that_changed_whole_or_not_at_all_are_saved_as_a_full_save_lays_them_out(
        tmp_path, monkeypatch, planning):
    """An array whose every chunk changed goes on in a full save's layout (one object per rank's box, not one per
    chunk: what a fully changing array's saves would pay in files), unhashed while it keeps changing; once unchanged
    it is linked whole, and stays so. A frozen array is an object per chunk while the chain learns that it does not
    change (its first two saves), then is laid out whole (written and hashed once) and linked whole from then on. An
    array that changed in part keeps its chunks. Every store loads alone, and zarr-python reads it."""
    options = {"inner_chunk_bytes": 16 << 10}
    hashed = _counting_hashes(monkeypatch)
    w_bytes, f_bytes = 192 * 64 * 4, 256 * 64 * 4
    w_from = [0, 1, 2, 3, 3, 3, 3]  # w changes in saves 1 to 3, and not after
    paths = [tmp_path / f"{step}.zarr" for step in range(len(w_from))]
    files, records = [], []
    for step, path in enumerate(paths):
        hashed.clear()
        state = _whole_chain_state(step, w_from[step])
        more = {"incremental": True} if step == 0 else {"incremental_from": paths[step - 1]}
        writer = ZarrWriter(path, **options, **more)
        dcp.save(state, storage_writer=writer, no_dist=True,
                 **({"planner": DCPsPlanning()} if planning == "dcp" else {}))
        files.append(file_identities(path))
        records.append(_recorded_digests(path))
        if step:
            new = new_files(path, paths[step - 1])
            assert len(chunks_under(new, "e")) == 1, f"save {step}: e's one chunk"
            assert (chunks_under(new, "f") == set()) == (step != 2), f"save {step}: f written only as laid out anew"
            assert (chunks_under(new, "w") == set()) == (step >= 4), f"save {step}: w linked once unchanged"
        assert _chunk_shape(path, "e") == [64, 64]
        assert _chunk_shape(path, "w") == ([192, 64] if step >= 2 else [64, 64]), step
        assert _chunk_shape(path, "f") == ([256, 64] if step >= 2 else [64, 64]), step
        assert (w_bytes in hashed) == (step >= 4), f"save {step}: w hashed whole only where it may be linked whole"
        assert (f_bytes in hashed) == (step >= 2), f"save {step}: f hashed whole once laid out whole"
        if step >= 2:
            shutil.rmtree(paths[step - 2])
        assert_state_equal(load_full(str(path), state), state)
        group = zarr.open_group(path, mode="r")
        for name, tensor in state.items():
            np.testing.assert_array_equal(group[name][...], tensor.numpy())

    assert records[1]["w"] == [UNHASHED] * 3, "every chunk changed: recorded unhashed"
    assert records[2]["w"] == records[3]["w"] == [UNHASHED], "laid out whole, and kept so while it changes"
    assert records[4]["w"] == records[5]["w"] == records[6]["w"] != [UNHASHED], "unchanged: hashed, and kept whole"
    assert chunks_under(files[2], "w") == chunks_under(files[6], "w") == {"w/c.0.0"}
    assert chunks_under(files[2], "f") == chunks_under(files[6], "f") == {"f/c.0.0"}
    assert records[1]["f"] == records[0]["f"] and len(records[1]["f"]) == 4 and UNHASHED not in records[1]["f"]
    assert records[2]["f"] == records[6]["f"] and len(records[6]["f"]) == 1 and UNHASHED not in records[6]["f"]
    assert writer.reuse_counts.written_chunks == 1, "the last save: w's and f's shards linked, e's one chunk written"
    assert writer.reuse_counts.linked_chunks == 1 + 1 + 3, "w's shard, f's shard, e's three unchanged chunks"
    assert [records[step]["e"].count(UNHASHED) for step in range(7)] == [0] + [1] * 6, "e: its one changed chunk"


def test_a_frozen_array_s_shard_replaced_since_it_was_recorded_is_written_anew(tmp_path):
    """A shard linked whole is checked by its index and its inner chunks' crc32c's, read without its data: a shard of
    another frozen array (the same size and index, other bytes) put in its place is written anew, not linked."""
    options = {"inner_chunk_bytes": 16 << 10}
    frozen = {"a": random_bits((256, 64), torch.float32, 1), "b": random_bits((256, 64), torch.float32, 2)}
    paths = [tmp_path / f"{step}.zarr" for step in range(4)]
    for step, path in enumerate(paths[:3]):
        more = {"incremental": True} if step == 0 else {"incremental_from": paths[step - 1]}
        save(frozen, path, **options, **more)
    assert _chunk_shape(paths[2], "a") == [256, 64]  # laid out whole, hashed
    victim = paths[2] / "a" / "c.0.0"
    assert victim.stat().st_size == (paths[2] / "b" / "c.0.0").stat().st_size
    shutil.copyfile(paths[2] / "b" / "c.0.0", tmp_path / "replacement")
    os.replace(tmp_path / "replacement", victim)

    writer = save(frozen, paths[3], incremental_from=paths[2], **options)

    assert chunks_under(new_files(paths[3], paths[2]), "a") == {"a/c.0.0"}
    assert chunks_under(new_files(paths[3], paths[2]), "b") == set()
    assert writer.reuse_counts.linked_chunks == 1 and writer.reuse_counts.written_chunks == 1
    shutil.rmtree(paths[2])
    assert_state_equal(load_full(str(paths[3]), frozen), frozen)


@pytest.mark.parametrize("planning", ["local", "dcp"])
def test_an_array_that_changed_whole_is_stored_in_shards_of_at_most_16_inner_chunks(tmp_path, planning):
    """A rank's box of 80 inner chunks (4 rows of 1 KiB) would be one 80-chunk shard in a full save: shards of 16
    here, so that confirming one unchanged reads at most 16 inner chunks back."""
    planner = {"planner": DCPsPlanning()} if planning == "dcp" else {}
    paths = [tmp_path / f"{step}.zarr" for step in range(3)]
    for step, path in enumerate(paths):
        more = {"incremental": True} if step == 0 else {"incremental_from": paths[step - 1]}
        state = {"w": random_bits((320, 64), torch.float32, step)}
        dcp.save(state, storage_writer=ZarrWriter(path, inner_chunk_bytes=1 << 10, **more), no_dist=True, **planner)
    assert _chunk_shape(paths[1], "w") == [4, 64] and len(chunk_files(paths[1])) == 80
    assert _chunk_shape(paths[2], "w") == [64, 64] and len(chunk_files(paths[2])) == 5
    with open(paths[2] / "w" / "zarr.json") as f:
        assert json.load(f)["codecs"][0]["configuration"]["chunk_shape"] == [4, 64]  # sharded: 16 inner chunks
    shutil.rmtree(paths[1])
    assert_state_equal(load_full(str(paths[2]), state), state)
    np.testing.assert_array_equal(zarr.open_array(paths[2] / "w", mode="r")[...], state["w"].numpy())


# -- every way of saving, every kind of value --------------------------------------------------------------------------


def _changing_state(step: int) -> dict:
    """A frozen matrix, a trained one whose rows 0..step changed, and the step."""
    trained = torch.randn(256, 128, generator=torch.Generator().manual_seed(7))
    trained[: step + 1] += 1
    return {"model": {"frozen": torch.randn(256, 128, generator=torch.Generator().manual_seed(6)), "trained": trained},
            "step": torch.tensor(step)}


def test_a_save_dcp_plans_reuses_chunks_too(tmp_path, monkeypatch):
    made = []

    class CountedDcpPlannedSave(DcpPlannedSave):
        def __init__(self, *args, **kwargs):
            made.append(self)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(dcp_zarr.writer, "DcpPlannedSave", CountedDcpPlannedSave)
    options = {"inner_chunk_bytes": 16 << 10}
    for step, more in ((1, {"incremental": True}), (2, {"incremental_from": tmp_path / "1.zarr"})):
        writer = ZarrWriter(tmp_path / f"{step}.zarr", **options, **more)
        dcp.save(_changing_state(step), storage_writer=writer, planner=DCPsPlanning(), no_dist=True)

    assert len(made) == 2, "both saves went the way DCP plans"
    assert 0 < writer.reuse_counts.linked_chunks and 0 < writer.reuse_counts.written_chunks
    later = file_identities(tmp_path / "2.zarr")
    assert all(later[f] == file_identities(tmp_path / "1.zarr")[f] for f in chunks_under(later, "model/frozen"))
    assert root_manifest(tmp_path / "2.zarr")["chunks"]["incremental_from"]["reused_chunks"] > 0
    shutil.rmtree(tmp_path / "1.zarr")
    expected = _changing_state(2)
    assert_state_equal(load_full(str(tmp_path / "2.zarr"), expected), expected)


def test_compressed_incremental_saves_reuse_chunks_and_zarr_reads_them(tmp_path):
    def state(step):  # small integers in float32: zstd shrinks them whatever the sample
        weights = torch.randint(0, 16, (512, 256), generator=torch.Generator().manual_seed(0)).float()
        weights[:step] += 1
        return {"w": weights, "frozen": torch.randint(0, 4, (256, 256)).float()}

    first, second = state(1), state(2)
    second["frozen"] = first["frozen"]
    save(first, tmp_path / "1.zarr", incremental=True, compression="zstd", inner_chunk_bytes=64 << 10)
    writer = save(second, tmp_path / "2.zarr", incremental_from=tmp_path / "1.zarr", compression="zstd",
                  inner_chunk_bytes=64 << 10)

    with open(tmp_path / "2.zarr" / "w" / "zarr.json") as f:
        assert '"zstd"' in f.read(), "compressed"
    assert writer.reuse_counts.linked_chunks > 0 and writer.reuse_counts.written_chunks > 0
    assert chunks_under(new_files(tmp_path / "2.zarr", tmp_path / "1.zarr"), "frozen") == set()
    shutil.rmtree(tmp_path / "1.zarr")
    assert_state_equal(load_full(str(tmp_path / "2.zarr"), second), second)
    group = zarr.open_group(tmp_path / "2.zarr", mode="r")
    for name, tensor in second.items():
        np.testing.assert_array_equal(group[name][...], tensor.numpy())


def test_an_array_whose_zarr_json_changed_is_written_whole_though_its_data_did_not(tmp_path):
    save(_changing_state(1), tmp_path / "1.zarr", incremental=True, inner_chunk_bytes=16 << 10)
    writer = save(_changing_state(1), tmp_path / "2.zarr", incremental_from=tmp_path / "1.zarr",
                  inner_chunk_bytes=16 << 10, compression=Compression("zstd", min_bytes=0, min_ratio=0))

    # the arrays' zarr.json changed (compressed now), so nothing is linked; the 0-d step is kept in its fill_value
    assert writer.reuse_counts.linked_chunks == 0 and "step/c" not in chunk_files(tmp_path / "2.zarr")
    shutil.rmtree(tmp_path / "1.zarr")
    assert_state_equal(load_full(str(tmp_path / "2.zarr"), _changing_state(1)), _changing_state(1))


@pytest.mark.s3
def test_on_s3_the_unchanged_chunks_are_copied_by_the_server(s3, aws_environment):
    options = {"storage_options": s3.storage_options(), "inner_chunk_bytes": 16 << 10}
    first, second = (f"s3://{s3.bucket}/{name}-{uuid.uuid4().hex[:8]}.zarr" for name in ("1", "2"))
    save(_changing_state(1), first, incremental=True, **options)
    with s3.counting() as traffic, warnings.catch_warnings():
        warnings.simplefilter("error", IncrementalSaveWarning)  # bytes through this process would warn
        writer = save(_changing_state(2), second, incremental_from=first, **options)

    counts = writer.reuse_counts
    assert counts.linked_chunks > 0 and counts.written_chunks > 0
    assert counts.written_bytes <= traffic.bytes_in < counts.written_bytes + counts.linked_bytes // 2
    s3.filesystem().rm(first, recursive=True)
    expected = _changing_state(2)
    assert_state_equal(load_full(second, expected, storage_options=s3.storage_options()), expected)


def test_bf16_0d_tensors_and_non_tensor_values_survive_a_chain(tmp_path):
    def state(step):
        return {"model": {"frozen": random_bits((64, 48), torch.bfloat16, 1),
                          "trained": random_bits((64, 48), torch.bfloat16, 1 + step),
                          "scale": torch.tensor(0.5, dtype=torch.bfloat16), "step": torch.tensor(step),
                          "lr": torch.tensor(1e-4 * step)},
                "step": step, "config": {"lr": 1e-4 * step, "name": f"run-{step}", "layers": [1, step]},
                "shape": torch.Size([step, 3])}

    save(state(1), tmp_path / "1.zarr", incremental=True)
    save(state(2), tmp_path / "2.zarr", incremental_from=tmp_path / "1.zarr")

    written = new_files(tmp_path / "2.zarr", tmp_path / "1.zarr")
    assert chunks_under(written, "model/trained") and not chunks_under(written, "model/frozen")
    assert not chunks_under(written, "model/scale"), "an unchanged bfloat16 0-d chunk is linked"
    stored = file_identities(tmp_path / "2.zarr")  # int64 and float32 0-d tensors: in their fill_value, no chunk
    assert not chunks_under(stored, "model/step") and not chunks_under(stored, "model/lr")
    assert {"model/step/zarr.json", "model/lr/zarr.json"} <= written.keys()
    shutil.rmtree(tmp_path / "1.zarr")
    assert_state_equal(load_full(str(tmp_path / "2.zarr"), state(2)), state(2))


def test_zarr_python_alone_reads_every_array_of_an_incremental_store(tmp_path):
    def state(step):
        changing = _changing_state(step)
        changing["model"]["ids"] = torch.arange(1000, dtype=torch.int64) * step
        return changing

    save(state(1), tmp_path / "1.zarr", incremental=True, inner_chunk_bytes=16 << 10)
    save(state(2), tmp_path / "2.zarr", incremental_from=tmp_path / "1.zarr", inner_chunk_bytes=16 << 10)
    shutil.rmtree(tmp_path / "1.zarr")

    expected = {"model/frozen": state(2)["model"]["frozen"], "model/trained": state(2)["model"]["trained"],
                "model/ids": state(2)["model"]["ids"], "step": state(2)["step"]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        group = zarr.open_group(tmp_path / "2.zarr", mode="r")
        arrays = {name: member for name, member in group.members(max_depth=None) if isinstance(member, zarr.Array)}
        assert arrays.keys() == expected.keys()
        for name, array in arrays.items():
            assert json.loads(json.dumps(array.attrs.asdict()))["dcp_zarr"]["fqn"] == name.replace("/", ".")
            np.testing.assert_array_equal(array[...], expected[name].numpy(), err_msg=name)


# -- the tools and CheckpointManager -----------------------------------------------------------------------------------


def test_the_tools_treat_an_incremental_store_like_any_other(tmp_path, capsys):
    first, second = tmp_path / "1.zarr", tmp_path / "2.zarr"
    save(_changing_state(1), first, incremental=True, inner_chunk_bytes=16 << 10)
    save(_changing_state(2), second, incremental_from=first, inner_chunk_bytes=16 << 10)

    origin = root_manifest(second)["chunks"]["incremental_from"]
    assert origin["path"] == str(first) and origin["reused_chunks"] > 0
    assert main(["inspect", str(first)]) == 0  # the two matrices: the step, kept in its fill_value, has no chunk
    assert "  incremental: 2 arrays recorded; the first of a chain: nothing reused\n" in capsys.readouterr().out
    assert main(["inspect", str(second)]) == 0
    assert (f"  incremental: 2 arrays recorded; {origin['reused_chunks']} chunks "
            f"({human_bytes(origin['reused_bytes'])}) linked from {first}\n") in capsys.readouterr().out
    assert main(["diff", str(first), str(second), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert {e["fqn"] for e in report["entries"] if e["status"] != "equal"} == {"model.trained", "step"}
    shutil.rmtree(first)
    assert main(["verify", str(second)]) == 0
    assert capsys.readouterr().out.startswith("OK: ")
    assert main(["convert", str(second), str(tmp_path / "hf"), "--to", "safetensors"]) == 0
    from safetensors.torch import load_file

    exported = {}
    for line in capsys.readouterr().out.split():
        if line.endswith(".safetensors"):
            exported.update(load_file(line))
    assert_state_equal(exported, _changing_state(2)["model"])


def test_checkpoint_manager_chains_incremental_saves_through_retention(tmp_path):
    from dcp_zarr import CheckpointManager

    with CheckpointManager(tmp_path, incremental=True, keep_last=1, inner_chunk_bytes=16 << 10) as manager:
        for step in (1, 2, 3):
            manager.save(step, _changing_state(step))

            assert manager.steps() == [step]
            expected = _changing_state(step)
            assert_state_equal(load_full(manager.path(step), expected), expected)
            origin = root_manifest(manager.path(step))["chunks"].get("incremental_from")
            if step == 1:
                assert origin is None, "the first save of the chain is a full one"
            else:
                assert origin["path"] == manager.path(step - 1) and origin["reused_chunks"] > 0


def test_checkpoint_manager_chains_from_a_step_stored_under_another_form_s_name(tmp_path):
    from dcp_zarr import CheckpointManager

    save(_changing_state(7), tmp_path / "step-7", incremental=True, inner_chunk_bytes=16 << 10)  # torchtitan's name
    with CheckpointManager(tmp_path, incremental=True, inner_chunk_bytes=16 << 10) as manager:
        assert manager.steps() == [7]
        manager.save(8, _changing_state(8))

        origin = root_manifest(manager.path(8))["chunks"]["incremental_from"]
        assert origin["path"] == str(tmp_path / "step-7") and origin["reused_chunks"] > 0
        assert_state_equal(load_full(manager.path(8), _changing_state(8)), _changing_state(8))
