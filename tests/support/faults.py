"""Fault injection: kill hooks that SIGKILL a rank at a chosen filesystem mutation of a save, the state the crash
trials save, their rank programs (for ``tests.support.ranks.Zygote``), and the causes inside a failed save or load.

Kill points
    ``install_kill_hooks`` counts every filesystem mutation a rank makes during a save (chunk and zarr.json
    writes, fsyncs, renames, unlinks) and SIGKILLs the rank at a chosen one: before it, or halfway through a write.
    ``StepLog`` logs the steps of an incremental save (links, chunk and zarr.json writes, the commit) to a file that
    outlives the rank, and can SIGKILL every rank of the save at one of them.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch
import torch.distributed.checkpoint as dcp

from tests.support.states import random_bits

__all__ = ["CRASH_WRITER_OPTIONS", "INCREMENTAL_WRITER_OPTIONS", "StepLog", "causes", "crash_state",
           "incremental_save_program", "incremental_state", "install_kill_hooks", "load_program", "logged_steps",
           "managed_incremental_program", "managed_save_program", "save_program", "sharded_incremental_state",
           "shard_named", "sharded_state", "step_phase"]


def causes(exc: BaseException) -> list[BaseException]:
    """The per-rank exceptions inside a CheckpointException (DCP keeps ``(exception, traceback)`` pairs)."""
    failures = getattr(exc, "failures", None)
    if not failures:
        return [exc]
    return [f[0] if isinstance(f, tuple) else f for _, f in sorted(failures.items())]



# --------------------------------------------------------------------------------------------------
# The state the crash trials save: DTensors cut from full tensors that are a pure function of the seed
# --------------------------------------------------------------------------------------------------


def crash_state(seed: int) -> dict:
    """Full (unsharded) tensors and values; ``sharded_state`` cuts each rank's part of it."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "embed.weight": torch.randn(37, 16, generator=g),
            "layers.0.w": torch.randn(96, 64, generator=g),  # sharded codec: several inner chunks per shard
            "layers.0.b": random_bits((20, 9), torch.bfloat16, g),
            "layers.1.w": random_bits((6, 11), torch.float16, g),
            "layers.2.w": torch.randn(50, 64, generator=g),  # at 3 ranks: 17/17/16 rows, an edge shard with padding
            "ids": torch.randint(-(2**40), 2**40, (11,), generator=g),
            "mask": torch.rand(5, 5, generator=g) > 0.5,
        },
        "optim": {
            "step": torch.tensor(float(seed)),
            "exp_avg": torch.randn(33, 4, generator=g),
            "lr": 0.01 * (1 + seed % 7),
            "betas": (0.9, 0.999),
            "seen": torch.Size([seed, seed + 1]),  # not JSON: stored as torch.save bytes
        },
    }


# fqn -> placement kind on a 1-D mesh; everything else is a plain tensor (every rank holds it, DCP dedups it).
_SHARDING = {"embed.weight": 0, "layers.0.w": 0, "layers.0.b": 1, "layers.2.w": 0, "ids": 0, "exp_avg": 0}


def sharded_state(seed: int, world_size: int) -> dict:
    return shard_named(crash_state(seed), world_size, _SHARDING)


def shard_named(state: dict, world_size: int, dims: dict[str, int]) -> dict:
    """``state`` (groups of tensors) with each tensor ``dims`` names made a DTensor sharded along its dim on a 1-D mesh
    of ``world_size`` ranks (each rank cuts its own piece: no communication); the others left as they are."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    for group in state.values():
        for name, value in group.items():
            if name in dims:
                group[name] = distribute_tensor(value, mesh, [Shard(dims[name])], src_data_rank=None)
    return state


CRASH_WRITER_OPTIONS = {"overwrite": True, "inner_chunk_bytes": 2048, "thread_count": 2}


def save_program(rank: int, world_size: int, report, target: str, seed: int, kill: dict | None,
                 options: dict | None = None):
    """Rank program of a crash trial: save ``sharded_state(seed)`` to ``target`` (with ZarrWriter ``options`` over
    CRASH_WRITER_OPTIONS); returns this rank's events, in order."""
    from dcp_zarr import ZarrWriter

    state = sharded_state(seed, world_size)
    counter = install_kill_hooks(kill if kill and kill["rank"] == rank else None)
    report("saving", time.monotonic())
    writer = ZarrWriter(target, **{**CRASH_WRITER_OPTIONS, **(options or {})})
    dcp.save(state, storage_writer=writer)
    return counter.sequence


def load_program(rank: int, world_size: int, report, target: str, kill: dict | None, options: dict):
    """Rank program of a crash trial of a load: load ``target`` into a blank sharded state with ZarrReader
    ``options``; returns this rank's events (its collective exchanges among them), in order."""
    from dcp_zarr import ZarrReader

    state = sharded_state(0, world_size)
    blank = {group: {name: value.clone() * 0 if hasattr(value, "clone") else value for name, value in values.items()}
             for group, values in state.items()}
    counter = install_kill_hooks(kill if kill and kill["rank"] == rank else None)
    report("loading", time.monotonic())
    dcp.load(blank, storage_reader=ZarrReader(target, **options))
    return counter.sequence


