"""dcp_zarr: torch.distributed.checkpoint storage in Zarr v3 stores.

    dcp.save(state_dict, storage_writer=ZarrWriter("ckpt.zarr"))
    dcp.load(state_dict, storage_reader=ZarrReader("ckpt.zarr"))
    dcp.load(state_dict, storage_reader=ZarrReader("ckpt.zarr"), planner=ZarrLoadPlanner())  # any optimizer key form
    open_checkpoint("ckpt.zarr").load_full_state_dict()  # offline, no process group
"""

from dcp_zarr.checks import assert_step_present
from dcp_zarr.errors import (
    CheckpointExistsError,
    CorruptChunkError,
    IncompleteCheckpointError,
    InvalidEntryError,
    InvalidKeyError,
    MalformedMetadataError,
    MetadataTooLargeError,
    MissingKeysError,
    NotACheckpointError,
    OptimizerStepError,
    ParamTableMismatchError,
    ReplicaMismatchError,
    UnsafeFileError,
    ZarrCheckpointError,
)
from dcp_zarr.load_planner import ZarrLoadPlanner
from dcp_zarr.offline import Checkpoint, open_checkpoint
from dcp_zarr.prefixes import (
    PrefixTolerantLoadPlanner,
    WrapperPrefixError,
    WrapperPrefixLoadMixin,
    strip_wrapper_prefixes,
)
from dcp_zarr.reader import ZarrReader
from dcp_zarr.storage.retry import ObjectStoreError, RetryPolicy
from dcp_zarr.version import __version__
from dcp_zarr.writer import ZarrWriter

__all__ = [
    "ZarrWriter",
    "ZarrReader",
    "ZarrLoadPlanner",
    "assert_step_present",
    "open_checkpoint",
    "Checkpoint",
    "PrefixTolerantLoadPlanner",
    "WrapperPrefixLoadMixin",
    "strip_wrapper_prefixes",
    "WrapperPrefixError",
    "ZarrCheckpointError",
    "NotACheckpointError",
    "IncompleteCheckpointError",
    "CheckpointExistsError",
    "InvalidKeyError",
    "InvalidEntryError",
    "CorruptChunkError",
    "MalformedMetadataError",
    "MetadataTooLargeError",
    "ObjectStoreError",
    "RetryPolicy",
    "MissingKeysError",
    "ParamTableMismatchError",
    "ReplicaMismatchError",
    "UnsafeFileError",
    "OptimizerStepError",
    "__version__",
]
