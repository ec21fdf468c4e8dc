"""dcp_zarr: torch.distributed.checkpoint storage in Zarr v3 stores.

    dcp.save(state_dict, storage_writer=ZarrWriter("ckpt.zarr"))  # planned on every rank, O(1) bytes on the wire
    dcp.load(state_dict, storage_reader=ZarrReader("ckpt.zarr"))  # at any world size, any mesh
    dcp.load(state_dict, storage_reader=ZarrReader("ckpt.zarr"), planner=ZarrLoadPlanner())  # any optimizer key form
    open_checkpoint("ckpt.zarr").load_full_state_dict()  # offline, no process group
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from dcp_zarr import errors
from dcp_zarr.errors import (
    CheckpointExistsError,
    CorruptChunkError,
    IncompleteCheckpointError,
    NotACheckpointError,
    ZarrCheckpointError,
)
from dcp_zarr.version import __version__

# The rest is imported on first use (PEP 562): zarr imports dcp_zarr.format.zarr_dtypes, and so this package, whenever
# it opens a bfloat16 array, and the CLI only looks at stores; neither should pay for importing torch.
_LAZY = {
    "assert_step_present": "dcp_zarr.optim.checks",
    "CheckpointManager": "dcp_zarr.lifecycle.manager",
    "SaveReport": "dcp_zarr.lifecycle.save_report",
    "ZarrLoadPlanner": "dcp_zarr.optim.load_planner",
    "ZarrSavePlanner": "dcp_zarr.planning.save_planner",
    "Checkpoint": "dcp_zarr.offline",
    "open_checkpoint": "dcp_zarr.offline",
    "PrefixTolerantLoadPlanner": "dcp_zarr.optim.prefixes",
    "WrapperPrefixLoadMixin": "dcp_zarr.optim.prefixes",
    "strip_wrapper_prefixes": "dcp_zarr.optim.wrapper_names",
    "ZarrReader": "dcp_zarr.reader",
    "RetryPolicy": "dcp_zarr.storage.retry",
    "ZarrWriter": "dcp_zarr.writer",
    "Compression": "dcp_zarr.format.compression",
    "release_staging_memory": "dcp_zarr.staging.pool",
    "set_staging_memory_limit": "dcp_zarr.staging.pool",
    "staging_memory_held": "dcp_zarr.staging.pool",
}

if TYPE_CHECKING:
    from dcp_zarr.format.compression import Compression
    from dcp_zarr.lifecycle.manager import CheckpointManager
    from dcp_zarr.lifecycle.save_report import SaveReport
    from dcp_zarr.offline import Checkpoint, open_checkpoint
    from dcp_zarr.optim.checks import assert_step_present
    from dcp_zarr.optim.load_planner import ZarrLoadPlanner
    from dcp_zarr.optim.prefixes import (
        PrefixTolerantLoadPlanner,
        WrapperPrefixLoadMixin,
        strip_wrapper_prefixes,
    )
    from dcp_zarr.planning.save_planner import ZarrSavePlanner
    from dcp_zarr.reader import ZarrReader
    from dcp_zarr.staging.pool import release_staging_memory, set_staging_memory_limit, staging_memory_held
    from dcp_zarr.storage.retry import RetryPolicy
    from dcp_zarr.writer import ZarrWriter


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None and name in errors.__all__:  # every error lives in dcp_zarr.errors; found here too
        return getattr(errors, name)
    if module is None:  # the public face is __all__; implementation modules are imported by their own names
        raise AttributeError(f"module 'dcp_zarr' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # found once, then an ordinary attribute
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


# The public face, grouped as docs/api.md groups it (tests/project/test_api_reference.py holds the order).
__all__ = [
    # Saving and loading
    "ZarrWriter",
    "ZarrReader",
    "ZarrSavePlanner",
    "ZarrLoadPlanner",
    # Compression
    "Compression",
    # Async saves' staging memory
    "staging_memory_held",
    "release_staging_memory",
    "set_staging_memory_limit",
    # A training job's checkpoints
    "CheckpointManager",
    "SaveReport",
    "assert_step_present",
    # Reading without a process group
    "open_checkpoint",
    "Checkpoint",
    # Names that drift
    "PrefixTolerantLoadPlanner",
    "WrapperPrefixLoadMixin",
    "strip_wrapper_prefixes",
    # Object stores
    "RetryPolicy",
    # The errors users catch most; every error and warning is in dcp_zarr.errors (docs/api.md lists them)
    "ZarrCheckpointError",
    "NotACheckpointError",
    "IncompleteCheckpointError",
    "CheckpointExistsError",
    "CorruptChunkError",
    "__version__",
]