def managed_save_program(rank: int, world_size: int, report, root: str, step: int, seed: int, options: dict,
                         kill: dict | None = None):
    """Rank program of a manager trial: one ``CheckpointManager.save`` of ``sharded_state(seed)`` as ``step``;
    returns this rank's filesystem events from the save on (retention and ``close`` included), in order."""
    from dcp_zarr import CheckpointManager

    state = sharded_state(seed, world_size)
    manager = CheckpointManager(root, **options)
    counter = install_kill_hooks(kill if kill and kill["rank"] == rank else None)
    report("saving", time.monotonic())
    manager.save(step, state)
    manager.close()
    return counter.sequence


# --------------------------------------------------------------------------------------------------
# Kill hooks (installed inside a rank process only)
# --------------------------------------------------------------------------------------------------


class _Counter:
    def __init__(self, kill: dict | None):
        self.kill = kill
        self.count = 0
        self.sequence: list[str] = []
        self.lock = threading.Lock()

    def event(self, kind: str) -> bool:
        """Count one event; True if the rank must die at it."""
        with self.lock:
            self.count += 1
            self.sequence.append(kind)
            return self.kill is not None and self.count == self.kill["event"]


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # never reached


def install_kill_hooks(kill: dict | None) -> _Counter:
    """Count (and, if ``kill`` says so, die at) every filesystem mutation of a save in this process.

    ``kill = {"event": n, "torn": bool}``: SIGKILL this process at its n-th event; for a write with ``torn``, after
    writing only the first half of the bytes.
    """
    from dcp_zarr.collective import transfer
    from dcp_zarr.storage.local import LocalStorage
    from dcp_zarr.store_io import commit

    counter = _Counter(kill)
    original_write, original_flush = LocalStorage.write, LocalStorage.flush

    def write(self, key, buffers):
        if counter.event("write"):
            if kill.get("torn"):
                data = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
                path = self._path(key)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(data[: len(data) // 2])
            _die()
        return original_write(self, key, buffers)

    def flush(self):
        if counter.event("flush"):
            _die()
        return original_flush(self)

    LocalStorage.write, LocalStorage.flush = write, flush

    def wrap(module, name, kind):
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            if counter.event(kind):
                _die()
            return original(*args, **kwargs)

        setattr(module, name, wrapper)

    wrap(os, "rename", "rename")
    wrap(os, "replace", "rename")
    wrap(os, "unlink", "unlink")
    wrap(os, "remove", "unlink")
    wrap(os, "rmdir", "rmdir")
    wrap(commit, "_exchange", "exchange")
    wrap(commit, "_fsync_directory", "fsync_dir")
    wrap(transfer.Group, "exchange", "transfer")  # a round of collective I/O's messages (collective/transfer.py)
    return counter


# --------------------------------------------------------------------------------------------------
# Incremental saves: a state with a large frozen part, and what each rank did before it was killed
# --------------------------------------------------------------------------------------------------


# Small chunks: about eighty links a rank, so that kills land among them.
INCREMENTAL_WRITER_OPTIONS = {"inner_chunk_bytes": 16 << 10, "thread_count": 2}
_FROZEN_SEED = 7
_INCREMENTAL_SHARDED = ("embed.weight", "layers.0.w", "layers.1.w", "head.w", "exp_avg")


def incremental_state(seed: int) -> dict:
    """Full tensors: the frozen part (2.5 MiB) is the same in every save; ``head.w``, ``optim`` and the first rows
    of ``layers.1.w`` change with ``seed``."""
    frozen, changing = torch.Generator().manual_seed(_FROZEN_SEED), torch.Generator().manual_seed(seed)
    partly = torch.randn(512, 256, generator=frozen)
    partly[:16] = torch.randn(16, 256, generator=changing)
    return {
        "model": {
            "embed.weight": torch.randn(1024, 256, generator=frozen),
            "layers.0.w": torch.randn(1024, 256, generator=frozen),
            "layers.1.w": partly,
            "norm.w": torch.randn(256, generator=frozen),
            "head.w": torch.randn(96, 256, generator=changing),
        },
        "optim": {"step": torch.tensor(float(seed)), "exp_avg": torch.randn(128, 64, generator=changing)},
    }


def sharded_incremental_state(seed: int, world_size: int) -> dict:
    return shard_named(incremental_state(seed), world_size, dict.fromkeys(_INCREMENTAL_SHARDED, 0))


class StepLog:
    """Appends one line per step of a save to ``log_dir/rank<r>.log``, each once the step is done, with its
    ``time.monotonic()``: ``link`` (a chunk hard-linked from the earlier checkpoint), ``chunk`` (a chunk written),
    ``meta`` (an array's or group's zarr.json written), ``root`` (the root zarr.json, which makes the staged store
    complete), ``commit`` (the rename onto ``target``); a rank killed from outside leaves what it had done.

    ``kill = {"rank", "kind", "n", "before"}``: at rank ``rank``'s ``n``-th step of ``kind`` (before doing it, or
    once done), SIGKILL every rank of the save (their pids are in ``log_dir``), this one last."""

    def __init__(self, log_dir: str, rank: int, world_size: int, target: str, kill: dict | None):
        from dcp_zarr.storage.local import LocalStorage

        os.makedirs(log_dir, exist_ok=True)
        self.log_dir, self.world_size = log_dir, world_size
        with open(os.path.join(log_dir, f"rank{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
        self.fd = os.open(os.path.join(log_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.kill = kill if kill is not None and kill["rank"] == rank else None
        self.seen: dict[str, int] = {}
        self.lock = threading.Lock()
        real_link, real_write, real_rename = os.link, LocalStorage.write, os.rename

        def link(src, dst, *args, **kwargs):
            return self.step("link", lambda: real_link(src, dst, *args, **kwargs))

        def write(storage, key, buffers):
            kind = "root" if key == "zarr.json" else "meta" if key.endswith("/zarr.json") else "chunk"
            return self.step(kind, lambda: real_write(storage, key, buffers))

        def rename(src, dst, *args, **kwargs):
            if os.fspath(dst) != target:
                return real_rename(src, dst, *args, **kwargs)
            return self.step("commit", lambda: real_rename(src, dst, *args, **kwargs))

        os.link, LocalStorage.write, os.rename = link, write, rename

    def step(self, kind: str, do):
        with self.lock:
            self.seen[kind] = self.seen.get(kind, 0) + 1
            dies = self.kill is not None and self.kill["kind"] == kind and self.kill["n"] == self.seen[kind]
        if dies and self.kill["before"]:
            self._kill_every_rank()
        result = do()
        os.write(self.fd, f"{kind} {time.monotonic()}\n".encode())
        if dies:
            self._kill_every_rank()
        return result

    def _kill_every_rank(self) -> None:
        for rank in range(self.world_size):
            try:
                with open(os.path.join(self.log_dir, f"rank{rank}.pid")) as f:
                    pid = int(f.read())
            except (FileNotFoundError, ValueError):
                continue  # not started yet: it finds no one to save with
            if pid != os.getpid():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        _die()


def logged_steps(log_dir: str, rank: int) -> list[tuple[str, float]]:
    """The steps a rank's ``StepLog`` logged, in order: (kind, time.monotonic())."""
    try:
        with open(os.path.join(log_dir, f"rank{rank}.log")) as f:
            return [(kind, float(at)) for kind, at in (line.split() for line in f)]
    except FileNotFoundError:
        return []


def step_phase(log_dir: str, world_size: int) -> str:
    """How far a killed save got, over every rank's ``StepLog``: ``before any chunk``, ``chunks`` (chunks and
    zarr.json documents of arrays), ``staged`` (the root zarr.json written, not committed) or ``committed``."""
    kinds = {kind for rank in range(world_size) for kind, _ in logged_steps(log_dir, rank)}
    for phase, marks in (("committed", {"commit"}), ("staged", {"root"}), ("chunks", {"link", "chunk", "meta"})):
        if kinds & marks:
            return phase
    return "before any chunk"


def incremental_save_program(rank: int, world_size: int, report, target: str, earlier: str | None, seed: int,
                             log_dir: str, kill: dict | None = None, writer_options: dict | None = None):
    """Rank program: save ``sharded_incremental_state(seed)`` to ``target`` incrementally from ``earlier`` (None: a
    save that only records its chunks, ``incremental=True``), logging its steps (``StepLog``); returns this rank's
    ``reuse_counts`` and its steps (``logged_steps``). ``writer_options``: default INCREMENTAL_WRITER_OPTIONS."""
    from dcp_zarr import ZarrWriter

    state = sharded_incremental_state(seed, world_size)
    StepLog(log_dir, rank, world_size, target, kill)
    report("saving", time.monotonic())
    options = INCREMENTAL_WRITER_OPTIONS if writer_options is None else writer_options
    writer = ZarrWriter(target, incremental=True, incremental_from=earlier, **options)
    dcp.save(state, storage_writer=writer)
    return writer.reuse_counts, logged_steps(log_dir, rank)


def managed_incremental_program(rank: int, world_size: int, report, root: str, step: int, seed: int, log_dir: str,
                                kill: dict | None = None, resume: bool = False):
    """Rank program: ``CheckpointManager(root, incremental=True)`` saves ``sharded_incremental_state(seed)`` as
    ``step``, logging its steps; with ``resume`` it first loads the latest step, and returns it."""
    from dcp_zarr import CheckpointManager

    state = sharded_incremental_state(seed, world_size)
    with CheckpointManager(root, incremental=True, keep_last=2, **INCREMENTAL_WRITER_OPTIONS) as manager:
        resumed = manager.load(sharded_incremental_state(0, world_size)) if resume else None
        StepLog(log_dir, rank, world_size, manager.path(step), kill)
        report("saving", time.monotonic())
        manager.save(step, state)
    return resumed
