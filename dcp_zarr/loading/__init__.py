"""One load, as ``ZarrReader`` runs it: the DCP metadata a store presents (``metadata.py``), the root read once and
broadcast (``root_once.py``), and a rank's reads, each rank for itself or shared over the process group
(``rank_reads.py``); ``settings.py`` holds what the reader was made with. Implementation: import from ``dcp_zarr``,
not from here.
"""
