"""Multi-process test machinery: launch gloo ranks on CPU, build sharded models, save/load, compare.

Import it from test modules as ``from tests import distributed``.

Launching
    ``run_ranks(fn, world_size, *args, timeout=120, **kwargs)`` forks ``world_size`` processes from a
    forkserver that has already imported torch (a fresh interpreter per rank spends ~2 s of CPU importing
    torch; forking takes milliseconds), joins them into one gloo group through a TCPStore held by the
    calling process on a kernel-chosen port (so back-to-back launches never race for a port), runs
    ``fn(rank, world_size, *args, **kwargs)`` on every rank and returns the per-rank results.
    ``fn`` must be a module-level function of a test module or a ``tests/`` module.

Models
    One architecture, ``ToyModel``, serves every layout, so a checkpoint saved under any layout loads
    into any other. Its dims are odd on purpose: torch.chunk splits them unevenly and leaves some ranks
    with empty shards at world size 4.

Save / load, as a checkpointing user would, with any DCP storage writer / reader
    ``save_checkpoint(model, optim, writer)`` / ``load_checkpoint(model, optim, reader)``;
    whole rank programs: ``train_and_save(rank, world_size, layout, writer)`` and
    ``load_fresh(rank, world_size, layout, reader)``, both returning ``full_state`` (rank 0 only).
"""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

__all__ = [
    "LAYOUTS",
    "ToyModel",
    "assert_state_equal",
    "build",
    "full_state",
    "load_checkpoint",
    "load_fresh",
    "local_shapes",
    "make_batch",
    "make_model",
    "make_optimizer",
    "make_tp_model",
    "prime_optimizer",
    "run_ranks",
    "save_checkpoint",
    "shard",
    "shard_fsdp2",
    "shard_fsdp_tp",
    "shard_hsdp",
    "train_and_save",
    "train_steps",
]

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_REPO_DIR = os.path.dirname(_TESTS_DIR)

# After one rank fails, the others are usually blocked in a collective that will never complete.
_GRACE_AFTER_FAILURE_S = 3.0
# A rank that has sent its result still has to tear down gloo and exit.
_EXIT_WAIT_S = 10.0

# --------------------------------------------------------------------------------------------------
# Launching ranks
# --------------------------------------------------------------------------------------------------

_context: multiprocessing.context.BaseContext | None = None


def _forkserver_context() -> multiprocessing.context.BaseContext:
    global _context
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        # The forkserver imports these once; every rank is then a cheap fork of it. The forkserver
        # gets this process's sys.path, so this module (and tests/) import there under the same name.
        ctx.set_forkserver_preload(
            [
                "torch",
                "torch._dynamo",  # fully_shard imports it lazily: ~1.4 s per rank otherwise
                "torch.distributed.checkpoint",
                "torch.distributed.fsdp",
                "torch.distributed.tensor.parallel",
                __name__,
            ]
        )
        _context = ctx
        atexit.register(_stop_forkserver)
    return _context


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
    try:
        store = dist.TCPStore(
            "127.0.0.1", store_port, world_size, is_master=False, timeout=timedelta(seconds=timeout)
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
        )
        # Unpickled only now, with tests/ on sys.path, so fn and args from test modules resolve.
        fn, args, kwargs = pickle.loads(payload)
        outcome = ("ok", fn(rank, world_size, *args, **kwargs))
    except BaseException:
        # BaseException: CheckpointException is one, and so are SystemExit and KeyboardInterrupt.
        outcome = ("raised", traceback.format_exc())
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
    try:
        payload = pickle.dumps((fn, args, kwargs))
    except Exception as e:
        raise TypeError(
            f"run_ranks needs a module-level fn and picklable args (a test module or tests/ module): {e}"
        ) from e
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
# The model
# --------------------------------------------------------------------------------------------------

