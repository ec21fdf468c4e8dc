"""The GPU check's measurements (benchmarks/gpu_check.sh runs it; see benchmarks/README.md).

World size 1 with NCCL (``cpu:gloo,cuda:nccl``, so that ``dcp.async_save`` has its CPU backend): a state dict of
``--size-gb`` (bf16 weights and fp32 optimizer state in a transformer's shapes, and two large fp32 tensors), as
DTensors on the 1-device mesh, saved and loaded through ZarrWriter/ZarrReader, FileSystemWriter/Reader and a raw
write of the same bytes (device-to-host copy, os.pwrite, fsync), on /dev/shm and on local disk, medians of
``--repeats``; then ``dcp.async_save`` with ``ZarrWriter(cache_staged_state_dict=True)`` against a plain
device-to-pinned copy of the same bytes. Each measurement notes its peak GPU memory beyond what was allocated before
it (``torch.cuda.max_memory_allocated``) and its peak host RSS beyond the RSS before it (sampled every 5 ms: a coarse
sampler, so that it costs the timed code nothing measurable). ``--dry-run``: the same on CPU with gloo, 32 MB.

The result (JSON and Markdown) is rewritten after every step, so a run stopped at its time limit leaves what it had.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from ckpt_dist import Runtime, exit_without_interpreter_teardown, init_distributed, shutdown, synchronize
from ckpt_measure import PeakRssSampler, timed_async_save, timed_region
from ckpt_model import fill_zeros, local_view, locally_equal, tensor_leaves, zeroed_copy
from ckpt_runs import evict_page_cache
from ckpt_storage import (  # noqa: E402
    DCP_KINDS,
    WRITER_KINDS,
    make_planner,
    make_reader,
    make_writer,
    require_dcp_zarr,
    write_raw_shards,
)
from gpu_report import SCHEMA, measurement, target_ratios, targets_met, to_markdown, validate_result
from torch.distributed.tensor import DTensor, Shard

REPO_ROOT = Path(__file__).resolve().parents[1]
STARTED = time.perf_counter()
RSS_INTERVAL_S = 0.005
DISK_SPACE_MARGIN = 1.25  # one checkpoint at a time lives on a target, and some room is left beside it


def log(message: str) -> None:
    print(f"[gpu_bench {time.perf_counter() - STARTED:6.1f}s] {message}", flush=True)


# --- the state dict -------------------------------------------------------------------------------------------------


def state_layout(total_bytes: int, hidden: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of a state dict of at least ``total_bytes``: two large fp32 tensors (a quarter of it),
    an embedding, then transformer layers (bf16 weights, fp32 ``exp_avg`` of each, fp32 norms) until it is full."""
    layout: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    big_rows = max(1, math.ceil(total_bytes / 8 / (4 * hidden)))
    layout += [(f"extra.big.{i}", (big_rows, hidden), torch.float32) for i in range(2)]
    vocab = 8 * hidden
    layout += [("model.embed.weight", (vocab, hidden), torch.bfloat16),
               ("optim.embed.weight.exp_avg", (vocab, hidden), torch.float32)]
    weights = {"qkv": (3 * hidden, hidden), "proj": (hidden, hidden), "up": (4 * hidden, hidden),
               "down": (hidden, 4 * hidden)}
    per_layer = 12 * hidden * hidden * (2 + 4) + 2 * hidden * 4
    so_far = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in layout)
    for layer in range(max(1, math.ceil((total_bytes - so_far) / per_layer))):
        for name, shape in weights.items():
            layout.append((f"model.layers.{layer}.{name}.weight", shape, torch.bfloat16))
            layout.append((f"optim.layers.{layer}.{name}.weight.exp_avg", shape, torch.float32))
        for norm in ("attn_norm", "mlp_norm"):
            layout.append((f"model.layers.{layer}.{norm}.weight", (hidden,), torch.float32))
    return layout


