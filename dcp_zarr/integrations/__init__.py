"""Adapters for the training frameworks people save and load with: one module per framework, each optional.

* ``dcp_zarr.integrations.torchtitan``: ``ZarrCheckpointManager``, chosen in torchtitan's config
  (``checkpoint=ZarrCheckpointManager.Config(...)``).
* ``dcp_zarr.integrations.lightning``: ``ZarrModelParallelStrategy``, ``ZarrFSDPStrategy`` for
  ``Trainer(strategy=...)``; ``ZarrFabricModelParallelStrategy``, ``ZarrFabricFSDPStrategy`` for
  ``Fabric(strategy=...)``.
* ``dcp_zarr.integrations.accelerate``: ``ZarrAccelerator``, whose ``save_state`` / ``load_state`` of FSDP2 models go
  through dcp_zarr.

Importing ``dcp_zarr`` (or this package) imports no framework; importing an adapter without its framework raises
``FrameworkNotInstalledError`` naming the package to install, and an adapter whose framework changed the internals
it relies on raises ``FrameworkVersionError`` naming both versions (``framework.py``).
The three adapter modules are public (docs/api.md); ``framework.py`` is their implementation.
"""
