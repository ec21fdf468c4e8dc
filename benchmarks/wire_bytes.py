"""Bytes that torch's collectives carry per rank, per save and per load, counted in real gloo ranks on the CPU.

    python benchmarks/wire_bytes.py                                   # 2, 4 and 8 ranks x 240 and 960 tensors
    python benchmarks/wire_bytes.py --world-sizes 4 --kinds zarr_local,zarr_default --saves 2

Each rank wraps the tensor collectives of ``torch.distributed.distributed_c10d`` (the module-level names that its
object collectives call: ``gather_object`` calls ``all_gather`` + ``gather``, ``scatter_object_list`` ``broadcast``
+ ``scatter``, ``broadcast_object_list`` ``broadcast``, ``all_gather_object`` ``all_gather``; plus every other
tensor collective and point-to-point call, and ``torch.distributed``'s bindings of the same functions) and counts
the calls and the bytes of every tensor each call touches on that rank, inputs and outputs: a gather's destination
counts its gather list, a scatter's source its scatter list. Each object collective is also recorded with its
caller and what it carried (``object_calls``), so a figure that grows can be traced to the object that grows.
``torch.distributed._functional_collectives`` (DTensor's redistributions) is counted apart (``functional``): it
does not go through those functions, and a save or load of local shards should make none.

A self-check runs in every launch before anything else: a ``gather_object``, ``scatter_object_list``,
``broadcast_object_list`` and ``all_gather_object`` of known payloads must count exactly the bytes torch's own
code moves (sizes as int64 tensors, payloads padded to the largest); a mismatch stops the run.

The state: an FSDP2 (``fully_shard`` per layer and at the root, on ``init_device_mesh("cpu", (ws,))``) stack of
``nn.Linear(8, 8)`` layers with AdamW state after one step, from ``get_state_dict``: 8 tensors per layer (weight,
bias; ``step``, ``exp_avg``, ``exp_avg_sq`` of each), so 30 layers hold 240 tensors and 120 layers 960 (plus the
param group's non-tensor values). The tensors are tiny: what is counted is the protocol, not the data, which moves
through files.

Kinds, each launched in fresh rank processes (DCP's plan cache is class-level state), saving ``--saves`` times in a
row into new directories under ``--target``: ``save_first`` is the first ``dcp.save`` of the process, ``save_later``
the last one.

- ``zarr_local``: ``ZarrWriter`` with ``dcp_zarr.ZarrSavePlanner`` (the locally planned save); then loads of its
  first checkpoint: ``load_zarr`` (``ZarrReader(read_once=True)``, as it reads from object stores, DCP's default
  load planner) and ``load_zarr_zlp`` (the same with ``dcp_zarr.ZarrLoadPlanner``);
- ``zarr_default``: ``ZarrWriter`` with DCP's ``DefaultSavePlanner``;
- ``fs_default``: DCP's ``FileSystemWriter`` with its default planner; then ``load_fs`` (``FileSystemReader``);
- ``zarr_cached``: ``ZarrWriter`` with ``DefaultSavePlanner(enable_plan_caching=True)`` (a new planner each save,
  as Megatron-core and NeMo pass it).

Reported per operation: the coordinator's (rank 0, which receives the gathers) bytes and calls, and a rank's (the
largest of ranks 1..ws-1), with the ratio 960/240 of each. Output: ``--out`` (JSON, default
``benchmarks/results/wire_bytes.json``) and a Markdown table beside it (``.md``), both stamped with the torch
version and the commit (``git rev-parse --short HEAD``, dirty or not); the table is printed too.

The counting (``WireCounter``, ``self_check``) and one rank's measurement (``measure_rank``) are importable:
tests/test_wire_bytes.py runs ``measure_rank`` on its own ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import inspect
import json
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

BENCHMARKS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(BENCHMARKS_DIR)
if REPO_DIR not in sys.path:
    sys.path.append(REPO_DIR)

TENSORS_PER_LAYER = 8  # weight, bias; step, exp_avg, exp_avg_sq of each
WIDTH = 8

# Every module-level tensor collective and point-to-point call of distributed_c10d. The object collectives look
# these names up in that module's globals at each call, so replacing the attribute is enough for them; DCP and
# dcp_zarr call ``dist.X``, torch.distributed's binding of the same function, which is replaced too.
TENSOR_COLLECTIVES = (
    "all_gather", "gather", "broadcast", "scatter", "all_reduce", "reduce", "barrier", "monitored_barrier",
    "all_gather_into_tensor", "_all_gather_base", "all_gather_coalesced", "all_reduce_coalesced",
    "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all", "all_to_all_single",
    "send", "recv", "isend", "irecv", "batch_isend_irecv",
)  # fmt: skip
OBJECT_COLLECTIVES = (
    "gather_object", "scatter_object_list", "broadcast_object_list", "all_gather_object", "send_object_list",
    "recv_object_list",
)  # fmt: skip
# What each object collective sends from this rank, and what it fills on the ranks that receive.
SENT_ARGUMENT = {"gather_object": "obj", "scatter_object_list": "scatter_object_input_list",
                 "broadcast_object_list": "object_list", "all_gather_object": "obj", "send_object_list": "object_list"}
RECEIVED_ARGUMENT = {"gather_object": "object_gather_list", "scatter_object_list": "scatter_object_output_list",
                     "broadcast_object_list": "object_list", "all_gather_object": "object_list",
                     "recv_object_list": "object_list"}
FUNCTIONAL_COLLECTIVES = (
    "broadcast", "all_reduce", "all_gather_tensor", "all_gather_tensor_autograd", "reduce_scatter_tensor",
    "reduce_scatter_tensor_autograd", "all_reduce_coalesced", "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor_coalesced", "all_to_all_single", "all_to_all_single_autograd", "permute_tensor",
)  # fmt: skip

# Where dcp_zarr moves the checkpoint's own bytes over the process group instead of through storage (issue 25's
# collective I/O: aggregated writes, reads done once, the root zarr.json read by one rank): counted apart, as
# ``payload_bytes``. It is data, O(the checkpoint's bytes) like the files, not the planning protocol that ``bytes``
# counts, which must not grow with the tensors a rank holds.
PAYLOAD_SITES = {("exchange", "transfer.py"), ("_manifest_read_once", "reader.py")}

SAVE_KINDS = ("zarr_local", "zarr_default", "fs_default", "zarr_cached")
LOADS_AFTER = {"zarr_local": ("load_zarr", "load_zarr_zlp"), "fs_default": ("load_fs",)}
LOCALLY_PLANNED = ("zarr_local", "load_zarr", "load_zarr_zlp")  # the operations meant not to grow
KIND_TITLES = {
    "zarr_local": "ZarrWriter + ZarrSavePlanner",
    "zarr_default": "ZarrWriter + DefaultSavePlanner",
    "fs_default": "FileSystemWriter",
    "zarr_cached": "ZarrWriter + DefaultSavePlanner(enable_plan_caching=True)",
    "load_zarr": "ZarrReader",
    "load_zarr_zlp": "ZarrReader + ZarrLoadPlanner",
    "load_fs": "FileSystemReader",
}


# --------------------------------------------------------------------------------------------------
# Counting
# --------------------------------------------------------------------------------------------------


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor in ``value`` (a tensor, a P2POp, or lists/tuples of them, nested)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, c10d.P2POp):
        return tensor_bytes(value.tensor)
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def describe(obj: Any, depth: int = 0) -> str:
    """A short description of what an object collective carried: types, and the length of every list."""
    name = type(obj).__name__
    if obj is None:
        return "None"
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):  # a NamedTuple (Summary, Ticket) by name
        kinds = sorted({describe(v, depth + 1) for v in obj}) if depth < 2 else sorted({type(v).__name__ for v in obj})
        return f"{name}[{len(obj)}] of {' | '.join(kinds[:4]) or '-'}{' | ...' if len(kinds) > 4 else ''}"
    items = getattr(obj, "items", None)
    if isinstance(items, list):
        extras = [f"items={len(items)}"]
        for field in ("storage_data", "planner_data"):
            if getattr(obj, field, None) is not None:
                extras.append(f"{field}={type(getattr(obj, field)).__name__}")
        return f"{name}({', '.join(extras)})"
    if name == "WriteResult":
        return f"WriteResult({type(obj.storage_data).__name__})"
    return name


def _from_payload_site() -> bool:
    frame = sys._getframe(2)
    for _ in range(40):
        if frame is None:
            return False
        if (frame.f_code.co_name, os.path.basename(frame.f_code.co_filename)) in PAYLOAD_SITES:
            return True
        frame = frame.f_back
    return False


def _caller() -> str:
    """The first two frames outside distributed_c10d and this module: who called the object collective."""
    frames = []
    frame = sys._getframe(2)
    while frame is not None and len(frames) < 2:
        path = frame.f_code.co_filename
        if path not in (c10d.__file__, __file__) and not path.endswith("c10d_logger.py"):
            tail = "/".join(path.replace(os.sep, "/").split("/")[-2:])
            frames.append(f"{tail}:{frame.f_code.co_name}")
        frame = frame.f_back
    return " < ".join(frames)


class WireCounter:
    """Counts, in this process, the calls and tensor bytes of torch's collectives while installed.

    ``with counter.measure() as counts:`` yields a dict filled when the block ends: ``bytes``, ``calls``,
    ``by_collective`` (name -> [calls, bytes]), ``object_calls`` (one record per object collective: name,
    caller, what this rank sent and its pickled size, what it received, and the bytes and calls of the tensor
    collectives it made: a gathered payload is padded to the largest rank's, so one rank's large object is
    every rank's) and ``functional`` (calls and input bytes of functional collectives).
    """

    def __init__(self) -> None:
        self._originals: list[tuple[Any, str, Any]] = []
        self._lock = threading.Lock()
        self._outer = threading.local()
        self.reset()

    def reset(self) -> None:
        self.by_collective: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self.payload: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # PAYLOAD_SITES' calls, apart
        self.object_calls: list[dict[str, Any]] = []
        self.functional: dict[str, list[int]] = defaultdict(lambda: [0, 0])

    def install(self) -> WireCounter:
        import torch.distributed._functional_collectives as funcol

        if self._originals:
            return self
        for name in TENSOR_COLLECTIVES:
            self._replace(name, self._tensor_wrapper)
        for name in OBJECT_COLLECTIVES:
            self._replace(name, self._object_wrapper)
        for name in FUNCTIONAL_COLLECTIVES:
            original = getattr(funcol, name, None)
            if original is not None:
                self._originals.append((funcol, name, original))
                setattr(funcol, name, self._functional_wrapper(name, original))
        return self

    def uninstall(self) -> None:
        for module, name, original in reversed(self._originals):
            setattr(module, name, original)
        self._originals.clear()

    def _replace(self, name: str, make: Callable[[str, Any], Any]) -> None:
        original = getattr(c10d, name, None)
        if original is None:
            return
        wrapper = make(name, original)
        for module in (c10d, dist):
            if getattr(module, name, None) is original:
                self._originals.append((module, name, original))
                setattr(module, name, wrapper)

    def _tensor_wrapper(self, name: str, original: Any) -> Any:
        def counted(*args, **kwargs):
            nbytes = tensor_bytes(list(args)) + tensor_bytes(list(kwargs.values()))
            if name in ("isend", "irecv") and not nbytes:  # called by batch_isend_irecv with the P2POp's tensor
                nbytes = tensor_bytes([kwargs.get("tensor")])
            payload = _from_payload_site()
            with self._lock:
                entry = (self.payload if payload else self.by_collective)[name]
                entry[0] += 1
                entry[1] += nbytes
                outer = getattr(self._outer, "record", None)
                if outer is not None and payload:
                    outer["payload"] = True
                elif outer is not None:
                    outer["bytes"] += nbytes
                    outer["tensor_calls"] += 1
            return original(*args, **kwargs)

        counted.__wrapped__ = original  # type: ignore[attr-defined]
        return counted

    def _object_wrapper(self, name: str, original: Any) -> Any:
        signature = inspect.signature(original)

        def counted(*args, **kwargs):
            arguments = signature.bind_partial(*args, **kwargs).arguments
            sent = arguments.get(SENT_ARGUMENT.get(name, ""))
            record = {"name": name, "caller": _caller(), "sent": describe(sent), "sent_bytes": _pickled_size(sent),
                      "received": None, "received_bytes": None, "bytes": 0, "tensor_calls": 0}
            previous = getattr(self._outer, "record", None)
            self._outer.record = record
            try:
                return original(*args, **kwargs)
            finally:
                self._outer.record = previous
                received = arguments.get(RECEIVED_ARGUMENT.get(name, ""))
                if received is not None:
                    record["received"] = describe(received)
                    record["received_bytes"] = _pickled_size(received)
                with self._lock:
                    self.object_calls.append(record)

        counted.__wrapped__ = original  # type: ignore[attr-defined]
        return counted

    def _functional_wrapper(self, name: str, original: Any) -> Any:
        def counted(*args, **kwargs):
            with self._lock:
                entry = self.functional[name]
                entry[0] += 1
                entry[1] += tensor_bytes(list(args)) + tensor_bytes(list(kwargs.values()))
            return original(*args, **kwargs)

        return counted

    def snapshot(self) -> dict[str, Any]:
        by_collective = {name: list(v) for name, v in sorted(self.by_collective.items())}
        return {
            "bytes": sum(v[1] for v in by_collective.values()),
            "calls": sum(v[0] for v in by_collective.values()),
            "by_collective": by_collective,
            "object_calls": [dict(r) for r in self.object_calls if not r.get("payload")],
            "functional": {name: list(v) for name, v in sorted(self.functional.items())},
            "payload_bytes": sum(v[1] for v in self.payload.values()),
            "payload_calls": sum(v[0] for v in self.payload.values()),
        }

    @contextlib.contextmanager
    def measure(self) -> Iterator[dict[str, Any]]:
        counts: dict[str, Any] = {}
        self.reset()
        try:
            yield counts
        finally:
            counts.update(self.snapshot())
            self.reset()


def _pickled_size(obj: Any) -> int | None:
    """What ``_object_to_tensor``'s pickle.Pickler writes for ``obj`` (before padding to the largest rank's)."""
    if obj is None:
        return None
    try:
        return len(pickle.dumps(obj))
    except Exception:  # e.g. ZarrSavePlanner's RankState, which refuses to be sent
        return None


def self_check(counter: WireCounter, rank: int, world_size: int) -> dict[str, Any]:
    """Object collectives of known payloads must count exactly the bytes torch moves; raises if not.

    Payloads differ in size per rank, so padding to the largest (gather_object, all_gather_object,
    scatter_object_list) shows. int64 size tensors are 8 bytes per object.
    """
    payload = [bytes(1000 + 37 * r) for r in range(world_size)]
    sizes = [len(pickle.dumps(p)) for p in payload]
    largest, ws = max(sizes), world_size
    expected: dict[str, dict[str, list[int]]] = {
        # all_gather of each rank's size (8 in, 8 x ws out), then gather of the padded payload (and, on the
        # destination, the gather list of ws padded payloads)
        "gather_object": {"all_gather": [1, 8 + 8 * ws], "gather": [1, largest + (ws * largest if rank == 0 else 0)]},
        # broadcast of the largest size, scatter of the padded payloads, scatter of each one's size
        "scatter_object_list": {"broadcast": [1, 8], "scatter": [
            2, largest + 8 + ((ws * largest + 8 * ws) if rank == 0 else 0)]},
        # broadcast of the sizes of the list's objects, then of their concatenation
        "broadcast_object_list": {"broadcast": [2, 8 * 2 + sizes[0] + sizes[1]]},
        # all_gather of sizes, then all_gather of the padded payloads (ws of them out)
        "all_gather_object": {"all_gather": [2, 8 + 8 * ws + largest + ws * largest]},
    }
    found: dict[str, dict[str, list[int]]] = {}
    with counter.measure() as counts:
        dist.gather_object(payload[rank], [None] * ws if rank == 0 else None, dst=0)
    found["gather_object"] = counts["by_collective"]
    out: list[Any] = [None]
    with counter.measure() as counts:
        dist.scatter_object_list(out, payload if rank == 0 else None, src=0)
    found["scatter_object_list"] = counts["by_collective"]
    assert out[0] == payload[rank]
    box: list[Any] = [payload[0], payload[1]] if rank == 0 else [None, None]
    with counter.measure() as counts:
        dist.broadcast_object_list(box, src=0)
    found["broadcast_object_list"] = counts["by_collective"]
    gathered: list[Any] = [None] * ws
    with counter.measure() as counts:
        dist.all_gather_object(gathered, payload[rank])
    found["all_gather_object"] = counts["by_collective"]
    if found != expected:
        raise AssertionError(f"rank {rank}: the wire counter's self-check failed: counted {found}, "
                             f"torch's object collectives move {expected}")
    return {"ok": True, "payload_bytes": sizes, "counted": found}


# --------------------------------------------------------------------------------------------------
# The state and one rank's measurement
# --------------------------------------------------------------------------------------------------


class Stack(torch.nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # never called: the state is made without training
        for layer in self.layers:
            x = layer(x)
        return x


def count_tensors(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):
        return 1
    if isinstance(tree, dict):
        return sum(count_tensors(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(count_tensors(v) for v in tree)
    return 0


def build_state(world_size: int, tensors: int) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` of an FSDP2 stack holding ``tensors`` tensors (a multiple of 8)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if tensors % TENSORS_PER_LAYER:
        raise ValueError(f"--tensors: {tensors} is not a multiple of {TENSORS_PER_LAYER}")
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,))
    model = Stack(tensors // TENSORS_PER_LAYER)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():  # one step's state without a forward pass (FSDP's collectives are not counted)
        p.grad = torch.full_like(p, 0.01)
    optim.step()
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    found = count_tensors(state)
    if found != tensors:
        raise AssertionError(f"the state holds {found} tensors, not {tensors}")
    return state


def _writer(kind: str, path: str):
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from dcp_zarr import ZarrSavePlanner, ZarrWriter

    if kind == "fs_default":
        return FileSystemWriter(path, thread_count=1, sync_files=False), None
    writer = ZarrWriter(path, thread_count=1, sync_files=False)
    if kind == "zarr_local":
        return writer, ZarrSavePlanner()
    if kind == "zarr_default":
        return writer, None
    if kind == "zarr_cached":
        return writer, DefaultSavePlanner(enable_plan_caching=True)
    raise ValueError(f"unknown kind {kind!r}: expected one of {', '.join(SAVE_KINDS)}")


def _reader(load: str, path: str):
    from torch.distributed.checkpoint import FileSystemReader

    from dcp_zarr import ZarrLoadPlanner, ZarrReader

    if load == "load_fs":
        return FileSystemReader(path), None
    if load == "load_zarr":  # read_once=True: reads shared as on object stores (a local path's default is not to)
        return ZarrReader(path, read_once=True), None
    if load == "load_zarr_zlp":
        return ZarrReader(path, read_once=True), ZarrLoadPlanner()
    raise ValueError(f"unknown load {load!r}")


def measure_rank(rank: int, world_size: int, kinds: list[str], tensors: int, root: str, saves: int = 3,
                 loads: bool = True) -> dict[str, Any]:
    """On one rank of an initialised gloo group: the counts of each kind's first and last save (``saves`` in a
    row) and of the loads after it (``LOADS_AFTER``), in ``kinds``' order. Only the first kind's first save is the
    first ``dcp.save`` of the process: give a kind whose planner caches its own launch."""
    import torch.distributed.checkpoint as dcp

    counter = WireCounter().install()
    try:
        result: dict[str, Any] = {"rank": rank, "self_check": self_check(counter, rank, world_size), "ops": {}}
        state = build_state(world_size, tensors)
        for kind in kinds:
            paths = [os.path.join(root, f"{kind}-{tensors}-{i}") for i in range(saves)]
            for i, path in enumerate(paths):
                writer, planner = _writer(kind, path)
                dist.barrier()
                with counter.measure() as counts:
                    dcp.save(state, storage_writer=writer, planner=planner)
                if i == 0:
                    result["ops"][f"{kind}/save_first"] = counts
                if i == saves - 1 and saves > 1:
                    result["ops"][f"{kind}/save_later"] = counts
            for load in LOADS_AFTER.get(kind, ()) if loads else ():
                reader, load_planner = _reader(load, paths[0])
                dist.barrier()
                with counter.measure() as counts:
                    dcp.load(state, storage_reader=reader, planner=load_planner)
                result["ops"][f"{load}/load"] = counts
        dist.barrier()
        return result
    finally:
        counter.uninstall()


# --------------------------------------------------------------------------------------------------
# Launching ranks: fresh processes per kind, forked from one forkserver that imported torch once
# --------------------------------------------------------------------------------------------------

_PRELOAD = ["torch", "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.fsdp", "dcp_zarr",
            "wire_bytes"]


def _rank_entry(rank: int, world_size: int, port: int, conn, args: tuple, timeout_s: float) -> None:
    os.setpgrp()
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        outcome: tuple[str, Any] = ("ok", measure_rank(rank, world_size, *args))
    except BaseException:
        outcome = ("raised", traceback.format_exc())
    conn.send_bytes(pickle.dumps(outcome))
    conn.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: gloo's threads may still hold the last collective's tensors


def _context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    if BENCHMARKS_DIR not in sys.path:
        sys.path.insert(0, BENCHMARKS_DIR)
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def launch(world_size: int, kinds: list[str], tensors: int, root: str, saves: int, timeout_s: float) -> list[dict]:
    """Run ``measure_rank`` on ``world_size`` fresh rank processes; each rank's result, or RuntimeError with the
    tracebacks of the ranks that failed."""
    import wire_bytes  # the target must be importable by name in the forkserver, not __main__'s

    ctx = _context()
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    processes, conns = [], {}
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            process = ctx.Process(target=wire_bytes._rank_entry, name=f"rank{rank}",
                                  args=(rank, world_size, store.port, writer, (kinds, tensors, root, saves),
                                        timeout_s))
            process.start()
            writer.close()
            processes.append(process)
            conns[reader] = rank
        outcomes: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while conns and time.monotonic() < deadline:
            for conn in multiprocessing.connection.wait(list(conns), timeout=deadline - time.monotonic()):
                rank = conns.pop(conn)
                try:
                    outcomes[rank] = pickle.loads(conn.recv_bytes())
                except EOFError:
                    outcomes[rank] = ("died", "exited without reporting")
                conn.close()
                if outcomes[rank][0] != "ok":
                    deadline = min(deadline, time.monotonic() + 3)
        for rank in conns.values():
            outcomes[rank] = ("hung", f"still running after {timeout_s} s (or after another rank failed)")
    finally:
        for process in processes:
            process.join(10)
            if process.is_alive() and process.pid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.join()
        del store
    failed = {r: o for r, o in sorted(outcomes.items()) if o[0] != "ok"}
    if failed:
        text = "\n".join(f"----- rank {r} {kind} -----\n{detail}" for r, (kind, detail) in failed.items())
        raise RuntimeError(f"{world_size} ranks, {tensors} tensors, kinds {kinds}: ranks {sorted(failed)} failed\n"
                           + text)
    return [outcomes[r][1] for r in range(world_size)]


# --------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------


def summarize(per_rank: list[dict], op: str) -> dict[str, Any]:
    """The coordinator's (rank 0) and a rank's (the largest of ranks 1..) counts of ``op``."""
    counts = [r["ops"][op] for r in per_rank]
    others = max(counts[1:], key=lambda c: (c["bytes"], c["calls"])) if len(counts) > 1 else counts[0]
    return {
        "coordinator_bytes": counts[0]["bytes"], "coordinator_calls": counts[0]["calls"],
        "rank_bytes": others["bytes"], "rank_calls": others["calls"],
        "payload_bytes_per_rank": [c.get("payload_bytes", 0) for c in counts],
        "bytes_per_rank": [c["bytes"] for c in counts],
        "by_collective_coordinator": counts[0]["by_collective"],
        "by_collective_rank": others["by_collective"],
        "object_calls_coordinator": counts[0]["object_calls"],
        "object_calls_rank": others["object_calls"],
        "functional_calls": sum(v[0] for c in counts for v in c["functional"].values()),
        "_counts": counts,  # dropped before the report is written: what_grows compares them
    }


def what_grows(small: dict[str, Any], large: dict[str, Any], peers: list[dict[str, Any]] | None = None,
               limit: int = 2) -> list[str]:
    """The object collectives of one rank's operation whose bytes grew most from ``small`` to ``large`` (the
    counts of the same operation on two states), as lines: name, caller, bytes before and after, what was sent and
    received (pickled sizes before and after) and, given ``peers`` (every rank's counts of the large state), the
    pickled size each rank sent in that call: gathers pad every payload to the largest."""
    pairs = sorted(enumerate(zip(small["object_calls"], large["object_calls"])),
                   key=lambda p: p[1][1]["bytes"] - p[1][0]["bytes"], reverse=True)
    lines = []
    for i, (before, after) in pairs[:limit]:
        if after["bytes"] <= 1.05 * before["bytes"]:  # the few bytes a larger digest's count adds are not growth
            break
        line = f"{after['name']} ({after['caller']}): {before['bytes']:,} -> {after['bytes']:,} B"
        if after.get("sent_bytes") is not None:
            line += f"; sent {after['sent']} ({before.get('sent_bytes')} -> {after['sent_bytes']} B pickled)"
        if after.get("received_bytes") is not None and after["received"] != after["sent"]:
            line += f"; received {after['received']} ({before.get('received_bytes')} -> {after['received_bytes']} B)"
        if peers is not None:
            sent = [p["object_calls"][i].get("sent_bytes") if i < len(p["object_calls"]) else None for p in peers]
            line += f"; each rank sent {sent} B"
        lines.append(line)
    return lines


def ratios(rows: list[dict], small: int, large: int) -> list[dict]:
    by_key = {(r["world_size"], r["tensors"], r["op"]): r for r in rows}
    out = []
    for (ws, n, op), row in sorted(by_key.items()):
        other = by_key.get((ws, large, op))
        if n != small or other is None:
            continue
        rank = max(range(1, len(row["_counts"])), key=lambda r: other["_counts"][r]["bytes"], default=0)
        out.append({"world_size": ws, "op": op,
                    "rank_ratio": other["rank_bytes"] / max(row["rank_bytes"], 1),
                    "coordinator_ratio": other["coordinator_bytes"] / max(row["coordinator_bytes"], 1),
                    "grows_on_coordinator": what_grows(row["_counts"][0], other["_counts"][0], other["_counts"]),
                    "grows_on_rank": what_grows(row["_counts"][rank], other["_counts"][rank], other["_counts"])})
    return out


def git_state() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", "--no-optional-locks", *args], cwd=REPO_DIR, capture_output=True, text=True,
                              check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": os.environ.get("WIRE_BYTES_COMMIT", "unknown"), "dirty": None}


def _kb(n: int) -> str:
    return f"{n / 1000:,.1f} KB"


def markdown(report: dict) -> str:
    small, large = report["config"]["tensors"][0], report["config"]["tensors"][-1]
    stamp = report["stamp"]
    dirty = {True: " (dirty tree)", False: "", None: " (dirty: unknown)"}[stamp["dirty"]]
    lines = [
        f"Bytes through torch's collectives per save / load (gloo, CPU), at {stamp['commit']}{dirty}, torch "
        f"{stamp['torch']}, {stamp['date']}. `rank`: the largest of ranks 1..ws-1; `coord`: rank 0. Calls in "
        "brackets: tensor collectives.",
        "",
        f"| ws | kind | op | rank {small} | rank {large} | rank x | coord {small} | coord {large} | coord x |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    rows = {(r["world_size"], r["tensors"], r["op"]): r for r in report["rows"]}
    ratio = {(r["world_size"], r["op"]): r for r in report["ratios"]}
    for ws in report["config"]["world_sizes"]:
        for op in report["ops"]:
            a, b, x = rows.get((ws, small, op)), rows.get((ws, large, op)), ratio.get((ws, op))
            if a is None or b is None or x is None:
                continue
            kind, what = op.split("/")
            lines.append(
                f"| {ws} | {KIND_TITLES[kind]} | {what} | {_kb(a['rank_bytes'])} ({a['rank_calls']}) | "
                f"{_kb(b['rank_bytes'])} ({b['rank_calls']}) | {x['rank_ratio']:.2f} | "
                f"{_kb(a['coordinator_bytes'])} ({a['coordinator_calls']}) | "
                f"{_kb(b['coordinator_bytes'])} ({b['coordinator_calls']}) | {x['coordinator_ratio']:.2f} |")
    notes = [x for x in report["ratios"] if x["op"].split("/")[0] in LOCALLY_PLANNED
             and max(x["rank_ratio"], x["coordinator_ratio"]) > 1.2]
    if notes:
        lines += ["", f"What grows from {small} to {large} tensors in the locally planned operations (bytes of each "
                  "object collective's tensor collectives on that rank):"]
        for x in notes:
            for where in ("coordinator", "rank"):
                lines += [f"- ws {x['world_size']} {x['op']}, {where}: {line}" for line in x[f"grows_on_{where}"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,4,8")
    parser.add_argument("--tensors", default="240,960", help="tensors per state dict (multiples of 8), two values")
    parser.add_argument("--kinds", default=",".join(SAVE_KINDS), help=f"of {', '.join(SAVE_KINDS)}")
    parser.add_argument("--saves", type=int, default=3, help="saves in a row per kind: the first and the last count")
    parser.add_argument("--target", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                        help="where the checkpoints go (a temporary folder in it, deleted after)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    parser.add_argument("--out", default=os.path.join(BENCHMARKS_DIR, "results", "wire_bytes.json"))
    args = parser.parse_args(argv)
    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    sizes = [int(n) for n in args.tensors.split(",")]
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(SAVE_KINDS)
    if unknown or len(sizes) != 2 or args.saves < 2:
        parser.error(f"unknown kinds {sorted(unknown)}" if unknown else "--tensors takes two values, --saves >= 2")

    rows, self_checks, started = [], [], time.monotonic()
    ops: list[str] = []
    root = tempfile.mkdtemp(prefix="wire_bytes_", dir=args.target)
    try:
        for ws in world_sizes:
            for n in sizes:
                for kind in kinds:
                    t0 = time.monotonic()
                    per_rank = launch(ws, [kind], n, root, args.saves, args.timeout)
                    self_checks.append({"world_size": ws, "tensors": n, "kind": kind,
                                        "ok": all(r["self_check"]["ok"] for r in per_rank)})
                    for op in per_rank[0]["ops"]:
                        if op not in ops:
                            ops.append(op)
                        rows.append({"world_size": ws, "tensors": n, "op": op, **summarize(per_rank, op)})
                    print(f"ws {ws}, {n} tensors, {kind}: {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
                    for entry in os.listdir(root):
                        shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    ratio_rows = ratios(rows, sizes[0], sizes[1])
    for row in rows:
        del row["_counts"]
    report = {
        "stamp": {"torch": torch.__version__, "python": sys.version.split()[0],
                  "date": datetime.date.today().isoformat(), **git_state()},
        "config": {"world_sizes": world_sizes, "tensors": sizes, "kinds": kinds, "saves": args.saves,
                   "tensors_per_layer": TENSORS_PER_LAYER, "width": WIDTH, "backend": "gloo",
                   "elapsed_s": round(time.monotonic() - started, 1)},
        "ops": ops,
        "self_checks": self_checks,
        "rows": rows,
        "ratios": ratio_rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    table = markdown(report)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
