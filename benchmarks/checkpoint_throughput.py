"""Checkpoint throughput of dcp_zarr against DCP's FileSystemWriter/Reader and raw I/O, on an FSDP2 transformer with
AdamW state (2.0 GB in fp32 by default; the kinds and commands: benchmarks/README.md).

Each repeat (after ``--warmup`` untimed ones) saves the state dict with every kind, in rotating order, into a fresh
directory, counts its files and loads it back into a zeroed state dict of the same sharding (checked equal); then
``dcp.async_save`` with one ZarrWriter keeping its staging buffers (``--no-staging-cache``: a new one each time).
``--manager`` also times ``CheckpointManager(keep_last=2).save``, sync and async: the time it holds the caller.
``--reshard-from`` also loads a ``--save-only`` checkpoint of another world size, counting the bytes each rank read()
(``rchar``: page-cache hits included, mmap-ed reads not) against the bytes it needs. Without torchrun: world size 1.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import shutil
import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from benchmarks import harness as h
from benchmarks import writers

QUICK = {"layers": 4, "hidden": 128, "vocab": 2048, "repeats": 2}  # a 16 MB fp32 state dict
DEFAULTS = {"layers": 8, "hidden": 1024, "vocab": 32000, "repeats": 3}  # 2.0 GB
SAVED_CONFIG = "bench_config.json"  # beside a --save-only run's checkpoints


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for key, default in DEFAULTS.items():
        p.add_argument(f"--{key}", type=int, help=f"default {default}; --quick {QUICK[key]}")
    p.add_argument("--target", default=h.SCRATCH, help="directory for the checkpoints (default: tmpfs)")
    p.add_argument("--warmup", type=int, default=1, help="untimed repeats first")
    p.add_argument("--threads", type=int, default=4, help="thread count of every writer and zarr reader")
    p.add_argument("--kinds", default="zarr,fs,raw", help="comma-separated (default zarr,fs,raw)")
    p.add_argument("--evict-cache", action="store_true", help="drop the checkpoint's pages before each load")
    p.add_argument("--save-only", metavar="DIR", help="save one checkpoint per kind under DIR, then exit")
    p.add_argument("--reshard-from", metavar="DIR", help="also time loads of a --save-only run's checkpoints")
    p.add_argument("--no-staging-cache", action="store_true", help="async: a new ZarrWriter for every repeat")
    p.add_argument("--manager", action="store_true", help="also CheckpointManager saves, against bare ones")
    p.add_argument("--quick", action="store_true", help="a 16 MB model, 2 repeats")
    p.add_argument("--out", help="result JSON (default benchmarks/results/checkpoint_throughput.json)")
    args = p.parse_args(argv)
    for key, default in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, QUICK[key] if args.quick else default)
    args.kinds = [k for k in args.kinds.split(",") if k]
    if args.repeats < 1 or args.threads < 1 or args.warmup < 0:
        p.error("--repeats and --threads must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    faulthandler.enable()  # a crash in a native thread (gloo, zarr's IO loop) still shows every Python stack
    h.on_ranks("checkpoint_throughput", args.out, lambda ranks: run(args, ranks))


def run(args: argparse.Namespace, ranks: h.Ranks) -> tuple[dict, str] | None:
    cfg = h.ModelConfig(args.layers, args.hidden, args.vocab)
    state = h.fsdp_model_state(cfg, ranks.mesh, ranks.device)
    # What is alive now lives for the whole run: frozen, the gc.collect() before each timed region costs ms, not 0.25 s
    gc.collect()
    gc.freeze()
    total, rank_bytes = h.global_bytes(state), h.gather(h.local_bytes(state))
    if ranks.rank == 0:
        print(f"{cfg}: {total / 1e9:.3f} GB, {ranks.world_size} ranks", flush=True)
    if args.save_only:
        return save_only(args, ranks, cfg, state)
    if ranks.rank == 0 and shutil.disk_usage(args.target).free < 1.5 * total:
        raise SystemExit(f"{args.target} has {shutil.disk_usage(args.target).free} bytes free, needs {1.5 * total:.0f}")
    root = h.gather(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.target) if ranks.rank == 0 else None)[0]
    try:
        result = Bench(args, ranks, root, state).run(cfg, total, rank_bytes)
    finally:
        dist.barrier()
        if ranks.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    return result, summary(result)


def save_only(args, ranks: h.Ranks, cfg: h.ModelConfig, state) -> None:
    if ranks.rank == 0 and os.path.isdir(args.save_only) and os.listdir(args.save_only):
        raise SystemExit(f"--save-only {args.save_only} exists and is not empty")
    dist.barrier()
    kinds = [k for k in args.kinds if k != "raw"]
    for kind in kinds:
        writers.save(kind, state, os.path.join(args.save_only, kind), args.threads)
    saved = {"model": asdict(cfg), "world_size": ranks.world_size, "kinds": kinds}
    if ranks.rank == 0:
        Path(args.save_only, SAVED_CONFIG).write_text(json.dumps(saved, indent=2) + "\n")
        print(f"saved {', '.join(kinds)} at world size {ranks.world_size} under {args.save_only}", flush=True)


def read_chars() -> int:
    """``rchar`` of /proc/self/io: the bytes this process read() (page-cache hits and a little gloo traffic too)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


