"""Damaged stores: every flipped bit, truncation or missing file in a chunk or shard index is caught by ``dcp.load`` and
``dcp-zarr verify`` with an error naming the array and chunk; malformed metadata gives a clear error, never a crash
deep in numpy; a hostile pickle in an object entry never runs.

The damaged stores are copies of one checkpoint saved by three gloo ranks (tests/support/ranks.py's ``run_ranks``):
plain chunks, a 0-d array, shards with inner chunks and a shard index, an edge shard whose padding inner chunk is
absent from its index, a ``torch.save`` object entry and JSON values.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import shutil
import warnings
from collections import Counter

import pytest
import torch
import torch.distributed.checkpoint as dcp
import zarr
from torch.distributed.checkpoint.api import CheckpointException

from dcp_zarr import (
    CorruptChunkError,
    IncompleteCheckpointError,
    MalformedMetadataError,
    NotACheckpointError,
    UntrustedTypeError,
    ZarrCheckpointError,
    ZarrReader,
    ZarrSavePlanner,
    ZarrWriter,
)
from dcp_zarr.format.encoding import checksum
from dcp_zarr.tools.cli import main as dcp_zarr_cli
from tests.support.compare import assert_state_equal
from tests.support.faults import causes, crash_state, sharded_state
from tests.support.ranks import run_ranks, start_forkserver
from tests.support.states import blank_like, load_full
from tests.support.stores import chunk_files, drop_root_copies, edit_json, edit_root_copies, edit_root_manifest

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

warnings.filterwarnings("ignore", message=".*torch.distributed is (disabled|unavailable|not initialized).*")

WORLD_SIZE = 3
SEED = 0
TRIALS = 150
TEMPLATE = crash_state(SEED)


def save_three_ranks(rank: int, world_size: int, path: str) -> None:
    dcp.save(sharded_state(SEED, world_size), planner=ZarrSavePlanner(),
             storage_writer=ZarrWriter(path, inner_chunk_bytes=2048))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("pristine") / "ckpt.zarr")
    start_forkserver()
    run_ranks(save_three_ranks, WORLD_SIZE, path)
    assert_state_equal(load_full(path, TEMPLATE), TEMPLATE)
    return path


@pytest.fixture
def damaged(pristine, store_copy) -> str:
    return str(store_copy(pristine, "ckpt.zarr"))


def load_failure(path: str, **reader_kwargs) -> BaseException | None:
    """The per-rank cause of a failed full ``dcp.load`` of ``path``, or None if it loaded bit-exact."""
    try:
        loaded = load_full(path, TEMPLATE, **reader_kwargs)
    except CheckpointException as exc:
        return causes(exc)[0]
    assert_state_equal(loaded, TEMPLATE)
    return None


def verify(path: str, capsys) -> tuple[int, dict]:
    capsys.readouterr()
    status = dcp_zarr_cli(["verify", "--json", "--no-progress", path])
    return status, json.loads(capsys.readouterr().out)


# -- chunk damage ---------------------------------------------------------------------------------------------------


def _shard_layout(path: str, node: str) -> tuple[int, int] | None:
    """(index bytes, inner chunks) of the array's shards, or None if its chunks are plain."""
    with open(os.path.join(path, node, "zarr.json")) as f:
        document = json.load(f)
    codec = document["codecs"][0]
    if codec["name"] != "sharding_indexed":
        return None
    inner = codec["configuration"]["chunk_shape"][0]
    count = document["chunk_grid"]["configuration"]["chunk_shape"][0] // inner
    return count * 16 + 4, count


def _split(relative: str) -> tuple[str, str]:
    """("model/ids", "c.1") from "model/ids/c.1" (and ("model/ids", "c/1") from a format-2 "model/ids/c/1")."""
    parts = relative.split(os.sep)
    if parts[-1] == "c" or parts[-1].startswith("c."):
        return "/".join(parts[:-1]), parts[-1]
    at = len(parts) - 1 - parts[::-1].index("c")
    return "/".join(parts[:at]), "/".join(parts[at:])


