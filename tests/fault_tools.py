"""Shared machinery of the fault-injection tests: killable multi-rank saves, store digests, failure causes.

Killable ranks
    ``Zygote`` is one helper process (started once, from the multiprocessing forkserver, so torch is already
    imported) that imports dcp_zarr once and then ``os.fork``s every rank of every trial: a trial costs a fork and
    a gloo rendezvous, not an interpreter start (~7 s of CPU here). ``Zygote.launch(fn, world_size, *args)`` returns
    a ``Launch``: the ranks' pids, ``kill()``, ``wait()``, and what each rank reported so far. Ranks rendezvous
    and report through a TCPStore held by the test process, so a killed rank can never take the store with it.
    ``tests/distributed.py``'s ``run_ranks`` is the tool for ranks that are meant to finish; this one is for ranks
    that are meant to die.

Kill points
    ``install_kill_hooks`` counts every filesystem mutation a rank makes during a save (chunk and zarr.json
    writes, fsyncs, renames, unlinks) and SIGKILLs the rank at a chosen one: before it, or halfway through a write.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import multiprocessing.forkserver as forkserver
import os
import pickle
import signal
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

# tests/distributed.py's list and ours: whichever module starts the (one, shared) forkserver first decides.
_PRELOAD = ["torch", "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.fsdp",
            "torch.distributed.tensor.parallel", "dcp_zarr", "tests.distributed", __name__]

# --------------------------------------------------------------------------------------------------
# Failure causes and store digests
# --------------------------------------------------------------------------------------------------


def causes(exc: BaseException) -> list[BaseException]:
    """The per-rank exceptions inside a CheckpointException (DCP keeps ``(exception, traceback)`` pairs)."""
    failures = getattr(exc, "failures", None)
    if not failures:
        return [exc]
    return [f[0] if isinstance(f, tuple) else f for _, f in sorted(failures.items())]


def tree_digest(root: str) -> dict[str, str]:
    """relative path -> sha256 of every file (and "dir" for every directory) under ``root``."""
    digest = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            digest[os.path.relpath(os.path.join(dirpath, name), root)] = "dir"
        for name in filenames:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                digest[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return digest


def chunk_files(root: str) -> list[str]:
    """Relative paths of every chunk (or shard) file: ``c.0.1`` and a 0-d array's ``c`` (format 3), or everything
    under a ``c`` directory (format 1 and 2)."""
    found = []
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            parts = rel.split(os.sep)
            if "c" in parts[:-1] or parts[-1] == "c" or parts[-1].startswith("c."):
                found.append(rel)
    return sorted(found)


def random_bits(shape, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Arbitrary bit patterns of ``dtype`` (NaN payloads, subnormals, -0.0 included)."""
    shape = tuple(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, itemsize), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def blank_like(value):
    """A load target with the structure of ``value``: tensors filled with 0x5A bytes, other leaves None."""
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool:
            return torch.ones(value.shape, dtype=torch.bool)
        blank = torch.empty(value.shape, dtype=value.dtype)
        blank.reshape(-1).view(torch.uint8).fill_(0x5A)
        return blank
    if isinstance(value, dict):
        return {k: blank_like(v) for k, v in value.items()}
    if isinstance(value, list) and any(isinstance(v, (torch.Tensor, dict, list)) for v in value):
        return [blank_like(v) for v in value]
    return None


def load_full(path: str, template, **reader_kwargs):
    """``dcp.load`` (no process group) into a fresh ``blank_like(template)``; returns it."""
    from dcp_zarr import ZarrReader

    target = blank_like(template)
    dcp.load(target, storage_reader=ZarrReader(path, **reader_kwargs))
    return target


def save_plain(state, path: str, **writer_kwargs) -> None:
    from dcp_zarr import ZarrWriter

    dcp.save(state, storage_writer=ZarrWriter(path, **writer_kwargs))


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
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    state = crash_state(seed)
    for group in state.values():
        for name, value in group.items():
            if name in _SHARDING:
                group[name] = distribute_tensor(value, mesh, [Shard(_SHARDING[name])], src_data_rank=None)
    return state


