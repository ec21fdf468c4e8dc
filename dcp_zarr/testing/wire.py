"""Counting what torch's collectives carry: ``WireCounter`` wraps, in one process, the tensor collectives of
``torch.distributed.distributed_c10d`` (the names its object collectives call: ``gather_object`` calls ``all_gather``
+ ``gather``, ``scatter_object_list`` ``broadcast`` + ``scatter``, ``broadcast_object_list`` ``broadcast``,
``all_gather_object`` ``all_gather`` up to torch 2.14 and ``all_gather_single`` from 2.15; every other tensor
collective and point-to-point call; and ``torch.distributed``'s bindings of them) and counts the calls and the bytes of
every tensor each call touches on the rank, inputs and outputs (a gather's destination counts its gather list). A
collective that another calls (``all_gather_into_tensor`` calls ``all_gather_single``, ``send`` ``isend``,
``batch_isend_irecv`` its P2POps') is counted once, as the one called. Each object collective is recorded with its
caller and what it carried, so that a figure that grows can be traced to its object (``what_grows``).
``_functional_collectives`` (DTensor's redistributions) are counted apart, and so are the calls from ``PAYLOAD_SITES``,
where dcp_zarr moves the checkpoint's own bytes over the process group (collective I/O's exchanges, the root
``zarr.json``'s broadcast): data, not protocol. ``self_check`` proves the counts against object collectives of known
payloads.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import pickle
import threading
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from dcp_zarr.torch_private import functional_collectives

__all__ = ["WireCounter", "self_check", "what_grows"]

# Every module-level tensor collective and point-to-point call of distributed_c10d (those a torch lacks are skipped:
# gather_single and gather_into_tensor are 2.15's). The object collectives look these names up in that module's
# globals at each call, so replacing the attribute is enough for them; DCP and dcp_zarr call ``dist.X``,
# torch.distributed's binding of the same function, which is replaced too.
TENSOR_COLLECTIVES = (
    "all_gather", "gather", "broadcast", "scatter", "all_reduce", "reduce", "barrier", "monitored_barrier",
    "all_gather_single", "all_gather_into_tensor", "_all_gather_base", "all_gather_coalesced", "all_reduce_coalesced",
    "gather_single", "gather_into_tensor", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor",
    "_reduce_scatter_base", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv",
)  # fmt: skip
# What each object collective sends from this rank, and what it fills on the ranks that receive.
SENT = {"gather_object": "obj", "scatter_object_list": "scatter_object_input_list",
        "broadcast_object_list": "object_list", "all_gather_object": "obj", "send_object_list": "object_list"}
RECEIVED = {"gather_object": "object_gather_list", "scatter_object_list": "scatter_object_output_list",
            "broadcast_object_list": "object_list", "all_gather_object": "object_list",
            "recv_object_list": "object_list"}
FUNCTIONAL_COLLECTIVES = (
    "broadcast", "all_reduce", "all_gather_tensor", "all_gather_tensor_autograd", "reduce_scatter_tensor",
    "reduce_scatter_tensor_autograd", "all_reduce_coalesced", "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor_coalesced", "all_to_all_single", "all_to_all_single_autograd", "permute_tensor",
)  # fmt: skip
PAYLOAD_SITES = {("exchange", "transfer.py"), ("manifest_read_once", "root_once.py")}  # data, counted apart

def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor in ``value`` (a tensor, a P2POp, or lists and tuples of them, nested)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, c10d.P2POp):
        return tensor_bytes(value.tensor)
    return sum(tensor_bytes(v) for v in value) if isinstance(value, (list, tuple)) else 0


def describe(obj: Any, depth: int = 0) -> str:
    """What an object collective carried, in short: types, and the length of every list."""
    name = type(obj).__name__
    if obj is None:
        return "None"
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):  # a NamedTuple (Summary, Ticket) by name
        kinds = sorted({describe(v, depth + 1) if depth < 2 else type(v).__name__ for v in obj})
        return f"{name}[{len(obj)}] of {' | '.join(kinds[:4]) or '-'}{' | ...' if len(kinds) > 4 else ''}"
    if isinstance(getattr(obj, "items", None), list):
        extras = [f"items={len(obj.items)}"] + [f"{f}={type(getattr(obj, f)).__name__}" for f in (
            "storage_data", "planner_data") if getattr(obj, f, None) is not None]
        return f"{name}({', '.join(extras)})"
    return f"WriteResult({type(obj.storage_data).__name__})" if name == "WriteResult" else name


def _pickled_size(obj: Any) -> int | None:
    """What ``_object_to_tensor``'s pickler writes for ``obj``, before padding to the largest rank's."""
    try:
        return None if obj is None else len(pickle.dumps(obj))
    except Exception:  # ZarrSavePlanner's RankState refuses to be sent
        return None


def _caller() -> Any:
    """The frame that called the function calling this (a counted collective's caller)."""
    frame = inspect.currentframe()
    return None if frame is None or frame.f_back is None else frame.f_back.f_back


def _frames(frame, depth: int = 40) -> Iterator[Any]:
    while frame is not None and depth:
        yield frame
        frame, depth = frame.f_back, depth - 1


class WireCounter:
    """Counts, in this process, the calls and tensor bytes of torch's collectives while installed. ``with
    counter.measure() as counts:`` fills ``counts`` when the block ends: ``bytes``, ``calls``, ``by_collective``
    (name -> [calls, bytes]), ``object_calls`` (per object collective: name, caller, what this rank sent and
    received and their pickled sizes, the bytes and calls of its tensor collectives), ``functional``,
    ``payload_bytes`` and ``payload_calls``."""

    def __init__(self) -> None:
        self.originals: list[tuple[Any, str, Any]] = []
        self.lock, self.outer = threading.Lock(), threading.local()
        self.reset()

    def reset(self) -> None:
        self.by_collective: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self.payload: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self.functional: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self.object_calls: list[dict[str, Any]] = []

    def install(self) -> WireCounter:
        funcol = functional_collectives()
        for names, wrap, modules in ((TENSOR_COLLECTIVES, self._tensor_wrapper, (c10d, dist)),
                                     ({*SENT, *RECEIVED}, self._object_wrapper, (c10d, dist)),
                                     (FUNCTIONAL_COLLECTIVES, self._functional_wrapper, (funcol,))):
            for name in names:
                original = getattr(modules[0], name, None)
                if original is None:
                    continue
                wrapper = wrap(name, original)
                for module in modules:
                    if getattr(module, name, None) is original:
                        self.originals.append((module, name, original))
                        setattr(module, name, wrapper)
        return self

    def uninstall(self) -> None:
        for module, name, original in reversed(self.originals):
            setattr(module, name, original)
        self.originals.clear()

    def _tensor_wrapper(self, name: str, original: Any) -> Any:
        @functools.wraps(original)  # inspect.unwrap reaches torch's function (self_check asks it)
        def counted(*args, **kwargs):
            if getattr(self.outer, "in_collective", False):  # called by a counted collective, which has its tensors
                return original(*args, **kwargs)
            nbytes = tensor_bytes(list(args)) + tensor_bytes(list(kwargs.values()))
            payload = any((f.f_code.co_name, os.path.basename(f.f_code.co_filename)) in PAYLOAD_SITES
                          for f in _frames(_caller()))
            with self.lock:
                entry = (self.payload if payload else self.by_collective)[name]
                entry[0], entry[1] = entry[0] + 1, entry[1] + nbytes
                outer = getattr(self.outer, "record", None)
                if outer is not None and payload:
                    outer["payload"] = True
                elif outer is not None:
                    outer["bytes"], outer["tensor_calls"] = outer["bytes"] + nbytes, outer["tensor_calls"] + 1
            self.outer.in_collective = True
            try:
                return original(*args, **kwargs)
            finally:
                self.outer.in_collective = False

        return counted

    def _object_wrapper(self, name: str, original: Any) -> Any:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args, **kwargs):
            arguments = signature.bind_partial(*args, **kwargs).arguments
            sent = arguments.get(SENT.get(name, ""))
            callers = [f"{'/'.join(f.f_code.co_filename.split(os.sep)[-2:])}:{f.f_code.co_name}"
                       for f in _frames(_caller())
                       if f.f_code.co_filename not in (c10d.__file__, __file__)
                       and not f.f_code.co_filename.endswith("c10d_logger.py")][:2]
            record = {"name": name, "caller": " < ".join(callers), "sent": describe(sent),
                      "sent_bytes": _pickled_size(sent), "received": None, "received_bytes": None, "bytes": 0,
                      "tensor_calls": 0}
            previous, self.outer.record = getattr(self.outer, "record", None), record
            try:
                return original(*args, **kwargs)
            finally:
                self.outer.record = previous
                received = arguments.get(RECEIVED.get(name, ""))
                if received is not None:
                    record["received"], record["received_bytes"] = describe(received), _pickled_size(received)
                with self.lock:
                    self.object_calls.append(record)

        return counted

    def _functional_wrapper(self, name: str, original: Any) -> Any:
        @functools.wraps(original)
        def counted(*args, **kwargs):
            with self.lock:
                entry = self.functional[name]
                entry[0], entry[1] = entry[0] + 1, entry[1] + tensor_bytes(list(args) + list(kwargs.values()))
            return original(*args, **kwargs)

        return counted

    @contextlib.contextmanager
    def measure(self):
        counts: dict[str, Any] = {}
        self.reset()
        try:
            yield counts
        finally:
            by_collective = {name: list(v) for name, v in sorted(self.by_collective.items())}
            counts.update(bytes=sum(v[1] for v in by_collective.values()), by_collective=by_collective,
                          calls=sum(v[0] for v in by_collective.values()),
                          object_calls=[dict(r) for r in self.object_calls if not r.get("payload")],
                          functional={name: list(v) for name, v in sorted(self.functional.items())},
                          payload_bytes=sum(v[1] for v in self.payload.values()),
                          payload_calls=sum(v[0] for v in self.payload.values()))
            self.reset()


