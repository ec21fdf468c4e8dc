"""The on-disk format: how a state dict maps onto a Zarr v3 store (layout, chunk bytes, data types, the manifest, non-
tensor values). Nothing here talks to a process group; the specification is docs/format.md. Implementation: the
public names are in ``dcp_zarr``."""
