"""The GPU check's measurements (benchmarks/gpu_check.sh runs them; what they are: benchmarks/README.md, "GPU check").

The state dict's tensors are DTensors on the 1-device mesh; raw I/O is saves only (device-to-host copy, ``os.pwrite``,
fsync). Each measurement's peak GPU memory and host RSS are beyond those just before it (the RSS sampled every 5 ms).
The result is rewritten after every step: a run stopped at its limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import math
import os
import shutil
import statistics
import tempfile
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from benchmarks import harness as h
from benchmarks import writers

SCHEMA, MIB = "gpu_check/2", 1 << 20  # 2: async measures the plain line and its peers
# zarr: ZarrWriter with ZarrSavePlanner; zarr-plain: dcp.save(sd, storage_writer=ZarrWriter(p)), the line users write
KINDS, LOADED = ("zarr", "zarr-plain", "fs", "raw"), ("zarr", "zarr-plain", "fs")
# The targets of issue 26, reported as met or not; a run fails only on errors.
SAVE_VS_FS, SAVE_VS_RAW, LOAD_VS_FS, ASYNC_VS_COPY = 1.5, 0.8, 1.5, 1.2
ASYNC_PEERS = ("zarr-one-writer", "fs", "fs-cache")
STARTED = time.perf_counter()


def log(message: str) -> None:
    print(f"[gpu_bench {time.perf_counter() - STARTED:6.1f}s] {message}", flush=True)


def state_layout(total_bytes: int, hidden: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of a state dict of at least ``total_bytes``: two large fp32 tensors (a quarter of it),
    an embedding, then transformer layers (bf16 weights, fp32 ``exp_avg`` of each, fp32 norms) until it is full."""
    rows, vocab = max(1, math.ceil(total_bytes / 8 / (4 * hidden))), 8 * hidden
    layout = [(f"extra.big.{i}", (rows, hidden), torch.float32) for i in range(2)] + [
        ("model.embed.weight", (vocab, hidden), torch.bfloat16),
        ("optim.embed.weight.exp_avg", (vocab, hidden), torch.float32)]
    weights = {"qkv": (3 * hidden, hidden), "proj": (hidden, hidden), "up": (4 * hidden, hidden),
               "down": (hidden, 4 * hidden)}
    so_far = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in layout)
    for layer in range(max(1, math.ceil((total_bytes - so_far) / (12 * hidden * hidden * 6 + 8 * hidden)))):
        for name, shape in weights.items():
            layout += [(f"model.layers.{layer}.{name}.weight", shape, torch.bfloat16),
                       (f"optim.layers.{layer}.{name}.weight.exp_avg", shape, torch.float32)]
        layout += [(f"model.layers.{layer}.{n}.weight", (hidden,), torch.float32) for n in ("attn_norm", "mlp_norm")]
    return layout


class Peaks:
    """Peak host RSS and GPU memory of one operation, each beyond what was in use just before it. The RSS is sampled
    in a thread every 5 ms, coarse so that it costs the timed code nothing measurable (it competes for the GIL)."""

    def __init__(self, device: torch.device, interval_s: float = 0.005):
        import psutil

        self.device, self.process, self.interval_s = device, psutil.Process(), interval_s
        self.stop, self.thread = threading.Event(), threading.Thread(target=self._sample, daemon=True)
        self.rss_before = self.rss_peak = self.gpu_before = 0
        self.gpu_extra_bytes: int | None = None

    def _sample(self) -> None:
        while not self.stop.wait(self.interval_s):
            self.rss_peak = max(self.rss_peak, self.process.memory_info().rss)

    def __enter__(self) -> Peaks:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.gpu_before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        gc.collect()
        with contextlib.suppress(OSError, AttributeError):  # glibc's free heap back to the OS: a clean baseline
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.rss_before = self.rss_peak = self.process.memory_info().rss
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.rss_peak = max(self.rss_peak, self.process.memory_info().rss)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.gpu_extra_bytes = torch.cuda.max_memory_allocated(self.device) - self.gpu_before