CRASH_WRITER_OPTIONS = {"overwrite": True, "inner_chunk_bytes": 2048, "thread_count": 2}


def save_program(rank: int, world_size: int, report, target: str, seed: int, kill: dict | None):
    """Rank program of a crash trial: save ``sharded_state(seed)`` to ``target``; returns this rank's events in order."""
    from dcp_zarr import ZarrWriter

    state = sharded_state(seed, world_size)
    counter = install_kill_hooks(kill if kill and kill["rank"] == rank else None)
    report("saving", time.monotonic())
    dcp.save(state, storage_writer=ZarrWriter(target, **CRASH_WRITER_OPTIONS))
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
# Random shardings (tests/test_property_roundtrip.py); here so that rank processes need not import hypothesis
# --------------------------------------------------------------------------------------------------


def full_tensor(spec: dict) -> torch.Tensor:
    """The whole tensor a spec ({"shape", "dtype", "seed", "save", "load"}) describes."""
    return random_bits(spec["shape"], spec["dtype"], torch.Generator().manual_seed(spec["seed"]))


def _placed(full: torch.Tensor, mesh, codes):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    placements = [Replicate() if c == "R" else Shard(int(c[1:])) for c in codes]
    return distribute_tensor(full, mesh, placements, src_data_rank=None)  # every rank cuts its own piece: no comms


def save_and_reload_sharded(rank: int, world_size: int, path: str, mesh_shape, specs, inner_chunk_bytes):
    """Rank program: save the specs' tensors as DTensors placed as ``spec["save"]`` ("R" or "S<dim>" per mesh dim),
    load them back placed as ``spec["load"]``, and compare each rank's local piece bit-exact."""
    from torch.distributed.device_mesh import init_device_mesh

    from dcp_zarr import ZarrReader, ZarrWriter
    from tests.distributed import assert_state_equal

    mesh = init_device_mesh("cpu", tuple(mesh_shape))
    state = {"model": {s["name"]: _placed(full_tensor(s), mesh, s["save"]) for s in specs}, "step": 7}
    dcp.save(state, storage_writer=ZarrWriter(path, inner_chunk_bytes=inner_chunk_bytes))
    target = {"model": {}, "step": None}
    for s in specs:
        blank = torch.empty(s["shape"], dtype=s["dtype"])
        if blank.numel() and s["dtype"] != torch.bool:
            blank.view(-1).view(torch.uint8).fill_(0x5A)
        target["model"][s["name"]] = _placed(blank, mesh, s["load"])
    dcp.load(target, storage_reader=ZarrReader(path))
    assert target["step"] == 7
    for s in specs:
        expected = _placed(full_tensor(s), mesh, s["load"]).to_local()
        assert_state_equal(target["model"][s["name"]].to_local(), expected)
    return True


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
    from dcp_zarr.storage import commit
    from dcp_zarr.storage.local import LocalStorage

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
    return counter


# --------------------------------------------------------------------------------------------------
# Zygote and launches
# --------------------------------------------------------------------------------------------------


def _rank_entry(payload: bytes, rank: int, world_size: int, port: int, prefix: str) -> None:
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))

    def report(name: str, value: Any = None) -> None:
        store.set(f"{prefix}/report/{rank}/{name}", pickle.dumps(value))

    try:
        dist.init_process_group("gloo", store=dist.PrefixStore(f"{prefix}/pg", store), rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=60))
        fn, args, kwargs = pickle.loads(payload)
        outcome = ("ok", fn(rank, world_size, report, *args, **kwargs))
    except BaseException:
        outcome = ("raised", traceback.format_exc())
    store.set(f"{prefix}/result/{rank}", pickle.dumps(outcome))
    if dist.is_initialized():
        dist.destroy_process_group()


