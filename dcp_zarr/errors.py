"""Exceptions raised by dcp_zarr. Each names the path, key or array at fault."""

import pickle

__all__ = [
    "ZarrCheckpointError",
    "NotACheckpointError",
    "IncompleteCheckpointError",
    "CheckpointExistsError",
    "InvalidKeyError",
    "InvalidEntryError",
    "CorruptChunkError",
    "UnsafeFileError",
    "UntrustedTypeError",
    "UntrustedTypeWarning",
    "MalformedMetadataError",
    "MetadataTooLargeError",
    "ReplicaMismatchError",
    "MissingKeysError",
    "ParamTableMismatchError",
    "OptimizerStepError",
    "TorchNotImportableError",
    "TorchRequiredError",
    "CheckpointRootBusyError",
    "StepNotFoundError",
    "WrapperPrefixError",
    "UnsupportedDtypeError",
    "ObjectStoreError",
    "ConversionError",
    "PlanMismatchError",
    "CollectiveIOError",
    "UnsupportedModeError",
    "FrameworkNotInstalledError",
    "FrameworkVersionError",
    "SharedPlannerError",
    "UnverifiedTorchWarning",
    "IncrementalBaseError",
    "IncrementalSaveWarning",
]


class ZarrCheckpointError(Exception):
    """Base class of every error dcp_zarr raises on purpose."""


class NotACheckpointError(ZarrCheckpointError):
    """The path holds no dcp_zarr checkpoint (missing, foreign, or not a zarr store)."""


class IncompleteCheckpointError(NotACheckpointError):
    """The store was started but never committed: a save was interrupted or is still running."""


class CheckpointExistsError(ZarrCheckpointError, FileExistsError):
    """Saving would replace an existing checkpoint and the writer was not told to."""


class InvalidKeyError(ZarrCheckpointError, ValueError):
    """A state-dict key cannot be stored safely (it would escape the store or collide)."""


class InvalidEntryError(ZarrCheckpointError, ValueError):
    """A state-dict value cannot be stored (unsupported tensor kind, dtype or layout)."""


class CorruptChunkError(ZarrCheckpointError):
    """A stored chunk fails its checksum, is truncated, or is missing."""


class UnsafeFileError(CorruptChunkError):
    """A file of the store is a symbolic link, FIFO, device or directory where a regular file belongs; never read."""


class UntrustedTypeError(ZarrCheckpointError, pickle.UnpicklingError):
    """A non-tensor value, stored as ``torch.save`` bytes, holds a type that ``torch.load(weights_only=True)`` does
    not trust or cannot import here. Pass the types you trust as ``safe_globals``."""


class UntrustedTypeWarning(UserWarning):
    """At save: a non-tensor value can only be stored as ``torch.save`` bytes that will need ``safe_globals`` to
    load."""


class MalformedMetadataError(ZarrCheckpointError, ValueError):
    """The store's metadata (zarr.json or the dcp_zarr manifest) is not what this version writes."""


class MetadataTooLargeError(MalformedMetadataError):
    """A metadata document is larger than the limit set for it; it is refused before parsing."""


class ReplicaMismatchError(ZarrCheckpointError, ValueError):
    """Several ranks hold different values, shapes or dtypes under one state-dict key; the save is refused."""


class MissingKeysError(ZarrCheckpointError, RuntimeError):
    """Requested state-dict keys have no counterpart in the checkpoint; the message lists them and the fix."""


class ParamTableMismatchError(ZarrCheckpointError, ValueError):
    """The loading optimizer's parameters do not match the checkpoint's param table (count, groups or shapes)."""


class OptimizerStepError(ZarrCheckpointError, AssertionError):
    """``assert_step_present`` found a parameter whose optimizer ``step`` is missing or disagrees."""


class TorchNotImportableError(ZarrCheckpointError, ImportError):
    """Something that needs torch (decoding ``torch.save`` bytes, making tensors) was asked for where torch cannot be
    imported; the torch-free readers (``read_array``, ``inspect``, ``verify``, ``diff``) still work there."""


class TorchRequiredError(ZarrCheckpointError, ImportError):
    """A DCP part of dcp_zarr (the writer, the reader, the planners, ``CheckpointManager``, the adapters) was imported
    where torch is missing or older than the floor (``dcp_zarr.torch_floor``): torch is not an install requirement of
    dcp-zarr, so that installing it never replaces a node's own torch build."""


class CheckpointRootBusyError(ZarrCheckpointError, RuntimeError):
    """Another live ``CheckpointManager`` holds the checkpoint root (its lease is fresh)."""


class StepNotFoundError(ZarrCheckpointError, FileNotFoundError):
    """``CheckpointManager.load`` asked for a step (or the latest) that has no complete checkpoint under the root."""


class WrapperPrefixError(ZarrCheckpointError, RuntimeError):
    """State-dict names and checkpoint names differ only by module-wrapper components."""


class UnsupportedDtypeError(ZarrCheckpointError, TypeError):
    """A torch dtype (or zarr data type name) that dcp_zarr cannot store bit-exactly."""


class ObjectStoreError(ZarrCheckpointError, OSError):
    """An object-store call failed permanently (or kept failing transiently); ``__cause__`` is the client's error."""

    def __str__(self) -> str:
        # The message alone: OSError's "[Errno 5] ..." prefix says nothing (the errno is a stand-in for most faults).
        return self.strerror if isinstance(self.strerror, str) else super().__str__()


class ConversionError(ZarrCheckpointError, ValueError):
    """A conversion that cannot be done as asked (wrong source or target kind, unsupported entries)."""


class PlanMismatchError(ZarrCheckpointError, ValueError):
    """Ranks that cannot be planned together: disagreeing entries under one key, a planner on another group, or ranks
    naming different checkpoints."""


class CollectiveIOError(ZarrCheckpointError, RuntimeError):
    """Another rank failed during a save's or load's collective I/O (its own error says why), so this one stopped."""


class UnsupportedModeError(ZarrCheckpointError, ValueError):
    """A DCP mode that ZarrWriter or ZarrReader cannot honour (``use_collectives=False``); refused before anything is
    written, on every rank, with the reason and what to use instead."""


class FrameworkNotInstalledError(ZarrCheckpointError, ImportError):
    """An adapter of ``dcp_zarr.integrations`` was imported without the framework it adapts installed."""


class FrameworkVersionError(ZarrCheckpointError, RuntimeError):
    """The installed framework no longer has the internals an adapter of ``dcp_zarr.integrations`` relies on; the
    message names the framework's version and the one the adapter was written against."""


class SharedPlannerError(ZarrCheckpointError, RuntimeError):
    """One planner object given to two ``dcp.save`` (or ``dcp.load``) calls running at once, in two threads: DCP
    keeps a call's state dict on its planner, so the calls would mix their state. Give each call its own planner."""


class UnverifiedTorchWarning(UserWarning):
    """The installed torch keeps a ``dcp.save``'s or ``dcp.load``'s planner and process group elsewhere than the
    releases dcp_zarr was verified on: the save or load follows DCP's own protocol, correct and slower. Once a
    process for saves and once for loads."""


class IncrementalBaseError(ZarrCheckpointError, ValueError):
    """An incremental save's ``incremental_from`` cannot serve: not a complete checkpoint, the save's own path,
    on other storage, or of another format version. Raised before anything is written."""


class IncrementalSaveWarning(UserWarning):
    """An incremental save that stores more than it would: the earlier checkpoint records no chunks, or its chunks
    cannot be linked (another file system, a store that cannot copy on its side) and are copied through the process
    instead. The new checkpoint is complete either way."""