def measurement(nbytes: int, times: list[float], peaks: list[Peaks]) -> dict:
    gpu = [p.gpu_extra_bytes for p in peaks if p.gpu_extra_bytes is not None]
    return {"bytes": nbytes, **h.speed(times, nbytes),  # RSS: beyond the RSS before each repeat; GPU: None without CUDA
            "peak_rss_extra_bytes": max(max(0, p.rss_peak - p.rss_before) for p in peaks),
            "peak_gpu_extra_bytes": max(gpu) if gpu else None}


class GpuBench:
    def __init__(self, args: argparse.Namespace, ranks: h.Ranks):
        self.args, self.ranks, self.result, self.failures = args, ranks, {}, []
        self.deadline = STARTED + args.budget_s

    def step(self, name: str, fn, catch: bool = True) -> Any:
        """Run one step, timed; on an error (``catch``) note it and go on: one lent GPU slot measures all it can."""
        started = time.perf_counter()
        log(f"{name} ...")
        try:
            value = fn()
        except Exception as exc:
            if not catch:
                raise
            traceback.print_exc()
            self.failures.append(f"{name} failed: {type(exc).__name__}: {exc}")
            value = None
        self.result.setdefault("steps", []).append({"name": name, "elapsed_s": time.perf_counter() - started})
        self.write()
        return value

    def write(self) -> None:
        if "state" in self.result:
            self.result.update(elapsed_s=time.perf_counter() - STARTED, failures=self.failures)
            out = Path(self.args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "gpu_check.json").write_text(json.dumps(self.result, indent=2) + "\n")
            (out / "gpu_check.md").write_text(to_markdown(self.result))

    def timed(self, times: dict[tuple[str, str], list], key: tuple[str, str], fn) -> None:
        with Peaks(self.ranks.device) as peaks:
            seconds = h.timed(fn, self.ranks.device)[0]
        times.setdefault(key, []).append((seconds, peaks))

    def measure_target(self, name: str, directory: str, state: dict, target: dict) -> dict[str, Any]:
        """Every kind's saves and loads on one file system, in rotating order, one checkpoint at a time; the first
        load of each kind is checked equal to the saved state. A target without room for a checkpoint is skipped."""
        need = int(self.result["state"]["bytes"] * 1.25)
        try:
            os.makedirs(directory, exist_ok=True)
            free = shutil.disk_usage(directory).free
            if free < need:
                return {"directory": directory, "skipped": f"{directory} has {free / 1e9:.1f} GB free, needs "
                                                           f"{need / 1e9:.1f} GB"}
        except OSError as exc:
            return {"directory": directory, "skipped": f"{directory} is not usable: {exc}"}
        evict, threads = name != "shm" and not self.args.no_evict, self.args.threads
        times, equal, done = {}, True, 0  # times: (op, kind) -> (seconds, Peaks) of each repeat
        with tempfile.TemporaryDirectory(prefix="gpu-check-", dir=directory) as work:
            for repeat in range(self.args.repeats):
                if repeat and time.perf_counter() > self.deadline:
                    log(f"{name}: over --budget-s {self.args.budget_s:.0f}, {repeat} of {self.args.repeats} repeats")
                    break
                for kind in h.rotated(KINDS, repeat):
                    path = os.path.join(work, f"{kind}-{repeat}")
                    self.timed(times, ("save", kind), lambda: writers.save(kind, state, path, threads))
                    if kind in LOADED:
                        h.fill_zeros(target)
                        if evict:  # a disk load that hits the page cache measures memory, not the disk
                            h.evict_page_cache(path)
                        self.timed(times, ("load", kind), lambda: writers.load(kind, target, path, threads))
                        equal = equal and (repeat > 0 or h.equal(target, state))
                    shutil.rmtree(path)
                done += 1
        entry: dict[str, Any] = {"directory": directory, "evicted_before_loads": evict, "repeats": done,
                                 "loads_equal": equal, "save": {}, "load": {}}
        for (op, kind), runs in times.items():
            entry[op][kind] = measurement(self.result["state"]["bytes"], [t for t, _ in runs], [p for _, p in runs])
        return entry

    def measure_async(self, directory: str, state: dict, target: dict) -> dict[str, Any]:
        """``dcp.async_save`` blocked time, the first save apart, against a device-to-pinned copy into buffers
        allocated once: the plain line (a new ZarrWriter each save: the process's staging pool, pinned for CUDA
        tensors), and beside it one ZarrWriter for every save, DCP's FileSystemWriter new each save, and one
        FileSystemWriter keeping its staging buffers (``cache_staged_state_dict=True``). Host memory dcp_zarr keeps
        between saves is read after the plain line's saves (``staging_memory_held``)."""
        from dcp_zarr import release_staging_memory, staging_memory_held

        with tempfile.TemporaryDirectory(prefix="gpu-check-async-", dir=directory, ignore_cleanup_errors=True) as work:
            release_staging_memory()
            plain, peaks, equal = self._async_saves("zarr-plain", work, state, target)
            held = staging_memory_held()
            release_staging_memory()
            peers = {}
            for kind in ASYNC_PEERS:
                try:
                    peers[kind] = self._async_saves(kind, work, state, None)[0]
                except Exception as exc:  # noqa: BLE001 - a peer that fails here is reported, not fatal
                    peers[kind] = {"failed": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
                release_staging_memory()
        cuda = self.ranks.device.type == "cuda"  # a plain copy of every tensor into buffers allocated once
        sources = [h.local(t) for t in h.leaves(state)]
        buffers = [torch.empty(s.shape, dtype=s.dtype, pin_memory=cuda) for s in sources]
        copies = [h.timed(lambda: [b.copy_(s, non_blocking=cuda) for b, s in zip(buffers, sources)],
                          self.ranks.device)[0] for _ in range(self.args.repeats)]
        buffers.clear()
        copy_s = statistics.median(copies)
        for runs in [plain, *peers.values()]:
            if "median_blocking_s" in runs:
                runs["blocking_vs_copy"] = runs["median_blocking_s"] / copy_s
        m = measurement(self.result["state"]["bytes"], plain["total_times_s"], peaks or [Peaks(torch.device("cpu"))])
        return {"target": directory, "bytes": m["bytes"], "pinned": cuda, **plain, "copy_times_s": copies,
                "median_copy_s": copy_s, "copy_gbps": m["bytes"] / copy_s / h.GB, "staging_held_bytes": held,
                "peak_rss_extra_bytes": m["peak_rss_extra_bytes"] if peaks else 0,
                "peak_gpu_extra_bytes": m["peak_gpu_extra_bytes"], "loads_equal": equal, "peers": peers}

    def _async_saves(self, kind: str, work: str, state: dict, target: dict | None) -> tuple[dict, list, bool]:
        """``--repeats`` + 1 async saves of ``kind``, each waited for; the first one's store loaded into ``target``
        and compared (where given)."""
        from dcp_zarr import ZarrWriter

        one = {"zarr-one-writer": lambda p: ZarrWriter(p, thread_count=self.args.threads),
               "fs-cache": lambda p: FileSystemWriter(p, cache_staged_state_dict=True)}.get(kind)
        kept = one(os.path.join(work, f"{kind}-first")) if one else None
        blocking, total, peaks, equal = [], [], [], False
        for repeat in range(self.args.repeats + 1):
            if repeat > 1 and time.perf_counter() > self.deadline:
                log(f"async {kind}: over --budget-s, {repeat - 1} of {self.args.repeats} repeats")
                break
            path = os.path.join(work, f"{kind}-r{repeat}")
            writer = kept or (ZarrWriter(path, thread_count=self.args.threads) if kind.startswith("zarr")
                              else FileSystemWriter(path))
            with Peaks(self.ranks.device) as p:
                b, t = h.timed_async(lambda: dcp.async_save(state, storage_writer=writer, checkpoint_id=path),
                                     self.ranks.device)
            blocking.append(b)
            total.append(t)
            if repeat:
                peaks.append(p)  # the first save's peaks include allocating the staging buffers
            elif target is not None:
                h.fill_zeros(target)
                writers.load("zarr", target, path, self.args.threads)
                equal = h.equal(target, state)
            shutil.rmtree(path)
        later, later_total = blocking[1:] or blocking, total[1:] or total
        return {"first_blocking_s": blocking[0], "first_total_s": total[0], "blocking_times_s": later,
                "total_times_s": later_total, "median_blocking_s": statistics.median(later),
                "median_total_s": statistics.median(later_total)}, peaks, equal

    def run(self) -> dict[str, Any]:
        from torch.distributed.tensor import DTensor, Shard

        from dcp_zarr.format.chunk_layout import INNER_CHUNK_TARGET_BYTES

        device, cuda = self.ranks.device, self.ranks.device.type == "cuda"
        generator = torch.Generator(device=device).manual_seed(0)
        state: dict[str, Any] = self.step("build the state dict", lambda: {"step": 100, **{
            name: DTensor.from_local(torch.randn(shape, generator=generator, device=device, dtype=dtype),
                                     self.ranks.mesh, [Shard(0)], run_check=False)
            for name, shape, dtype in state_layout(int(self.args.size_gb * 1e9), self.args.hidden)}}, catch=False)
        target = self.step("allocate the load target", lambda: h.zeroed(state), catch=False)
        tensors, by_dtype = h.leaves(state), Counter[str]()
        for t in tensors:
            by_dtype[str(t.dtype).removeprefix("torch.")] += h.local_bytes(t)
        s = h.stamp()
        self.result.update(
            schema=SCHEMA, dry_run=self.args.dry_run, stamp=s, date=s["date"], torch=torch.__version__,
            commit=s["commit"] + (" with uncommitted changes" if s["dirty"] else ""),
            cuda=torch.version.cuda if cuda else None,
            device=torch.cuda.get_device_name(device) if cuda else f"CPU ({os.cpu_count()} cores)",
            python=s["python"], zarr=s["zarr"], backend="cpu:gloo,cuda:nccl" if cuda else "gloo",
            threads=self.args.threads, repeats=self.args.repeats, state={
                "bytes": sum(by_dtype.values()), "tensors": len(tensors), "bytes_by_dtype": dict(by_dtype),
                "largest_bytes": max(map(h.local_bytes, tensors))},
            # the GPU-memory target: what the IO threads may hold on the device at once, one inner chunk each
            gpu_bound_bytes=self.args.threads * INNER_CHUNK_TARGET_BYTES, targets={}, ratios={}, targets_met={},
            **{"async": None})
        log(f"state dict: {self.result['state']['bytes'] / 1e9:.2f} GB in {len(tensors)} tensors")
        for name, directory in (("shm", self.args.shm_dir), ("disk", self.args.disk_dir)):
            entry = self.step(f"save and load on {name} ({directory})", lambda: self.measure_target(
                name, directory, state, target))
            self.result["targets"][name] = entry or {"directory": directory, "failed": self.failures[-1]}
            self.result["ratios"][name] = {
                "save_zarr_vs_fs": ratio(entry, "save", "fs"), "save_zarr_fraction_of_raw": ratio(entry, "save", "raw"),
                "load_zarr_vs_fs": ratio(entry, "load", "fs"),
                "save_plain_vs_fs": ratio(entry, "save", "fs", "zarr-plain"),
                "save_plain_vs_planned": ratio(entry, "save", "zarr", "zarr-plain")}
        measured = [t["directory"] for t in self.result["targets"].values() if "save" in t]
        if measured:
            self.result["async"] = self.step("async save", lambda: self.measure_async(measured[0], state, target))
        zarr_gpu = [t["save"]["zarr"]["peak_gpu_extra_bytes"] for t in self.result["targets"].values()
                    if "zarr" in t.get("save", {})]
        self.result["targets_met"] = targets_met(self.result, max(zarr_gpu) if zarr_gpu and None not in zarr_gpu
                                                 and cuda else None)
        self.write()
        if self.failures:
            raise SystemExit("gpu_bench: " + "; ".join(self.failures) + f" (what was measured is in {self.args.out})")
        validate_result(self.result)
        return self.result


def ratio(entry: dict | None, op: str, peer: str, kind: str = "zarr") -> float | None:
    """time(peer) / time(kind): above 1, ``kind`` is faster."""
    found = (entry or {}).get(op, {})
    return found[peer]["median_s"] / found[kind]["median_s"] if peer in found and kind in found else None


def targets_met(result: dict, gpu_extra: int | None) -> dict[str, bool | None]:
    """Each target of issue 26: True, False, or None where it was not measured (a skipped target, no CUDA)."""
    def at_least(value, bound):  # None where either was not measured
        return None if value is None or bound is None else value >= bound

    met: dict[str, bool | None] = {}
    for name, r in result["ratios"].items():
        met[f"{name}: save >= {SAVE_VS_FS}x FileSystemWriter"] = at_least(r["save_zarr_vs_fs"], SAVE_VS_FS)
        met[f"{name}: save >= {SAVE_VS_RAW}x raw"] = at_least(r["save_zarr_fraction_of_raw"], SAVE_VS_RAW)
        met[f"{name}: load >= {LOAD_VS_FS}x FileSystemReader"] = at_least(r["load_zarr_vs_fs"], LOAD_VS_FS)
        met[f"{name}: plain line save >= {SAVE_VS_FS}x FileSystemWriter"] = at_least(r["save_plain_vs_fs"], SAVE_VS_FS)
    blocked = result["async"]["blocking_vs_copy"] if result["async"] else None
    met[f"async, the plain line: blocked <= {ASYNC_VS_COPY}x device-to-pinned copy"] = at_least(ASYNC_VS_COPY, blocked)
    met["zarr: GPU memory beyond the state dict <= one inner chunk per IO thread"] = at_least(
        result["gpu_bound_bytes"], gpu_extra)
    return met


def to_markdown(result: dict) -> str:
    def mib(value):
        return "n/a" if value is None else f"{value / MIB:,.0f}"

    def cells(entry):
        return ["", "", "", ""] if not entry else [f"{entry['median_s']:.3f}", f"{entry['gbps']:.2f}", mib(
            entry["peak_gpu_extra_bytes"]), mib(entry["peak_rss_extra_bytes"])]

    state, rows = result["state"], []
    for name, target in result.get("targets", {}).items():
        if "save" not in target:
            rows.append([name, f"skipped: {target['skipped']}" if target.get("skipped") else
                         f"failed: {target.get('failed')}", *[""] * 8])
        for kind in KINDS if "save" in target else ():
            save, load = cells(target["save"].get(kind)), cells(target["load"].get(kind))
            rows.append([name, kind, save[0], save[1], load[0], load[1], save[2], save[3], load[2], load[3]])
    lines = [f"# GPU check{' (dry run on CPU: sizes and timings mean nothing)' if result['dry_run'] else ''}", "",
             f"commit {result['commit']}, {result['date']}, torch {result['torch']}, CUDA {result['cuda']}, "
             f"{result['device']}, zarr {result['zarr']}, Python {result['python']}; backend {result['backend']}, "
             f"world size 1, {result['threads']} IO threads, medians of {result['repeats']}", "",
             f"State dict: {state['bytes'] / h.GB:.2f} GB in {state['tensors']} tensors (" + ", ".join(
                 f"{dtype} {nbytes / h.GB:.2f} GB" for dtype, nbytes in state["bytes_by_dtype"].items()) + ").", "",
             h.table(["target", "kind", "save s", "save GB/s", "load s", "load GB/s", "save GPU extra MiB",
                      "save RSS extra MiB", "load GPU extra MiB", "load RSS extra MiB"], rows), "",
             h.table(["target", "save zarr vs fs", "save zarr / raw", "load zarr vs fs", "save plain vs fs",
                      "save plain vs planned"], [[name, *[
                 "n/a" if v is None else f"{v:.2f}x" for v in r.values()]] for name, r in result["ratios"].items()])]
    if a := result.get("async"):
        lines += ["", f"`dcp.async_save(sd, storage_writer=ZarrWriter(path))`, a new writer each save, to "
                  f"{a['target']}: blocked {a['median_blocking_s']:.3f} s, total {a['median_total_s']:.3f} s (first "
                  f"save, allocating the staging buffers: {a['first_blocking_s']:.3f} s / {a['first_total_s']:.3f} "
                  f"s); a plain device-to-pinned copy of the same bytes {a['median_copy_s']:.3f} s "
                  f"({a['copy_gbps']:.2f} GB/s): blocked = {a['blocking_vs_copy']:.2f}x the copy; host memory kept "
                  f"between saves {mib(a['staging_held_bytes'])} MiB; GPU extra {mib(a['peak_gpu_extra_bytes'])} "
                  f"MiB, RSS extra {mib(a['peak_rss_extra_bytes'])} MiB.", "",
                  h.table(["async peer", "first save blocked s", "later saves blocked s", "vs copy"], [
                      [kind, "failed", r["failed"], ""] if "failed" in r else
                      [kind, f"{r['first_blocking_s']:.3f}", f"{r['median_blocking_s']:.3f}",
                       f"{r['blocking_vs_copy']:.2f}x"] for kind, r in a["peers"].items()])]
    lines += ["", f"Targets (issue 26){' (a dry run judges nothing)' if result['dry_run'] else ''}:", ""]
    lines += [f"- {name}: {'not measured' if met is None else 'met' if met else 'NOT met'}"
              for name, met in result.get("targets_met", {}).items()]
    lines += [f"- FAILED: {failure}" for failure in result.get("failures", [])]
    lines += ["", f"Elapsed {result['elapsed_s']:.1f} s: " + ", ".join(
        f"{step['name']} {step['elapsed_s']:.1f} s" for step in result["steps"]) + "."]
    return "\n".join(lines) + "\n"


def validate_result(result: dict) -> None:
    """Raise ValueError naming the first field that is missing or wrong; every timing finite and > 0."""
    def times(where: str, values) -> None:
        if not values or not all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in values):
            raise ValueError(f"{where}: expected finite positive times, got {values!r}")

    missing = [k for k in ("schema", "dry_run", "commit", "date", "torch", "cuda", "device", "python", "zarr",
                           "backend", "threads", "repeats", "state", "targets", "async", "ratios", "targets_met",
                           "steps", "elapsed_s") if k not in result]
    if missing or result["schema"] != SCHEMA or result.get("failures"):
        raise ValueError(f"result: missing {missing}, schema {result.get('schema')!r}, failures "
                         f"{result.get('failures')}")
    cuda, measured = result["backend"] != "gloo", 0
    for name, target in result["targets"].items():
        for op, kinds in (() if target.get("skipped") else (("save", KINDS), ("load", LOADED))):
            for kind in kinds:
                where, entry = f"targets.{name}.{op}.{kind}", target.get(op, {}).get(kind)
                if entry is None:
                    raise ValueError(f"{where}: missing")
                times(where, entry["times_s"] + [entry["median_s"], entry["gbps"]])
                rss, gpu = entry["peak_rss_extra_bytes"], entry["peak_gpu_extra_bytes"]
                if not (isinstance(entry["bytes"], int) and entry["bytes"] > 0 and isinstance(rss, int) and rss >= 0):
                    raise ValueError(f"{where}: bytes {entry['bytes']!r}, peak_rss_extra_bytes {rss!r}")
                if cuda != isinstance(gpu, int) or (cuda and gpu < 0):
                    raise ValueError(f"{where}.peak_gpu_extra_bytes: expected {'an int >= 0' if cuda else 'None'}, "
                                     f"got {gpu!r}")
                measured += 1
        if not target.get("skipped") and target.get("loads_equal") is not True:
            raise ValueError(f"targets.{name}.loads_equal: a load did not give back the saved state")
    if not measured:
        raise ValueError("targets: every target was skipped, nothing was measured")
    if (a := result["async"]) is not None:
        for key in ("blocking_times_s", "total_times_s", "copy_times_s"):
            times(f"async.{key}", a.get(key))
        if a.get("loads_equal") is not True:
            raise ValueError("async.loads_equal: the async checkpoint did not load back equal")
    times("steps", [step["elapsed_s"] for step in result["steps"]] + [result["elapsed_s"]])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU and gloo, 32 MB, 1 repeat: tests this script")
    p.add_argument("--out", default=str(h.RESULTS / "gpu"), help="result directory")
    p.add_argument("--size-gb", type=float, help="state dict size (default 8.0; 0.032 with --dry-run)")
    p.add_argument("--hidden", type=int, help="model width (default 4096; 256 with --dry-run)")
    p.add_argument("--repeats", type=int, help="repeats per measurement (default 3; 1 with --dry-run)")
    p.add_argument("--threads", type=int, default=8, help="IO threads of every writer and reader")
    p.add_argument("--shm-dir", default="/dev/shm", help="the tmpfs target")
    p.add_argument("--disk-dir", default=tempfile.gettempdir(), help="the local-disk target")
    p.add_argument("--no-evict", action="store_true", help="keep the disk checkpoint's pages cached before loads")
    p.add_argument("--budget-s", type=float, default=300.0, help="start no repeat after this (the device's limit: 600)")
    p.add_argument("--layout-only", action="store_true", help="print the state dict's layout as JSON and exit")
    p.add_argument("--check", nargs="+", metavar="FILE", help="check these results' schema and exit (1 if any fails)")
    args = p.parse_args(argv)
    for key, dry_run, full in (("size_gb", 0.032, 8.0), ("hidden", 256, 4096), ("repeats", 1, 3)):
        setattr(args, key, getattr(args, key) or (dry_run if args.dry_run else full))
    if args.check:
        failed = 0
        for path in args.check:
            try:
                validate_result(json.loads(Path(path).read_text()))
                print(f"{path}: valid")
            except (ValueError, KeyError, TypeError) as exc:
                failed = 1
                print(f"{path}: invalid: {exc!r}")
        raise SystemExit(failed)
    if args.layout_only:
        print(json.dumps([[name, list(shape), str(dtype)] for name, shape, dtype in state_layout(
            int(args.size_gb * 1e9), args.hidden)]))
        return
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("gpu_bench: torch.cuda.is_available() is False; on a machine without CUDA use --dry-run")
    h.on_ranks("gpu_bench", args.out, lambda ranks: run(args, ranks), "gloo" if args.dry_run else "nccl")


def run(args: argparse.Namespace, ranks: h.Ranks) -> None:
    """The whole check; its result files are GpuBench's own (rewritten after every step), not the harness's."""
    if ranks.world_size != 1:
        raise SystemExit(f"gpu_bench runs at world size 1 (no torchrun); WORLD_SIZE is {ranks.world_size}")
    result = GpuBench(args, ranks).run()
    log(f"wrote {args.out}/gpu_check.json and gpu_check.md")
    print(to_markdown(result), flush=True)


if __name__ == "__main__":
    main()