def _damage(path: str, relative: str, kind: str, rng: random.Random, index_bytes: int = 0) -> tuple[str, int]:
    """Damage one file; returns what was done and the first byte offset it touched."""
    file = os.path.join(path, relative)
    size = os.path.getsize(file)
    if kind == "delete":
        os.remove(file)
        return "deleted", 0
    with open(file, "r+b") as f:
        data = bytearray(f.read())
        if kind == "flip":
            at, bit = rng.randrange(size), rng.randrange(8)
            data[at] ^= 1 << bit
            what = f"bit {bit} of byte {at}/{size} flipped"
        elif kind == "index-flip":  # a shard's index: the last bytes of the file
            at, bit = size - 1 - rng.randrange(index_bytes), rng.randrange(8)
            data[at] ^= 1 << bit
            what = f"bit {bit} of byte {at}/{size} (in the shard index) flipped"
        elif kind == "burst":
            at = rng.randrange(size)
            run = rng.randint(1, min(64, size - at))
            data[at:at + run] = bytes(b ^ 0xFF for b in data[at:at + run])
            what = f"{run} bytes inverted at {at}/{size}"
        elif kind == "truncate":
            at = rng.randrange(size)
            del data[at:]
            what = f"truncated {size} -> {at} bytes"
        else:
            raise ValueError(kind)
        f.seek(0)
        f.truncate()
        f.write(data)
    return what, at


def test_every_random_chunk_and_shard_index_damage_is_detected_and_named(pristine, tmp_path, capsys):
    rng = random.Random(20260602)
    files = chunk_files(pristine)
    shards = [f for f in files if _shard_layout(pristine, _split(f)[0])]
    kinds = ["flip", "index-flip", "truncate", "delete", "burst", "flip"]
    assert shards and len(files) >= len(shards) + 3, "the store must hold plain chunks and shards"
    outcomes = Counter()
    for trial in range(TRIALS):
        path = str(tmp_path / f"t{trial}.zarr")
        shutil.copytree(pristine, path)
        kind = kinds[trial % len(kinds)]
        relative = rng.choice(shards if kind == "index-flip" else files)
        node, key = _split(relative)
        shard = _shard_layout(pristine, node)
        what, _ = _damage(path, relative, kind, rng, shard[0] if shard else 0)
        label = f"trial {trial}: {relative} {what}"

        cause = load_failure(path)
        assert isinstance(cause, CorruptChunkError), f"{label}: dcp.load gave {cause!r}"
        assert repr(node) in str(cause) and key in str(cause), f"{label}: the error does not name it: {cause}"

        status, report = verify(path, capsys)
        assert status == 1 and not report["ok"], f"{label}: verify passed: {report}"
        assert any(p["node"] == node and p["chunk"].startswith(key) for p in report["problems"]), (label, report)
        outcomes[kind] += 1
        shutil.rmtree(path)
    print(f"\ncorruption: {TRIALS} trials over {len(files)} chunk files ({len(shards)} of them shards): "
          f"{dict(outcomes)}; every one detected by dcp.load and by dcp-zarr verify, naming the array and chunk")


def test_zarr_itself_rejects_a_flipped_bit(damaged):
    """The checksums are zarr's crc32c codec: zarr-python refuses the damaged chunk too, not only dcp_zarr."""
    _damage(damaged, os.path.join("model", "layers.0.w", "c.0.0"), "flip", random.Random(1))
    array = zarr.open_array(os.path.join(damaged, "model", "layers.0.w"), mode="r")
    with pytest.raises(Exception, match="(?i)checksum"):
        array[...]


def test_bytes_appended_to_a_chunk_never_change_what_loads_and_verify_reports_them(damaged, capsys):
    with open(os.path.join(damaged, "model", "ids", "c.0"), "ab") as f:
        f.write(b"\x00garbage")
    assert load_failure(damaged) is None or isinstance(load_failure(damaged), CorruptChunkError)
    status, report = verify(damaged, capsys)
    assert status == 1 and report["problems"][0]["node"] == "model/ids", report


def test_a_missing_array_zarr_json_is_named_by_verify_and_loads_from_its_copy_in_the_root(damaged, capsys):
    os.remove(os.path.join(damaged, "model", "embed.weight", "zarr.json"))
    assert load_failure(damaged) is None  # the load reads the copy in the root; the data is all there
    status, report = verify(damaged, capsys)  # but zarr tools cannot open it
    assert status == 1 and report["problems"][0]["node"] == "model/embed.weight", report


