"""End-to-end example: train a small FSDP2 model with a CheckpointManager saving every step, resume elsewhere.

    torchrun --nproc-per-node 2 examples/train_resume.py --phase train  --root /tmp/dcp-zarr-demo
    torchrun --nproc-per-node 3 examples/train_resume.py --phase resume --root /tmp/dcp-zarr-demo

Runs on CPU with gloo. The train phase saves asynchronously after every step (the manager keeps the last 2). The
resume phase loads the latest complete checkpoint at its own world size, checks every parameter and the optimizer's
step against the stored arrays, trains on, and rank 0 prints the steps kept and the latest store's tree.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import zarr
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dcp_zarr import CheckpointManager


def build_model(world_size: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(101, 24), nn.Linear(24, 37), nn.GELU(), nn.Linear(37, 101))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in (model[1], model[3]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, first: int) -> float:
    for step in range(first, first + steps):
        tokens = torch.randint(0, 101, (8, 16), generator=torch.Generator().manual_seed(step))
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 101), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=["train", "resume"], required=True)
    parser.add_argument("--root", required=True, help="the directory the CheckpointManager saves into")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_model(world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = CheckpointManager(args.root, keep_last=2, overwrite=True)

    if args.phase == "train":
        for step in range(1, args.steps + 1):
            loss = train(model, optimizer, 1, first=step - 1)
            model_sd, optim_sd = get_state_dict(model, optimizer)
            # Returns once the state is staged; the write overlaps the next step, and the next save waits for it.
            manager.save(step, {"model": model_sd, "optim": optim_sd, "progress": {"step": step}}, async_save=True)
        manager.wait()
        if rank == 0:
            print(f"trained {args.steps} steps on {world_size} ranks (loss {loss:.4f}), a checkpoint after each; "
                  f"kept steps {manager.steps()} under {args.root}")
    else:
        train(model, optimizer, 1, first=-1)  # creates optimizer state to load into
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd, "progress": {"step": 0}}
        done = manager.load(state)  # the latest complete checkpoint, resharded to this world size
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        assert state["progress"]["step"] == done
        _check_against_store(model, optimizer, manager.path(done), done)
        loss = train(model, optimizer, args.steps, first=done)
        if rank == 0:
            print(f"resumed at step {done} on {world_size} ranks: weights and optimizer step match the store; "
                  f"trained to step {done + args.steps} (loss {loss:.4f})")
            print(zarr.open_group(manager.path(done), mode="r").tree())
    manager.close()
    dist.barrier()
    dist.destroy_process_group()


def _check_against_store(model: nn.Module, optimizer: torch.optim.Optimizer, path: str, step: int) -> None:
    """Every local shard equals the matching rows of the stored full tensor (read with plain zarr)."""
    group = zarr.open_group(path, mode="r")
    for name, param in model.named_parameters():
        local = param.to_local()
        offset = param.device_mesh.get_rank() * -(-param.shape[0] // param.device_mesh.size())
        stored = torch.from_numpy(group["model"][name][offset: offset + local.shape[0]])
        assert torch.equal(local.detach(), stored), f"{name} differs from the store"
        assert optimizer.state[param]["step"].item() == step, f"{name}: optimizer step is not {step}"


def exit_without_interpreter_teardown(code: int = 0) -> None:
    """End the process now that everything is saved, skipping Python's finalization.

    gloo's worker threads can still hold the tensors of DCP's last collective when the script ends; releasing them
    takes the GIL, which a finalizing interpreter answers by ending the thread, and the process aborts with
    "terminate called without an active exception" (pytorch #190489; docs/usage.md "Clean exits"). A barrier makes that
    rarer; only not finalizing rules it out.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
    exit_without_interpreter_teardown()