VOCAB = 17  # embedding rows: 17 -> 9/8 on 2 ranks, 6/6/5 on 3, 5/5/5/2 on 4
DIM = 13  # model width: 13 -> 7/6, 5/5/3, 4/4/4/1
HIDDEN = 5  # block hidden: 5 -> 3/2, 2/2/1, 2/2/1/0 (an empty shard at world size 4)
FFN = 18  # tensor-parallel hidden: must be even (TP splits it in two); FSDP then splits each half 5/4
OUT = 3  # output features: 3 -> 2/1, 1/1/1, 1/1/1/0 (an empty shard at world size 4)
TOKENS = 24  # one flat batch: 2-D activations, so the root's output is not a view (FSDP2 warns on views)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class FeedForward(nn.Module):
    """The pair that tensor parallelism splits: ``up`` column-wise, ``down`` row-wise."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, FFN)
        self.down = nn.Linear(FFN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class ToyModel(nn.Module):
    """embed -> 2 blocks -> ffn -> norm -> head, with odd dims.

    ``embed.weight`` is frozen and ``spare`` is never called, so after training the optimizer has
    Adam state for neither: optimizer state dicts cover only some parameters.
    """

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.embed.weight.requires_grad_(False)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ffn = FeedForward()
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, OUT)
        self.spare = nn.Linear(DIM, OUT)  # never used in forward: never gets a gradient

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(self.ffn(x)))


def make_model(seed: int = 0) -> ToyModel:
    """A deterministic, unsharded ToyModel (same values on every rank for the same seed)."""
    torch.manual_seed(seed)
    return ToyModel()


# Every layout uses the same ToyModel; the alias names the intent where TP is involved.
make_tp_model = make_model


def make_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic ``(tokens, target)``: tokens ``(TOKENS,)`` int64, target ``(TOKENS, OUT)`` float32."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    target = torch.randn(TOKENS, OUT, generator=g)
    return tokens, target


# --------------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------------


def _fully_shard_blocks_and_root(model: ToyModel, mesh) -> ToyModel:
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def shard_fsdp2(model: ToyModel, world_size: int) -> ToyModel:
    """FSDP2 on a 1-D CPU mesh: each block, then the root (which holds embed, ffn, norm, head, spare)."""
    return _fully_shard_blocks_and_root(model, init_device_mesh("cpu", (world_size,)))


def shard_hsdp(model: ToyModel, world_size: int = 4) -> ToyModel:
    """HSDP: replicate over "rep" (2), shard over "shard" (world_size // 2); placements (Replicate(), Shard(0))."""
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("rep", "shard"))
    return _fully_shard_blocks_and_root(model, mesh)


def shard_fsdp_tp(model: ToyModel, world_size: int = 4) -> ToyModel:
    """TP over "tp" (2) on ``ffn`` (up column-wise, down row-wise), then FSDP2 over "dp" (world_size // 2)."""
    mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model.ffn, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return _fully_shard_blocks_and_root(model, mesh["dp"])


LAYOUTS = ("plain", "fsdp2", "hsdp", "fsdp_tp")


def shard(model: ToyModel, layout: str, world_size: int) -> ToyModel:
    """Apply ``layout`` to ``model``; "plain" leaves it unsharded (replicated on every rank)."""
    if layout == "plain":
        return model
    if layout == "fsdp2":
        return shard_fsdp2(model, world_size)
    if layout in ("hsdp", "fsdp_tp"):
        if world_size % 2 or world_size < 4:
            raise ValueError(f"layout {layout!r} needs an even world size >= 4, got {world_size}")
        return shard_hsdp(model, world_size) if layout == "hsdp" else shard_fsdp_tp(model, world_size)
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # All parameters, frozen and unused included, as a careless user would: they get no Adam state.
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def build(layout: str, world_size: int, seed: int = 0) -> tuple[ToyModel, torch.optim.Optimizer]:
    """A fresh ``make_model(seed)`` sharded as ``layout`` and its AdamW (no state yet)."""
    model = shard(make_model(seed), layout, world_size)
    return model, make_optimizer(model)


def local_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Each parameter's local (this rank's) shape; the full shape for plain tensors."""
    return {
        name: tuple((p.to_local() if isinstance(p, DTensor) else p).shape)
        for name, p in model.named_parameters()
    }


# --------------------------------------------------------------------------------------------------
# Training, saving, loading
# --------------------------------------------------------------------------------------------------


def _loss(model: nn.Module, batch_seed: int) -> torch.Tensor:
    tokens, target = make_batch(batch_seed)
    return nn.functional.mse_loss(model(tokens), target)


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, n: int, first_batch: int = 0) -> None:
    """``n`` optimizer steps on ``make_batch(first_batch + i)``; every rank sees the same batch."""
    for i in range(n):
        optimizer.zero_grad(set_to_none=True)
        _loss(model, first_batch + i).backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def prime_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create Adam state for exactly the parameters that train, without changing any parameter.

    ``get_state_dict`` on a stateless optimizer would instead fake a step on *every* requires_grad
    parameter, ``spare`` included, and the load would then ask the checkpoint for state it never had
    ("Missing key in checkpoint state_dict: optim.state.spare.bias.step", NeMo-Automodel #2071).
    A real backward at lr=0 gives state to the same parameters as training did.
    """
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    train_steps(model, optimizer, 1, first_batch=-1)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr


