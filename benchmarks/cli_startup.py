"""Wall time of short ``dcp-zarr`` commands, start-up included: ``--help`` and ``inspect`` of a store.

Each command runs ``--repeats`` times in a fresh ``python -m dcp_zarr`` process, after one untimed run (so the
page cache holds the interpreter, torch and the store alike); the median and the spread are printed. ``--source``
runs the code of another source tree (for example ``git archive COMMIT | tar -x -C DIR``), to compare commits
on the same machine in the same minute.

    python benchmarks/cli_startup.py /tmp/dcp-zarr-demo/step-3.zarr
    python benchmarks/cli_startup.py /tmp/dcp-zarr-demo/step-3.zarr --source /tmp/at-5bbe509 --repeats 9
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def time_command(argv: list[str], env: dict, repeats: int) -> list[float]:
    # Run from a neutral directory: `python -m` puts the working directory first on sys.path, and from a checkout
    # that would be the checkout's dcp_zarr, whatever --source says.
    cwd = tempfile.gettempdir()
    subprocess.run(argv, env=env, cwd=cwd, check=True, capture_output=True)  # untimed: warms the page cache
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(argv, env=env, cwd=cwd, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store", help="a dcp_zarr store to inspect")
    parser.add_argument("--source", default=None, help="source tree whose dcp_zarr to run (default: the installed one)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)

    env = dict(os.environ)
    if args.source:
        env["PYTHONPATH"] = os.path.abspath(args.source)
    where = subprocess.run([sys.executable, "-c", "import dcp_zarr; print(dcp_zarr.__file__)"], env=env,
                           cwd=tempfile.gettempdir(), check=True, capture_output=True, text=True).stdout.strip()
    print(f"dcp_zarr from {where}", file=sys.stderr)
    results = {}
    for name, command in (("--help", ["--help"]), ("inspect", ["inspect", os.path.abspath(args.store)])):
        times = time_command([sys.executable, "-m", "dcp_zarr", *command], env, args.repeats)
        results[name] = {"median_s": round(statistics.median(times), 3), "min_s": round(min(times), 3),
                         "max_s": round(max(times), 3), "repeats": len(times)}
        print(f"{name:8} median {results[name]['median_s']:.3f} s (min {results[name]['min_s']:.3f}, "
              f"max {results[name]['max_s']:.3f}, {len(times)} runs)", file=sys.stderr)
    print(json.dumps({"source": args.source, "dcp_zarr": where, "store": args.store, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
