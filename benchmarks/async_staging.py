"""How long ``dcp.async_save`` blocks training, and the host memory it allocates, save after save, for the line users
write (a new writer per checkpoint) and its peers: against a copy of the same bytes into buffers allocated once.

One process (``no_dist``), a state dict of ``--gib`` GiB of fp32 tensors (16 MiB each), on the CPU; on a GPU the same
kinds run in ``gpu_bench`` with CUDA tensors and pinned buffers. For each kind, ``--saves`` saves one after another
(each waits for the previous future, as training loops do), the state changed in place between them; blocked time is
until ``dcp.async_save`` returns. The process's RSS after each save and dcp_zarr's ``staging_memory_held()`` show
what stays allocated: after the first save the plain line must allocate nothing more.

    python -m benchmarks.async_staging --gib 1 --saves 5

Kinds: ``zarr-plain`` (``ZarrWriter(path)`` new each save: the process's staging pool), ``zarr-no-cache``
(``cache_staged_state_dict=False``: new memory each save), ``fs`` (``FileSystemWriter(path)`` new each save) and
``fs-cache`` (one ``FileSystemWriter(cache_staged_state_dict=True)``, ``checkpoint_id=`` per save).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings

import psutil
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from benchmarks.harness import SCRATCH, table, write_result

KINDS = ("zarr-plain", "zarr-no-cache", "fs", "fs-cache")


def _writer(kind: str, path: str, kept: dict):
    from dcp_zarr import ZarrWriter

    if kind == "zarr-plain":
        return ZarrWriter(path)
    if kind == "zarr-no-cache":
        return ZarrWriter(path, cache_staged_state_dict=False)
    if kind == "fs":
        return FileSystemWriter(path)
    kept.setdefault("fs-cache", FileSystemWriter(path, cache_staged_state_dict=True))
    return kept["fs-cache"]


def measure(kind: str, state: dict, saves: int, work: str) -> dict:
    from dcp_zarr import release_staging_memory, staging_memory_held

    release_staging_memory()
    process, kept, blocked, rss, held = psutil.Process(), {}, [], [], []
    for i in range(saves):
        path = os.path.join(work, f"{kind}-{i}")
        writer = _writer(kind, path, kept)
        start = time.perf_counter()
        future = dcp.async_save(state, storage_writer=writer, checkpoint_id=path, no_dist=True)
        blocked.append(time.perf_counter() - start)
        future.result()
        del future, writer
        rss.append(process.memory_info().rss)
        held.append(staging_memory_held())
        shutil.rmtree(path)
        for tensor in state.values():
            tensor.add_(1)  # training changes the state between saves
    kept.clear()
    release_staging_memory()
    return {"first_blocked_s": blocked[0], "blocked_s": blocked[1:], "median_blocked_s": statistics.median(blocked[1:]),
            "rss_bytes": rss, "rss_growth_after_first_bytes": rss[-1] - rss[0], "staging_held_bytes": held}


def copy_times(state: dict, repeats: int) -> list[float]:
    """A copy of every tensor into buffers allocated once: the least a blocking stage can take."""
    buffers = {name: torch.empty_like(tensor) for name, tensor in state.items()}
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for name, tensor in state.items():
            buffers[name].copy_(tensor)
        times.append(time.perf_counter() - start)
    return times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--target", default=SCRATCH, help="where the checkpoints go (default: tmpfs)")
    parser.add_argument("--out")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    count = max(1, int(args.gib * (1 << 30) / (16 << 20)))
    state = {f"layers.{i}.w": torch.randn(2048, 2048) for i in range(count)}  # 16 MiB each
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    copies = copy_times(state, args.saves)
    copy_s = statistics.median(copies)
    result: dict = {"bytes": nbytes, "saves": args.saves, "copy_times_s": copies, "median_copy_s": copy_s, "kinds": {}}
    rows = [["copy into buffers allocated once", "", f"{copy_s:.3f}", "1.00x", "", ""]]
    work = tempfile.mkdtemp(prefix="async-staging-", dir=args.target)
    try:
        for kind in args.kinds.split(","):
            try:
                m = measure(kind, state, args.saves, work)
            except RuntimeError as exc:  # fs-cache on a machine without CUDA: DCP's cache pins, which needs a GPU
                result["kinds"][kind] = {"not_measured": str(exc).splitlines()[0]}
                rows.append([kind, "not measured", str(exc).splitlines()[0][:60], "", "", ""])
                continue
            m["blocked_vs_copy"] = m["median_blocked_s"] / copy_s
            result["kinds"][kind] = m
            rows.append([kind, f"{m['first_blocked_s']:.3f}", f"{m['median_blocked_s']:.3f}",
                         f"{m['blocked_vs_copy']:.2f}x", f"{m['rss_growth_after_first_bytes'] / 2**20:+.0f}",
                         f"{m['staging_held_bytes'][-1] / 2**20:.0f}"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    head = ["kind", "first save blocked (s)", f"saves 2-{args.saves} blocked, median (s)", "vs copy",
            f"RSS after save {args.saves} - after save 1 (MiB)", "dcp_zarr staging held (MiB)"]
    write_result("async_staging", args.out, result, f"{nbytes / 2**30:.2f} GiB of fp32\n\n" + table(head, rows))


if __name__ == "__main__":
    main()
