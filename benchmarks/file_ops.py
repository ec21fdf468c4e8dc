"""Per-file cost of a file system: what a checkpoint of many small tensors pays per tensor.

A zarr store holds one array per tensor: a directory, its zarr.json and a chunk file (``c.0``). DCP's
FileSystemWriter appends every tensor to one file per rank and thread. On a file system where creating a file or a
directory is expensive, that difference, not the writer's code, decides the small-tensor save time.

Each operation is timed twice: into a fresh directory, nothing deleted since the timed runs began (``fresh``), and
right after as many files as the run creates were deleted (``after delete``), as when a benchmark, or a retention
policy, removes the previous checkpoint just before the next save. On ext4 without a journal (this project's
development VM) the second is several times slower: allocating an inode skips, one inode-table lookup each, every
recently deleted one (``recently_deleted`` in ``fs/ext4/ialloc.c``, which runs only when there is no journal).

    python benchmarks/file_ops.py --target /tmp/bench --count 2500
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

PAYLOAD = os.urandom(2048)  # a small tensor's chunk, about 512 float32
METADATA = os.urandom(900)  # about the size of an array's zarr.json


def write_file(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def zarr_array(root: str, i: int) -> None:
    """What ZarrWriter does for one small tensor (store format 3 and later)."""
    node = os.path.join(root, f"small.{i:06d}")
    os.mkdir(node)
    write_file(os.path.join(node, "zarr.json"), METADATA)
    write_file(os.path.join(node, "c.0"), PAYLOAD)


OPERATIONS: dict[str, Callable[[str, int], None]] = {
    "mkdir": lambda root, i: os.mkdir(os.path.join(root, f"d{i}")),
    "create + write 2 KiB": lambda root, i: write_file(os.path.join(root, f"f{i}"), PAYLOAD),
    "one zarr array (mkdir, 2 files)": zarr_array,
}
# Files each operation makes, to delete as many before an "after delete" run.
FILES_PER_OPERATION = {"mkdir": 1, "create + write 2 KiB": 1, "one zarr array (mkdir, 2 files)": 3}


def time_operation(target: str, operation: Callable[[str, int], None], count: int) -> float:
    """Seconds per operation into a new directory, the file system synced before and after (the sync is timed: it
    is part of a save). The directory is left for the caller to remove."""
    root = tempfile.mkdtemp(prefix="file-ops-", dir=target)
    os.sync()
    start = time.perf_counter()
    for i in range(count):
        operation(root, i)
    os.sync()
    return (time.perf_counter() - start) / count


def delete_files(target: str, count: int) -> None:
    """Create ``count`` files, sync, delete them, sync: what removing the previous checkpoint leaves behind."""
    root = tempfile.mkdtemp(prefix="file-ops-deleted-", dir=target)
    for i in range(count):
        write_file(os.path.join(root, f"f{i}"), PAYLOAD)
    os.sync()
    shutil.rmtree(root)
    os.sync()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=tempfile.gettempdir(), help="a directory on the file system to measure")
    parser.add_argument("--count", type=int, default=2500, help="operations per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per operation; the median is shown")
    args = parser.parse_args()
    os.makedirs(args.target, exist_ok=True)
    print(f"{args.target}: {args.count} operations per run, median of {args.repeats} runs; us per operation, "
          "fresh / after delete")
    work = tempfile.mkdtemp(prefix="file-ops-", dir=args.target)
    try:
        fresh = {name: [time_operation(work, operation, args.count) for _ in range(args.repeats)]
                 for name, operation in OPERATIONS.items()}  # nothing deleted until every fresh run is done
        shutil.rmtree(work)
        os.makedirs(work)
        after = {}
        for name, operation in OPERATIONS.items():
            after[name] = []
            for _ in range(args.repeats):
                delete_files(work, args.count * FILES_PER_OPERATION[name])
                after[name].append(time_operation(work, operation, args.count))
        for name in OPERATIONS:
            us = [statistics.median(runs[name]) * 1e6 for runs in (fresh, after)]
            print(f"  {name:36s} {us[0]:9.1f} {us[1]:9.1f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
