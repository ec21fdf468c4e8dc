"""Rank processes for tests: ``run_ranks`` for ranks meant to finish, ``Zygote`` for ranks meant to be killed.

Both fork their ranks cheaply and rendezvous them the same way:

* one multiprocessing forkserver per test process, which has already imported torch, dcp_zarr and tests.support
  (a fresh interpreter per rank spends ~2 s of CPU importing torch; forking takes milliseconds);
* a TCPStore held by the test process on a kernel-chosen port (so back-to-back launches never race for a port, and a
  killed rank can never take the store with it), through which the ranks join one gloo group;
* ``fn`` and its arguments travel pickled, so ``fn`` must be a module-level function of a test module or a tests/
  module (pickled by reference, resolved again in the rank).

``run_ranks(fn, world_size, *args, timeout=120, **kwargs)`` runs ``fn(rank, world_size, *args, **kwargs)`` on every
rank, in its own process group (killed with everything it started), and returns the per-rank results or raises an
AssertionError carrying every failing rank's traceback (and the Python stacks of hung ranks).

``Zygote`` is one helper process, started from the forkserver, that ``os.fork``s every rank of every trial: a trial
costs a fork and a gloo rendezvous. ``Zygote.launch(fn, world_size, *args)`` runs ``fn(rank, world_size, report,
*args)`` and returns a ``Launch``: the ranks' pids, ``kill()``, ``wait()``, and what each rank ``report``ed so far.
"""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver as forkserver
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tests.support import marks

__all__ = ["Launch", "Zygote", "run_ranks", "start_forkserver"]

_TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_REPO_DIR = os.path.dirname(_TESTS_DIR)

# After one rank fails, the others are usually blocked in a collective that will never complete.
_GRACE_AFTER_FAILURE_S = 3.0
# A rank that has sent its result still has to tear down gloo and exit.
_EXIT_WAIT_S = 10.0

# The forkserver imports these once; every rank is then a cheap fork of it. The forkserver gets this process's
# sys.path, so tests.support imports there under the same names. torch._dynamo: fully_shard and DTensor import it
# lazily, ~1.4 s per rank otherwise.
_PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
    "dcp_zarr",
    "tests.support.compare",
    "tests.support.faults",
    "tests.support.models",
    "tests.support.states",
    __name__,
]

# --------------------------------------------------------------------------------------------------
# What both launchers share: the forkserver, a rank's environment, the payload
# --------------------------------------------------------------------------------------------------

_context: multiprocessing.context.BaseContext | None = None


def _forkserver_context() -> multiprocessing.context.BaseContext:
    global _context
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _context = ctx
        atexit.register(_stop_forkserver)
    return _context


def start_forkserver() -> multiprocessing.context.BaseContext:
    """The forkserver context, its server started now with ``_PRELOAD`` imported.

    A test module that forks ranks from a module-scoped fixture calls it first, so that the server (one per
    process) starts from this module's import list rather than whenever the first launch happens to need it.
    """
    ctx = _forkserver_context()
    forkserver.ensure_running()
    return ctx


def _stop_forkserver() -> None:
    """At exit, stop and reap the forkserver and the resource tracker it started.

    Left alone they exit just after this process, are adopted by PID 1 and, where PID 1 does not reap
    (as in some sandboxes), stay zombies. Both objects are private to multiprocessing, hence the guards.
    """
    from multiprocessing import forkserver, resource_tracker

    server = forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) is not None and hasattr(server, "_stop"):
        server._stop()  # returns once the forkserver exited; it exits as soon as asked
    tracker = resource_tracker._resource_tracker
    fd, pid = getattr(tracker, "_fd", None), getattr(tracker, "_pid", None)
    if fd is None or pid is None:
        return
    os.close(fd)  # the tracker exits when every holder of this pipe has closed it
    tracker._fd = tracker._pid = None
    deadline = time.monotonic() + 2.0  # bounded: an orphan elsewhere may still hold the pipe
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
        except ChildProcessError:
            return
        time.sleep(0.02)


def _payload(fn: Callable[..., Any], args: tuple, kwargs: dict) -> bytes:
    try:
        return pickle.dumps((fn, args, kwargs))
    except Exception as e:
        raise TypeError(
            f"rank programs need a module-level fn and picklable args (a test module or tests/ module): {e}"
        ) from e


