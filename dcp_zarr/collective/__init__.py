"""Collective I/O: few large requests, every byte through storage once.

ROMIO's two-phase I/O in the terms of a checkpoint. On a save, the small pieces many ranks hold of an array travel
over the process group to one rank, its aggregator, which writes the array (or each large block of it) as one object;
on a load, a region several ranks need (replicas, or small pieces of one object) is read by one rank and sent to the
others. Every rank decides alike, from what every rank knows, who moves what:

* ``rounds.py``: units of work (a block to aggregate, a region to read), each owned by one rank, packed into
  rounds that bound the bytes a rank holds at once;
* ``transfer.py``: the messages of a round, point to point, each with a status, so that a rank that failed makes
  every rank fail instead of leaving one waiting;
* ``aggregation.py``: which arrays a save aggregates, their blocks, and who sends which part to whom;
* ``aggregated_writes.py``: the writer's side of an aggregated save (the parts sent, the blocks written);
* ``needs.py`` and ``shared_reads.py``: what each rank of a load needs, derived rather than sent, and the reads
  done once. Implementation: nothing here is imported by users."""
