"""Metadata and planning at 8 to 8,192 ranks, simulated in one process, beside DCP's FileSystemWriter/Reader.

    python benchmarks/scale.py --out benchmarks/results/scale     # the README's table and plot (~15 min here)
    python benchmarks/scale.py --quick --out /tmp/scale            # small sizes, a minute (what the tests run)

No process group: each saving rank's SavePlan is built as that rank's DefaultSavePlanner would (one WriteItem per
tensor shard, FSDP ``Shard(0)``, HSDP ``(Replicate, Shard(0))`` on an (n/8, 8) mesh, or FSDP+TP on a (n/8, 8)
(dp, tp) mesh), and then the functions a real save and load call are timed on them:

- coordinator save planning: DCP's ``DefaultSavePlanner.create_global_plan`` (dedup, metadata, validation), then
  what each writer adds in ``prepare_global_plan`` (``ZarrWriter``: node paths, chunk grids, assignments);
- metadata: each writer's ``finish`` on the global plan (synthetic WriteResults), bytes of ``.metadata`` / root
  ``zarr.json``;
- per loading rank: ``read_metadata`` (read and parse), then DCP's ``create_read_items_for_chunk_list`` for every
  tensor with the rank's shard of a 128-rank FSDP job (what ``create_default_local_load_plan`` calls): time and
  read items;
- validation: ``Manifest.from_json`` of the root document, and of a format-1 entry of 1,000,000 boxes.

Rank-local planning (building each rank's plan) runs on every rank in parallel in a real job and is not timed. The
8,192 x 2,000 save-planning point would hold 16.4M write items (~11 GB) and take DCP most of an hour here, so it is
measured on 2 planning calls of 50 tensors each and scaled to 2,000: every step timed is per tensor.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dcp_zarr import ZarrReader, ZarrWriter  # noqa: E402
from dcp_zarr.format.manifest import Manifest  # noqa: E402

HIDDEN = 4096
LOAD_WORLD_SIZE = 128
_PROPS = TensorProperties(dtype=torch.bfloat16)


def model_tensors(entries: int) -> list[tuple[str, tuple[int, ...]]]:
    """A transformer's weights: per layer four (d, d) attention matrices, (4d, d) and (d, 4d) MLP, two norms."""
    per_layer = [("wq", (HIDDEN, HIDDEN)), ("wk", (HIDDEN, HIDDEN)), ("wv", (HIDDEN, HIDDEN)), ("wo", (HIDDEN, HIDDEN)),
                 ("w1", (4 * HIDDEN, HIDDEN)), ("w2", (HIDDEN, 4 * HIDDEN)), ("norm1", (HIDDEN,)), ("norm2", (HIDDEN,))]
    return [(f"model.layers.{i // 8}.{per_layer[i % 8][0]}", per_layer[i % 8][1]) for i in range(entries)]


