"""The measurements: every repeat's saves, loads, async save and small-tensor save; peak memory; resharded loads.

Each rank runs the same sequence (every timed region is collective); rank 0 owns the directories.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ckpt_dist import Runtime, all_ranks_true, broadcast_from_rank0, gather
from ckpt_measure import PeakRssSampler, RankTimes, read_chars, timed_async_save, timed_region
from ckpt_model import (
    ModelConfig,
    build_sharded_state_dict,
    fill_zeros,
    global_bytes,
    has_nonzero,
    local_bytes,
    locally_equal,
    small_tensor_state_dict,
    tensor_leaves,
    zeroed_copy,
)
from ckpt_report import async_entry, compute_ratios, memory_entry, timing_entry
from ckpt_storage import DCP_KINDS, WRITER_KINDS, make_planner, make_reader, make_writer, write_raw_shards

SAVED_CONFIG = "bench_config.json"  # written by --save-only next to the checkpoints


STARTED = time.perf_counter()


def log(rt: Runtime, message: str) -> None:
    if rt.rank == 0:
        print(f"[checkpoint_throughput {time.perf_counter() - STARTED:6.1f}s] {message}", flush=True)


class Workspace:
    """A run directory under the target: rank 0 makes and removes it and its per-measurement sub-directories."""

    def __init__(self, target: str | None, rank: int):
        self.rank = rank
        root = target or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        if rank == 0:
            os.makedirs(root, exist_ok=True)
        path = tempfile.mkdtemp(prefix="ckpt-bench-", dir=root) if rank == 0 else None
        self.path = broadcast_from_rank0(path)

    def fresh(self, name: str, make: bool = False) -> str:
        path = os.path.join(self.path, name)
        if make and self.rank == 0:
            os.makedirs(path)
        return path  # the next timed region's barrier orders mkdir before use

    def remove(self, path: str) -> None:
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        self.remove(self.path)


def footprint(path: str) -> dict[str, int]:
    """Files, directories (the checkpoint's own included) and file bytes under ``path``: file-system metadata work
    that tmpfs hides and a disk or network file system charges for."""
    files = directories = size = 0
    for directory, _, names in os.walk(path):
        directories += 1
        files += len(names)
        size += sum(os.path.getsize(os.path.join(directory, name)) for name in names)
    return {"files": files, "directories": directories, "bytes": size}


def evict_page_cache(path: str) -> None:
    """Ask the kernel to drop the files' clean pages (no root needed; a no-op on tmpfs)."""
    for directory, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class Benchmark:
    def __init__(
        self,
        args: argparse.Namespace,
        rt: Runtime,
        workspace: Workspace,
        model_config: ModelConfig,
        state_dict: dict[str, Any],
    ):
        self.args, self.rt, self.ws = args, rt, workspace
        self.model_config = model_config
        self.state_dict = state_dict
        self.rank_bytes = gather(local_bytes(state_dict))
        self.total_bytes = global_bytes(state_dict)
        self.runs: dict[str, list[RankTimes]] = {}
        self.checks: dict[str, bool] = {}
        self.footprint: dict[str, dict[str, int]] = {}  # rank 0 only
        self.async_writer = None

    def record(self, name: str, times: RankTimes) -> None:
        self.runs.setdefault(name, []).append(times)

    def check(self, name: str, passed: bool) -> None:
        self.checks[name] = self.checks.get(name, True) and all_ranks_true(passed)

    def note_footprint(self, name: str, path: str) -> None:
        if self.rt.rank == 0 and name not in self.footprint:
            self.footprint[name] = footprint(path)

    def kinds_in_turn(self, kinds: tuple[str, ...], repeat: int) -> list[str]:
        # Rotate the order so no kind always runs first (cold allocator, cache, CPU frequency).
        shift = repeat % len(kinds)
        return list(kinds[shift:] + kinds[:shift])

    def save(self, kind: str, state_dict: dict[str, Any], path: str) -> None:
        if kind == "raw":
            write_raw_shards(state_dict, os.path.join(path, f"rank{self.rt.rank}.bin"), self.args.threads)
        else:
            dcp.save(state_dict, storage_writer=make_writer(kind, path, self.args.threads), planner=make_planner(kind))

    def load(self, kind: str, state_dict: dict[str, Any], path: str) -> None:
        dcp.load(state_dict, storage_reader=make_reader(kind, path, self.args.threads))

    def prepare_load(self, target: dict[str, Any], path: str) -> None:
        fill_zeros(target)
        if self.args.evict_cache:
            if self.rt.rank == 0:
                evict_page_cache(path)
            dist.barrier()

    def run_save_load(self, repeat: int, target: dict[str, Any]) -> None:
        for kind in self.kinds_in_turn(self.args.kinds, repeat):
            path = self.ws.fresh(f"{kind}-r{repeat}", make=kind == "raw")
            times, _ = timed_region(lambda: self.save(kind, self.state_dict, path), self.rt.device)
            self.record(f"save/{kind}", times)
            self.note_footprint(f"save/{kind}", path)
            if kind in DCP_KINDS:
                self.prepare_load(target, path)
                times, _ = timed_region(lambda: self.load(kind, target, path), self.rt.device)
                self.record(f"load/{kind}", times)
                self.check(f"load/{kind} equals saved", locally_equal(target, self.state_dict))
            self.ws.remove(path)

    def run_async(self, repeat: int, target: dict[str, Any]) -> None:
        path = self.ws.fresh(f"async-zarr-r{repeat}")
        # One writer for every repeat, as a training loop would keep it: it is also the stager, and with
        # cache_staged_state_dict it copies into the buffers it staged into last time (pinned ones for CUDA tensors)
        # instead of allocating new ones. --no-staging-cache measures a new writer (new buffers) each time.
        if self.async_writer is None or self.args.no_staging_cache:
            cache = not self.args.no_staging_cache
            self.async_writer = make_writer("zarr", path, self.args.threads, cache_staged_state_dict=cache)
        blocking, total = timed_async_save(
            lambda: dcp.async_save(self.state_dict, storage_writer=self.async_writer, checkpoint_id=path,
                                   planner=make_planner("zarr")),
            self.rt.device,
        )
        self.record("async/zarr blocking", blocking)
        self.record("async/zarr", total)
        if repeat == 0:  # untimed: the async checkpoint must load back equal too
            self.prepare_load(target, path)
            self.load("zarr", target, path)
            self.check("async/zarr loads equal", locally_equal(target, self.state_dict))
        self.ws.remove(path)

    def run_small(self, repeat: int, small: dict[str, torch.Tensor]) -> None:
        for kind in self.kinds_in_turn(tuple(k for k in self.args.kinds if k in DCP_KINDS), repeat):
            path = self.ws.fresh(f"small-{kind}-r{repeat}")
            times, _ = timed_region(lambda: self.save(kind, small, path), self.rt.device)
            self.record(f"small/{kind}", times)
            self.note_footprint(f"small/{kind}", path)
            self.ws.remove(path)

    def measure_memory(self) -> dict[str, Any]:
        memory = {}
        for kind in self.args.kinds:
            path = self.ws.fresh(f"memory-{kind}", make=kind == "raw")
            sampler = PeakRssSampler()

            def sampled_save() -> None:
                with sampler:
                    self.save(kind, self.state_dict, path)

            timed_region(sampled_save, self.rt.device)
            memory[f"save/{kind}"] = memory_entry(gather(sampler.extra_bytes), self.rank_bytes)
            self.ws.remove(path)
        return memory

    def run_reshard(self, source: str) -> dict[str, Any]:
        """Load a --save-only checkpoint (any world size) with each reader; record time and bytes read."""
        saved = json.loads(Path(source, SAVED_CONFIG).read_text())
        cfg = ModelConfig(**saved["model"])
        same = cfg == self.model_config
        state_dict = self.state_dict if same else build_sharded_state_dict(cfg, self.rt.mesh, self.rt.device)
        kinds = [k for k in self.args.kinds if k in DCP_KINDS]
        missing = [k for k in kinds if k not in saved["kinds"]]
        if missing:
            raise SystemExit(f"--reshard-from {source} has no checkpoint for kinds {missing} (it has {saved['kinds']})")
        targets = {kind: zeroed_copy(state_dict) for kind in kinds}
        needed = gather(local_bytes(state_dict))
        read: dict[str, list[list[int]]] = {kind: [] for kind in kinds}
        runs: dict[str, list[RankTimes]] = {kind: [] for kind in kinds}
        for repeat in range(-self.args.warmup, self.args.repeats):
            for kind in self.kinds_in_turn(tuple(kinds), repeat):
                path = os.path.join(source, kind)
                self.prepare_load(targets[kind], path)

                def load_counting_reads(kind=kind, path=path) -> int:
                    before = read_chars()
                    self.load(kind, targets[kind], path)
                    return read_chars() - before

                times, read_bytes = timed_region(load_counting_reads, self.rt.device)
                if repeat >= 0:
                    runs[kind].append(times)
                    read[kind].append(gather(read_bytes))
        if {"zarr", "fs"} <= set(kinds):
            self.check("reshard/zarr equals reshard/fs", locally_equal(targets["zarr"], targets["fs"]))
        self.check("reshard loads are not all zeros", all(has_nonzero(target) for target in targets.values()))
        entries = {}
        for kind in kinds:
            entry = timing_entry(global_bytes(state_dict), needed, runs[kind])
            per_rank_read = [statistics.median_low(r[rank] for r in read[kind]) for rank in range(self.rt.world_size)]
            entry.update(
                saved_world_size=saved["world_size"],
                rank_read_bytes=per_rank_read,
                rank_needed_bytes=needed,
                rank_read_amplification=[r / max(1, n) for r, n in zip(per_rank_read, needed)],
            )
            entries[f"reshard/{kind}"] = entry
        return entries

    def run(self) -> dict[str, Any]:
        args = self.args
        target = zeroed_copy(self.state_dict)
        small = None
        small_rank_bytes: list[int] = []
        if args.small_tensors > 0:
            small = small_tensor_state_dict(args.small_tensors, self.rt.rank, self.rt.world_size, self.rt.device)
            small_rank_bytes = gather(local_bytes(small))
        # Repeat -1 is the warm-up: first-use costs (tmpfs pages, imports, thread pools) land there, not on
        # whichever kind happens to run first. Its times are dropped.
        for repeat in range(-args.warmup, args.repeats):
            self.run_save_load(repeat, target)
            if "zarr" in args.kinds:
                self.run_async(repeat, target)
            if small is not None:
                self.run_small(repeat, small)
            log(self.rt, "warm-up done" if repeat < 0 else f"repeat {repeat + 1}/{args.repeats} done")
        if self.async_writer is not None:
            self.async_writer.close()  # its staging copy of the state dict
        if args.warmup:
            self.runs = {name: runs[args.warmup:] for name, runs in self.runs.items()}
        del target

        measurements: dict[str, Any] = {}
        for name, runs in self.runs.items():
            if name == "async/zarr blocking":
                continue
            if name == "async/zarr":
                measurements[name] = async_entry(
                    self.total_bytes, self.rank_bytes, self.runs["async/zarr blocking"], runs
                )
            elif name.startswith("small/"):
                measurements[name] = timing_entry(sum(small_rank_bytes), small_rank_bytes, runs)
            else:
                measurements[name] = timing_entry(self.total_bytes, self.rank_bytes, runs)
        memory = self.measure_memory()
        if args.reshard_from:
            measurements.update(self.run_reshard(args.reshard_from))
        measurements = dict(sorted(measurements.items(), key=lambda item: measurement_order(item[0])))
        state = {
            "total_bytes": self.total_bytes,
            "rank_bytes": self.rank_bytes,
            "tensors": sum(1 for _ in tensor_leaves(self.state_dict)),
        }
        if small is not None:
            state.update(small_tensors=args.small_tensors, small_total_bytes=sum(small_rank_bytes))
        return {
            "state_dict": state,
            "measurements": measurements,
            "ratios": compute_ratios(measurements),
            "memory": memory,
            "footprint": dict(sorted(self.footprint.items(), key=lambda item: measurement_order(item[0]))),
            "checks": self.checks,
        }


def measurement_order(name: str) -> tuple[int, int]:
    """save, load, async, small, reshard; within each: zarr, fs, raw."""
    operation, kind = name.split("/", 1)
    return ("save", "load", "async", "small", "reshard").index(operation), WRITER_KINDS.index(kind)
