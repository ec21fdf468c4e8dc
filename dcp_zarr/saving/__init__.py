"""One save, as ``ZarrWriter`` runs it: an object made at the save's first callback and dropped with it.

``LocallyPlannedSave`` (``locally_planned.py``): DCP's own planner taken over, or ``ZarrSavePlanner``; each rank
plans its part (planning/local_save.py) and the messages are digests (planning/protocol.py). ``DcpPlannedSave``
(``dcp_planned.py``): a planner that plans for itself; DCP's global plan is turned into nodes and chunk layouts
(planning/dcp_plans.py). Both write through ``item_writes.py`` (store_io/write_jobs.py builds the jobs) and commit
through ``committing.py``; ``settings.py`` holds what the writer was made with. Implementation: import from
``dcp_zarr``, not from here.
"""