def test_a_store_of_format_5_loads_from_the_copies_in_its_consolidated_metadata(damaged, capsys):
    _as_format_5(damaged)
    os.remove(os.path.join(damaged, "model", "embed.weight", "zarr.json"))
    assert load_failure(damaged) is None  # read from the copy, where formats 4 and 5 keep it
    assert verify(damaged, capsys)[1]["problems"][0]["node"] == "model/embed.weight"


def test_a_missing_array_zarr_json_is_named_in_a_store_without_copies_in_the_root(damaged, capsys):
    drop_root_copies(damaged)
    os.remove(os.path.join(damaged, "model", "embed.weight", "zarr.json"))
    cause = load_failure(damaged)
    assert isinstance(cause, ZarrCheckpointError) and "'model/embed.weight'" in str(cause), repr(cause)
    assert verify(damaged, capsys)[0] == 1


def test_an_array_zarr_json_unlike_its_copy_in_the_root_is_reported_by_verify(damaged, capsys):
    edit_json(os.path.join(damaged, "model", "embed.weight", "zarr.json"),
              lambda document: document["attributes"].update(note="rewritten by another tool"))
    assert load_failure(damaged) is None
    status, report = verify(damaged, capsys)
    assert status == 1 and "copy in the root" in report["problems"][0]["message"], report


def test_a_missing_object_chunk_is_named(damaged, capsys):
    os.remove(os.path.join(damaged, "optim", "seen", "c.0"))
    cause = load_failure(damaged)
    assert isinstance(cause, CorruptChunkError) and "'optim/seen'" in str(cause) and "c.0" in str(cause), repr(cause)
    assert verify(damaged, capsys)[0] == 1


# -- malformed metadata ----------------------------------------------------------------------------------------------


def _edit_manifest(edit):
    return lambda path: edit_root_manifest(path, edit)


def _edit_entry(fqn: str, **changes):
    def edit(manifest):
        entry = manifest["entries"][fqn]
        for key, value in changes.items():
            if value is _DELETE:
                del entry[key]
            else:
                entry[key] = value
    return _edit_manifest(edit)


def _edit_array(node: str, edit):
    """Edit the array's zarr.json and its copy in the root alike (as a tool that rewrote both would): a load checks
    the copy, verify the array's own."""
    def apply(path: str) -> None:
        edit_json(os.path.join(path, *node.split("/"), "zarr.json"), edit)
        edit_root_copies(path, lambda copies: edit(copies[node]))
    return apply


def _edit_root(path: str, edit) -> None:
    edit_json(os.path.join(path, "zarr.json"), edit)


def _as_format_5(path: str) -> None:
    """The copies where formats 4 and 5 kept them: zarr's consolidated metadata."""
    def move(root):
        copies = root["attributes"]["dcp_zarr"].pop("nodes")
        root["consolidated_metadata"] = {"kind": "inline", "must_understand": False, "metadata": copies}
    _edit_root(path, move)


def _set_copy(node: str, value):
    return lambda path: edit_root_copies(path, lambda copies: copies.update({node: value}))


def _write(relative: str, data: bytes):
    def apply(path: str) -> None:
        with open(os.path.join(path, relative), "wb") as f:
            f.write(data)
    return apply


def _nested_value(fqn: str, depth: int):
    """The entry's value nested ``depth`` lists deep, written as text (json.dump itself would recurse too deep)."""
    def apply(path: str) -> None:
        _edit_entry(fqn, value="NESTED")(path)
        with open(os.path.join(path, "zarr.json")) as f:
            text = f.read()
        with open(os.path.join(path, "zarr.json"), "w") as f:
            f.write(text.replace('"NESTED"', "[" * depth + "1" + "]" * depth))
    return apply


_DELETE = object()
W = "model.layers.0.w"  # sharded, (96, 64) float32, saved as three row blocks of 32
E = "model.embed.weight"  # plain chunks, (37, 16) float32