def _enter_rank(rank: int, world_size: int, store_port: int) -> None:
    """A rank's environment, as torchrun would set it, with one compute thread (ranks share the machine's cores)."""
    for path in (_REPO_DIR, _TESTS_DIR):  # appended, so tests/ modules never shadow installed ones
        if path not in sys.path:
            sys.path.append(path)
    os.environ.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store_port),
    )
    torch.set_num_threads(1)


def _join_group(store: dist.Store, rank: int, world_size: int, timeout: float) -> None:
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))


def _call(payload: bytes, rank: int, world_size: int, *leading: Any) -> tuple[str, Any]:
    """``("ok", fn(rank, world_size, *leading, *args, **kwargs))`` or ``("raised", traceback)``.

    Unpickled only here, in the rank, with tests/ on sys.path, so fn and args from test modules resolve.
    BaseException: CheckpointException is one, and so are SystemExit and KeyboardInterrupt.
    """
    try:
        fn, args, kwargs = pickle.loads(payload)
        return ("ok", fn(rank, world_size, *leading, *args, **kwargs))
    except BaseException:
        return ("raised", traceback.format_exc())


# --------------------------------------------------------------------------------------------------
# run_ranks: ranks meant to finish
# --------------------------------------------------------------------------------------------------




def _die_with_parent() -> None:
    """SIGKILL this rank when the forkserver exits, which it does when the launching process dies.

    Being in its own process group, a rank would otherwise outlive a killed pytest (CI timeouts).
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def _rank_main(
    payload: bytes,
    rank: int,
    world_size: int,
    store_port: int,
    result_conn: multiprocessing.connection.Connection,
    stacks_path: str,
    timeout: float,
) -> None:
    """Body of one rank: ``payload`` is the pickled ``(fn, args, kwargs)``."""
    # Own process group, so the launcher can kill anything this rank starts along with it.
    os.setpgrp()
    _die_with_parent()
    stacks = open(stacks_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    _enter_rank(rank, world_size, store_port)
    try:
        store = dist.TCPStore(
            "127.0.0.1", store_port, world_size, is_master=False, timeout=timedelta(seconds=timeout)
        )
        _join_group(store, rank, world_size, timeout)
    except BaseException:
        outcome = ("raised", traceback.format_exc())
    else:
        outcome = _call(payload, rank, world_size)
    # Report before tearing down the group: if peers are stuck, the launcher should know now.
    # Plain pickle, not the Connection's ForkingPickler: torch registers reductions there that pass tensors
    # as shared-memory handles, which die with this process before the launcher reads them.
    try:
        message = pickle.dumps(outcome)
    except BaseException:
        message = pickle.dumps(("raised", f"rank {rank}'s result does not pickle:\n{traceback.format_exc()}"))
    result_conn.send_bytes(message)
    result_conn.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    stacks.close()


def _kill_rank(process: multiprocessing.process.BaseProcess) -> None:
    """SIGKILL the rank and everything it started (its process group), then reap it."""
    if process.pid is not None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if process.is_alive():
            process.kill()
    process.join()


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks; return each rank's result.

    Raises AssertionError with every failing rank's traceback when a rank raises (any BaseException),
    dies, or the ranks are still running after ``timeout`` seconds (Python stacks of the hung ranks are
    included). Every rank process, and whatever it started, is killed and reaped before returning.
    """
    marks.require("distributed", "starts rank processes")
    payload = _payload(fn, args, kwargs)
    ctx = _forkserver_context()
    # Port 0: the kernel picks a free port and this store keeps it bound for the whole launch.
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    stacks_dir = tempfile.mkdtemp(prefix="run_ranks_")
    processes: list[multiprocessing.process.BaseProcess] = []
    conns: dict[multiprocessing.connection.Connection, int] = {}
    outcomes: dict[int, tuple[str, Any]] = {}
    stacks_paths = [os.path.join(stacks_dir, f"rank{rank}.stacks") for rank in range(world_size)]
    name = f"run_ranks({getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}, world_size={world_size})"
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            process = ctx.Process(
                target=_rank_main,
                args=(payload, rank, world_size, store.port, writer, stacks_paths[rank], timeout),
                name=f"rank{rank}",
            )
            process.start()
            writer.close()
            processes.append(process)
            conns[reader] = rank

        deadline = time.monotonic() + timeout
        failed_at: float | None = None
        while conns:
            limit = deadline if failed_at is None else min(deadline, failed_at + _GRACE_AFTER_FAILURE_S)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            for conn in multiprocessing.connection.wait(list(conns), timeout=remaining):
                rank = conns.pop(conn)
                try:
                    outcomes[rank] = pickle.loads(conn.recv_bytes())
                except EOFError:
                    processes[rank].join(_EXIT_WAIT_S)
                    outcomes[rank] = ("died", f"exited with code {processes[rank].exitcode} without reporting")
                except Exception:
                    outcomes[rank] = ("sent a result the launcher could not read", traceback.format_exc())
                conn.close()
                if outcomes[rank][0] != "ok" and failed_at is None:
                    failed_at = time.monotonic()

        hung = sorted(conns.values())
        hung_stacks = {}
        for rank in hung:
            if processes[rank].pid is not None:
                try:
                    os.kill(processes[rank].pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        if hung:
            time.sleep(0.5)
            hung_stacks = {rank: _read(stacks_paths[rank]) for rank in hung}
        for rank, process in enumerate(processes):
            if rank not in hung:
                process.join(_EXIT_WAIT_S)
            _kill_rank(process)
    finally:
        for process in processes:
            _kill_rank(process)
        for conn in conns:
            conn.close()
        shutil.rmtree(stacks_dir, ignore_errors=True)
        del store

    failures = {rank: outcome for rank, outcome in sorted(outcomes.items()) if outcome[0] != "ok"}
    if not failures and not hung:
        return [outcomes[rank][1] for rank in range(world_size)]

    parts = []
    if hung and not failures:
        parts.append(
            f"{name}: timed out after timeout={timeout}s; ranks {hung} were still running and were killed"
        )
    else:
        parts.append(f"{name}: ranks {sorted(failures)} failed")
    for rank, (kind, text) in failures.items():
        parts.append(f"----- rank {rank} {kind} -----\n{text}")
    for rank in hung:
        why = "timeout" if not failures else f"still running {_GRACE_AFTER_FAILURE_S}s after another rank failed"
        parts.append(f"----- rank {rank} killed ({why}); its Python stacks -----\n{hung_stacks.get(rank, '')}")
    raise AssertionError("\n".join(parts))


# --------------------------------------------------------------------------------------------------
# Zygote and launches: ranks meant to be killed
# --------------------------------------------------------------------------------------------------


def _rank_entry(payload: bytes, rank: int, world_size: int, port: int, prefix: str) -> None:
    _enter_rank(rank, world_size, port)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))

    def report(name: str, value: Any = None) -> None:
        store.set(f"{prefix}/report/{rank}/{name}", pickle.dumps(value))

    try:
        _join_group(dist.PrefixStore(f"{prefix}/pg", store), rank, world_size, 60)
    except BaseException:
        outcome = ("raised", traceback.format_exc())
    else:
        outcome = _call(payload, rank, world_size, report)
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
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:  # it ended between the look and the kill
                    pass
                # gone before this returns: a process tearing down its memory after SIGKILL still shows as running
                # for a while, and a lease it held (CheckpointManager's) would read as live to the next manager
                end = time.monotonic() + 30
                while _alive(pid) and time.monotonic() < end:
                    time.sleep(0.005)
        outcomes = {}
        for rank in range(len(self.pids)):
            result = self._result(rank)
            if result is not None:
                outcomes[rank] = result
            else:
                outcomes[rank] = ("killed" if rank in self.killed else "died", None)
        return outcomes


class Zygote:
    """Forks rank processes cheaply; one per test module (``close()`` it)."""

    def __init__(self):
        marks.require("distributed", "starts rank processes")
        ctx = start_forkserver()
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_zygote_main, args=(child,), name="dcp-zarr-test-zygote", daemon=True)
        self._process.start()
        child.close()
        self._store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
        self._launches = 0
        self._lock = threading.Lock()

    def launch(self, fn: Callable, world_size: int, *args, **kwargs) -> Launch:
        marks.require("distributed", "starts rank processes")
        payload = _payload(fn, args, kwargs)
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
