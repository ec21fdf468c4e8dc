"""Which rank holds which box: the one vocabulary the save planner, collective I/O and the reader share. What a rank
holds of each key (``holdings``: kind, dtype, shape, and a DTensor's mesh and placements), a DTensor's box at a
mesh coordinate in arithmetic (``boxes``), chunk grids from placements (``chunk_grids``), and who writes each
box and each array's ``zarr.json``, however the save was planned (``box_writers``).
Implementation: import from ``dcp_zarr``."""
