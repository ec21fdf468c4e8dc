"""Incremental saves (issue 53): time, bytes written and requests of ``ZarrWriter(incremental_from=earlier)`` against
a full save of the same state and DCP's own writer, in one run (commands: benchmarks/README.md).

Runs (``--runs``: ``scenario:target:MB``) on ``--ranks`` gloo ranks: ``lora`` (FSDP2: frozen fp32 ``--hidden``-square
weights with rank-``--lora-rank`` adapters) and ``finetune`` (harness's stack, every parameter trained), AdamW one step
on from the earlier checkpoint; ``embedding``, an fp32 table of ``--embedding-dim`` columns sharded by rows,
``--changed`` of its rows (random) changed. Targets: ``disk`` (``--disk-dir``), ``tmpfs``, ``s3`` (the loopback server).

Kinds: ``full`` (``ZarrWriter(path)``), ``first`` (``incremental=True``: a chain's first save), ``second``
(``incremental_from=`` a chain's start, saved by ``first`` two steps back once per run: what a chain's second save
costs, every chunk hashed), ``incremental`` (``incremental_from=`` the chain's second save, one step back, made once per
run: what its later saves cost, a chunk that changed in the earlier save not hashed), ``dcp`` (FileSystemWriter,
``sync_files=True``; FsspecWriter on S3): ``dcp.save``, DCP's planner, ``--threads`` IO threads. ZarrWriter syncfs's
its store, FileSystemWriter fsyncs, ``harness.timed`` syncs before each save; no page cache is dropped (``--evict-base``
evicts the earlier checkpoints' before each save). Rounds, one untimed first, save every kind in rotating order into a
fresh location, all deleted at the round's end (a deletion's cost falls on what follows it: on ext4 mounted with
``discard``, more so after many files); medians of the slowest rank's times. New bytes: ``du -sb earlier new``'s
figure for the new store (hard links counted in the earlier one), or PUT bodies; requests: files opened to write and
read (``LocalCalls``) and links, or the server's by method (a server-side copy is a bodiless PUT). The last
incremental store must load equal with the earlier ones deleted.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn

from benchmarks import harness as h
from benchmarks import writers
from benchmarks.compression import stored_bytes

KINDS = ("full", "first", "second", "incremental", "dcp")
INCREMENTAL = ("second", "incremental")
RUNS = "lora:disk:800,lora:tmpfs:800,embedding:disk:256,finetune:disk:800,finetune:tmpfs:800,lora:s3:128"
# The targets: a LoRA-like save on disk's new bytes over the store's, and its time over a full save's; an
# embedding's new bytes over its changed chunks'; a full fine-tune's incremental time on disk over a full save's
LORA_BYTES, LORA_TIME, EMBEDDING_BYTES, FINETUNE_TIME = 0.05, 0.3, 2.0, 1.05


class _Lora(nn.Module):
    """A frozen linear weight and its trainable low-rank adapters (B starts at zero, as LoRA's does)."""

    def __init__(self, hidden: int, rank: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden, hidden), requires_grad=False)
        self.lora_a, self.lora_b = nn.Parameter(torch.empty(rank, hidden)), nn.Parameter(torch.empty(hidden, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x @ self.weight.T + (x @ self.lora_a.T) @ self.lora_b.T)


def _stepper(model, optim, loss):
    """A training step of ``loss()``: the state dict after it."""

    def step():
        loss().backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        return h._state(model, optim)

    return step


def _lora(ranks: h.Ranks, mb: float, args) -> tuple[Any, Any, dict]:
    from torch.distributed.fsdp import fully_shard

    layers, g = max(1, round(mb * 1e6 / (4 * args.hidden ** 2))), torch.Generator().manual_seed(ranks.rank)
    with torch.device("meta"):
        model = nn.Sequential(*(_Lora(args.hidden, args.lora_rank) for _ in range(layers)))
    for layer in [*model, model]:
        fully_shard(layer, mesh=ranks.mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            h.local(p).copy_(torch.zeros(()) if "lora_b" in name else torch.randn(h.local(p).shape, generator=g) * .02)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    step = _stepper(model, optim, lambda: F.mse_loss(model(torch.randn(8, args.hidden, generator=g)),
                                                     torch.randn(8, args.hidden, generator=g)))
    state = step()
    return state, step, {"layers": layers, "hidden": args.hidden, "lora_rank": args.lora_rank,
                         "frozen": f"{layers * args.hidden ** 2 * 4 / h.global_bytes(state):.1%} of the bytes"}


def _finetune(ranks: h.Ranks, mb: float, args) -> tuple[Any, Any, dict]:
    hidden, g = h.stack_hidden(mb, torch.float32), torch.Generator().manual_seed(ranks.rank)
    model, optim = h._sharded(h.ModelConfig(h.STACK_LAYERS, hidden, h.STACK_HEAD), ranks.mesh, ranks.device, g, False)
    step = _stepper(model, optim, lambda: F.cross_entropy(model(torch.randn(4, 32, hidden, generator=g)).flatten(0, 1),
                                                          torch.randint(h.STACK_HEAD, (128,), generator=g)))
    return step(), step, {"hidden": hidden, "layers": h.STACK_LAYERS, "head": h.STACK_HEAD}


def _embedding(ranks: h.Ranks, mb: float, args) -> tuple[Any, Any, dict]:
    from torch.distributed.tensor import DTensor, Shard

    mine = round(mb * 1e6 / (4 * args.embedding_dim) / ranks.world_size)
    rows, start = mine * ranks.world_size, mine * ranks.rank
    table = torch.randn(mine, args.embedding_dim, generator=torch.Generator().manual_seed(ranks.rank))
    state = {"model": {"embed.weight": DTensor.from_local(table, ranks.mesh, [Shard(0)], run_check=False)}}
    changed = torch.randperm(rows, generator=torch.Generator().manual_seed(53))[:round(rows * args.changed)]

    def step():
        local = changed[(changed >= start) & (changed < start + mine)] - start
        table[local] += torch.randn(len(local), args.embedding_dim)
        return state

    return state, step, {"rows": rows, "dim": args.embedding_dim, "changed_rows": sorted(changed.tolist())}


SCENARIOS = {"lora": _lora, "embedding": _embedding, "finetune": _finetune}


def save(kind: str, state, where: str, bases: dict[str, str], args, options: dict | None, fs) -> Any:
    """One save of ``kind`` into ``where`` (``bases``: the earlier checkpoint of each incremental kind): this rank's
    ReuseCounts, for a kind that records its chunks."""
    if kind == "dcp":
        return writers.save("fsspec" if options else "fs", state, where, args.threads, options, file_system=fs)
    from dcp_zarr import ZarrWriter

    extra = {"incremental_from": bases[kind]} if kind in INCREMENTAL else {"first": {"incremental": True}}.get(kind, {})
    writer = ZarrWriter(where, storage_options=options, thread_count=args.threads, **extra)
    dcp.save(state, storage_writer=writer)
    return writer.reuse_counts


def du(*paths: str) -> list[int]:
    """``du -sb`` of each path: a file hard-linked into an earlier path counted there only."""
    out = subprocess.run(["du", "-sb", *paths], capture_output=True, text=True, check=True).stdout
    return [int(line.split()[0]) for line in out.splitlines()]


def changed_chunks(where: str, rows: list[int]) -> dict:
    """The embedding's chunks holding a changed row in the store at ``where``: how many, of how many, their bytes."""
    from dcp_zarr.offline import open_checkpoint

    node = next(e.node for e in open_checkpoint(where).entries.values() if e.fqn == "model.embed.weight")
    meta = json.load(open(os.path.join(where, node, "zarr.json")))
    chunk_rows, separator = (meta["chunk_grid"]["configuration"]["chunk_shape"][0],
                             meta["chunk_key_encoding"]["configuration"]["separator"])
    touched = {row // chunk_rows for row in rows}
    return {"chunk_rows": chunk_rows, "chunks": -(-meta["shape"][0] // chunk_rows), "changed_chunks": len(touched),
            "changed_bytes": sum(os.path.getsize(os.path.join(where, node, f"c{separator}{i}{separator}0"))
                                 for i in touched)}


def hash_seconds(ranks: h.Ranks, state) -> float:
    """The slowest rank's time to xxh3-128 every byte of its tensors in 1 MiB pieces, on one thread."""
    from dcp_zarr.format.chunk_record import data_digest

    h.quiesce(ranks.device)
    started = time.perf_counter()
    for t in h.leaves(state):
        view = h.local(t).detach().reshape(-1).view(torch.uint8).numpy()
        for at in range(0, len(view), 1 << 20):
            data_digest(view[at:at + (1 << 20)])
    return max(h.gather(time.perf_counter() - started))


def measure(ranks: h.Ranks, args, roots: dict[str, str], endpoint: str | None) -> dict | None:
    from benchmarks.storage_traffic import LocalCalls
    from dcp_zarr import ZarrReader
    from dcp_zarr.testing import s3_server

    calls, results = LocalCalls(), []
    options = {"endpoint_url": endpoint, **s3_server.CREDENTIALS} if endpoint else None
    if endpoint and ranks.rank == 0:
        s3_server.control(endpoint, f"latency?ms={args.latency_ms}")
    for spec in args.runs:
        scenario, target, mb = spec.split(":")
        s3 = target == "s3"
        opts, fs = (options, None) if s3 else (None, calls.file_system)
        remove = (lambda p: writers.remove_s3(p, opts)) if s3 else (lambda p: shutil.rmtree(p, ignore_errors=True))
        gc.collect()  # the last run's state released
        before, advance, info = SCENARIOS[scenario](ranks, float(mb), args)  # built anew: the same for every run
        start, base = f"{roots[target]}/{scenario}-{mb}-start", f"{roots[target]}/{scenario}-{mb}-base"
        bases = {"second": start, "incremental": base}
        save("first", before, start, bases, args, opts, fs)
        save("second", advance(), base, bases, args, opts, fs)
        state = advance()
        times: dict[str, list[float]] = {k: [] for k in KINDS}
        counts: dict[str, dict] = {}
        for repeat in range(-1, args.repeats):
            made = []  # deleted together after the round: no kind always follows the deletion of the same kind's files
            for kind in h.rotated(KINDS, repeat):
                where = f"{roots[target]}/{scenario}-{mb}-{kind}-{repeat + 1}"
                if args.evict_base and not s3 and ranks.rank == 0:
                    for earlier in bases.values():
                        h.evict_page_cache(earlier)
                if s3 and ranks.rank == 0:
                    s3_server.control(endpoint, "reset")
                calls.take()
                seconds, _, reuse = h.timed(lambda: save(kind, state, where, bases, args, opts, fs))
                local, reuse = sum(h.gather(calls.take()), Counter()), h.gather(reuse)
                if repeat >= 0:
                    times[kind].append(seconds)
                if ranks.rank == 0 and kind not in counts:
                    found = {f: sum(getattr(r, f) for r in reuse) if reuse[0] else None for f in (
                        "linked_chunks", "written_chunks", "written_bytes")}
                    if s3:
                        traffic = s3_server.control(endpoint, "counts")
                        found.update(requests={**traffic["methods"], "server CPU s": traffic["server_cpu_s"]},
                                     new_bytes=traffic["bytes_in"])
                    else:
                        found.update(requests={"write": local["writes"], "read": local["reads"],
                                               "link": found["linked_chunks"] or 0},
                                     new_bytes=du(bases.get(kind, base), where)[1])
                        if scenario == "embedding" and kind == "incremental":
                            found.update(changed_chunks(where, info["changed_rows"]))
                    stored = stored_bytes(where, opts) | ({} if s3 else {"bytes": du(where)[0]})  # du: dirs too
                    counts[kind] = {**found, **{f"store_{k}": v for k, v in stored.items()}}
                made += [] if repeat == args.repeats - 1 and kind == "incremental" else [where]
            dist.barrier()
            for where in made if ranks.rank == 0 else ():
                remove(where)
            dist.barrier()
        if ranks.rank == 0:  # the last incremental store must load without the checkpoints it linked from
            remove(start)
            remove(base)
        dist.barrier()
        loaded, where = h.zeroed(state), f"{roots[target]}/{scenario}-{mb}-incremental-{args.repeats}"
        dcp.load(loaded, storage_reader=ZarrReader(where, storage_options=opts))
        loads_equal = all(h.gather(h.equal(loaded, state)))
        dist.barrier()
        if ranks.rank == 0:
            remove(where)
        info.pop("changed_rows", None)
        results.append({"run": spec, "scenario": scenario, "target": target, "bytes": h.global_bytes(state),
                        "info": info, "hash_s": hash_seconds(ranks, state), "loads_equal": loads_equal,
                        "times_s": times, "median_s": h.medians(times), "counts": counts})
    return {"runs": results} if ranks.rank == 0 else None


def paired(r: dict, kind: str) -> float:
    """The median over rounds of time(kind) / time(full) in the same round: drifts of a shared machine's load cancel."""
    return statistics.median(t / full for t, full in zip(r["times_s"][kind], r["times_s"]["full"]))


def verdicts(runs: list[dict]) -> list[list[str]]:
    """The issue's targets, each met or not (times: the ratio of medians; the paired ratio beside it)."""
    found = []
    for r in runs:
        m, c, at = r["median_s"], r["counts"]["incremental"], (r["scenario"], r["target"])
        if at == ("lora", "disk"):
            found.append((r["run"], "new bytes / the store's", c["new_bytes"] / c["store_bytes"], "", LORA_BYTES))
        for kind in INCREMENTAL if at in (("lora", "disk"), ("finetune", "disk")) else ():
            found.append((r["run"], f"{kind}: time / a full save's", m[kind] / m["full"], f"{paired(r, kind):.3f}",
                          LORA_TIME if at[0] == "lora" else FINETUNE_TIME))
        if "changed_bytes" in c:
            found.append((r["run"], "new bytes / the changed chunks'", c["new_bytes"] / c["changed_bytes"], "",
                          EMBEDDING_BYTES))
    return [[run, f"{what} <= {limit:g}", f"{value:.3f}", pair, "yes" if value <= limit else "NO"]
            for run, what, value, pair, limit in found]


def markdown(result: dict) -> str:
    c = result["config"]
    out = [f"{c['ranks']} gloo ranks (FSDP2, CPU), {c['threads']} IO threads per writer, medians of {c['repeats']} "
           "rounds (after one untimed), kinds in rotating order; `x full`, `x dcp`: time(kind) / time(full save), "
           "/ time(DCP's writer), of medians; `paired`: the median of each round's time(kind) / time(full save); new "
           "MB: du of the store beside the earlier one (S3: PUT bodies); requests: files written / read / linked (S3: "
           "by method); chunks: linked / written by the chunk reuse; hash s: xxh3-128 of a rank's bytes in 1 MiB "
           "pieces, one thread (slowest rank). The earlier checkpoint's pages "
           f"{'evicted before every save' if c['evict_base'] else 'left in the page cache'}."]
    for r in result["runs"]:
        m, info = r["median_s"], ", ".join(f"{k} {v}" for k, v in r["info"].items())
        out += ["", f"**{r['run']}**: {r['bytes'] / 1e6:.1f} MB ({info}); hash s {r['hash_s']:.3f}; incremental store "
                f"loaded equal after the earlier one was deleted: {'yes' if r['loads_equal'] else 'NO'}"]
        e = r["counts"]["incremental"]
        if "changed_bytes" in e:
            out.append(f"changed chunks: {e['changed_chunks']} of {e['chunks']} ({e['chunk_rows']} rows each), "
                       f"{e['changed_bytes'] / 1e6:.2f} MB; new bytes / changed chunks' bytes "
                       f"{e['new_bytes'] / e['changed_bytes']:.3f}")
        rows = []
        for kind in KINDS:
            k = r["counts"][kind]
            rows.append([kind, f"{m[kind]:.3f}", " ".join(f"{t:.2f}" for t in r["times_s"][kind]),
                         *(f"{x:.3f}" for x in (m[kind] / m["full"], paired(r, kind), m[kind] / m["dcp"])),
                         f"{k['new_bytes'] / 1e6:.2f}", f"{k['new_bytes'] / k['store_bytes']:.2%}",
                         f"{k['store_bytes'] / 1e6:.1f}", f"{k['store_files']:,}",
                         " / ".join(f"{n} {v:,.4g}" for n, v in k["requests"].items()),
                         f"{k['linked_chunks']:,} / {k['written_chunks']:,}" if k["written_bytes"] is not None else ""])
        out += ["", h.table(["kind", "save s", "rounds s", "x full", "paired", "x dcp", "new MB", "new / store",
                             "store MB", "files", "requests", "chunks"], rows)]
    out += ["", h.table(["run", "the issue's target", "value", "paired", "met"], result["verdicts"])]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default=RUNS, help=f"comma-separated scenario:target:MB (default {RUNS})")
    h.add_options(p, repeats=5, threads=4, ranks=2, hidden=4096, lora_rank=16, embedding_dim=4096, changed=0.01,
                  disk_dir="/var/tmp", latency_ms=0.0)
    p.add_argument("--evict-base", action="store_true", help="evict the earlier checkpoint's pages before each save")
    p.add_argument("--out", help="result JSON (default benchmarks/results/incremental.json; .md beside it)")
    args = p.parse_args(argv)
    args.runs = args.runs.split(",")
    for spec in args.runs:
        parts = spec.split(":")
        if len(parts) != 3 or parts[0] not in SCENARIOS or parts[1] not in ("disk", "tmpfs", "s3"):
            p.error(f"--runs: {spec!r} is not scenario:target:MB of {', '.join(SCENARIOS)} and disk, tmpfs, s3")
    roots = {"disk": tempfile.mkdtemp(prefix="incremental-", dir=args.disk_dir),
             "tmpfs": tempfile.mkdtemp(prefix="incremental-", dir=h.SCRATCH)}
    server = None
    if any(":s3:" in spec for spec in args.runs):
        from dcp_zarr.testing.s3_server import S3Server

        tempfile.tempdir = h.SCRATCH  # moto spools objects over 5 MB to a temporary file: tmpfs
        server = S3Server()
        roots["s3"] = f"s3://{server.make_bucket('bench')}/incremental"
    try:
        runs = h.spawn(measure, args.ranks, args, roots, server and server.endpoint)[0]["runs"]
    finally:
        server and server.stop()
        for root in (roots["disk"], roots["tmpfs"]):
            shutil.rmtree(root, ignore_errors=True)
    result = {"config": {k: v for k, v in vars(args).items() if k != "out"}, "roots": roots, "runs": runs,
              "checks": {r["run"]: r["loads_equal"] for r in runs}}
    result["verdicts"] = verdicts(runs)
    h.write_result("incremental", args.out, result, markdown(result))
    if not all(result["checks"].values()):
        raise SystemExit(3)


if __name__ == "__main__":
    main()
