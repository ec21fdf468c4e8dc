"""The ``dcp-zarr`` command on compressed stores: verify checks each compressed inner chunk (crc32c, then that it
decompresses to its size), inspect shows stored and logical bytes, convert compresses and decompresses a store, diff
compares a compressed store with a plain one."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from dcp_zarr import ZarrWriter
from dcp_zarr.errors import ConversionError
from dcp_zarr.format.chunk_layout import ChunkLayout
from dcp_zarr.format.encoding import (
    INDEX_ENTRY_BYTES,
    checksum,
    decode_shard_index,
    encode_chunk,
    shard_index_bytes,
)
from dcp_zarr.format.manifest import FORMAT_VERSION
from dcp_zarr.offline import open_checkpoint
from dcp_zarr.tools.convert import convert
from dcp_zarr.tools.stored_sizes import uncompressed_stored_bytes
from tests.support.compare import assert_state_equal
from tests.tools.test_cli import run

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
INNER_BYTES = 128 << 10  # model.f: 8 inner chunks of 64 rows; model.w: 4 of 128 rows; model.ids: 2 of 256 rows
COMPRESSED = ("model.f", "model.w")


def _state() -> dict:
    torch.manual_seed(0)
    return {"model": {"w": (torch.randn(512, 512) * 0.02).to(torch.bfloat16), "f": torch.randn(512, 512) * 0.02,
                      "ids": torch.arange(512 * 64).reshape(512, 64), "b": torch.randn(16)},
            "extra": {"size": torch.Size([2, 3])}, "lr": 0.1}


def _save(path, state, **options) -> None:
    dcp.save(state, storage_writer=ZarrWriter(path, inner_chunk_bytes=INNER_BYTES, **options), no_dist=True)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """One state dict saved compressed (zstd) and as it is, and as a DCP directory."""
    root = tmp_path_factory.mktemp("compressed")
    state = _state()
    _save(root / "c.zarr", state, compression="zstd")
    _save(root / "p.zarr", state)
    dcp.save(state, storage_writer=FileSystemWriter(root / "dcp"), no_dist=True)
    return root


def _data_bytes(store, node: str) -> int:
    """What the files of an array hold, its zarr.json left out: the stored bytes inspect must report."""
    folder = os.path.join(store, node)
    return sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder) if name != "zarr.json")


def _inspected(capsys, store, *argv) -> dict:
    code, out, _ = run(capsys, "inspect", store, "--json", *argv)
    assert code == 0
    return json.loads(out)


def _codecs_in(store) -> set[str]:
    """The names of every codec in every zarr.json of the store, sharding's inner codecs included."""
    names: set[str] = set()

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("name"), str):
                names.add(node["name"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for folder, _, files in os.walk(store):
        if "zarr.json" in files:
            with open(os.path.join(folder, "zarr.json")) as f:
                walk(json.load(f))
    return names


def _index_and_offset(shard, layout_rows: int, shard_rows: int):
    """The decoded index of a one-shard array's file and where it starts."""
    data = shard.read_bytes()
    count = shard_rows // layout_rows
    layout = ChunkLayout((shard_rows, 1), (shard_rows, 1), layout_rows)
    assert shard_index_bytes(layout) == count * INDEX_ENTRY_BYTES + 4
    start = len(data) - shard_index_bytes(layout)
    return decode_shard_index(data[start:], layout, str(shard)), start


# -- verify -----------------------------------------------------------------------------------------------------------


def test_verify_passes_a_compressed_store(stores, capsys):
    code, out, _ = run(capsys, "verify", stores / "c.zarr")

    assert code == 0 and out.startswith("OK: "), out
    code, out, _ = run(capsys, "verify", stores / "c.zarr", "--json")
    report = json.loads(out)
    # every shard's index and every stored inner chunk, each read once: the bytes of the arrays and objects
    assert report["ok"] and report["bytes_read"] == sum(
        _data_bytes(stores / "c.zarr", node) for node in ("model/w", "model/f", "model/ids", "model/b", "extra/size"))


def test_verify_names_the_compressed_inner_chunk_holding_a_flipped_byte(stores, store_copy, capsys):
    copy = store_copy(stores / "c.zarr")
    shard = copy / "model" / "f" / "c.0.0"
    index, _ = _index_and_offset(shard, 64, 512)
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle] ^= 0x10
    shard.write_bytes(bytes(data))
    hit = next(i for i, (offset, length) in enumerate(index) if offset <= middle < offset + length)

    code, out, _ = run(capsys, "verify", copy)

    assert code == 1 and out.startswith("CORRUPT: "), out
    assert (f"array 'model/f' chunk c.0.0 inner chunk {hit} (entry 'model.f'): crc32c mismatch "
            "(the chunk is corrupt or truncated)") in out
    code, out, _ = run(capsys, "verify", copy, "--json")
    problems = json.loads(out)["problems"]
    assert [(p["fqn"], p["chunk"]) for p in problems] == [("model.f", f"c.0.0 inner chunk {hit}")]


def test_verify_decompresses_a_chunk_whose_crc32c_holds(stores, store_copy, capsys):
    # A blosc header saying one byte more than the inner chunk holds, with the crc32c made to match: only
    # decompressing finds it.
    copy = store_copy(stores / "c.zarr")
    shard = copy / "model" / "w" / "c.0.0"
    index, _ = _index_and_offset(shard, 128, 512)
    offset, length = (int(n) for n in index[1])
    data = bytearray(shard.read_bytes())
    stored = data[offset: offset + length - 4]
    nbytes = int.from_bytes(stored[4:8], "little")
    assert nbytes == 128 * 512 * 2  # the inner chunk's bytes, as blosc's header records them
    stored[4:8] = (nbytes + 1).to_bytes(4, "little")
    data[offset: offset + length] = bytes(stored) + checksum(bytes(stored))
    shard.write_bytes(bytes(data))

    code, out, _ = run(capsys, "verify", copy)

    assert code == 1
    assert (f"array 'model/w' chunk c.0.0 inner chunk 1 (entry 'model.w'): blosc header says {nbytes + 1} bytes "
            f"compressed into {length - 4}; the chunk holds {nbytes} bytes stored in {length - 4}") in out
    assert out.count("\n  array ") == 1


def test_verify_refuses_unread_an_index_length_no_compressed_chunk_has(stores, store_copy, capsys):
    copy = store_copy(stores / "c.zarr")
    shard = copy / "model" / "f" / "c.0.0"
    index, start = _index_and_offset(shard, 64, 512)
    forged = np.array(index)
    forged[3, 1] = 1 << 40  # a terabyte: read, it would be refused only after the read
    forged[5, 1] = 4  # a crc32c and nothing before it
    data = shard.read_bytes()
    shard.write_bytes(data[:start] + forged.tobytes() + checksum(forged.tobytes()))
    most = 64 * 512 * 4 + 16 + 4  # an inner chunk, blosc's header, the crc32c

    code, out, _ = run(capsys, "verify", copy)

    assert code == 1
    assert (f"chunk c.0.0 inner chunk 3 (entry 'model.f'): the shard index gives it {1 << 40} bytes, a compressed "
            f"inner chunk holds 5 to {most}") in out
    assert "inner chunk 5 (entry 'model.f'): the shard index gives it 4 bytes, a compressed inner chunk holds" in out
    assert out.count("\n  array ") == 2
    # inspect cannot count what that index gives: the size is unknown, not the terabyte
    summary = _inspected(capsys, copy)
    entries = {e["fqn"]: e for e in summary["entries"]}
    assert entries["model.f"]["stored_bytes"] is None and summary["tensor_stored_unknown"] == 1
    assert entries["model.w"]["stored_bytes"] == _data_bytes(copy, "model/w")
    code, out, _ = run(capsys, "inspect", copy)
    assert code == 0 and "1 tensor not counted: its shard index cannot be read (dcp-zarr verify says why)" in out


# -- inspect ----------------------------------------------------------------------------------------------------------


def test_inspect_json_gives_every_entrys_stored_and_logical_bytes(stores, capsys):
    for name in ("c.zarr", "p.zarr"):
        summary = _inspected(capsys, stores / name)
        entries = {e["fqn"]: e for e in summary["entries"]}
        for fqn in ("model.w", "model.f", "model.ids", "model.b", "extra.size"):
            # exactly what the array's files hold: computed for arrays stored as they are, read from the shard
            # indexes for compressed ones
            assert entries[fqn]["stored_bytes"] == _data_bytes(stores / name, entries[fqn]["node"]), (name, fqn)
        assert entries["lr"]["stored_bytes"] == 0  # held in the manifest
        tensors = [e for e in entries.values() if e["kind"] == "tensor"]
        assert summary["tensor_stored_bytes"] == sum(e["stored_bytes"] for e in tensors)
        assert summary["tensor_bytes"] == sum(e["nbytes"] for e in tensors) == 2 * 512 * 512 * 3 + 512 * 64 * 8 + 64
        assert summary["tensor_stored_unknown"] == 0
    compressed = {e["fqn"]: e for e in _inspected(capsys, stores / "c.zarr")["entries"]}
    plain = {e["fqn"]: e for e in _inspected(capsys, stores / "p.zarr")["entries"]}
    for fqn in COMPRESSED:
        assert compressed[fqn]["stored_bytes"] < 0.95 * compressed[fqn]["nbytes"]
        assert compressed[fqn]["codec"]["name"] == "blosc"
        assert compressed[fqn]["codec"]["configuration"]["cname"] == "zstd"
    for fqn in ("model.w", "model.f", "model.ids"):  # sharded: each inner chunk's crc32c, then the index
        inner = 4 if fqn == "model.w" else 8 if fqn == "model.f" else 2
        assert plain[fqn]["stored_bytes"] == plain[fqn]["nbytes"] + inner * 4 + inner * 16 + 4
        assert plain[fqn]["codec"] is None
    assert compressed["model.ids"]["stored_bytes"] == plain["model.ids"]["stored_bytes"]  # ints: as they are
    assert plain["model.b"]["stored_bytes"] == 64 + 4


def test_inspect_shows_the_totals_and_a_ratio_per_entry(stores, capsys):
    summary = _inspected(capsys, stores / "c.zarr")
    logical, stored = summary["tensor_bytes"], summary["tensor_stored_bytes"]
    assert (summary["compressed_tensor_count"], summary["codecs"]) == (2, ["blosc zstd level 1"])

    code, out, _ = run(capsys, "inspect", stores / "c.zarr")

    lines = out.splitlines()
    assert code == 0 and len(lines) <= 60
    from dcp_zarr.tools.inspection import human_bytes

    assert (f"  stored: {human_bytes(stored)} for {human_bytes(logical)} of tensors ({logical / stored:.2f}x); "
            "2 of 4 tensors compressed (blosc zstd level 1)") in lines
    table = lines[lines.index("") + 1:lines.index("values:") - 1]
    assert table[0].split() == ["group", "entries", "tensors", "bytes", "stored", "ratio", "dtypes"]
    rows = {row.split()[0]: row.split() for row in table[1:]}
    entries = {e["fqn"]: e for e in summary["entries"]}
    w = entries["model.w"]
    assert rows["model.w"][-2:] == [f"{w['nbytes'] / w['stored_bytes']:.2f}x", "bfloat16"]
    assert float(rows["model.w"][-2][:-1]) > 1.1 and rows["model.ids"][-2] == "1.00x"  # stored as it is

    code, out, _ = run(capsys, "inspect", stores / "c.zarr", "--tree")
    tree = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert code == 0
    ratio = f"{w['nbytes'] / w['stored_bytes']:.2f}x"
    assert tree["w"].endswith(f"512.0 KiB  stored {human_bytes(w['stored_bytes']):>10} {ratio:>6}  "
                              "1 shard 512x512, chunks 128x512, blosc zstd")
    assert "blosc" not in tree["ids"] and "stored " in tree["ids"]

    code, out, _ = run(capsys, "inspect", stores / "c.zarr", "--filter", "model.[wf]")
    assert "matching 'model.[wf]': 2 entries, 1.5 MiB, stored in " in out
    filtered = _inspected(capsys, stores / "c.zarr", "--filter", "model.[wf]")
    assert filtered["matched_stored_bytes"] == sum(entries[f]["stored_bytes"] for f in COMPRESSED)


def test_inspect_of_a_plain_store_keeps_its_table_and_says_nothing_is_compressed(stores, capsys):
    code, out, _ = run(capsys, "inspect", stores / "p.zarr")

    lines = out.splitlines()
    summary = _inspected(capsys, stores / "p.zarr")
    assert code == 0 and summary["compressed_tensor_count"] == 0 and summary["codecs"] == []
    assert any(line.startswith("  stored: ") and line.endswith("none compressed") for line in lines), out
    table = lines[lines.index("") + 1:lines.index("values:") - 1]
    assert table[0].split() == ["group", "entries", "tensors", "bytes", "dtypes"]


@pytest.mark.parametrize("shape, chunk_shape, inner_rows", [
    ((10, 7), (4, 3), 0),  # edge chunks along both dims, padded to the chunk shape
    ((100, 5), (64, 5), 8),  # the edge shard holds 36 rows: 5 inner chunks stored, 3 absent
    ((96, 6, 2), (40, 4, 2), 10),  # three dims, edge shards along two
    ((), (), 0),  # 0-d
    ((0, 4), (1, 4), 0),  # no elements, no chunks
    ((512, 64), (512, 64), 256),
])
def test_the_computed_stored_bytes_are_what_the_encoder_writes(shape, chunk_shape, inner_rows):
    layout = ChunkLayout(shape, chunk_shape, inner_rows)
    written = 0
    for coords in layout.all_chunks():
        _, sizes = layout.chunk_box(coords)
        written += sum(len(memoryview(b).cast("B")) for b in encode_chunk(np.ones(sizes, dtype="<f4"), layout))

    assert uncompressed_stored_bytes(layout, 4) == written


# -- convert ----------------------------------------------------------------------------------------------------------


def test_convert_compresses_a_plain_store(stores, tmp_path, capsys):
    out = tmp_path / "compressed.zarr"

    code, printed, _ = run(capsys, "convert", stores / "p.zarr", out, "--to", "zarr", "--compression", "zstd")

    assert code == 0 and printed.strip() == str(out)
    converted = open_checkpoint(out)
    assert converted.manifest.format_version == FORMAT_VERSION
    assert {fqn for fqn, e in converted.manifest.entries.items() if getattr(e, "codec", None)} == set(COMPRESSED)
    assert_state_equal(converted.load_full_state_dict(), open_checkpoint(stores / "p.zarr").load_full_state_dict())
    assert _inspected(capsys, out)["tensor_stored_bytes"] < 0.9 * _inspected(capsys, stores / "p.zarr")["tensor_bytes"]
    assert "blosc" in _codecs_in(out)
    assert run(capsys, "verify", out)[0] == 0


def test_convert_decompresses_a_compressed_store(stores, tmp_path, capsys):
    out = tmp_path / "plain.zarr"
    assert "blosc" in _codecs_in(stores / "c.zarr")

    code, _, _ = run(capsys, "convert", stores / "c.zarr", out, "--to", "zarr", "--compression", "none")

    assert code == 0
    converted = open_checkpoint(out)
    assert converted.manifest.format_version == FORMAT_VERSION
    assert all(getattr(e, "codec", None) is None for e in converted.manifest.entries.values())
    assert "blosc" not in _codecs_in(out) and "crc32c" in _codecs_in(out)
    assert_state_equal(converted.load_full_state_dict(), open_checkpoint(stores / "c.zarr").load_full_state_dict())
    summary = _inspected(capsys, out)
    assert summary["tensor_stored_bytes"] > summary["tensor_bytes"]  # checksums and indexes, nothing compressed
    assert run(capsys, "diff", stores / "c.zarr", out)[0] == 0


def test_convert_keeps_the_sources_compression_unless_told(stores, tmp_path, capsys):
    assert run(capsys, "convert", stores / "c.zarr", tmp_path / "kept.zarr", "--to", "zarr")[0] == 0
    assert run(capsys, "convert", stores / "c.zarr", tmp_path / "lz4.zarr", "--to", "zarr",
               "--compression", "lz4")[0] == 0
    assert run(capsys, "convert", stores / "p.zarr", tmp_path / "plain.zarr", "--to", "zarr")[0] == 0

    kept = open_checkpoint(tmp_path / "kept.zarr").manifest.entries
    assert {(kept[f].codec.cname, kept[f].codec.clevel) for f in COMPRESSED} == {("zstd", 1)}
    lz4 = open_checkpoint(tmp_path / "lz4.zarr").manifest.entries
    assert {lz4[f].codec.cname for f in COMPRESSED} == {"lz4"}
    assert open_checkpoint(tmp_path / "plain.zarr").manifest.format_version == FORMAT_VERSION
    assert "blosc" not in _codecs_in(tmp_path / "plain.zarr")


def test_convert_compresses_a_dcp_directory(stores, tmp_path, capsys):
    out = tmp_path / "from-dcp.zarr"

    assert run(capsys, "convert", stores / "dcp", out, "--to", "zarr", "--compression", "zstd")[0] == 0

    assert open_checkpoint(out).manifest.format_version == FORMAT_VERSION
    assert "blosc" in _codecs_in(out)
    code, printed, _ = run(capsys, "diff", stores / "dcp", out)
    assert code == 0 and printed.splitlines()[-1] == "6 entries: 6 equal"


def test_convert_keeps_the_optimizer_tables(tmp_path, capsys):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    optim.step()
    model_sd, optim_sd = get_state_dict(model, optim)
    _save(tmp_path / "src.zarr", {"model": model_sd, "optim": optim_sd})

    code, _, _ = run(capsys, "convert", tmp_path / "src.zarr", tmp_path / "out.zarr", "--to", "zarr",
                     "--compression", "zstd")

    source, converted = open_checkpoint(tmp_path / "src.zarr"), open_checkpoint(tmp_path / "out.zarr")
    assert code == 0 and converted.manifest.optimizers == source.manifest.optimizers
    assert converted.manifest.optimizers and converted.manifest.optimizers[0].params
    assert converted.state_dict_type == source.state_dict_type == "full"
    assert list(converted.entries) == list(source.entries)  # the saved state dict's order


def test_convert_into_the_source_itself_needs_overwrite(stores, store_copy, capsys):
    copy = store_copy(stores / "p.zarr")
    before = open_checkpoint(copy).manifest.save_id

    code, _, err = run(capsys, "convert", copy, copy, "--to", "zarr", "--compression", "zstd")
    assert code == 2 and "is the source itself; pass --overwrite" in err
    assert open_checkpoint(copy).manifest.save_id == before

    assert run(capsys, "convert", copy, copy, "--to", "zarr", "--compression", "zstd", "--overwrite")[0] == 0
    converted = open_checkpoint(copy)
    assert converted.manifest.save_id != before and converted.manifest.format_version == FORMAT_VERSION
    assert_state_equal(converted.load_full_state_dict(), open_checkpoint(stores / "p.zarr").load_full_state_dict())
    assert not any(name.startswith(".") for name in os.listdir(copy.parent))  # no staging left behind


def test_convert_refuses_what_it_cannot_do_naming_the_option(stores, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        run(capsys, "convert", stores / "p.zarr", tmp_path / "x.zarr", "--to", "zarr", "--compression", "gzip")
    assert exited.value.code == 2
    assert ("argument --compression: expected one of keep, none, zstd, lz4, lz4hc, blosclz, zlib, got 'gzip'"
            in capsys.readouterr().err)
    code, _, err = run(capsys, "convert", stores / "p.zarr", tmp_path / "x.pt", "--to", "torch", "--compression", "lz4")
    assert code == 2 and "--compression applies to --to zarr only" in err
    shutil.copytree(stores / "p.zarr", tmp_path / "taken.zarr")
    code, _, err = run(capsys, "convert", stores / "c.zarr", tmp_path / "taken.zarr", "--to", "zarr")
    assert code == 2 and "already holds a checkpoint" in err
    assert open_checkpoint(tmp_path / "taken.zarr").manifest.format_version == FORMAT_VERSION  # untouched
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, "convert", tmp_path / "empty", tmp_path / "y.zarr", "--to", "zarr")
    assert code == 2 and "is neither a DCP checkpoint directory (.metadata + .distcp files) nor a dcp_zarr store" in err
    assert not os.path.exists(tmp_path / "x.zarr") and not os.path.exists(tmp_path / "y.zarr")

    with pytest.raises(ConversionError, match=r"compression='gzip': expected one of keep, none, zstd"):
        convert(stores / "p.zarr", tmp_path / "z.zarr", "zarr", compression="gzip")
    with pytest.raises(ConversionError, match="compression applies to a conversion to zarr, not to torch"):
        convert(stores / "p.zarr", tmp_path / "z.pt", "torch", compression="zstd")


# -- diff -------------------------------------------------------------------------------------------------------------


def test_diff_of_a_compressed_and_a_plain_store_of_one_state_finds_no_difference(stores, capsys):
    code, out, _ = run(capsys, "diff", stores / "c.zarr", stores / "p.zarr", "--all")

    assert code == 0 and out.splitlines()[-1] == "6 entries: 6 equal"
    assert "  equal  model.f" in out and "  equal  model.w" in out
