"""A checkpoint store's bytes through ``storage/``: chunks cut from and read into arrays (``chunks``), one manifest
entry's data, checked (``entry_data``), the root document (``root_document``), the commit that makes a staged store
the checkpoint (``commit``), and the thread pool that runs I/O jobs (``scheduler``). Implementation: import from
``dcp_zarr``, not from here."""