class Bench:
    def __init__(self, args, ranks: h.Ranks, root: str, state):
        self.args, self.ranks, self.root, self.state = args, ranks, root, state
        # name -> every repeat's per-rank seconds; check -> passed; save/kind -> its files, directories and bytes
        self.times, self.checks, self.footprint, self.managers = {}, {}, {}, {}

    def check(self, name: str, passed: bool) -> None:
        self.checks[name] = self.checks.get(name, True) and all(h.gather(bool(passed)))

    def load(self, kind: str, target, path: str) -> None:
        h.fill_zeros(target)
        if self.args.evict_cache:
            if self.ranks.rank == 0:
                h.evict_page_cache(path)
            dist.barrier()
        writers.load(kind, target, path, self.args.threads)

    def timed(self, name: str, fn, record: bool) -> None:
        per_rank = h.timed(fn, self.ranks.device)[1]
        if record:
            self.times.setdefault(name, []).append(per_rank)

    def run(self, cfg: h.ModelConfig, total: int, rank_bytes: list[int]) -> dict:
        args = self.args
        target, writer = h.zeroed(self.state), None
        for repeat in range(-args.warmup, args.repeats):  # the warm-up's first uses of everything are not timed
            timed = repeat >= 0
            for kind in h.rotated(args.kinds, repeat):
                path = os.path.join(self.root, f"{kind}-{repeat}")
                self.timed(f"save/{kind}", lambda: writers.save(kind, self.state, path, args.threads), timed)
                self.timed(f"load/{kind}", lambda: self.load(kind, target, path), timed)
                self.check(f"load/{kind} equals saved", h.equal(target, self.state))
                if self.ranks.rank == 0:
                    self.footprint.setdefault(f"save/{kind}", h.footprint(path))
                    shutil.rmtree(path)
            if "zarr" in args.kinds:
                writer = self.async_save(repeat, writer, target, timed)
            if args.manager:
                self.manager_saves(repeat, timed)
            if self.ranks.rank == 0:
                print(f"repeat {repeat + 1}/{args.repeats} done" if timed else "warm-up done", flush=True)
        if writer is not None:
            writer.close()  # its staging copy of the state dict
        for manager in self.managers.values():
            manager.close()
        target = None  # freed before the resharded loads allocate theirs
        measurements = {name: entry(rank_bytes, runs) for name, runs in self.times.items()
                        if name != "async/zarr blocking"}
        if "async/zarr" in measurements:
            blocking = [max(r) for r in self.times["async/zarr blocking"]]
            measurements["async/zarr"].update(blocking_times_s=blocking, median_blocking_s=statistics.median(
                blocking), blocking_gbps=total / statistics.median(blocking) / h.GB)
        if args.reshard_from:
            measurements.update(self.reshard(args.reshard_from, cfg))
        config = {**asdict(cfg), **{k: v for k, v in vars(args).items() if k not in asdict(cfg)},
                  "world_size": self.ranks.world_size}
        return {"config": config, "state_dict": {"total_bytes": total, "rank_bytes": rank_bytes, "tensors": len(
                    h.leaves(self.state))}, "measurements": measurements, "ratios": ratios(measurements),
                "footprint": self.footprint, "checks": self.checks}

    def async_save(self, repeat: int, writer, target, timed: bool):
        """One writer for every repeat, as a training loop keeps it: with ``cache_staged_state_dict`` it stages
        into the buffers it staged into last time (pinned ones for CUDA tensors) instead of allocating new ones."""
        from dcp_zarr import ZarrSavePlanner, ZarrWriter

        path, cache = os.path.join(self.root, f"async-{repeat}"), not self.args.no_staging_cache
        if writer is None or not cache:
            writer = ZarrWriter(path, thread_count=self.args.threads, cache_staged_state_dict=cache)
        blocking, total = h.timed_async(lambda: dcp.async_save(self.state, storage_writer=writer, checkpoint_id=path,
                                                               planner=ZarrSavePlanner()), self.ranks.device)
        if timed:
            self.times.setdefault("async/zarr blocking", []).append([blocking])
            self.times.setdefault("async/zarr", []).append([total])
        if repeat == -self.args.warmup:  # untimed: an async checkpoint loads back equal too
            self.load("zarr", target, path)
            self.check("async/zarr loads equal", h.equal(target, self.state))
        dist.barrier()
        if self.ranks.rank == 0:
            shutil.rmtree(path)
        return writer

    def manager_saves(self, repeat: int, timed: bool) -> None:
        """``CheckpointManager(keep_last=2)`` saves, sync and async, against bare ones of the state (``save/zarr``, and
        ``dcp.async_save`` with a new ZarrWriter, as the manager makes one a step): the time each held the caller.
        Retention's deletions, from the third step on, run in the background: waited for after each, untimed."""
        from dcp_zarr import CheckpointManager, ZarrSavePlanner, ZarrWriter

        self.managers = self.managers or {mode: CheckpointManager(os.path.join(self.root, f"manager-{mode}"),
                                                                  keep_last=2, thread_count=self.args.threads)
                                          for mode in ("sync", "async")}
        step, bare = repeat + self.args.warmup, os.path.join(self.root, f"bare-{repeat}")
        writer = ZarrWriter(bare, thread_count=self.args.threads)
        blocked = {"manager/sync": h.timed(lambda: self.managers["sync"].save(step, self.state), self.ranks.device)[0]}
        for name, save in {"manager/async blocking": lambda: self.managers["async"].save(step, self.state,
                                                                                         async_save=True),
                           "async/bare blocking": lambda: dcp.async_save(self.state, storage_writer=writer,
                                                                         planner=ZarrSavePlanner())}.items():
            self.managers["sync"].wait()
            blocked[name] = h.timed_async(save, self.ranks.device)[0]
            self.managers["async"].wait()
        kept = list(range(max(0, step - 1), step + 1))
        self.check("managers keep their last 2 steps", all(m.steps() == kept for m in self.managers.values()))
        for name, seconds in blocked.items() if timed else ():
            self.times.setdefault(name, []).append([seconds])
        if self.ranks.rank == 0:
            shutil.rmtree(bare)

    def reshard(self, source: str, cfg: h.ModelConfig) -> dict:
        """Loads of a --save-only checkpoint of any world size with each reader: time and bytes read per rank."""
        saved = json.loads(Path(source, SAVED_CONFIG).read_text())
        saved_cfg = h.ModelConfig(**saved["model"])
        state = self.state if saved_cfg == cfg else h.fsdp_model_state(saved_cfg, self.ranks.mesh, self.ranks.device)
        kinds = [k for k in self.args.kinds if k != "raw"]
        if set(kinds) - set(saved["kinds"]):
            raise SystemExit(f"--reshard-from {source} has no checkpoint of {sorted(set(kinds) - set(saved['kinds']))}")
        targets = {kind: h.zeroed(state) for kind in kinds}
        needed = h.gather(h.local_bytes(state))
        runs, read = {kind: [] for kind in kinds}, {kind: [] for kind in kinds}  # per-rank times and bytes read
        for repeat in range(-self.args.warmup, self.args.repeats):
            for kind in h.rotated(kinds, repeat):
                def counted(kind=kind) -> int:
                    before = read_chars()
                    self.load(kind, targets[kind], os.path.join(source, kind))
                    return read_chars() - before

                _, per_rank, nbytes = h.timed(counted, self.ranks.device)
                if repeat >= 0:
                    runs[kind].append(per_rank)
                    read[kind].append(h.gather(nbytes))
        if {"zarr", "fs"} <= set(kinds):
            self.check("reshard/zarr equals reshard/fs", h.equal(targets["zarr"], targets["fs"]))
        self.check("reshard loads are not all zeros", all(any(bool(h.local(t).any()) for t in h.leaves(target))
                                                          for target in targets.values()))
        found = {}
        for kind in kinds:
            rank_read = [statistics.median_low(r[rank] for r in read[kind]) for rank in range(self.ranks.world_size)]
            found[f"reshard/{kind}"] = {**entry(needed, runs[kind]), "saved_world_size": saved["world_size"],
                                        "rank_read_bytes": rank_read, "rank_needed_bytes": needed,
                                        "rank_read_amplification": [r / max(1, n) for r, n in zip(rank_read, needed)]}
        return found


