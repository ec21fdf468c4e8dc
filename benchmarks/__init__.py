"""dcp_zarr's benchmarks: run each from the repository root as ``python -m benchmarks.<name>`` or ``torchrun
--nproc-per-node N -m benchmarks.<name>`` (benchmarks/README.md); ``harness`` is what they share."""
