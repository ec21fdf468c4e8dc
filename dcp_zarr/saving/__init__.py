"""One save, as ``ZarrWriter`` runs it: an object made at the save's first callback and dropped with it.

``save.py``: ``Save``, the interface the writer speaks to. Its two kinds: ``LocallyPlannedSave``
(``locally_planned_save.py``: DCP's own planner taken over, or ``ZarrSavePlanner``; each rank plans its part,
planning/rank_planning.py, and the messages are digests, planning/protocol.py) and ``DcpPlannedSave``
(``dcp_planned_save.py``: a planner that plans for itself; DCP's global plan is turned into nodes and chunk layouts,
planning/assignments.py). Both write through ``item_writes.py`` (store_io/write_jobs.py builds the jobs) and begin
and end in ``coordinator.py`` (the staging area; the replicas compared, the manifest's entries, the commit);
``settings.py`` holds what the writer was made with. Implementation: import from ``dcp_zarr``, not from here.
"""