# (name, mutation, expected error type, text the message must contain)
def _without_checksum(document: dict) -> None:
    """Drop the crc32c codec: from a plain array's codecs, or from the inner codecs of a sharded one."""
    codecs = document["codecs"]
    if codecs[0]["name"] == "sharding_indexed":
        codecs[0]["configuration"]["codecs"] = codecs[0]["configuration"]["codecs"][:1]
    else:
        document["codecs"] = codecs[:1]


METADATA_CASES = [
    ("root zarr.json is not JSON", _write("zarr.json", b"{\"zarr_format\": 3, "), MalformedMetadataError,
     "not valid JSON"),
    ("root zarr.json is not UTF-8", _write("zarr.json", b"\xff\xfe\x00garbage"), MalformedMetadataError, "zarr.json"),
    ("root zarr.json nests without end", _write("zarr.json", b"[" * 100_000), MalformedMetadataError, "zarr.json"),
    ("root zarr.json is a list", _write("zarr.json", b"[]"), NotACheckpointError, "zarr_format"),
    ("no manifest attribute", _write("zarr.json", b'{"zarr_format": 3, "node_type": "group", "attributes": {}}'),
     NotACheckpointError, "not a dcp_zarr checkpoint"),
    ("format version from the future", _edit_manifest(lambda m: m.update(format_version=99)), MalformedMetadataError,
     "version 99"),
    ("not marked complete", _edit_manifest(lambda m: m.update(complete=False)), IncompleteCheckpointError, "complete"),
    ("entries is a list", _edit_manifest(lambda m: m.update(entries=[])), MalformedMetadataError, "entries"),
    ("unknown entry kind", _edit_entry(E, kind="pickle"), MalformedMetadataError, repr(E)),
    ("negative shape", _edit_entry(E, shape=[-37, 16]), MalformedMetadataError, repr(E)),
    ("float shape", _edit_entry(E, shape=[37.5, 16]), MalformedMetadataError, repr(E)),
    ("string shape", _edit_entry(E, shape="37x16"), MalformedMetadataError, repr(E)),
    ("unknown dtype", _edit_entry(E, dtype="torch.float128"), MalformedMetadataError, "float128"),
    ("shape too large for any tensor", _edit_entry(E, shape=[2**40, 2**40]), MalformedMetadataError, repr(E)),
    ("chunk shape missing", _edit_entry(E, chunk_shape=_DELETE), MalformedMetadataError, repr(E)),
    ("chunk shape of zero", _edit_entry(E, chunk_shape=[0, 16]), MalformedMetadataError, repr(E)),
    ("chunk shape of another rank", _edit_entry(E, chunk_shape=[37]), MalformedMetadataError, repr(E)),
    ("chunk shape disagrees with zarr.json", _edit_entry(E, chunk_shape=[5, 16]), MalformedMetadataError,
     "'model/embed.weight'"),
    ("negative saved shards", _edit_entry(E, saved_shards=-1), MalformedMetadataError, repr(E)),
    ("inner chunk rows not a number", _edit_entry(E, inner_chunk_rows="4"), MalformedMetadataError, repr(E)),
    ("value entry without its node", _edit_entry("optim.lr", node=_DELETE), MalformedMetadataError, "'optim.lr'"),
    ("saved world size of zero", _edit_manifest(lambda m: m.update(saved_world_size=0)), MalformedMetadataError,
     "saved_world_size"),
    ("optimizer tables not a list", _edit_manifest(lambda m: m.update(optimizers={"a": 1})), MalformedMetadataError,
     "optimizers"),
    ("node missing", _edit_entry(E, node=_DELETE), MalformedMetadataError, repr(E)),
    ("node not a string", _edit_entry(E, node=7), MalformedMetadataError, repr(E)),
    ("path not a list", _edit_entry(E, path=5), MalformedMetadataError, repr(E)),
    ("malformed tagged JSON value", _edit_entry("optim.betas", value={"__tuple__": 5}), MalformedMetadataError,
     "'optim.betas'"),
    ("malformed float tag", _edit_entry("optim.lr", value={"__float__": "fast"}), MalformedMetadataError, "'optim.lr'"),
    ("bytes tag holding a number", _edit_entry("optim.lr", value={"__bytes__": 5}), MalformedMetadataError,
     "'optim.lr'"),
    ("a value nested 900 deep", _nested_value("optim.lr", 900), MalformedMetadataError, "'optim.lr'"),
    ("a value nested 100,000 deep", _nested_value("optim.lr", 100_000), MalformedMetadataError, "zarr.json"),
    ("set tag holding a number", _edit_entry("optim.lr", value={"__set__": 5}), MalformedMetadataError, "'optim.lr'"),
    ("dict tag of single items", _edit_entry("optim.lr", value={"__dict__": [[1]]}), MalformedMetadataError,
     "'optim.lr'"),
    ("array zarr.json is not JSON (no copy in the root)", lambda p: (
        drop_root_copies(p), _write(os.path.join("model", "embed.weight", "zarr.json"), b"{not json")(p)),
     MalformedMetadataError, "'model/embed.weight'"),
    ("array zarr.json is a list (no copy in the root)", lambda p: (
        drop_root_copies(p), _write(os.path.join("model", "embed.weight", "zarr.json"), b"[1, 2]")(p)),
     MalformedMetadataError, "'model/embed.weight'"),
    ("copy in the root is a list", _set_copy("model/embed.weight", [1, 2]), MalformedMetadataError,
     "'model/embed.weight'"),
    ("copy in the root is a group's", _set_copy("model/embed.weight", {"zarr_format": 3, "node_type": "group"}),
     MalformedMetadataError, "'model/embed.weight'"),
    ("the manifest's nodes not a table", _edit_manifest(lambda m: m.update(nodes=[])), MalformedMetadataError,
     "'nodes'"),
    ("format 5's consolidated metadata not an object",
     lambda p: (_as_format_5(p), _edit_root(p, lambda root: root.update(consolidated_metadata=[]))),
     MalformedMetadataError, "consolidated_metadata"),
    ("format 5's consolidated metadata without its 'metadata'",
     lambda p: (_as_format_5(p), _edit_root(p, lambda root: root["consolidated_metadata"].pop("metadata"))),
     MalformedMetadataError, "consolidated_metadata"),
    ("array shape disagrees with the manifest",
     _edit_array("model/embed.weight", lambda d: d.update(shape=[38, 16])), MalformedMetadataError, "shape"),
    ("array chunk shape of zero", _edit_array("model/embed.weight", lambda d: d["chunk_grid"]["configuration"].update(
        chunk_shape=[0, 16])), MalformedMetadataError, "'model/embed.weight'"),
    ("array data type disagrees with the manifest",
     _edit_array("model/embed.weight", lambda d: d.update(data_type="float64")), MalformedMetadataError, "float64"),
    ("array codecs changed (compressed)",
     _edit_array("model/embed.weight",
                 lambda d: d["codecs"].insert(1, {"name": "zstd", "configuration": {"level": 1}})),
     MalformedMetadataError, "'model/embed.weight'"),
    ("array without its checksum codec", _edit_array("model/embed.weight", _without_checksum),
     MalformedMetadataError, "'model/embed.weight'"),
    ("inner chunk rows changed", _edit_array("model/layers.0.w", lambda d: d["codecs"][0]["configuration"].update(
        chunk_shape=[4, 64])), MalformedMetadataError, "'model/layers.0.w'"),
    ("consistent but wrong dtype (float64 in both)", lambda p: (_edit_entry(E, dtype="torch.float64")(p), _edit_array(
        "model/embed.weight", lambda d: d.update(data_type="float64"))(p)), ZarrCheckpointError,
     "'model/embed.weight'"),
    ("consistent but wrong shape (in both)", lambda p: (
        _edit_entry(E, shape=[74, 16])(p),
        _edit_array("model/embed.weight", lambda d: d.update(shape=[74, 16]))(p)), BaseException, "embed.weight"),
]


