"""What ZarrWriter's replica check costs a save: the benchmark's FSDP2 model with AdamW state, saved with
``check_replicas`` "none", "small" (the default) and "all", interleaved, medians of the slowest rank's times.

    torchrun --standalone --nproc-per-node 2 benchmarks/replica_check.py --repeats 5 --target /dev/shm/replicas
    torchrun --standalone --nproc-per-node 2 benchmarks/replica_check.py --quick    # small model (tests)

The replicated entries of an FSDP2 state dict are the optimizer steps and param_groups values: "small" compares all
of them by value. "all" would also compare replicated tensors over the size limit (none here).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ckpt_dist import exit_without_interpreter_teardown, init_distributed, shutdown  # noqa: E402
from ckpt_measure import timed_region  # noqa: E402
from ckpt_model import ModelConfig, build_sharded_state_dict, global_bytes  # noqa: E402

from dcp_zarr import ZarrWriter, replicas  # noqa: E402

MODES = ("none", "small", "all")


def time_the_checks(state_dict, world_size: int) -> dict:
    """The replica check's own functions on the ranks' real local plans (gathered), timed on this rank."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict, is_coordinator=True)
    writer = ZarrWriter("unused")
    plan = writer.prepare_local_plan(planner.create_local_plan())
    plans = [None] * world_size
    dist.all_gather_object(plans, plan)
    plan_s = statistics.median(_seconds(lambda: replicas.plan_checks(plans, "small", replicas.DEFAULT_MAX_BYTES))
                               for _ in range(5))
    checks = replicas.plan_checks(plans, "small", replicas.DEFAULT_MAX_BYTES)[dist.get_rank()]
    checksum_s = statistics.median(_seconds(lambda: replicas.checksums_result(writer._local_items, checks, planner))
                                   for _ in range(5))
    return {"plan_checks_s": plan_s, "checksums_s": checksum_s, "items": len(plan.items), "checked": len(checks)}


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--target", default="/dev/shm/dcp-zarr-replicas")
    parser.add_argument("--quick", action="store_true", help="a 16 MB model, 2 repeats")
    args = parser.parse_args(argv)
    rt = init_distributed("gloo")
    try:
        cfg = ModelConfig(4, 128, 2048, "float32") if args.quick else ModelConfig(8, 1024, 32000, "float32")
        repeats = 2 if args.quick else args.repeats
        state_dict = build_sharded_state_dict(cfg, rt.mesh, rt.device)
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        for repeat in range(repeats + 1):  # the first round warms up and is not counted
            for mode in MODES:
                path = os.path.join(args.target, f"{mode}-{repeat}.zarr")  # a fresh store: no deletion timed
                writer = ZarrWriter(path, check_replicas=mode)
                elapsed, _ = timed_region(lambda: dcp.save(state_dict, storage_writer=writer), rt.device)
                if repeat:
                    times[mode].append(elapsed.max_s)
                if rt.rank == 0:
                    shutil.rmtree(path)  # before the next region's quiesce (sync, barrier)
        direct = time_the_checks(state_dict, rt.world_size)
        if rt.rank == 0:
            medians = {mode: statistics.median(values) for mode, values in times.items()}
            print(f"{global_bytes(state_dict) / 1e9:.2f} GB state dict, {rt.world_size} ranks, {repeats} repeats")
            for mode in MODES:
                print(f"  check_replicas={mode!r:8} save {medians[mode]:.3f} s  "
                      f"({medians[mode] / medians['none'] - 1:+.1%} against 'none')  runs {times[mode]}")
            print(f"  the checks alone (check_replicas='small', medians of 5): coordinator plan_checks "
                  f"{direct['plan_checks_s'] * 1e3:.2f} ms over {direct['items']} items x {rt.world_size} ranks; "
                  f"checksums {direct['checksums_s'] * 1e3:.2f} ms for {direct['checked']} replicated items per rank")
            shutil.rmtree(args.target, ignore_errors=True)
        return 0
    finally:
        shutdown()


if __name__ == "__main__":
    exit_without_interpreter_teardown(main())
