"""A checkpoint's model weights as safetensors, torch-free: ``dcp-zarr convert --to safetensors`` runs where only the
reading install is (no torch), for zarr stores; a DCP directory brings torch to read it.

The files are written here, not by the safetensors package: its numpy API has no bfloat16 or float8 (nor does numpy),
and its raw serializer's arguments changed between releases (0.4: bytes, 0.8: pointers). The format is one
little-endian u64 (the header's length), a JSON header naming each tensor's dtype, shape and byte range, padded
with spaces to 8 bytes, then the bytes (https://github.com/huggingface/safetensors, "Format");
``tests/tools/test_convert.py`` reads the files with safetensors itself.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Sequence

import numpy as np

from dcp_zarr.errors import ConversionError
from dcp_zarr.format.manifest import TENSOR
from dcp_zarr.offline import Checkpoint, Entry
from dcp_zarr.progress import progress_bar
from dcp_zarr.tools.outputs import SAFETENSORS_INDEX, check_local_output, staging_name, swap_into_place

# Hugging Face's default max_shard_size for save_pretrained.
DEFAULT_SAFETENSORS_SHARD_BYTES = 5 * 1000**3
# torch's dtype name (as the manifest records it) -> safetensors' name; complex128 has none.
SAFETENSORS_DTYPES = {
    "torch.float64": "F64", "torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16",
    "torch.float8_e4m3fn": "F8_E4M3", "torch.float8_e5m2": "F8_E5M2", "torch.int64": "I64", "torch.int32": "I32",
    "torch.int16": "I16", "torch.int8": "I8", "torch.uint64": "U64", "torch.uint32": "U32", "torch.uint16": "U16",
    "torch.uint8": "U8", "torch.bool": "BOOL", "torch.complex64": "C64",
}


def to_safetensors(source: Checkpoint, dst: str | os.PathLike, *, overwrite: bool = False,
                   prefix: Sequence | None = None, max_shard_bytes: int = DEFAULT_SAFETENSORS_SHARD_BYTES,
                   progress: bool | None = False) -> list[str]:
    """Model weights as safetensors, named by their FQN under ``prefix`` (default: ``("model",)`` when the
    checkpoint has a ``model`` group, else everything).

    ``dst`` ending in ``.safetensors`` is one file. Otherwise it is a directory in Hugging Face's layout: one
    ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards of at most ``max_shard_bytes`` each (a
    larger tensor gets a shard of its own) plus ``model.safetensors.index.json``. Non-tensor entries are skipped.
    """
    target = check_local_output(dst, overwrite)
    tensors = _weights(source, prefix)
    if not tensors:
        raise ConversionError(f"{source.url}: no tensors under {tuple(prefix) if prefix else 'the root'} to convert")
    unwritable = [f"{entry.fqn} ({entry.dtype_name})" for _, entry in tensors
                  if entry.dtype_name not in SAFETENSORS_DTYPES]
    if unwritable:
        raise ConversionError(f"{source.url}: safetensors has no data type for {', '.join(unwritable[:3])}; choose "
                              "--prefix to leave them out, or convert --to torch")
    single_file = target.endswith(".safetensors")
    shards = [tensors] if single_file else _shard(tensors, max_shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    staging = staging_name(target)
    try:
        if not single_file:
            os.makedirs(staging)
        with progress_bar(sum(e.nbytes for _, e in tensors), "converting", enabled=progress) as bar:
            for shard, name in zip(shards, names):
                _write_file(source, shard, staging if single_file else os.path.join(staging, name), bar.update)
        if not single_file and len(shards) > 1:
            index = {"metadata": {"total_size": sum(e.nbytes for _, e in tensors)},
                     "weight_map": {key: name for shard, name in zip(shards, names) for key, _ in shard}}
            with open(os.path.join(staging, SAFETENSORS_INDEX), "w") as f:
                json.dump(index, f, indent=2)
        swap_into_place(staging, target)
    finally:
        if os.path.isdir(staging):
            shutil.rmtree(staging)
        elif os.path.exists(staging):
            os.remove(staging)
    if single_file:
        return [target]
    return sorted(os.path.join(target, name) for name in os.listdir(target))


def _write_file(source: Checkpoint, shard: list[tuple[str, Entry]], path: str, advance) -> None:
    """One safetensors file of ``shard``'s tensors, each read and written in turn (one tensor in memory at a time)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, entry in shard:
        header[key] = {"dtype": SAFETENSORS_DTYPES[str(entry.dtype_name)], "shape": list(entry.shape or ()),
                       "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for _, entry in shard:
            array = np.ascontiguousarray(source.read_array(entry))
            f.write(array.reshape(-1).view(np.uint8).data)  # bf16 and float8 too: their bytes as they are
            advance(entry.nbytes)


def _weights(source: Checkpoint, prefix: Sequence | None) -> list[tuple[str, Entry]]:
    """(name, entry) of every tensor under ``prefix``; the name is the state-dict path below it, dot-joined."""
    if prefix is None:
        prefix = ("model",) if any(e.path[:1] == ("model",) and e.kind == TENSOR for e in source) else ()
    prefix = tuple(prefix)
    chosen: list[tuple[str, Entry]] = []
    for entry in source:
        if entry.kind == TENSOR and tuple(entry.path[: len(prefix)]) == prefix and len(entry.path) > len(prefix):
            chosen.append((".".join(map(str, entry.path[len(prefix):])), entry))
    return chosen


def _shard(tensors: list, max_bytes: int) -> list[list]:
    shards: list[list] = [[]]
    size = 0
    for key, entry in tensors:
        if shards[-1] and size + entry.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((key, entry))
        size += entry.nbytes
    return shards
