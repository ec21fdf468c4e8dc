"""The states single-process tests save and the targets they load into: arbitrary bit patterns of every dtype,
blank targets that no correct load leaves as they were, and ``dcp.save``/``dcp.load`` without a process group."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp

__all__ = ["DTYPES", "blank_like", "load_full", "random_bits", "save_plain"]

# Every dtype dcp_zarr stores (bf16 and fp8 through dcp_zarr's zarr data types).
DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64,
    torch.bool, torch.complex64, torch.complex128,
]


def random_bits(shape, dtype: torch.dtype, seed: int | torch.Generator = 0) -> torch.Tensor:
    """Arbitrary bit patterns of ``dtype`` (NaN payloads, infinities, subnormals, -0.0 included).

    ``seed``: an int (a fresh generator seeded with it) or a generator to draw from, so a caller can make many.
    """
    generator = torch.Generator().manual_seed(seed) if isinstance(seed, int) else seed
    shape = tuple(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, itemsize), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def blank_like(value):
    """A load target with the structure of ``value``: tensors filled with 0x5A bytes, other leaves None."""
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool:
            return torch.ones(value.shape, dtype=torch.bool)
        blank = torch.empty(value.shape, dtype=value.dtype)
        blank.reshape(-1).view(torch.uint8).fill_(0x5A)
        return blank
    if isinstance(value, dict):
        return {k: blank_like(v) for k, v in value.items()}
    if isinstance(value, list) and any(isinstance(v, (torch.Tensor, dict, list)) for v in value):
        return [blank_like(v) for v in value]
    return None


def load_full(path: str, template, **reader_kwargs):
    """``dcp.load`` (no process group) into a fresh ``blank_like(template)``; returns it."""
    from dcp_zarr import ZarrReader

    target = blank_like(template)
    dcp.load(target, storage_reader=ZarrReader(path, **reader_kwargs))
    return target


def save_plain(state, path: str, **writer_kwargs) -> None:
    from dcp_zarr import ZarrWriter

    dcp.save(state, storage_writer=ZarrWriter(path, **writer_kwargs))
