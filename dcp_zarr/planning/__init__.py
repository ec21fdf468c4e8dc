"""Planning a save. Locally on every rank (``ZarrSavePlanner``: ``save_planner``, ``local_save``, the ``protocol``
DCP carries, the ``exchange`` when ranks differ), or by DCP's coordinator (``dcp_plans``); the checks that
replicated entries agree (``replicas``); a load's read items (``load_plan``); and everything read or set inside DCP
(``dcp_internals``). Implementation: import from ``dcp_zarr``."""
