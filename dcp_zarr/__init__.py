"""dcp_zarr: torch.distributed.checkpoint storage in Zarr v3 stores.

    dcp.save(state_dict, storage_writer=ZarrWriter("ckpt.zarr"))
    dcp.load(state_dict, storage_reader=ZarrReader("ckpt.zarr"))
"""

from dcp_zarr.errors import (
    CheckpointExistsError,
    CorruptChunkError,
    IncompleteCheckpointError,
    InvalidEntryError,
    InvalidKeyError,
    MalformedMetadataError,
    NotACheckpointError,
    ZarrCheckpointError,
)
from dcp_zarr.reader import ZarrReader
from dcp_zarr.version import __version__
from dcp_zarr.writer import ZarrWriter

__all__ = [
    "ZarrWriter",
    "ZarrReader",
    "ZarrCheckpointError",
    "NotACheckpointError",
    "IncompleteCheckpointError",
    "CheckpointExistsError",
    "InvalidKeyError",
    "InvalidEntryError",
    "CorruptChunkError",
    "MalformedMetadataError",
    "__version__",
]