@pytest.mark.parametrize("mutate, expected, text", [c[1:] for c in METADATA_CASES], ids=[c[0] for c in METADATA_CASES])
def test_malformed_metadata_gives_a_clear_error(damaged, mutate, expected, text):
    mutate(damaged)
    try:
        ZarrReader(damaged).read_metadata()
    except ZarrCheckpointError as exc:  # refused when the manifest is read: before any planning or chunk read
        assert isinstance(exc, expected), repr(exc)
        assert text in str(exc), str(exc)
        with pytest.raises(CheckpointException, match="failed"):
            dcp.load(blank_like(TEMPLATE), storage_reader=ZarrReader(damaged))
        return
    cause = load_failure(damaged)
    assert cause is not None, "loaded as if nothing were wrong"
    assert isinstance(cause, expected), repr(cause)
    assert text in str(cause), str(cause)
    if expected is not BaseException:  # DCP's own size check names the key; every other refusal is ours
        assert isinstance(cause, ZarrCheckpointError), f"not one of dcp_zarr's errors: {cause!r}"


@pytest.mark.parametrize("mutate", [c[1] for c in METADATA_CASES], ids=[c[0] for c in METADATA_CASES])
def test_the_cli_reports_malformed_metadata_without_a_traceback(damaged, mutate, capsys):
    mutate(damaged)
    for command, allowed in ((["inspect"], (0, 2)), (["verify", "--no-progress"], (0, 1, 2))):
        status = dcp_zarr_cli([*command, damaged])
        err = capsys.readouterr().err
        assert status in allowed and "Traceback" not in err, (command, status, err)


