"""What every benchmark shares (benchmarks/README.md): the stamp and the result files, rank launching, timing across
ranks and the states; the writer kinds are writers.py's. Nothing here imports dcp_zarr at import time: DCP's own
writer can be measured where dcp_zarr does not import.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import hashlib
import importlib
import json
import multiprocessing
import os
import pickle
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()  # tmpfs: the default target
GB = 1e9
CPU = torch.device("cpu")
TIMEOUT = datetime.timedelta(minutes=30)  # process groups': a checkpoint of several GB on a slow disk keeps ranks apart

# -- The stamp and the results ----------------------------------------------------------------------------------------


def _git(*args: str) -> str:
    return subprocess.run(["git", "--no-optional-locks", *args], cwd=REPO, capture_output=True, text=True, check=True,
                          timeout=30).stdout.strip()


def stamp() -> dict[str, Any]:
    """What a result was measured with (benchmarks/README.md; ``BENCH_COMMIT``: the commit, where there is no .git)."""
    commit, dirty = os.environ.get("BENCH_COMMIT"), None
    if not commit:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            if Path(_git("rev-parse", "--show-toplevel")).resolve() == REPO:  # not some other repository's tree
                commit, dirty = _git("rev-parse", "--short", "HEAD"), bool(_git("status", "--porcelain"))
    sources = hashlib.blake2b(digest_size=8)  # which library code ran, when it is not a commit's
    for path in sorted((REPO / "dcp_zarr").rglob("*.py")):
        sources.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    import zarr

    return {"commit": commit or "unknown (no git here: set BENCH_COMMIT)", "dirty": dirty,
            "dcp_zarr_sources": sources.hexdigest(), "torch": torch.__version__, "zarr": zarr.__version__,
            "python": platform.python_version(), "nproc": os.cpu_count(), "kernel": platform.release(),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join(["python", *sys.orig_argv[1:]])}


def table(head: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows])


def add_options(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """``--name`` for each ``name=default`` (``zarr_threads``: ``--zarr-threads``), of the default's type."""
    for name, default in defaults.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)


