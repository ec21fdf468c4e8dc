"""Checkpoint throughput of dcp_zarr against DCP's FileSystemWriter and a raw-write limit.

    torchrun --nproc-per-node 2 benchmarks/checkpoint_throughput.py --quick
    python benchmarks/checkpoint_throughput.py --kinds fs,raw          # world size 1, no torchrun
    torchrun --nproc-per-node 4 benchmarks/checkpoint_throughput.py --save-only /dev/shm/ck
    torchrun --nproc-per-node 2 benchmarks/checkpoint_throughput.py --reshard-from /dev/shm/ck

Every repeat saves the same FSDP2 state dict (model + AdamW state) into a fresh directory with each writer kind and
loads it back into a zeroed state dict of the same sharding (checked equal), then times an async save and a save of
many small tensors. Peak host memory is sampled in one extra, untimed save per kind. Results go to a JSON file (rank 0)
and a PNG. ``validate_result`` (from ckpt_report) checks a result file's schema.

What the numbers mean and miss:
- Times are the slowest rank's, between barriers, medians over repeats. On CUDA the device-to-host copy is included.
- Loads follow their save directly, so on a disk target they read from the page cache unless --evict-cache is given;
  on tmpfs (/dev/shm, the default) everything is memory.
- Read bytes for resharded loads come from /proc/self/io ``rchar``: everything a process read() (page cache included,
  plus a little gloo socket traffic), not what the device delivered; mmap-ed reads are not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Run as a script (torchrun/python), this file's directory is on sys.path, the repository root is not: put it there
# so the working tree's dcp_zarr is the one measured.
REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(1, str(REPO_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from ckpt_dist import Runtime, init_distributed, shutdown  # noqa: E402
from ckpt_measure import PeakRssSampler, RankTimes, read_chars, timed_async_save, timed_region  # noqa: E402
from ckpt_model import (  # noqa: E402
    DTYPES,
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
from ckpt_report import (  # noqa: E402
    SCHEMA_VERSION,
    async_entry,
    compute_ratios,
    memory_entry,
    plot_result,
    summary_lines,
    timing_entry,
    validate_result,
)
from ckpt_storage import DCP_KINDS, make_reader, make_writer, parse_kinds, require_dcp_zarr, write_raw_shards  # noqa: E402

__all__ = ["validate_result", "main"]

QUICK = {"layers": 4, "hidden": 128, "vocab": 2048, "repeats": 2, "small_tensors": 300}  # ~16 MB fp32 state dict
DEFAULTS = {"layers": 8, "hidden": 1024, "vocab": 32000, "repeats": 3, "small_tensors": 5000}  # ~2 GB fp32
SAVED_CONFIG = "bench_config.json"  # written by --save-only next to the checkpoints


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, help=f"transformer blocks (default {DEFAULTS['layers']})")
    p.add_argument("--hidden", type=int, help=f"hidden size (default {DEFAULTS['hidden']})")
    p.add_argument("--vocab", type=int, help=f"vocabulary size (default {DEFAULTS['vocab']})")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="gloo: CPU tensors; nccl: CUDA tensors")
    p.add_argument("--target", help="directory to write checkpoints under (default: a temp dir in /dev/shm or /tmp)")
    p.add_argument("--repeats", type=int, help=f"timed repeats, median reported (default {DEFAULTS['repeats']})")
    p.add_argument("--threads", type=int, default=4, help="thread count given to every writer and reader")
    p.add_argument("--kinds", default="zarr,fs,raw", help="writer kinds to measure (default: all)")
    p.add_argument("--small-tensors", type=int, help=f"N for the small-tensor save, 0 to skip (default {DEFAULTS['small_tensors']})")
    p.add_argument("--evict-cache", action="store_true", help="drop the checkpoint's pages from the page cache before each load")
    p.add_argument("--save-only", metavar="DIR", help="save one checkpoint per DCP kind under DIR for --reshard-from, then exit")
    p.add_argument("--reshard-from", metavar="DIR", help="also time loading the checkpoints of a --save-only run")
    p.add_argument("--quick", action="store_true", help="tiny model, 2 repeats, 300 small tensors")
    p.add_argument("--out", help="result JSON (default benchmarks/results/checkpoint_throughput-<time>.json)")
    p.add_argument("--plot", help="result PNG (default: --out with .png)")
    args = p.parse_args(argv)
    for key, default in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, QUICK[key] if args.quick else default)
    args.kinds = parse_kinds(args.kinds)
    if args.repeats < 1 or args.threads < 1:
        p.error("--repeats and --threads must be >= 1")
    return args


def host_info() -> dict[str, Any]:
    import psutil
    import zarr

    return {
        "cpu_count": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "torch_version": torch.__version__,
        "zarr_version": zarr.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def filesystem_type(path: str) -> str:
    """The mount type holding ``path`` (tmpfs, ext4, ...), from /proc/mounts."""
    best, fstype = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mount_point, kind = line.split()[:3]
                if (path == mount_point or path.startswith(mount_point.rstrip("/") + "/")) and len(mount_point) > len(best):
                    best, fstype = mount_point, kind
    except OSError:
        pass
    return fstype


def gather(value: Any) -> list[Any]:
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def all_ranks_true(flag: bool) -> bool:
    return all(gather(bool(flag)))


def broadcast_from_rank0(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Workspace:
    """A run directory under the target: rank 0 makes and removes it and its per-measurement sub-directories."""

    def __init__(self, target: str | None, rank: int):
        self.rank = rank
        root = target or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
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
    def __init__(self, args: argparse.Namespace, rt: Runtime, workspace: Workspace, state_dict: dict[str, Any]):
        self.args, self.rt, self.ws = args, rt, workspace
        self.state_dict = state_dict
        self.rank_bytes = gather(local_bytes(state_dict))
        self.total_bytes = global_bytes(state_dict)
        self.runs: dict[str, list[RankTimes]] = {}
        self.checks: dict[str, bool] = {}

    def record(self, name: str, times: RankTimes) -> None:
        self.runs.setdefault(name, []).append(times)

    def check(self, name: str, passed: bool) -> None:
        self.checks[name] = self.checks.get(name, True) and all_ranks_true(passed)

    def kinds_in_turn(self, kinds: tuple[str, ...], repeat: int) -> list[str]:
        # Rotate the order so no kind always runs first (cold allocator, cache, CPU frequency).
        shift = repeat % len(kinds)
        return list(kinds[shift:] + kinds[:shift])

    def save(self, kind: str, state_dict: dict[str, Any], path: str) -> None:
        if kind == "raw":
            write_raw_shards(state_dict, os.path.join(path, f"rank{self.rt.rank}.bin"), self.args.threads)
        else:
            dcp.save(state_dict, storage_writer=make_writer(kind, path, self.args.threads))

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
            if kind in DCP_KINDS:
                self.prepare_load(target, path)
                times, _ = timed_region(lambda: self.load(kind, target, path), self.rt.device)
                self.record(f"load/{kind}", times)
                self.check(f"load/{kind} equals saved", locally_equal(target, self.state_dict))
            self.ws.remove(path)

    def run_async(self, repeat: int, target: dict[str, Any]) -> None:
        path = self.ws.fresh(f"async-zarr-r{repeat}")
        writer = lambda: make_writer("zarr", path, self.args.threads)  # noqa: E731
        blocking, total = timed_async_save(
            lambda: dcp.async_save(self.state_dict, storage_writer=writer()), self.rt.device
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
        same = cfg == model_config(self.args)
        state_dict = self.state_dict if same else build_sharded_state_dict(cfg, self.rt.mesh, self.rt.device)
        kinds = [k for k in self.args.kinds if k in DCP_KINDS]
        missing = [k for k in kinds if k not in saved["kinds"]]
        if missing:
            raise SystemExit(f"--reshard-from {source} has no checkpoint for kinds {missing} (it has {saved['kinds']})")
        targets = {kind: zeroed_copy(state_dict) for kind in kinds}
        needed = gather(local_bytes(state_dict))
        read: dict[str, list[list[int]]] = {kind: [] for kind in kinds}
        runs: dict[str, list[RankTimes]] = {kind: [] for kind in kinds}
        for repeat in range(self.args.repeats):
            for kind in self.kinds_in_turn(tuple(kinds), repeat):
                path = os.path.join(source, kind)
                self.prepare_load(targets[kind], path)

                def load_counting_reads(kind=kind, path=path) -> int:
                    before = read_chars()
                    self.load(kind, targets[kind], path)
                    return read_chars() - before

                times, read_bytes = timed_region(load_counting_reads, self.rt.device)
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
        for repeat in range(args.repeats):
            self.run_save_load(repeat, target)
            if "zarr" in args.kinds:
                self.run_async(repeat, target)
            if small is not None:
                self.run_small(repeat, small)
            log(self.rt, f"repeat {repeat + 1}/{args.repeats} done")
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
            "checks": self.checks,
        }


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(layers=args.layers, hidden=args.hidden, vocab=args.vocab, dtype=args.dtype)


def log(rt: Runtime, message: str) -> None:
    if rt.rank == 0:
        print(f"[checkpoint_throughput] {message}", flush=True)


def save_only(args: argparse.Namespace, rt: Runtime, state_dict: dict[str, Any]) -> None:
    kinds = [k for k in args.kinds if k in DCP_KINDS]
    if rt.rank == 0 and os.path.isdir(args.save_only) and os.listdir(args.save_only):
        raise SystemExit(f"--save-only {args.save_only} exists and is not empty")
    dist.barrier()
    for kind in kinds:
        dcp.save(state_dict, storage_writer=make_writer(kind, os.path.join(args.save_only, kind), args.threads))
    if rt.rank == 0:
        saved = {"model": model_config(args).to_json(), "world_size": rt.world_size, "kinds": kinds}
        Path(args.save_only, SAVED_CONFIG).write_text(json.dumps(saved, indent=2) + "\n")
    dist.barrier()
    log(rt, f"saved {', '.join(kinds)} checkpoints at world size {rt.world_size} under {args.save_only}")


def default_out() -> str:
    return str(Path(__file__).resolve().parent / "results" / f"checkpoint_throughput-{time.strftime('%Y%m%d-%H%M%S')}.json")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dcp_zarr_path = require_dcp_zarr() if "zarr" in args.kinds else None  # fail before any rank waits on another
    rt = init_distributed(args.backend)
    try:
        cfg = model_config(args)
        state_dict = build_sharded_state_dict(cfg, rt.mesh, rt.device)
        total = global_bytes(state_dict)
        log(rt, f"model {cfg}: state dict {total / 1e9:.3f} GB ({total / 2**20:.1f} MiB), "
                f"{local_bytes(state_dict) / 2**20:.1f} MiB on rank 0, world size {rt.world_size}")  # fmt: skip
        if args.save_only:
            save_only(args, rt, state_dict)
            return 0

        workspace = Workspace(args.target, rt.rank)
        if rt.rank == 0 and shutil.disk_usage(workspace.path).free < 1.5 * total:
            raise SystemExit(f"{workspace.path} has {shutil.disk_usage(workspace.path).free} bytes free, need ~{1.5 * total:.0f}")
        try:
            result = Benchmark(args, rt, workspace, state_dict).run()
        finally:
            workspace.close()

        if rt.rank != 0:
            return 0 if all(result["checks"].values()) else 3
        result = {
            "schema_version": SCHEMA_VERSION,
            "config": {
                **cfg.to_json(),
                "world_size": rt.world_size,
                "backend": rt.backend,
                "threads": args.threads,
                "repeats": args.repeats,
                "target": workspace.path,
                "target_filesystem": filesystem_type(workspace.path),
                "kinds": list(args.kinds),
                "small_tensors": args.small_tensors,
                "reshard_from": args.reshard_from,
                "evict_cache": args.evict_cache,
                "quick": args.quick,
                "launched_by_torchrun": rt.launched_by_torchrun,
                "dcp_zarr_path": dcp_zarr_path,
                "host": host_info(),
            },
            **result,
        }
        out = Path(args.out or default_out())
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        plot = Path(args.plot or out.with_suffix(".png"))
        plot_result(result, str(plot))
        print("\n".join(summary_lines(result)), flush=True)
        print(f"wrote {out} and {plot}", flush=True)
        validate_result(result)
        return 0 if all(result["checks"].values()) else 3
    finally:
        shutdown()


if __name__ == "__main__":
    sys.exit(main())
