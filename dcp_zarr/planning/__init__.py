"""Planning a save. Locally on every rank (``ZarrSavePlanner``: ``save_planner``, ``local_save``, the ``protocol``
DCP carries, the ``exchange`` when ranks differ), or by DCP's coordinator (``dcp_plans``, ``plan_cache``); and the
checks that replicated entries agree (``replicas``). Implementation: import from ``dcp_zarr``."""
