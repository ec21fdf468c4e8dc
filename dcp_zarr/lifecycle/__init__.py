"""A training job's checkpoints: ``CheckpointManager`` (one store per step, retention, resume), the root it owns, and
the lease that makes one manager the root's only writer and cleaner. ``CheckpointManager`` is public as
``dcp_zarr.CheckpointManager``; the rest is implementation."""
