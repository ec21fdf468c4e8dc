"""torchtitan's save time: its own CheckpointManager (DCP's FileSystemWriter) against dcp_zarr's
ZarrCheckpointManager, on the same Trainer, state and ranks (commands: docs/torchtitan.md).

torchtitan's Trainer builds its debug llama3 (6 layers, 6.2M parameters; ``--layers`` fewer) on CPU gloo ranks,
with the patches of dcp_zarr/testing/torchtitan_cpu.py, and trains one step (AdamW state: ~76 MB saved in all). Then
each manager, built from the same components by torchtitan's own ``Config.build``, saves ``--repeats`` times in
each mode (after one untimed save), alternating: a save is ``manager.save(step)``, torchtitan's whole path (its
garbage collections included), timed on every rank between barriers, the slowest rank's time kept; async saves also
until their future resolved. Each save goes to a new ``step-N`` folder under ``--target``, removed after it.
Medians, and the ratio FileSystemWriter / dcp_zarr (above 1: dcp_zarr faster), go to stdout (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from benchmarks import harness as h
from dcp_zarr.testing.torchtitan_cpu import tiny_llama3_config, use_cpu

MODES = ["disabled", "async"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--layers", type=int, default=6, help="of the debug llama3's 6")
    parser.add_argument("--target", default=h.SCRATCH, help="where the checkpoints go (default: tmpfs)")
    return parser.parse_args()


def build_managers(trainer, folder: str) -> dict:
    from torchtitan.components.checkpointer import CheckpointManager

    from dcp_zarr.integrations.torchtitan import ZarrCheckpointManager

    managers = {}
    for kind, cls in [("fs", CheckpointManager), ("zarr", ZarrCheckpointManager)]:
        for mode in MODES:
            config = cls.Config(enable=True, interval=1, keep_latest_k=0, async_mode=mode, folder=f"{kind}-{mode}")
            managers[kind, mode] = config.build(
                dataloader=trainer.dataloader, model_parts=trainer.model_parts, optimizers=trainer.optimizers,
                lr_schedulers=trainer.lr_schedulers, states={"train_state": trainer}, sd_adapter=None,
                base_folder=folder)
    return managers


def timed_save(manager, step: int) -> tuple[float, float]:
    """(seconds until save() returned, seconds until the save was complete), the slowest rank's."""
    dist.barrier()
    start = time.perf_counter()
    manager.save(step)
    blocking = time.perf_counter() - start
    manager.maybe_wait_for_saving()
    total = time.perf_counter() - start
    slowest = torch.tensor([blocking, total], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest[0]), float(slowest[1])


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    rank = dist.get_rank()
    use_cpu()
    folder = os.path.join(args.target, "torchtitan_save_bench")
    from torchtitan.components.checkpointer import CheckpointManager

    trainer = tiny_llama3_config(folder, CheckpointManager.Config(), steps=1, layers=args.layers).build()
    trainer.train()  # one step: the optimizer holds its state
    managers = build_managers(trainer, folder)
    times: dict[str, list] = {f"{kind}-{mode}": [] for kind, mode in managers}
    saved_bytes: dict[str, int] = {}
    for repeat in range(args.repeats + 1):
        order = list(managers) if repeat % 2 else list(reversed(managers))
        for kind, mode in order:
            step = repeat + 1
            measured = timed_save(managers[kind, mode], step)
            if repeat:  # the first round is untimed: the async modes make their process group and stager then
                times[f"{kind}-{mode}"].append(measured)
            dist.barrier()
            if rank == 0:
                saved = os.path.join(folder, f"{kind}-{mode}", f"step-{step}")
                saved_bytes[f"{kind}-{mode}"] = h.footprint(saved)["bytes"]
                shutil.rmtree(saved)
    if rank == 0:
        medians = {name: {"blocking_s": statistics.median(t[0] for t in runs),
                          "total_s": statistics.median(t[1] for t in runs)} for name, runs in times.items()}
        ratios = {mode: {part: medians[f"fs-{mode}"][part] / medians[f"zarr-{mode}"][part]
                         for part in ("blocking_s", "total_s")} for mode in MODES}
        print(json.dumps({"torch": torch.__version__, "world_size": dist.get_world_size(), "layers": args.layers,
                          "repeats": args.repeats, "target": args.target, "medians": medians,
                          "fs_over_zarr": ratios, "checkpoint_bytes": saved_bytes, "times": times}, indent=2))
        shutil.rmtree(folder, ignore_errors=True)
    for manager in managers.values():
        manager.close()
    trainer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
