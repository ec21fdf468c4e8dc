"""What rank 0 sees, told to every rank: a checkpoint to load, or to build an incremental save on, is found by listing
storage that the ranks may see a moment apart (a deletion or a commit under way), so one rank looks and the default
process group hears its answer. ``CheckpointManager`` and the torchtitan and Lightning adapters decide so."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch.distributed as dist

T = TypeVar("T")


def decided_by_rank0(decide: Callable[[], T]) -> T:
    """What ``decide()`` returns on rank 0, on every rank of the default process group, where no other rank calls it
    (a collective: every rank calls this); ``decide()`` itself in a process without a group."""
    if not (dist.is_available() and dist.is_initialized()):
        return decide()
    box = [decide() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[return-value]  # rank 0's, a T