def self_check(counter: WireCounter, rank: int, ws: int) -> dict[str, Any]:
    """Object collectives of known payloads, of a different size on each rank (so that padding shows), must count
    exactly the bytes torch moves, and a collective that calls another must count once; raises if not. Sizes travel
    as int64 tensors: 8 bytes each."""
    payload: list[Any] = [bytes(1000 + 37 * r) for r in range(ws)]  # Any: torch 2.15 types object collectives generic
    sizes = [len(pickle.dumps(p)) for p in payload]
    largest = max(sizes)
    # all_gather_object gathers into one tensor from torch 2.15 (all_gather_single), into a list before
    all_gather = ("all_gather_single" if "all_gather_single" in inspect.unwrap(c10d.all_gather_object).__code__.co_names
                  else "all_gather")
    expected = {
        # all_gather of each rank's size, then gather of the padded payload (the destination: ws of them)
        "gather_object": {"all_gather": [1, 8 + 8 * ws], "gather": [1, largest + (ws * largest if rank == 0 else 0)]},
        # broadcast of the largest size, scatter of the padded payloads, scatter of each one's size
        "scatter_object_list": {"broadcast": [1, 8], "scatter": [2, largest + 8 + (ws * (largest + 8) if rank == 0
                                                                                   else 0)]},
        # broadcast of the sizes of the list's objects, then of their concatenation
        "broadcast_object_list": {"broadcast": [2, 8 * 2 + sizes[0] + sizes[1]]},
        # all_gather of sizes, then all_gather of the padded payloads
        "all_gather_object": {all_gather: [2, 8 + 8 * ws + largest + ws * largest]},
        # a tensor collective that calls all_gather_single: its input and output, once
        "all_gather_into_tensor": {"all_gather_into_tensor": [1, 8 + 8 * ws]},
    }
    out: list[Any] = [None]
    calls = {"gather_object": lambda: dist.gather_object(payload[rank], [None] * ws if rank == 0 else None, dst=0),
             "scatter_object_list": lambda: dist.scatter_object_list(out, payload if rank == 0 else None, src=0),
             "broadcast_object_list": lambda: dist.broadcast_object_list(
                 [payload[0], payload[1]] if rank == 0 else [None, None], src=0),
             "all_gather_object": lambda: dist.all_gather_object([None] * ws, payload[rank]),
             "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.zeros(ws, dtype=torch.int64),
                                                                           torch.ones(1, dtype=torch.int64))}
    found = {}
    for name, call in calls.items():
        with counter.measure() as counts:
            call()
        found[name] = counts["by_collective"]
    if found != expected or out[0] != payload[rank]:
        raise AssertionError(f"rank {rank}: the wire counter's self-check failed: counted {found}, torch's object "
                             f"collectives move {expected}")
    return {"ok": True, "payload_bytes": sizes, "counted": found}


