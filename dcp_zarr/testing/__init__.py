"""Fixtures shipped for dcp_zarr's tests and benchmarks, as zarr ships ``zarr.testing``: one module each, among them
the loopback S3 server (``s3_server``), the FSDP, HSDP and DDP layouts of a state dict (``shardings``), a counter of
what torch's collectives carry (``wire``) and the contract every ``Storage`` backend meets (``storage_contract``).
The library itself never imports this package, and its modules need the test extras (moto, pytest) only where they
use them.
Implementation, but for ``storage_contract`` (the contract a backend author runs, docs/api.md): the
fixtures carry no promise to other users.
"""