def write_result(name: str, out: str | None, result: dict[str, Any], text: str = "") -> None:
    """``result`` stamped, as JSON at ``out`` (default benchmarks/results/NAME.json) and ``text`` (Markdown) beside
    it under the stamp's line; the text is printed."""
    s = stamp()
    path = Path(out or RESULTS / f"{name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"stamp": s, **result}, indent=1) + "\n")
    text = (f"{name}, commit {s['commit']}{' (tree differs from it)' if s['dirty'] else ''}, dcp_zarr sources "
            f"{s['dcp_zarr_sources']}, torch {s['torch']}, zarr {s['zarr']}, Python {s['python']}, {s['nproc']} CPUs, "
            f"kernel {s['kernel']}, {s['date']}: `{s['command']}`\n\n{text}").rstrip() + "\n"
    path.with_suffix(".md").write_text(text)
    print(text + f"\nwrote {path} and {path.with_suffix('.md')}", flush=True)


# -- Ranks: a torchrun job (or one process), or rank processes spawned from this one ----------------------------------


@dataclass(frozen=True)
class Ranks:
    rank: int
    world_size: int
    device: torch.device  # a GPU with backend "nccl" (gloo beside it for async saves), else the CPU
    mesh: Any  # a 1-d DeviceMesh over every rank


def init_ranks(backend: str = "gloo") -> Ranks:
    """Join the torchrun job's process group, or make a 1-process group when no torchrun variables are set."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.elastic.utils.distributed import get_free_port

    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(get_free_port()))
    device = CPU
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=TIMEOUT, device_id=device)
    else:
        dist.init_process_group("gloo", timeout=TIMEOUT)
    world = dist.get_world_size()
    return Ranks(dist.get_rank(), world, device, init_device_mesh(device.type, (world,)))


def end(code: int = 0) -> None:
    """End the process without Python's finalization: gloo's threads can still hold the tensors of the last
    collective, and releasing them in a finalizing interpreter aborts it (pytorch #190489; docs/usage.md)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def on_ranks(name: str, out: str | None, program: Callable[[Ranks], tuple[dict, str] | None],
             backend: str = "gloo") -> None:
    """Run ``program`` on every rank (the torchrun job, or this process alone); rank 0 writes the (result, text) it
    returns, if any (``write_result``). Ends the process: 0; 3 if a result's ``checks`` failed; 1 after an exception."""
    try:
        ranks = init_ranks(backend)
        returned = program(ranks)
        if returned is not None and ranks.rank == 0:
            write_result(name, out, *returned)
        code = 0 if returned is None or all(returned[0].get("checks", {}).values()) else 3
        dist.barrier()  # nobody tears the group down while rank 0 is still writing
    except BaseException:
        traceback.print_exc()
        code = 1
    end(code)


def gather(value: Any) -> list[Any]:
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


# The forkserver imports these once; every rank is then a fork of it. torch._dynamo: fully_shard and DTensor import
# it lazily, about 1.4 s per rank otherwise.
_PRELOAD = ["torch", "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.fsdp", "dcp_zarr",
            "benchmarks.harness", "benchmarks.writers"]


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 1800) -> list[Any]:
    """``fn(ranks, *args)``, a benchmarks module's function, on ``world_size`` fresh processes in a gloo group, forked
    from one forkserver that imported torch and dcp_zarr: each rank's result. When a rank fails, torch's launcher ends
    the others (blocked in a collective that never ends) and raises with its traceback."""
    from torch.multiprocessing import start_processes

    module = fn.__module__ if fn.__module__ != "__main__" else sys.modules["__main__"].__spec__.name
    multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)  # a failed rank keeps it up
    ranks = start_processes(_rank_entry, ((module, fn.__qualname__), world_size, store.port, args), world_size,
                            join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout
    while not ranks.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in ranks.processes:
                process.kill()
            raise RuntimeError(f"{fn.__qualname__} on {world_size} ranks: still running after {timeout} s")
    return [pickle.loads(store.get(f"result/{rank}")) for rank in range(world_size)]


def _rank_entry(rank: int, target: tuple[str, str], world_size: int, port: int, args: tuple) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # the ranks share the machine's cores
    fn = getattr(importlib.import_module(target[0]), target[1])
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=TIMEOUT)
    result = fn(Ranks(rank, world_size, torch.device("cpu"), init_device_mesh("cpu", (world_size,))), *args)
    store.set(f"result/{rank}", pickle.dumps(result))
    end(0)  # an exception instead reaches torch's launcher, which passes its traceback on


# -- Timing: regions between barriers, the slowest rank's time; kinds in rotating order; medians ----------------------


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def quiesce(device: torch.device) -> None:
    """Start a timed region from rest: garbage collected, device idle, nothing dirty in the page cache (else the
    write-back of what ran before, another kind's files or their deletion, lands in this measurement)."""
    gc.collect()
    _synchronize(device)
    dist.barrier()
    os.sync()
    dist.barrier()


def timed(fn: Callable[[], Any], device: torch.device = CPU) -> tuple[float, list[float], Any]:
    """``fn`` on every rank between barriers, device work waited for: (slowest rank's seconds, every rank's, result)."""
    quiesce(device)
    start = time.perf_counter()
    result = fn()
    _synchronize(device)
    elapsed = time.perf_counter() - start
    dist.barrier()
    per_rank = gather(elapsed)
    return max(per_rank), per_rank, result


def timed_async(start_save: Callable[[], Any], device: torch.device) -> tuple[float, float]:
    """Time ``dcp.async_save``: (the slowest rank's seconds until the call returned, until its future resolved). No
    collective runs between the two: the background save uses the default group."""
    quiesce(device)
    start = time.perf_counter()
    response = start_save()
    blocking = time.perf_counter() - start
    getattr(response, "upload_completion", response).result()
    total = time.perf_counter() - start
    dist.barrier()
    return max(gather(blocking)), max(gather(total))


