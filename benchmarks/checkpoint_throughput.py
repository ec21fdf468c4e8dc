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
import faulthandler
import gc
import json
import os
import platform
import shutil
import sys
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
from ckpt_dist import Runtime, exit_without_interpreter_teardown, init_distributed, shutdown  # noqa: E402
from ckpt_model import DTYPES, ModelConfig, build_sharded_state_dict, global_bytes, local_bytes  # noqa: E402
from ckpt_report import SCHEMA_VERSION, plot_result, summary_lines, validate_result  # noqa: E402
from ckpt_runs import SAVED_CONFIG, Benchmark, Workspace, log  # noqa: E402
from ckpt_storage import DCP_KINDS, make_writer, parse_kinds, require_dcp_zarr  # noqa: E402

__all__ = ["validate_result", "main"]

QUICK = {"layers": 4, "hidden": 128, "vocab": 2048, "repeats": 2, "small_tensors": 300}  # ~16 MB fp32 state dict
DEFAULTS = {"layers": 8, "hidden": 1024, "vocab": 32000, "repeats": 3, "small_tensors": 5000}  # ~2 GB fp32


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, help=f"transformer blocks (default {DEFAULTS['layers']})")
    p.add_argument("--hidden", type=int, help=f"hidden size (default {DEFAULTS['hidden']})")
    p.add_argument("--vocab", type=int, help=f"vocabulary size (default {DEFAULTS['vocab']})")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="gloo: CPU tensors; nccl: CUDA tensors")
    p.add_argument("--target", help="directory to write checkpoints under (default: a temp dir in /dev/shm or /tmp)")
    p.add_argument("--repeats", type=int, help=f"timed repeats, median reported (default {DEFAULTS['repeats']})")
    p.add_argument("--warmup", type=int, default=1, help="untimed repeats before the timed ones (default 1)")
    p.add_argument("--threads", type=int, default=4, help="thread count given to every writer and reader")
    p.add_argument("--kinds", default="zarr,fs,raw", help="writer kinds to measure (default: all)")
    p.add_argument("--small-tensors", type=int,
                   help=f"N for the small-tensor save, 0 to skip (default {DEFAULTS['small_tensors']})")
    p.add_argument("--evict-cache", action="store_true",
                   help="drop the checkpoint's pages from the page cache before each load")
    p.add_argument("--save-only", metavar="DIR",
                   help="save one checkpoint per DCP kind under DIR for --reshard-from, then exit")
    p.add_argument("--reshard-from", metavar="DIR", help="also time loading the checkpoints of a --save-only run")
    p.add_argument("--no-staging-cache", action="store_true",
                   help="async: a new ZarrWriter (new staging buffers) for every repeat, "
                        "instead of one that keeps them")
    p.add_argument("--quick", action="store_true", help="tiny model, 2 repeats, 300 small tensors")
    p.add_argument("--out", help="result JSON (default benchmarks/results/checkpoint_throughput-<time>.json)")
    p.add_argument("--plot", help="result PNG (default: --out with .png)")
    args = p.parse_args(argv)
    for key, default in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, QUICK[key] if args.quick else default)
    args.kinds = parse_kinds(args.kinds)
    if args.repeats < 1 or args.threads < 1 or args.warmup < 0:
        p.error("--repeats and --threads must be >= 1, --warmup >= 0")
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
                under = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
                if under and len(mount_point) > len(best):
                    best, fstype = mount_point, kind
    except OSError:
        pass
    return fstype


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(layers=args.layers, hidden=args.hidden, vocab=args.vocab, dtype=args.dtype)


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
    name = f"checkpoint_throughput-{time.strftime('%Y%m%d-%H%M%S')}.json"
    return str(Path(__file__).resolve().parent / "results" / name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    faulthandler.enable()  # a crash in a native thread (gloo, zarr's IO loop) still shows every Python stack
    dcp_zarr_path = require_dcp_zarr() if "zarr" in args.kinds else None  # fail before any rank waits on another
    rt = init_distributed(args.backend)
    try:
        cfg = model_config(args)
        state_dict = build_sharded_state_dict(cfg, rt.mesh, rt.device)
        # Everything alive now (torch's modules, the model) lives for the whole run: freezing it makes the
        # gc.collect() before each timed region cheap (0.25 s -> ms), so it costs nothing to keep.
        gc.collect()
        gc.freeze()
        total = global_bytes(state_dict)
        log(rt, f"model {cfg}: state dict {total / 1e9:.3f} GB ({total / 2**20:.1f} MiB), "
                f"{local_bytes(state_dict) / 2**20:.1f} MiB on rank 0, world size {rt.world_size}")  # fmt: skip
        if args.save_only:
            save_only(args, rt, state_dict)
            return 0

        workspace = Workspace(args.target, rt.rank)
        if rt.rank == 0 and shutil.disk_usage(workspace.path).free < 1.5 * total:
            free = shutil.disk_usage(workspace.path).free
            raise SystemExit(f"{workspace.path} has {free} bytes free, need ~{1.5 * total:.0f}")
        try:
            result = Benchmark(args, rt, workspace, cfg, state_dict).run()
        finally:
            workspace.close()

        exit_code = 0 if all(result["checks"].values()) else 3  # the checks are already agreed across ranks
        if rt.rank == 0:
            write_outputs(args, rt, cfg, workspace.path, dcp_zarr_path, result)
        dist.barrier()  # nobody tears the group down while rank 0 is still writing
        return exit_code
    finally:
        shutdown()


def write_outputs(
    args: argparse.Namespace, rt: Runtime, cfg: ModelConfig, target: str, dcp_zarr_path: str | None, result: dict
) -> None:
    result = {
        "schema_version": SCHEMA_VERSION,
        "config": {
            **cfg.to_json(),
            "world_size": rt.world_size,
            "backend": rt.backend,
            "threads": args.threads,
            "repeats": args.repeats,
            "target": target,
            "target_filesystem": filesystem_type(target),
            "kinds": list(args.kinds),
            "small_tensors": args.small_tensors,
            "reshard_from": args.reshard_from,
            "evict_cache": args.evict_cache,
            "async_staging_cache": not args.no_staging_cache,
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


if __name__ == "__main__":
    exit_without_interpreter_teardown(main())