def what_grows(small: dict, large: dict, peers: list[dict], limit: int = 2) -> list[str]:
    """The object collectives of one rank's operation whose bytes grew most from ``small`` to ``large`` (its counts
    on the two states): name, caller, bytes before and after, what was sent and received, and the pickled size each
    rank (``peers``: every rank's counts of the large state) sent in that call: gathers pad to the largest."""
    pairs = sorted(enumerate(zip(small["object_calls"], large["object_calls"])),
                   key=lambda p: p[1][1]["bytes"] - p[1][0]["bytes"], reverse=True)
    lines = []
    for i, (before, after) in pairs[:limit]:
        if after["bytes"] <= 1.05 * before["bytes"]:  # the few bytes a larger digest's count adds are not growth
            break
        line = f"{after['name']} ({after['caller']}): {before['bytes']:,} -> {after['bytes']:,} B"
        if after["sent_bytes"] is not None:
            line += f"; sent {after['sent']} ({before['sent_bytes']} -> {after['sent_bytes']} B pickled)"
        if after["received_bytes"] is not None and after["received"] != after["sent"]:
            line += f"; received {after['received']} ({before['received_bytes']} -> {after['received_bytes']} B)"
        sent = [p["object_calls"][i]["sent_bytes"] if i < len(p["object_calls"]) else None for p in peers]
        lines.append(line + f"; each rank sent {sent} B")
    return lines