def build_state(layout, rt: Runtime) -> dict[str, Any]:
    """DTensors sharded (Shard(0)) over the 1-device mesh, as FSDP2 gives them, made on the device directly."""
    generator = torch.Generator(device=rt.device).manual_seed(0)
    state: dict[str, Any] = {"step": 100}
    for name, shape, dtype in layout:
        local = torch.randn(shape, generator=generator, device=rt.device, dtype=dtype)
        state[name] = DTensor.from_local(local, rt.mesh, [Shard(0)], run_check=False)
    synchronize(rt.device)
    return state


def state_summary(state: dict[str, Any]) -> dict[str, Any]:
    by_dtype: dict[str, int] = {}
    tensors = list(tensor_leaves(state))
    for t in tensors:
        key = str(t.dtype).removeprefix("torch.")
        by_dtype[key] = by_dtype.get(key, 0) + local_view(t).numel() * t.element_size()
    return {"bytes": sum(by_dtype.values()), "tensors": len(tensors), "bytes_by_dtype": by_dtype,
            "largest_bytes": max(local_view(t).numel() * t.element_size() for t in tensors)}


# --- measuring one operation ----------------------------------------------------------------------------------------


class Peaks:
    """Peak host RSS and GPU memory of one operation, each beyond what was in use just before it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.rss = PeakRssSampler(RSS_INTERVAL_S)
        self.gpu_extra_bytes: int | None = None
        self._gpu_before = 0

    def __enter__(self) -> Peaks:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._gpu_before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.rss.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.rss.__exit__(*exc)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.gpu_extra_bytes = torch.cuda.max_memory_allocated(self.device) - self._gpu_before


def merge_peaks(peaks: list[Peaks]) -> tuple[int, int | None]:
    gpu = [p.gpu_extra_bytes for p in peaks if p.gpu_extra_bytes is not None]
    return max(p.rss.extra_bytes for p in peaks), (max(gpu) if gpu else None)


def timed(fn: Callable[[], Any], rt: Runtime) -> tuple[float, Peaks]:
    with Peaks(rt.device) as peaks:
        times, _ = timed_region(fn, rt.device)
    return times.max_s, peaks


# --- the run --------------------------------------------------------------------------------------------------------


class GpuBench:
    def __init__(self, args: argparse.Namespace, rt: Runtime):
        self.args, self.rt = args, rt
        self.deadline = STARTED + args.budget_s
        self.steps: list[dict[str, Any]] = []
        self.result: dict[str, Any] = {}

    def step(self, name: str, fn: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        log(f"{name} ...")
        value = fn()
        elapsed = time.perf_counter() - started
        self.steps.append({"name": name, "elapsed_s": elapsed})
        log(f"{name}: {elapsed:.1f} s")
        self.write()
        return value

    def over_budget(self) -> bool:
        return time.perf_counter() > self.deadline

    def write(self) -> None:
        if not self.result:
            return
        self.result["steps"] = self.steps
        self.result["elapsed_s"] = time.perf_counter() - STARTED
        out = Path(self.args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.json").write_text(json.dumps(self.result, indent=2) + "\n")
        (out / "gpu_check.md").write_text(to_markdown(self.result))

    def save(self, kind: str, state: dict, path: str) -> None:
        if kind == "raw":
            os.makedirs(path)
            write_raw_shards(state, os.path.join(path, "rank0.bin"), self.args.threads)
        else:
            dcp.save(state, storage_writer=make_writer(kind, path, self.args.threads), planner=make_planner(kind))

    def load(self, kind: str, target: dict, path: str) -> None:
        dcp.load(target, storage_reader=make_reader(kind, path, self.args.threads))

    def measure_target(self, name: str, directory: str, state: dict, target: dict) -> dict[str, Any]:
        """Every kind's saves and the DCP kinds' loads on one file system, in rotating order, one checkpoint at a
        time. The first load of each kind is checked equal to the saved state (untimed)."""
        need = int(self.result["state"]["bytes"] * DISK_SPACE_MARGIN)
        try:
            os.makedirs(directory, exist_ok=True)
            free = shutil.disk_usage(directory).free
        except OSError as exc:
            return {"directory": directory, "skipped": f"{directory} is not usable: {exc}"}
        if free < need:
            return {"directory": directory,
                    "skipped": f"{directory} has {free / 1e9:.1f} GB free, needs {need / 1e9:.1f} GB"}
        workspace = tempfile.mkdtemp(prefix="gpu-check-", dir=directory)
        evict = name != "shm" and not self.args.no_evict
        times: dict[str, list[float]] = {}
        peaks: dict[str, list[Peaks]] = {}
        loads_equal = True
        repeats_done = 0
        try:
            for repeat in range(self.args.repeats):
                if repeat and self.over_budget():
                    log(f"{name}: over --budget-s {self.args.budget_s:.0f}, {repeat} of {self.args.repeats} repeats")
                    break
                shift = repeat % len(WRITER_KINDS)  # no kind always first (cold allocator, caches)
                for kind in WRITER_KINDS[shift:] + WRITER_KINDS[:shift]:
                    path = os.path.join(workspace, f"{kind}-r{repeat}")
                    seconds, p = timed(lambda: self.save(kind, state, path), self.rt)
                    times.setdefault(f"save/{kind}", []).append(seconds)
                    peaks.setdefault(f"save/{kind}", []).append(p)
                    if kind in DCP_KINDS:
                        fill_zeros(target)
                        if evict:  # a disk load that hits the page cache measures memory, not the disk
                            evict_page_cache(path)
                        seconds, p = timed(lambda: self.load(kind, target, path), self.rt)
                        times.setdefault(f"load/{kind}", []).append(seconds)
                        peaks.setdefault(f"load/{kind}", []).append(p)
                        if repeat == 0:
                            loads_equal = loads_equal and locally_equal(target, state)
                    shutil.rmtree(path)
                repeats_done += 1
        finally:
            shutil.rmtree(workspace, ignore_errors=True)
        nbytes = self.result["state"]["bytes"]
        entry: dict[str, Any] = {"directory": directory, "evicted_before_loads": evict, "repeats": repeats_done,
                                 "loads_equal": loads_equal, "save": {}, "load": {}}
        for key, values in times.items():
            op, kind = key.split("/")
            entry[op][kind] = measurement(nbytes, values, *merge_peaks(peaks[key]))
        return entry

    def measure_async(self, directory: str, state: dict, target: dict) -> dict[str, Any]:
        """``dcp.async_save`` with one writer keeping its staging buffers (pinned for CUDA tensors): the first save
        allocates them (reported apart), the repeats copy into them; against a device-to-pinned copy into buffers
        allocated once, untimed."""
        workspace = tempfile.mkdtemp(prefix="gpu-check-async-", dir=directory)
        writer = make_writer("zarr", os.path.join(workspace, "first"), self.args.threads,
                             cache_staged_state_dict=True)
        blocking: list[float] = []
        total: list[float] = []
        peaks: list[Peaks] = []
        loads_equal = False
        try:
            for repeat in range(self.args.repeats + 1):
                if repeat > 1 and self.over_budget():
                    log(f"async: over --budget-s, {repeat - 1} of {self.args.repeats} repeats")
                    break
                path = os.path.join(workspace, f"r{repeat}")
                with Peaks(self.rt.device) as p:
                    b, t = timed_async_save(
                        lambda: dcp.async_save(state, storage_writer=writer, checkpoint_id=path,
                                               planner=make_planner("zarr")), self.rt.device)
                blocking.append(b.max_s)
                total.append(t.max_s)
                if repeat:
                    peaks.append(p)  # the first save's peaks include allocating the staging buffers
                if repeat == 0:
                    fill_zeros(target)
                    self.load("zarr", target, path)
                    loads_equal = locally_equal(target, state)
                shutil.rmtree(path)
        finally:
            writer.close()
            shutil.rmtree(workspace, ignore_errors=True)
        copy_times = self.measure_pinned_copy(state)
        rss, gpu = merge_peaks(peaks) if peaks else (0, None)
        nbytes = self.result["state"]["bytes"]
        # The first save is reported apart: it allocates (and pins) the buffers that the repeats copy into.
        repeat_blocking, repeat_total = blocking[1:] or blocking, total[1:] or total
        median, median_total = statistics.median(repeat_blocking), statistics.median(repeat_total)
        median_copy = statistics.median(copy_times)
        return {
            "target": directory, "bytes": nbytes, "pinned": self.rt.device.type == "cuda",
            "first_blocking_s": blocking[0], "first_total_s": total[0],
            "blocking_times_s": repeat_blocking, "total_times_s": repeat_total,
            "median_blocking_s": median, "median_total_s": median_total,
            "copy_times_s": copy_times, "median_copy_s": median_copy, "copy_gbps": nbytes / median_copy / 1e9,
            "blocking_vs_copy": median / median_copy,
            "peak_rss_extra_bytes": rss, "peak_gpu_extra_bytes": gpu, "loads_equal": loads_equal,
        }

    def measure_pinned_copy(self, state: dict) -> list[float]:
        """A plain copy of every tensor into host buffers allocated once (pinned where there is CUDA to pin for):
        what staging cannot beat."""
        cuda = self.rt.device.type == "cuda"
        sources = [local_view(t) for t in tensor_leaves(state)]
        buffers = [torch.empty(s.shape, dtype=s.dtype, pin_memory=cuda) for s in sources]

        def copy_all() -> None:
            for source, buffer in zip(sources, buffers):
                buffer.copy_(source, non_blocking=cuda)

        times = []
        for _ in range(self.args.repeats):
            times.append(timed_region(copy_all, self.rt.device)[0].max_s)
        buffers.clear()  # the pinned buffers go now, not when the caller's frame does
        return times

    def run(self) -> dict[str, Any]:
        layout = state_layout(int(self.args.size_gb * 1e9), self.args.hidden)
        state = self.step("build the state dict", lambda: build_state(layout, self.rt))
        target = self.step("allocate the load target", lambda: zeroed_copy(state))
        self.result = self.header(state_summary(state))
        log(f"state dict: {self.result['state']['bytes'] / 1e9:.2f} GB in {self.result['state']['tensors']} tensors")
        failures = []
        for name, directory in (("shm", self.args.shm_dir), ("disk", self.args.disk_dir)):
            entry = self.step(f"save and load on {name} ({directory})", lambda: self.attempt(
                failures, name, lambda: self.measure_target(name, directory, state, target)))
            self.result["targets"][name] = entry or {"directory": directory, "failed": failures[-1]}
            self.result["ratios"][name] = target_ratios(self.result["targets"][name])
            self.write()  # now, not after the next step: a run stopped at its time limit keeps this target
        measured = [t["directory"] for t in self.result["targets"].values() if "save" in t]
        if measured:
            self.result["async"] = self.step("async save", lambda: self.attempt(
                failures, "async", lambda: self.measure_async(measured[0], state, target)))
            self.write()
        zarr_gpu = [t["save"]["zarr"]["peak_gpu_extra_bytes"] for t in self.result["targets"].values()
                    if "zarr" in t.get("save", {})]
        gpu_extra = max(zarr_gpu) if zarr_gpu and None not in zarr_gpu else None
        bound = self.result["gpu_bound_bytes"] if self.rt.device.type == "cuda" else None
        self.result["targets_met"] = targets_met(self.result["ratios"], self.result["async"], bound, gpu_extra)
        self.result["failures"] = failures
        self.write()
        if failures:
            raise SystemExit("gpu_bench: " + "; ".join(failures) + f" (what was measured is in {self.args.out})")
        validate_result(self.result)
        return self.result

    def attempt(self, failures: list[str], name: str, fn: Callable[[], Any]) -> Any:
        """Run one step; on an error note it and go on, so that one lent GPU slot measures everything it can."""
        try:
            return fn()
        except Exception as exc:
            traceback.print_exc()
            failures.append(f"{name} failed: {type(exc).__name__}: {exc}")
            return None

    def header(self, state: dict[str, Any]) -> dict[str, Any]:
        import zarr

        from dcp_zarr.format.layout import INNER_CHUNK_TARGET_BYTES

        cuda = self.rt.device.type == "cuda"
        return {
            "schema": SCHEMA, "dry_run": self.args.dry_run, "commit": commit(),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": torch.__version__, "cuda": torch.version.cuda if cuda else None,
            "device": torch.cuda.get_device_name(self.rt.device) if cuda else f"CPU ({os.cpu_count()} cores)",
            "python": platform.python_version(), "zarr": zarr.__version__, "dcp_zarr": require_dcp_zarr(),
            "backend": self.rt.backend if not cuda else "cpu:gloo,cuda:nccl",
            "threads": self.args.threads, "repeats": self.args.repeats, "state": state,
            # The GPU-memory target: what the IO threads may hold on the device at once, one inner chunk each.
            "gpu_bound_bytes": self.args.threads * INNER_CHUNK_TARGET_BYTES,
            "targets": {}, "async": None, "ratios": {}, "targets_met": {},
        }


def commit() -> str:
    """The commit measured: GPU_CHECK_COMMIT (the device machine's copy of the tree has no .git), else git's."""
    if os.environ.get("GPU_CHECK_COMMIT"):
        return os.environ["GPU_CHECK_COMMIT"]
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=REPO_ROOT, capture_output=True,
                             text=True, check=True, timeout=10).stdout.strip()
        if Path(top).resolve() != REPO_ROOT:  # a copy of the tree inside some other repository
            raise OSError(f"{REPO_ROOT} is not a git work tree's root")
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git here: set GPU_CHECK_COMMIT)"
    return f"{head}{' with uncommitted changes' if dirty else ''}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU and gloo, 32 MB, 1 repeat: tests this script")
    p.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "gpu"), help="result directory")
    p.add_argument("--size-gb", type=float, help="state dict size (default 8.0; 0.032 with --dry-run)")
    p.add_argument("--hidden", type=int, help="model width (default 4096; 256 with --dry-run)")
    p.add_argument("--repeats", type=int, help="repeats per measurement (default 3; 1 with --dry-run)")
    p.add_argument("--threads", type=int, default=8, help="IO threads of every writer and reader")
    p.add_argument("--shm-dir", default="/dev/shm", help="the tmpfs target")
    p.add_argument("--disk-dir", default=tempfile.gettempdir(), help="the local-disk target")
    p.add_argument("--no-evict", action="store_true", help="keep the disk checkpoint's pages cached before loads")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="start no further repeat after this many seconds (the device's call limit is 600)")
    args = p.parse_args(argv)
    dry = args.dry_run
    args.size_gb = args.size_gb if args.size_gb is not None else (0.032 if dry else 8.0)
    args.hidden = args.hidden if args.hidden is not None else (256 if dry else 4096)
    args.repeats = args.repeats if args.repeats is not None else (1 if dry else 3)
    if args.repeats < 1 or args.size_gb <= 0 or args.hidden < 1:
        p.error("--repeats, --size-gb and --hidden must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("gpu_bench: torch.cuda.is_available() is False; on a machine without CUDA use --dry-run")
    require_dcp_zarr()
    rt = init_distributed("gloo" if args.dry_run else "nccl")
    if rt.world_size != 1:
        raise SystemExit(f"gpu_bench runs at world size 1 (plain python, no torchrun); WORLD_SIZE is {rt.world_size}")
    try:
        result = GpuBench(args, rt).run()
        log(f"wrote {args.out}/gpu_check.json and gpu_check.md")
        print(to_markdown(result), flush=True)
    finally:
        shutdown()
    exit_without_interpreter_teardown(0)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))  # the project from the working tree, installed or not
    main()
