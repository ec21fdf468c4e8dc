"""Optimizer state across key forms: the param-id tables the manifest records, the load planner that translates between
FQN, int-id and flattened keys, wrapper-prefix tolerance, and the step checks. The public names (``ZarrLoadPlanner``,
...) are in ``dcp_zarr``; the rest is implementation."""
