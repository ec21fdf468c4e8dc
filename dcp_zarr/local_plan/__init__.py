"""Saves planned on each rank from its own state dict (``ZarrSavePlanner``), with O(1) bytes per rank on the wire.

DCP's own protocol gathers every rank's full plan to the coordinator, deduplicates it there and scatters it back.
Here every rank derives the same global plan from what it already knows (a DTensor's global shape, mesh and
placements give every rank's box), and the process group carries only a digest of each rank's structure:

* ``entries.py``: what one rank holds, as rank-invariant ``Entry`` records, and the digest of them;
* ``layouts.py``: each array's chunk grid, from its placements (the grid DCP's boxes would give, without them);
* ``writers.py``: who writes each replicated box and each array's ``zarr.json``, chosen alike on every rank;
* ``protocol.py``: the messages (a rank's ``Summary``, the coordinator's ``Ticket``) and the checks made on them;
* ``exchange.py``: when digests differ, the one exchange that sends only what differs;
* ``planner.py``: ``ZarrSavePlanner``, which hands the writer its rank's items in place of a plan to gather.
"""
