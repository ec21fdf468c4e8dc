"""How long a save and a load take to fail against an S3 endpoint that cannot be reached, and what they print.

    python benchmarks/unreachable.py --repeats 3                 # default options
    python benchmarks/unreachable.py --repeats 3 --quick-options # the README's connect_timeout / max_attempts=3

Two endpoints: a refused port on 127.0.0.1 (a socket bound, then closed) and a host that cannot resolve
(``nonexistent.invalid``). Each trial runs in this process (torch and the clients imported once, not timed):
``dcp.save`` of one tensor (no process group) and ``open_checkpoint``. Reported per case: the median time to the
error, the lines written to stderr during the call, and the error's first line. Only the public API is used, so
the same script measures an older checkout (``PYTHONPATH=/path/to/checkout``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import socket
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

QUICK = {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 3}}  # README's "quick answer"


def refused_endpoint() -> str:
    with socket.socket() as s:  # nothing listens on a port just released: connections are refused
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def trial(operation: str, endpoint: str, quick: bool) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from dcp_zarr import ZarrWriter, open_checkpoint

    options = {"endpoint_url": endpoint, "key": "x", "secret": "x"}
    if quick:
        options["config_kwargs"] = dict(QUICK)
    url = f"s3://bench/unreachable-{time.monotonic_ns()}.zarr"
    stderr = io.StringIO()
    start = time.monotonic()
    error = None
    with contextlib.redirect_stderr(stderr):
        try:
            if operation == "save":
                dcp.save({"w": torch.zeros(4)}, storage_writer=ZarrWriter(url, storage_options=options), no_dist=True)
            else:
                open_checkpoint(url, options)
        except (Exception, CheckpointException) as exc:  # the point: what comes out, and when
            error = exc
    elapsed = time.monotonic() - start
    failures = getattr(error, "failures", None)  # dcp.save: a CheckpointException holding each rank's error
    if failures:
        error = next(iter(failures.values()))
        error = error[0] if isinstance(error, tuple) else error
    message = f"{type(error).__name__}: {error}" if error is not None else "no error"
    return {"seconds": elapsed, "stderr_lines": len(stderr.getvalue().splitlines()),
            "error": message.splitlines()[0][:300] if message else ""}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick-options", action="store_true", help="the README's small config_kwargs")
    parser.add_argument("--cases", default="refused,dns", help="comma-separated: refused, dns")
    parser.add_argument("--operations", default="save,load", help="comma-separated: save, load")
    args = parser.parse_args(argv)
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    import warnings

    warnings.filterwarnings("ignore", message=".*torch.distributed is (disabled|unavailable|not initialized).*")
    results = {}
    for case in args.cases.split(","):
        for operation in args.operations.split(","):
            runs = [trial(operation, refused_endpoint() if case == "refused" else "http://nonexistent.invalid:9",
                          args.quick_options) for _ in range(args.repeats)]
            results[f"{operation}/{case}"] = {
                "median_s": round(statistics.median(r["seconds"] for r in runs), 2),
                "samples_s": [round(r["seconds"], 2) for r in runs],
                "stderr_lines": [r["stderr_lines"] for r in runs], "error": runs[-1]["error"]}
            print(json.dumps({f"{operation}/{case}": results[f"{operation}/{case}"]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