def rotated(kinds: list[Any] | tuple[Any, ...], turn: int) -> list[Any]:
    """``kinds`` starting at ``turn``: no kind always runs first (a cold allocator, caches, the CPU's clock)."""
    return [kinds[(turn + i) % len(kinds)] for i in range(len(kinds))]


def medians(samples: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in samples.items()}


def speed(times: list[float], nbytes: float) -> dict[str, Any]:
    """A measurement's repeats (seconds): them, their median and minimum, and GB/s at the median."""
    median = statistics.median(times)
    return {"times_s": times, "median_s": median, "min_s": min(times), "gbps": nbytes / median / GB}


def footprint(path: str) -> dict[str, int]:
    """Files, directories (``path`` included) and bytes under ``path``: the metadata work a disk charges for."""
    walk = [(directory, names) for directory, _, names in os.walk(path)]
    return {"files": sum(len(names) for _, names in walk), "directories": len(walk),
            "bytes": sum(os.path.getsize(os.path.join(directory, name)) for directory, names in walk for name in names)}


def drop_page_cache(path: str) -> str:
    """Drop the page cache (root), else evict ``path``'s files: how it was done."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        evict_page_cache(path)
        return "posix_fadvise(DONTNEED), no root"


def evict_page_cache(path: str) -> None:
    """Drop the files' clean pages from the page cache (no root needed; a no-op on tmpfs)."""
    for directory, _, names in os.walk(path):
        for name in names:
            with open(os.path.join(directory, name), "rb") as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


# -- States: an FSDP2 transformer with AdamW state, and walks over state dicts ----------------------------------------

@dataclass(frozen=True)
class ModelConfig:
    layers: int = 8
    hidden: int = 1024
    vocab: int = 32000  # these defaults: a 2.0 GB fp32 state dict with AdamW state
    dtype: str = "float32"


class _Block(nn.Module):
    """Pre-norm attention + MLP: about 12 x hidden**2 parameters."""

    def __init__(self, hidden: int):
        super().__init__()
        self.heads = hidden // 64 if hidden % 64 == 0 else 1
        self.attn_norm, self.mlp_norm = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden, bias=False), nn.Linear(hidden, hidden, bias=False)
        self.up, self.down = nn.Linear(hidden, 4 * hidden, bias=False), nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class _TransformerLM(nn.Module):
    """``cfg.layers`` blocks and a head of ``cfg.vocab`` outputs, after an embedding of ``cfg.vocab`` tokens unless
    ``embed`` is False (then its input is activations)."""

    def __init__(self, cfg: ModelConfig, embed: bool = True):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden) if embed else nn.Identity()
        self.blocks = nn.ModuleList(_Block(cfg.hidden) for _ in range(cfg.layers))
        self.norm, self.head = nn.LayerNorm(cfg.hidden), nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _sharded(cfg: ModelConfig, mesh, device: torch.device, generator: torch.Generator, embed: bool = True):
    """The model built on the meta device, FSDP2-sharded on ``mesh`` and materialised shard by shard (no rank ever
    holds the whole model): weights N(0, 0.02), norms 1 and 0; and its AdamW (lr 1e-3)."""
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = _TransformerLM(cfg, embed).to(getattr(torch, cfg.dtype))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                local(param).fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                local(param).copy_(torch.randn(local(param).shape, generator=generator) * 0.02)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _state(model, optim) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}