def _zygote_main(conn) -> None:
    # Imported once here, inherited by every fork. torch._dynamo: DTensor imports it lazily on first use (~4 s).
    import torch._dynamo  # noqa: F401
    import torch.distributed.device_mesh  # noqa: F401

    import dcp_zarr  # noqa: F401

    # Children are reaped by the kernel: the test process watches them by pid and learns results from the store.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    while True:
        request = conn.recv()
        if request is None:
            return
        payload, world_size, port, prefix = request
        pids = []
        for rank in range(world_size):
            pid = os.fork()
            if pid == 0:
                conn.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                try:
                    _rank_entry(payload, rank, world_size, port, prefix)
                finally:
                    os._exit(0)
            pids.append(pid)
        conn.send(pids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Launch:
    """One multi-rank run started by the zygote."""

    def __init__(self, store, prefix: str, pids: list[int]):
        self.store, self.prefix, self.pids = store, prefix, pids
        self.killed: set[int] = set()

    def reported(self, rank: int, name: str) -> bool:
        return self.store.check([f"{self.prefix}/report/{rank}/{name}"])

    def report(self, rank: int, name: str):
        return pickle.loads(self.store.get(f"{self.prefix}/report/{rank}/{name}"))

    def wait_reported(self, name: str, timeout: float, ranks=None) -> bool:
        deadline = time.monotonic() + timeout
        ranks = range(len(self.pids)) if ranks is None else ranks
        while time.monotonic() < deadline:
            if all(self.reported(r, name) or not _alive(self.pids[r]) for r in ranks):
                return all(self.reported(r, name) for r in ranks)
            time.sleep(0.002)
        return False

    def kill(self, ranks=None) -> None:
        for rank in range(len(self.pids)) if ranks is None else ranks:
            try:
                os.kill(self.pids[rank], signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.killed.add(rank)

    def _result(self, rank: int):
        key = f"{self.prefix}/result/{rank}"
        return pickle.loads(self.store.get(key)) if self.store.check([key]) else None

    def wait(self, timeout: float, grace_after_death: float = 5.0) -> dict[int, tuple]:
        """Per-rank outcome: ("ok", value), ("raised", traceback), ("killed", None) or ("died", None).

        Ranks still running ``grace_after_death`` s after another rank died (blocked in a collective that can no
        longer complete), or at ``timeout``, are killed.
        """
        deadline = time.monotonic() + timeout
        first_death = None
        while True:
            running = [r for r, pid in enumerate(self.pids) if self._result(r) is None and _alive(pid)]
            if not running:
                break
            now = time.monotonic()
            dead = [r for r in range(len(self.pids)) if r not in running and self._result(r) is None]
            if first_death is None and dead:
                first_death = now
            if now > deadline or (first_death is not None and now > first_death + grace_after_death):
                self.kill(running)
                break
            time.sleep(0.005)
        for pid in self.pids:  # a rank that reported may still be tearing gloo down
            end = time.monotonic() + 5
            while _alive(pid) and time.monotonic() < end:
                time.sleep(0.005)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        outcomes = {}
        for rank in range(len(self.pids)):
            result = self._result(rank)
            if result is not None:
                outcomes[rank] = result
            else:
                outcomes[rank] = ("killed" if rank in self.killed else "died", None)
        return outcomes


def start_forkserver() -> multiprocessing.context.BaseContext:
    """The forkserver context, its server started now with dcp_zarr and these modules preloaded, unless another
    module started it first (there is one per process): then ranks import what it lacks themselves (slower)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    forkserver.ensure_running()
    return ctx


class Zygote:
    """Forks rank processes cheaply; one per test module (``close()`` it)."""

    def __init__(self):
        ctx = start_forkserver()
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_zygote_main, args=(child,), name="dcp-zarr-test-zygote", daemon=True)
        self._process.start()
        child.close()
        self._store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
        self._launches = 0
        self._lock = threading.Lock()

    def launch(self, fn: Callable, world_size: int, *args, **kwargs) -> Launch:
        payload = pickle.dumps((fn, args, kwargs))
        with self._lock:
            self._launches += 1
            prefix = f"launch{self._launches}"
            self._conn.send((payload, world_size, self._store.port, prefix))
            pids = self._conn.recv()
        return Launch(self._store, prefix, pids)

    def close(self) -> None:
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
