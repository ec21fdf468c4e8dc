"""Process-group setup for the checkpoint benchmark: under torchrun, or as a 1-process group under plain python."""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# A checkpoint of several GB on a slow disk can keep ranks apart for minutes; gloo's default is 30 min anyway.
PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    backend: str  # "gloo" (CPU tensors) or "nccl" (CUDA tensors)
    device: torch.device
    mesh: DeviceMesh
    launched_by_torchrun: bool


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(backend: str) -> Runtime:
    """Join the torchrun group, or make a 1-process group when no torchrun variables are set."""
    launched = "RANK" in os.environ or "WORLD_SIZE" in os.environ
    if not launched:
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())
        )
    world_size = int(os.environ["WORLD_SIZE"])
    if backend == "gloo":
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=PROCESS_GROUP_TIMEOUT)
        mesh = init_device_mesh("cpu", (world_size,))
    elif backend == "nccl":
        if not torch.cuda.is_available():
            raise SystemExit("--backend nccl needs CUDA, and torch.cuda.is_available() is False")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        # async_save needs a CPU backend next to NCCL for its collectives.
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=PROCESS_GROUP_TIMEOUT, device_id=device)
        mesh = init_device_mesh("cuda", (world_size,))
    else:
        raise ValueError(f"unknown backend {backend!r}")
    return Runtime(dist.get_rank(), world_size, backend, device, mesh, launched)


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so device-to-host copies are inside the timed region."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_without_interpreter_teardown(code: int) -> None:
    """End the process, skipping Python's finalization: gloo's worker threads can still hold the tensors of the last
    collective, and releasing them in a finalizing interpreter aborts the process ("terminate called without an
    active exception", pytorch #190489; docs/usage.md "Clean exits")."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_rank_program(program: Callable[[Runtime], dict], out: str | None, *, echo: bool = False) -> None:
    """Run ``program`` on every rank of a gloo group; rank 0 writes the result it returns to ``out`` as JSON (and
    prints it with ``echo``). Then the group is destroyed and the process ends without interpreter teardown; an
    error propagates after the group is destroyed."""
    rt = init_distributed("gloo")
    try:
        result = program(rt)
        if rt.rank == 0:
            if echo:
                print(json.dumps(result, indent=2))
            if out:
                with open(out, "w") as f:
                    json.dump(result, f, indent=2)
        dist.barrier()
    finally:
        shutdown()
    exit_without_interpreter_teardown(0)


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