def entry(rank_bytes: list[int], runs: list[list[float]]) -> dict[str, Any]:
    """A measurement from its repeats' per-rank times: the slowest rank's each time, their median and GB/s."""
    return {**h.speed([max(run) for run in runs], sum(rank_bytes)), "rank_times_s": runs}


def ratios(measurements: dict[str, dict]) -> dict[str, float]:
    """time(other) / time(zarr): above 1, dcp_zarr is faster; ``*_fraction_of_raw``: how close a kind gets to raw."""
    median, pairs = {name: m["median_s"] for name, m in measurements.items()}, {}  # ratio: (numerator, denominator)
    for op, name in (("save", "save"), ("load", "load"), ("reshard", "reshard_load")):
        pairs[f"{name}_speedup_zarr_vs_fs"] = (f"{op}/fs", f"{op}/zarr")
        for kind in ("zarr", "fs") if op != "reshard" else ():
            pairs[f"{name}_{kind}_fraction_of_raw"] = (f"{op}/raw", f"{op}/{kind}")
    found = {ratio: median[a] / median[b] for ratio, (a, b) in pairs.items() if a in median and b in median}
    if {"manager/sync", "save/zarr"} <= set(median):
        found["manager_sync_vs_bare_save"] = median["manager/sync"] / median["save/zarr"]
        found["manager_async_vs_bare_blocking"] = median["manager/async blocking"] / median["async/bare blocking"]
    if "async/zarr" in measurements:
        found["async_blocking_fraction"] = measurements["async/zarr"]["median_blocking_s"] / median["async/zarr"]
    return found


