"""dcp_zarr's benchmarks, each run as ``python -m benchmarks.<name>`` (benchmarks/README.md); ``harness`` and
``writers`` are shared."""
