"""torch's private names that dcp_zarr uses (DCP's, ShardedTensor's, the functional collectives'), in one module of
the lowest layers, beside torch_floor.py: no other module of dcp_zarr imports a private module or name of torch
(``tests/project/test_layers.py``), so any layer reaches them without importing the layer that plans. Verified on the
torch releases of ``VERIFIED_TORCH``: importing this module fails, naming the name, the day torch keeps one elsewhere,
and ``tests/planning/test_dcp_internals.py`` holds what is read through them (``bash .ci/torch-matrix`` runs the tests
on each release).

What dcp_zarr reads or sets inside a DCP call under way (its frames, its planner's methods, its plan cache) is
planning's: ``planning/dcp_internals.py``.

Implementation.
"""

from __future__ import annotations

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

from torch.distributed.checkpoint import _nested_dict, _version
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.planner_helpers import _create_read_items, _create_write_items

__all__ = [
    "VERIFIED_TORCH", "create_read_items", "create_write_items", "flatten_state_dict", "set_element",
    "torch_2_3_keys", "state_dict_stager", "staged_bytes", "sharded_tensor_type", "whole_state_dict_planner",
    "functional_collectives",
]

# The torch releases on which these names, and what planning/dcp_internals.py reads in DCP's calls, were seen where
# dcp_zarr looks for them.
VERIFIED_TORCH = ((2, 11), (2, 12), (2, 13), (2, 14), (2, 15))

# DCP's private functions, under the names dcp_zarr calls them by: a WriteItem's and a ReadItem's making (a state
# dict's flattening and an element's setting keep DCP's names).
create_write_items = _create_write_items
create_read_items = _create_read_items


def torch_2_3_keys(state_dict: dict) -> set[str] | None:
    """The keys of DCP's ``flatten_state_dict(state_dict)`` with its version switch on ("2_3"), made by the traversal
    that switch selects, called directly: no module global of torch changes, so no other thread's flattening sees
    the switch. None where DCP's own planning must decide: torch no longer has the switch or that traversal, another
    call has the switch on right now, or two keys collide (DCP's error)."""
    traverse = getattr(_nested_dict, "traverse_state_dict_v_2_3", None)
    if traverse is None or getattr(_version, "_derived_version", "gone") is not None:
        return None
    keys: set[str] = set()
    collided = False

    def visit(path, value) -> None:
        nonlocal collided
        key = ".".join(map(str, path))
        collided = collided or key in keys
        keys.add(key)

    traverse(state_dict, visit)
    return None if collided else keys


# -- staging for async saves ---------------------------------------------------------------------------------------
# DCP's StateDictStager copies a state dict into host memory, keeping a buffer per source storage (a weak key) and
# copying into it again on the next stage. dcp_zarr uses it directly, not through DefaultStager: torch 2.11's and
# 2.12's DefaultStager closes its StateDictStager after every stage (emptying its buffers and its copy dispatch, so
# a second stage fails), where 2.13 keeps it; the StateDictStager itself is the same in 2.11 to 2.15.


def state_dict_stager(pinned: bool) -> StateDictStager:
    """A stager into pinned shared memory (for CUDA tensors: the GPU fills it by DMA, and a process-based executor
    maps it as it is), or into ordinary memory."""
    return StateDictStager(pin_memory=pinned, share_memory=pinned)


def staged_bytes(stager: StateDictStager) -> int:
    """Bytes of host memory the stager keeps for its next stage."""
    return sum(storage.nbytes() for storage in list(stager._cached_storage_mapping.values()))


def sharded_tensor_type() -> type | None:
    """torch's ``ShardedTensor`` (deprecated in favour of DTensor), or None where a torch no longer has it. Passed
    to the layers that name no torch module (``placement.holdings.rank_entries``, ``format.sources``)."""
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:  # pragma: no cover - ShardedTensor is deprecated and may go away
        return None
    return ShardedTensor


def whole_state_dict_planner():
    """A load planner that loads everything a DCP checkpoint holds into an empty state dict (``dcp.load({}, ...)``),
    as torch's own ``dcp_to_torch_save`` does; the state dict is then the planner's ``original_state_dict``."""
    return _EmptyStateDictLoadPlanner()


def functional_collectives():
    """torch's functional collectives module (``torch.distributed._functional_collectives``), which the wire
    counter of ``dcp_zarr.testing`` counts beside the c10d ones."""
    import torch.distributed._functional_collectives as funcol

    return funcol