def _split(n: int, parts: int, index: int) -> tuple[int, int]:
    """torch.chunk's split, as FSDP2 uses it: (offset, size) of part ``index``; trailing parts may be empty."""
    step = -(-n // parts)
    start = min(index * step, n)
    return start, min(step, n - start)


def rank_box(layout: str, shape: tuple[int, ...], rank: int, world: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    rest = tuple(shape[1:])
    if layout == "fsdp":
        start, size = _split(shape[0], world, rank)
    elif layout == "hsdp":  # (replicate, shard) mesh with 8-way sharding: replicas hold the same box
        start, size = _split(shape[0], 8, rank % 8)
    elif layout == "fsdp_tp":  # (dp, tp) mesh, tp = 8 colwise; FSDP splits each TP shard (a _StridedShard)
        tp_start, tp_size = _split(shape[0], 8, rank % 8)
        start, size = _split(tp_size, world // 8, rank // 8)
        start += tp_start
    else:
        raise ValueError(layout)
    if size == 0:  # an empty shard sits at the tensor's end, as FSDP2's do: it must not share a real shard's offset
        start = shape[0]
    return (start, *(0 for _ in rest)), (size, *rest)


def _new(cls, **fields):
    """A DCP plan object with its fields set directly: its frozen dataclass __init__ costs ~10 us, which at 16M
    items would dominate the run. Building plans is each rank's own work in a real job, and is not timed."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


def save_plans(tensors, layout: str, world: int) -> list[SavePlan]:
    planner_data = {fqn: ("model", fqn.removeprefix("model.")) for fqn, _ in tensors}
    plans = []
    for rank in range(world):
        items = []
        for fqn, shape in tensors:
            offsets, sizes = rank_box(layout, shape, rank, world)
            offsets = torch.Size(offsets)
            items.append(_new(WriteItem, index=_new(MetadataIndex, fqn=fqn, offset=offsets, index=None),
                              type=WriteItemType.SHARD, bytes_io_data=None,
                              tensor_data=_new(TensorWriteData, chunk=ChunkStorageMetadata(offsets, torch.Size(sizes)),
                                               properties=_PROPS, size=torch.Size(shape))))
        plans.append(SavePlan(items, planner_data=planner_data))
    return plans


def timed(fn, repeats: int = 1):
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def coordinator_planning(plans: list[SavePlan], work: str) -> dict:
    """DCP's global planning, then each writer's prepare_global_plan on its result."""
    dcp_s, (global_plan, metadata) = timed(lambda: DefaultSavePlanner().create_global_plan(plans))
    zarr_writer = ZarrWriter(os.path.join(work, "ckpt.zarr"), sync_files=False)
    zarr_s, _ = timed(lambda: zarr_writer.prepare_global_plan(global_plan))
    fs_writer = FileSystemWriter(os.path.join(work, "dcp"), sync_files=False)
    fs_writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    fs_s, _ = timed(lambda: fs_writer.prepare_global_plan(global_plan))
    return {"dcp_global_plan_s": dcp_s, "zarr_added_s": zarr_s, "fs_added_s": fs_s,
            "global_plan": global_plan, "metadata": metadata, "zarr_writer": zarr_writer, "fs_writer": fs_writer}


def zarr_results(global_plan: list[SavePlan], world: int) -> list[list[WriteResult]]:
    """The WriteResults each rank's ZarrWriter.write_data would return (the chunks themselves are not written)."""
    source = {"type": "dtensor", "placements": ["S(0)"], "mesh_shape": [world], "mesh_dim_names": None}
    return [[WriteResult(item.index, 0, {"source": source}) for item in plan.items] for plan in global_plan]


def loading_shards(tensors) -> dict[str, list[ChunkStorageMetadata]]:
    """Rank 0's shard of each tensor in a 128-rank FSDP job."""
    return {fqn: [ChunkStorageMetadata(*map(torch.Size, rank_box("fsdp", shape, 0, LOAD_WORLD_SIZE)))]
            for fqn, shape in tensors}


def read_items(metadata, local: dict) -> int:
    """DCP's read items for the rank's shards (what create_default_local_load_plan makes per tensor)."""
    return sum(len(create_read_items_for_chunk_list(fqn, metadata.state_dict_metadata[fqn], chunks))
               for fqn, chunks in local.items())


def write_metadata(planning: dict, world: int, work: str) -> dict:
    """Each writer's finish on synthetic WriteResults; the bytes of what it wrote."""
    fs_results = [[WriteResult(item.index, 0, _StorageInfo(f"__{rank}_0.distcp", 0, 0)) for item in plan.items]
                  for rank, plan in enumerate(planning["global_plan"])]
    os.makedirs(os.path.join(work, "dcp"), exist_ok=True)
    planning["fs_writer"].finish(planning["metadata"], fs_results)
    planning["zarr_writer"].finish(planning["metadata"], zarr_results(planning["global_plan"], world))
    root = os.path.join(work, "ckpt.zarr", "zarr.json")
    with open(root) as f:
        manifest = json.load(f)["attributes"]["dcp_zarr"]
    # the root zarr.json (what a loading rank reads) holds the manifest and a copy of every node's zarr.json
    return {"zarr_root_bytes": os.path.getsize(root),
            "zarr_manifest_bytes": len(json.dumps(manifest, separators=(",", ":"))),
            "dcp_metadata_bytes": os.path.getsize(os.path.join(work, "dcp", ".metadata"))}


def loading_rank(tensors, work: str, repeats: int) -> dict:
    """Rank 0 of a 128-rank FSDP job: read and parse the metadata, then DCP's read items for each of its shards.
    dcp_zarr's steps take milliseconds, so they get more repeats than DCP's (seconds at 8,192 ranks)."""
    cheap = max(25, repeats)
    local = loading_shards(tensors)

    def plan(metadata):
        return read_items(metadata, local)

    # Each side runs with only its own metadata alive, as on a real rank: DCP's unpickled metadata (millions of
    # objects at 8,192 ranks) would otherwise slow dcp_zarr's steps through Python's garbage collector.
    gc.collect()
    zarr_s, zarr_md = timed(lambda: ZarrReader(os.path.join(work, "ckpt.zarr")).read_metadata(), cheap)
    zarr_plan_s, zarr_items = timed(lambda: plan(zarr_md), cheap)
    with open(os.path.join(work, "ckpt.zarr", "zarr.json")) as f:
        document = json.load(f)["attributes"]["dcp_zarr"]
    validate_s, _ = timed(lambda: Manifest.from_json(document, "scale"), cheap)
    # Release both for the GC (None, not del: pyflakes would read the lambdas above as using deleted names).
    zarr_md = document = None
    gc.collect()
    fs_s, fs_md = timed(lambda: FileSystemReader(os.path.join(work, "dcp")).read_metadata(), repeats)
    fs_plan_s, fs_items = timed(lambda: plan(fs_md), repeats)
    return {"zarr_read_metadata_s": zarr_s, "dcp_read_metadata_s": fs_s, "zarr_load_plan_s": zarr_plan_s,
            "dcp_load_plan_s": fs_plan_s, "zarr_read_items": zarr_items, "dcp_read_items": fs_items,
            "zarr_validate_s": validate_s}


def measure(layout: str, world: int, entries: int, repeats: int) -> dict:
    tensors = model_tensors(entries)
    work = tempfile.mkdtemp(prefix="dcp-zarr-scale-")
    try:
        planning = coordinator_planning(save_plans(tensors, layout, world), work)
        row = {"layout": layout, "world": world, "entries": entries,
               **{k: v for k, v in planning.items() if k.endswith("_s")}}
        row.update(write_metadata(planning, world, work))
        del planning
        row.update(loading_rank(tensors, work, repeats))
        return row
    finally:
        shutil.rmtree(work, ignore_errors=True)


def sampled_save_planning(world: int, entries: int, batch: int, batches: int) -> dict:
    """Coordinator save planning over ``entries`` tensors, estimated from ``batches`` full planning calls of
    ``batch`` tensors each, scaled by entries / (batch x batches): every step timed is per tensor."""
    totals = {"dcp_global_plan_s": 0.0, "zarr_added_s": 0.0, "fs_added_s": 0.0}
    tensors = model_tensors(batch * batches)
    for start in range(0, batch * batches, batch):
        work = tempfile.mkdtemp(prefix="dcp-zarr-scale-")
        try:
            planning = coordinator_planning(save_plans(tensors[start:start + batch], "fsdp", world), work)
            for key in totals:
                totals[key] += planning[key]
            del planning
        finally:
            shutil.rmtree(work, ignore_errors=True)
    scale = entries / (batch * batches)
    return {"layout": "fsdp", "world": world, "entries": entries, "measured_entries": batch * batches,
            **{key: value * scale for key, value in totals.items()}}


def interleaved_load_planning(worlds: list[int], entries: int, rounds: int) -> dict[int, float]:
    """A loading rank's read_metadata + read items of dcp_zarr stores saved at each world size, timed round-robin
    over the world sizes (``rounds`` rounds, medians), so this machine's drifting speed falls on all of them alike."""
    tensors = model_tensors(entries)
    keep = tempfile.mkdtemp(prefix="dcp-zarr-scale-kept-")
    local = loading_shards(tensors)
    try:
        for world in worlds:
            work = tempfile.mkdtemp(prefix="dcp-zarr-scale-")
            try:
                planning = coordinator_planning(save_plans(tensors, "fsdp", world), work)
                planning["zarr_writer"].finish(planning["metadata"], zarr_results(planning["global_plan"], world))
                del planning
                shutil.copytree(os.path.join(work, "ckpt.zarr"), os.path.join(keep, f"ws{world}.zarr"))
            finally:
                shutil.rmtree(work, ignore_errors=True)
        gc.collect()
        times: dict[int, list[float]] = {world: [] for world in worlds}
        for _ in range(rounds):
            for world in worlds:
                start = time.perf_counter()
                read_items(ZarrReader(os.path.join(keep, f"ws{world}.zarr")).read_metadata(), local)
                times[world].append(time.perf_counter() - start)
        return {world: statistics.median(values) for world, values in times.items()}
    finally:
        shutil.rmtree(keep, ignore_errors=True)


def format1_validation(boxes: int, repeats: int) -> float:
    entry = {"path": ["w"], "kind": "tensor", "node": "w", "dtype": "torch.float32", "shape": [boxes, 2],
             "chunk_shape": [1, 2], "saved_chunks": [{"offsets": [i, 0], "sizes": [1, 2]} for i in range(boxes)]}
    document = {"format": "dcp_zarr", "format_version": 1, "complete": True, "entries": {"w": entry}}
    return timed(lambda: Manifest.from_json(document, "scale"), repeats)[0]


def table(rows: list[dict]) -> str:
    head = ("| layout | ranks | entries | DCP plan s | zarr added s | root zarr.json kB (manifest) | DCP .metadata kB "
            "| read+parse s "
            "zarr / DCP | load plan s zarr / DCP | read items zarr / DCP | validate s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['layout']} | {r['world']} | {r['entries']} | {r['dcp_global_plan_s']:.3f} | {r['zarr_added_s']:.3f} "
            f"| {r['zarr_root_bytes'] / 1e3:.1f} ({r['zarr_manifest_bytes'] / 1e3:.1f}) "
            f"| {r['dcp_metadata_bytes'] / 1e3:.1f} "
            f"| {r['zarr_read_metadata_s']:.4f} / {r['dcp_read_metadata_s']:.3f} "
            f"| {r['zarr_load_plan_s']:.4f} / {r['dcp_load_plan_s']:.3f} "
            f"| {r['zarr_read_items']} / {r['dcp_read_items']} | {r['zarr_validate_s']:.4f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fsdp = sorted((r for r in rows if r["layout"] == "fsdp" and r["entries"] == rows[0]["entries"]),
                  key=lambda r: r["world"])
    worlds = [r["world"] for r in fsdp]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    series = [
        ("metadata bytes", [("dcp_zarr root zarr.json", "zarr_root_bytes"),
                            ("dcp_zarr manifest", "zarr_manifest_bytes"), ("DCP .metadata", "dcp_metadata_bytes")]),
        ("per-rank read + parse + load plan (s)",
         [("dcp_zarr", ("zarr_read_metadata_s", "zarr_load_plan_s")),
          ("DCP", ("dcp_read_metadata_s", "dcp_load_plan_s"))]),
        ("coordinator save planning (s)", [("dcp_zarr prepare_global_plan (added)", "zarr_added_s"),
                                           ("DCP create_global_plan", "dcp_global_plan_s")]),
    ]
    for ax, (title, lines) in zip(axes, series):
        for label, keys in lines:
            keys = keys if isinstance(keys, tuple) else (keys,)
            ax.plot(worlds, [sum(r[k] for k in keys) for r in fsdp], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"saving ranks (FSDP, {fsdp[0]['entries']} entries)")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _interleaved_text(medians: dict[int, float]) -> str:
    first = min(medians)
    return ("a loading rank's read_metadata + read items (FSDP, 100 entries), round-robin over saving world sizes, "
            "medians of 51: " + ", ".join(f"{world} ranks {s * 1e3:.2f} ms ({s / medians[first]:.2f}x)"
                                          for world, s in medians.items()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: 8 and 64 ranks, 300 and 1,000 entries")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/scale",
                        help="directory for scale.json, scale.md, scale.png")
    parser.add_argument("--interleaved-only", action="store_true",
                        help="only the round-robin timing of a loading rank's read_metadata + read items")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    interleaved_worlds = [8, 64] if args.quick else [8, 64, 512, 2048, 8192]
    if args.interleaved_only:
        print(_interleaved_text(interleaved_load_planning(interleaved_worlds, 100, 51)))
        return 0
    if args.quick:
        worlds = {"fsdp": [8, 64], "hsdp": [8, 64], "fsdp_tp": [8, 64]}
        world_entries, entry_counts, target, boxes = 100, [300, 1000], None, 10_000
    else:
        worlds = {"fsdp": [8, 64, 512, 2048, 8192], "hsdp": [8, 512, 8192], "fsdp_tp": [8, 512, 8192]}
        world_entries, entry_counts, target, boxes = 100, [300, 2000, 6000, 20000], (8192, 2000, 50, 2), 1_000_000
    rows = []
    for layout, layout_worlds in worlds.items():
        for world in layout_worlds:
            rows.append(measure(layout, world, world_entries, args.repeats))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    for entries in entry_counts:
        rows.append(measure("fsdp", 64, entries, args.repeats))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    report = {"rows": rows,
              "format1_validation_s": {"boxes": boxes, "seconds": format1_validation(boxes, args.repeats)},
              "torch": torch.__version__}
    if target:
        report["target"] = sampled_save_planning(*target)
    report["interleaved_load_planning_s"] = interleaved_load_planning(interleaved_worlds, 100, 51)
    text = table(rows)
    text += (f"\n\nformat-1 entry of {boxes:,} boxes: "
             f"Manifest.from_json {report['format1_validation_s']['seconds']:.2f} s")
    if target:
        t = report["target"]
        text += (f"\ncoordinator save planning at {t['world']} ranks x {t['entries']} tensors (measured on "
                 f"{t['measured_entries']}, scaled): "
                 f"DCP {t['dcp_global_plan_s']:.1f} s, dcp_zarr adds {t['zarr_added_s']:.1f} s "
                 f"({t['zarr_added_s'] / t['dcp_global_plan_s']:.0%}), FileSystemWriter adds {t['fs_added_s']:.2f} s")
    text += "\n" + _interleaved_text(report["interleaved_load_planning_s"])
    print(text)
    with open(os.path.join(args.out, "scale.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out, "scale.md"), "w") as f:
        f.write(text + "\n")
    plot(rows, os.path.join(args.out, "scale.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