def summary(d: dict) -> str:
    c, rows = d["config"], []
    for name, m in d["measurements"].items():
        rows.append([name, f"{m['median_s']:.4f}", f"{m['min_s']:.4f}", f"{m['gbps']:.3f}",
                     d["footprint"].get(name, {}).get("files", "")])
        if name == "async/zarr":
            rows.append(["async/zarr blocked", f"{m['median_blocking_s']:.4f}", "", f"{m['blocking_gbps']:.3f}"])
    lines = [f"{c['world_size']} ranks, gloo, {c['threads']} threads, medians of {c['repeats']}, state dict "
             f"{d['state_dict']['total_bytes'] / h.GB:.3f} GB, target {c['target']}", "",
             h.table(["measurement", "median s", "min s", "GB/s", "files"], rows), ""]
    lines += [f"- {name}: {value:.3f}" for name, value in d["ratios"].items()]
    lines += [f"- {name} read / needed bytes per rank: {', '.join(f'{a:.2f}' for a in m['rank_read_amplification'])}"
              for name, m in d["measurements"].items() if name.startswith("reshard/")]
    failed = [name for name, ok in d["checks"].items() if not ok]
    return "\n".join(lines + [f"- checks: {'all passed' if not failed else 'FAILED: ' + ', '.join(failed)}"])


if __name__ == "__main__":
    main()