# -- hostile pickles ---------------------------------------------------------------------------------------------------


class _RunsCode:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _hostile_payloads(marker: str) -> dict[str, bytes]:
    zipped = io.BytesIO()
    torch.save({"fine": torch.ones(2), "evil": _RunsCode(marker)}, zipped)
    return {
        "torch.save zip": zipped.getvalue(),
        "legacy pickle stream": pickle.dumps(_RunsCode(marker), protocol=2),
        "pickle protocol 5": pickle.dumps([1, _RunsCode(marker)], protocol=5),
    }


@pytest.mark.parametrize("kind", ["torch.save zip", "legacy pickle stream", "pickle protocol 5"])
@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")  # torch's, of the bare protocol-5 stream
def test_a_hostile_pickle_in_an_object_entry_never_runs(damaged, tmp_path, kind):
    marker = str(tmp_path / "pwned")
    payload = _hostile_payloads(marker)[kind]
    with open(os.path.join(damaged, "optim", "seen", "c.0"), "wb") as f:
        f.write(payload + checksum(payload))  # a valid checksum: only the unpickler stands in the way
    _edit_entry("optim.seen", nbytes=len(payload))(damaged)

    # torch.save's archive is checked for what it would import (os.system: untrusted); a bare pickle stream is no
    # torch.save archive at all.
    expected = UntrustedTypeError if kind == "torch.save zip" else MalformedMetadataError
    cause = load_failure(damaged)
    assert not os.path.exists(marker), "the pickle ran code"
    assert isinstance(cause, expected) and "weights_only" in str(cause) and "'optim.seen'" in str(cause), repr(cause)
    # Trusting some types does not trust os.system.
    cause = load_failure(damaged, safe_globals=[_RunsCode])
    assert not os.path.exists(marker), "the pickle ran code"
    assert isinstance(cause, expected), repr(cause)
    if kind == "torch.save zip":
        assert "system" in str(cause)


def test_store_bytes_reach_only_weights_only_unpickling(damaged, monkeypatch):
    """Loading unpickles the object entry's bytes with weights_only=True and nothing else from the store; the
    planner's own torch.load (weights_only=False) only ever sees streams dcp_zarr rebuilt from checked values."""
    calls = []
    real_load = torch.load

    def load(f, *args, **kwargs):
        data = f.getvalue() if isinstance(f, io.BytesIO) else None
        calls.append((kwargs.get("weights_only"), data))
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", load)
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("pickle.loads called during a load"))
    target = blank_like(TEMPLATE)
    dcp.load(target, storage_reader=ZarrReader(damaged))
    assert target["optim"]["seen"] == TEMPLATE["optim"]["seen"]
    with open(os.path.join(damaged, "optim", "seen", "c.0"), "rb") as f:
        stored = f.read()[:-4]
    unsafe = [data for weights_only, data in calls if not weights_only]
    assert [data for weights_only, data in calls if weights_only] == [stored]
    assert len(unsafe) == 3, "one rebuilt stream per non-tensor entry (lr, betas, seen)"