def fsdp_model_state(cfg: ModelConfig, mesh, device: torch.device, seed: int = 0) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` of the model FSDP2-sharded on ``mesh`` after one AdamW step."""
    model, optim = _sharded(cfg, mesh, device, torch.Generator().manual_seed(seed + dist.get_rank()))
    tokens = torch.randint(cfg.vocab, (2, 17), device=device)
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return _state(model, optim)


# The compression benchmark's model: no embedding, whose optimizer state a short run leaves zero in the rows it never
# touches (which would flatter every compressor); blocks of about 12 x hidden**2 parameters and a head of hidden x HEAD.
STACK_LAYERS, STACK_HEAD = 4, 2048


def stack_hidden(mb: float, dtype: torch.dtype) -> int:
    """The hidden size (a multiple of 64) whose stack, with AdamW's two states, holds closest to ``mb`` MB."""
    per_param = 3 * torch.empty(0, dtype=dtype).element_size()
    size = lambda hid: per_param * (STACK_LAYERS * (12 * hid * hid + 4 * hid) + 2 * hid + hid * STACK_HEAD)  # noqa
    return min(range(64, 16385, 64), key=lambda hid: abs(size(hid) - mb * 1e6))


def trained_stack_state(mb: float, dtype: torch.dtype, steps: int, mesh, rank: int) -> tuple[dict[str, Any], dict]:
    """``({"model", "optim"}, its shape)`` of a stack of about ``mb`` MB FSDP2-sharded on ``mesh`` after ``steps``
    AdamW steps on random inputs and labels, each rank its own: optimizer state as training makes it."""
    hidden, generator = stack_hidden(mb, dtype), torch.Generator().manual_seed(1234 + rank)
    cfg = ModelConfig(STACK_LAYERS, hidden, STACK_HEAD, str(dtype).removeprefix("torch."))
    model, optim = _sharded(cfg, mesh, torch.device("cpu"), generator, embed=False)
    for _ in range(steps):
        x = torch.randn(4, 32, hidden, generator=generator).to(dtype)
        labels = torch.randint(STACK_HEAD, (4 * 32,), generator=generator)
        F.cross_entropy(model(x).flatten(0, 1).float(), labels).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
    return _state(model, optim), {"hidden": hidden, "layers": STACK_LAYERS, "head": STACK_HEAD}


def spreads(state: Any) -> dict[str, dict[str, float]]:
    """This rank's weights, exp_avg and exp_avg_sq of the linear layers: std, mean |x|, median, zeros."""
    optim = [entry for fqn, entry in state["optim"]["state"].items() if "norm" not in fqn]
    groups = {"weight": [t for fqn, t in state["model"].items() if fqn.endswith(".weight") and "norm" not in fqn],
              **{key: [entry[key] for entry in optim] for key in ("exp_avg", "exp_avg_sq")}}
    found = {}
    for key, parts in groups.items():
        x = torch.cat([local(t).float().reshape(-1) for t in parts])
        sample = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))[:1 << 20]]
        found[key] = {"std": x.std().item(), "mean_abs": x.abs().mean().item(), "median": sample.median().item(),
                      "zero_fraction": (x == 0).float().mean().item()}
    return found


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def leaves(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def local_bytes(tree: Any) -> int:
    """Bytes this rank holds: local shards and plain tensors."""
    return sum(local(t).numel() * t.element_size() for t in leaves(tree))


def global_bytes(tree: Any) -> int:
    """Bytes of the state dict unsharded: DTensors at their global size, plain tensors once."""
    return sum(t.numel() * t.element_size() for t in leaves(tree))


def zeroed(tree: Any) -> Any:
    """A state dict of the same sharding to load into, zero-filled, so that a load that skips data shows."""
    return tree_map_only(torch.Tensor, torch.zeros_like, tree)


def fill_zeros(tree: Any) -> None:
    with torch.no_grad():
        for tensor in leaves(tree):
            local(tensor).zero_()


def equal(a: Any, b: Any) -> bool:
    """The same structure, local tensor bytes and other leaves, on this rank."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and local(a).dtype == local(b).dtype
                and local(a).shape == local(b).shape and torch.equal(local(a), local(b)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b
