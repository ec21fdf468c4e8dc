"""Which arrays of a compressed save are worth compressing, measured, not guessed: each rank compresses a small
sample of its own part of every candidate array (floating point, at least ``Compression.min_bytes``) as the save
would, and names those that shrink less than ``Compression.min_ratio`` (random-like data, values already
quantised). An array any rank names is stored as it is; the names travel in the rank's ``Summary``, which stays
small, since most arrays compress."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch

from dcp_zarr.format.compression import Compression
from dcp_zarr.format.torch_arrays import tensor_as_numpy, torch_dtype_name

# A sample is a few pieces spread over the rank's part of the array: enough to see how its values are distributed,
# small enough that sampling the hundreds of arrays of a model costs milliseconds.
SAMPLE_PIECES = 4
SAMPLE_PIECE_BYTES = 16 << 10


def poorly_compressed(held: Iterable[tuple[str, torch.dtype, int]], local_tensor: Callable[[str], torch.Tensor | None],
                      compression: Compression) -> frozenset[str]:
    """The arrays of ``held`` (fqn, dtype, the array's global bytes) that are candidates, yet whose sample of
    ``local_tensor(fqn)`` (this rank's part; None or empty: nothing to sample) compresses less than
    ``compression.min_ratio``."""
    found: set[str] = set()
    if compression.min_ratio == 0:  # every candidate is compressed
        return frozenset()
    for fqn, dtype, nbytes in held:
        if not compression.compresses(torch_dtype_name(dtype), nbytes):
            continue
        tensor = local_tensor(fqn)
        if tensor is None or tensor.numel() == 0:
            continue
        if sample_ratio(tensor, compression) < compression.min_ratio:
            found.add(fqn)
    return frozenset(found)


def sample_ratio(tensor: torch.Tensor, compression: Compression) -> float:
    """How much a sample of ``tensor`` shrinks under ``compression``'s codec (its bytes over its compressed bytes)."""
    sample = _sample(tensor.detach()).to("cpu")
    data = tensor_as_numpy(sample)
    return data.nbytes / max(1, len(compression.codec(data.itemsize).encode(data)))


def _sample(tensor: torch.Tensor) -> torch.Tensor:
    per_piece = max(1, SAMPLE_PIECE_BYTES // tensor.element_size())
    if not tensor.is_contiguous():  # flattening would copy it all: its first rows instead
        rows = max(1, SAMPLE_PIECES * per_piece // max(1, tensor[0].numel() if tensor.dim() else 1))
        return tensor[:rows].contiguous().reshape(-1)[: SAMPLE_PIECES * per_piece]
    flat = tensor.reshape(-1)
    count = flat.numel()
    if count <= SAMPLE_PIECES * per_piece:
        return flat
    starts = [(count - per_piece) * i // (SAMPLE_PIECES - 1) for i in range(SAMPLE_PIECES)]
    return torch.cat([flat[start: start + per_piece] for start in starts])
