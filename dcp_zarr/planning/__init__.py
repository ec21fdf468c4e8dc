"""Planning a save. Locally on every rank (``ZarrSavePlanner``: ``save_planner``; the writer's side in
``rank_planning``: the rank's part gathered once, ``rank_part``, its replicas' checksums, ``replica_sums``, the
``protocol`` DCP carries, the ``exchange`` when ranks differ, and the plan as a value, ``write_plan``, kept in
``recent_plans``), or by DCP's coordinator (``assignments``); the checks that replicated entries agree
(``replicas``); a load's read items (``load_plan``); and everything read or set inside DCP (``dcp_internals``).
Implementation: import from ``dcp_zarr``."""