def save_checkpoint(model: nn.Module, optim: torch.optim.Optimizer, writer, planner=None) -> None:
    """``dcp.save({"model": ..., "optim": ...})`` of ``get_state_dict`` through ``writer``."""
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, storage_writer=writer, planner=planner)


def load_checkpoint(model: nn.Module, optim: torch.optim.Optimizer, reader, planner=None) -> None:
    """Load a ``save_checkpoint`` checkpoint through ``reader`` into ``model``/``optim`` (any layout).

    ``set_state_dict`` runs with ``strict=False`` because, strict, torch 2.13 refuses optimizer state
    that lacks a requires_grad parameter ("Missing optimizer state for parameter 'spare.weight'"), and
    ``spare`` never trains. The model keys cannot mismatch: they come from this same model, and
    ``dcp.load`` has already failed on any key the checkpoint lacks.
    """
    if not optim.state:
        prime_optimizer(model, optim)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=reader, planner=planner)
    set_state_dict(
        model,
        optim,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=StateDictOptions(strict=False),
    )


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any] | None:
    """The unsharded ``{"model": ..., "optim": ...}`` as plain CPU tensors and Python values, on rank 0.

    Collective: every rank must call it. Other ranks get None (DCP gathers full tensors to rank 0 only
    when offloading to CPU). Optimizer state is keyed by parameter FQN, so it compares across layouts.
    Call it after training or loading: on a stateless optimizer ``get_state_dict`` first fakes a step.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, optim, options=options)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    return _plain({"model": msd, "optim": osd})


def _plain(value: Any) -> Any:
    if isinstance(value, DTensor):
        raise TypeError("full_state got a DTensor; expected full tensors")
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def train_and_save(rank: int, world_size: int, layout: str, writer, steps: int = 2, seed: int = 0):
    """Rank program: build ``layout``, train ``steps`` AdamW steps, save through ``writer``.

    Returns ``(full_state, local_shapes)``: the full state of what was saved (rank 0; None elsewhere)
    and this rank's local parameter shapes.
    """
    model, optim = build(layout, world_size, seed)
    train_steps(model, optim, steps)
    save_checkpoint(model, optim, writer)
    return full_state(model, optim), local_shapes(model)


def load_fresh(rank: int, world_size: int, layout: str, reader, seed: int = 1):
    """Rank program: build ``layout`` from a different seed, load through ``reader``, return ``full_state``."""
    model, optim = build(layout, world_size, seed)
    load_checkpoint(model, optim, reader)
    return full_state(model, optim)


# --------------------------------------------------------------------------------------------------
# Comparing states
# --------------------------------------------------------------------------------------------------


def _element_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a (numel, itemsize) uint8 matrix: compares -0.0/0.0 and NaN payloads by their bits."""
    # clone: contiguous() keeps the odd strides of an empty tensor, which view(torch.uint8) then refuses
    flat = t.reshape(-1).clone() if t.numel() == 0 else t.contiguous().reshape(-1)
    return flat.view(torch.uint8).reshape(t.numel(), t.element_size())


def _first_difference(a: Any, b: Any, path: str) -> str | None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: {type(a).__name__} vs {type(b).__name__}"
        if isinstance(a, DTensor) or isinstance(b, DTensor):
            return f"{path}: DTensor found; compare full states (full_state)"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        differs = (_element_bytes(a) != _element_bytes(b)).any(dim=1)
        if differs.any():
            index = int(differs.nonzero()[0])
            where = tuple(int(i) for i in torch.unravel_index(torch.tensor(index), a.shape)) if a.dim() else ()
            x, y = a.reshape(-1)[index].item(), b.reshape(-1)[index].item()
            return f"{path}: tensors differ first at index {where}: {x!r} vs {y!r}"
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            only_a = sorted(set(a) - set(b), key=repr)
            only_b = sorted(set(b) - set(a), key=repr)
            return f"{path}: keys only in first {only_a}, only in second {only_b}"
        for key in a:
            found = _first_difference(a[key], b[key], f"{path}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return f"{path}: {type(a).__name__} of {len(a)} vs {type(b).__name__} of {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            found = _first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    if type(a) is not type(b):
        return f"{path}: {type(a).__name__} {a!r} vs {type(b).__name__} {b!r}"
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return None
    if a != b:
        return f"{path}: {a!r} vs {b!r}"
    return None


def assert_state_equal(a: Any, b: Any) -> None:
    """Bit-exact comparison of nested dicts/lists/tuples of tensors and Python values.

    Raises AssertionError naming the first differing key path,
    e.g. ``state['optim']['state']['head.weight']['exp_avg']``.
    """
    found = _first_difference(a, b, "state")
    if found:
        raise AssertionError(f"states differ at {found}")
