"""What ``dcp-zarr inspect`` shows: the save's context (world size, meshes, state_dict_type, optimizer steps), then a
summary that fits a screen (summary.py), the tree of every entry with its shape, dtype, size and chunk layout
(``--tree``, or the entries ``--filter`` picks), or groups at a fixed depth (``--depth``). Built from the manifest;
only step scalars are read, and the shard indexes of compressed arrays (one small read per shard), which give their
stored bytes (stored_sizes.py). Which entries are listed, in what order and how grouped is ``listing.py``'s.

Each entry has two sizes: its bytes (the tensor's, or the ``torch.save`` bytes': ``nbytes``) and the bytes its
array occupies in the store (``stored_bytes``: chunks, checksums and shard indexes, compressed or not); the header
gives both totals for the tensors and their ratio, bytes over stored (``1.32x``: compressed to 1/1.32 of its size).

Chunks and shards are named as zarr-python names them: an array's ``chunks`` are what one read decodes (the inner
chunks of a sharded array, ``Array.chunks``), its ``shards`` the stored objects that hold several (``Array.shards``).
The manifest's ``chunk_shape`` is the stored grid: the shards of a sharded array, the chunks of any other."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from dcp_zarr.errors import TorchNotImportableError
from dcp_zarr.format.chunk_layout import ChunkLayout
from dcp_zarr.format.codecs import codec_from_json
from dcp_zarr.format.manifest import TENSOR, ValueEntry
from dcp_zarr.offline import Checkpoint, Entry
from dcp_zarr.storage import directory_of
from dcp_zarr.tools.listing import depth_groups, matches, natural_key, node_key
from dcp_zarr.tools.stored_sizes import stored_sizes
from dcp_zarr.tools.summary import shown_values, summary_groups, summary_values, value_text


def step_values(ckpt: Checkpoint) -> dict[str, float | int]:
    """``{fqn: value}`` of every entry named ``step`` that holds one number (optimizer steps, a trainer's step)."""
    chosen = [e for e in ckpt if e.path and e.path[-1] == "step"
              and (e.kind != TENSOR or (e.shape is not None and _numel(e.shape) == 1))]

    def read(entry: Entry):
        try:  # numpy for tensors, so inspect needs no torch
            value = ckpt.read_array(entry) if entry.kind == TENSOR else ckpt.read_value(entry)
        except TorchNotImportableError:  # a step saved as torch.save bytes: shown where torch can decode it
            return entry.fqn, None
        if hasattr(value, "item"):
            value = value.item()
        return entry.fqn, value

    with ThreadPoolExecutor(ckpt.thread_count) as pool:
        found = dict(pool.map(read, chosen))
    return {fqn: found[fqn] for fqn in sorted(found, key=natural_key)
            if isinstance(found[fqn], (int, float)) and not isinstance(found[fqn], bool)}


def chunk_count(entry: Entry) -> int:
    """Stored chunks (shards, for large arrays) of a tensor entry: every chunk of its grid, since the saved boxes
    tile the tensor and each is whole chunks; none for a tensor kept in its array's fill_value."""
    assert entry.shape is not None and entry.chunk_shape is not None  # recorded for every tensor entry
    if entry.fill is not None:
        return 0
    return ChunkLayout(entry.shape, entry.chunk_shape, entry.inner_chunk_rows).chunk_count


def summarize(ckpt: Checkpoint, *, patterns: list[str] | None = None, depth: int | None = None) -> dict:
    """A JSON-serialisable description of the checkpoint (what ``inspect --json`` prints).

    ``entries`` lists those whose names match one of ``patterns`` (globs; all when None), in natural order of their
    nodes; with ``depth``, ``groups`` replaces ``entries`` (``listing.depth_groups``). The header (counts, bytes,
    stored bytes, steps) always describes the whole checkpoint.
    """
    sizes = stored_sizes(ckpt)  # every entry's: the header's totals are the whole checkpoint's
    entries = []
    for entry in sorted((e for e in ckpt if matches(e.fqn, patterns)), key=lambda e: node_key(e.node)):
        row = {"fqn": entry.fqn, "path": list(entry.path), "node": entry.node, "kind": entry.kind,
               "nbytes": entry.nbytes, "stored_bytes": sizes[entry.fqn]}
        if entry.kind == TENSOR:
            assert entry.dtype_name is not None and entry.shape is not None and entry.chunk_shape is not None
            inner = [entry.inner_chunk_rows, *entry.chunk_shape[1:]] if entry.inner_chunk_rows else None
            row.update(
                dtype=entry.dtype_name.removeprefix("torch."), shape=list(entry.shape),
                chunk_shape=list(entry.chunk_shape), chunks=chunk_count(entry), inner_chunk_shape=inner,
                # zarr-python's words: Array.chunks (what one read decodes) and Array.shards (None: unsharded)
                zarr_chunks=inner or list(entry.chunk_shape), zarr_shards=list(entry.chunk_shape) if inner else None,
                saved_shards=entry.saved_shards, source=entry.source, codec=entry.codec)
        elif entry.kind == "value":
            stored = ckpt.manifest.entries[entry.fqn]
            assert isinstance(stored, ValueEntry)  # the entry's kind is the manifest entry's
            row["value"] = stored.value
        entries.append(row)
    tensors = [e for e in ckpt if e.kind == TENSOR]
    compressed = [e.codec for e in tensors if e.codec is not None]
    listing: dict = {"entries": entries}
    if patterns:
        listing = {"filter": list(patterns), "matched_count": len(entries),
                   "matched_bytes": sum(row["nbytes"] for row in entries),
                   "matched_stored_bytes": sum(row["stored_bytes"] or 0 for row in entries), **listing}
    if depth is not None:
        listing["depth"] = depth
        listing["groups"] = depth_groups(entries, depth)
        del listing["entries"]
    return {
        "path": ckpt.url,
        "format_version": ckpt.manifest.format_version,
        "save_id": ckpt.manifest.save_id,
        "versions": ckpt.versions,
        "saved_world_size": ckpt.saved_world_size,
        "state_dict_type": ckpt.state_dict_type,
        "meshes": ckpt.meshes,
        "tensor_count": len(tensors),
        "tensor_bytes": sum(e.nbytes for e in tensors),
        # the stored bytes of the tensors whose size is known; tensor_stored_unknown: how many are not (an index that
        # cannot be read: verify says why)
        "tensor_stored_bytes": sum(sizes[e.fqn] or 0 for e in tensors),
        "tensor_stored_unknown": sum(sizes[e.fqn] is None for e in tensors),
        "compressed_tensor_count": len(compressed),
        "codecs": sorted({_codec_text(codec) for codec in compressed}),
        "entry_count": len(ckpt),
        "steps": step_values(ckpt),
        "incremental": _incremental(ckpt.manifest.chunk_record),
        **listing,
    }


def _incremental(record: dict | None) -> dict | None:
    """What a save that records its chunks says of itself (format/chunk_record.py): the arrays recorded, and where
    its reused chunks came from; None for a save that records none."""
    if record is None:
        return None
    arrays = record.get("arrays")
    origin = record.get("incremental_from")
    return {"recorded_arrays": len(arrays) if isinstance(arrays, dict) else 0,
            "reused_from": origin if isinstance(origin, dict) else None}


def format_summary(summary: dict, *, tree: bool = False) -> str:
    """``summarize``'s result for people: its groups with ``depth``, else every entry's tree with ``tree``, else the
    summary of summary.py (at most 56 lines)."""
    lines = [summary["path"]]
    versions = ", ".join(f"{k} {v}" for k, v in summary["versions"].items())
    lines.append(f"  format: dcp_zarr v{summary['format_version']}, saved by {versions}, save id {summary['save_id']}")
    meshes = "; ".join(
        "x".join(map(str, m["shape"])) + (f" ({', '.join(m['dim_names'])})" if m.get("dim_names") else "")
        for m in summary["meshes"]) or "none"
    lines.append(f"  saved world size: {summary['saved_world_size']}, state_dict_type: {summary['state_dict_type']}, "
                 f"meshes: {meshes}")
    others = summary["entry_count"] - summary["tensor_count"]
    lines.append(f"  entries: {summary['entry_count']} ({_plural(summary['tensor_count'], 'tensor')}, "
                 f"{human_bytes(summary['tensor_bytes'])}; {_plural(others, 'other value')})")
    lines.append(_stored_line(summary))
    incremental = summary.get("incremental")
    if incremental is not None:
        origin = incremental["reused_from"]
        reused = ("the first of a chain: nothing reused" if origin is None else
                  f"{_plural(origin.get('reused_chunks', 0), 'chunk')} ({human_bytes(origin.get('reused_bytes', 0))}) "
                  f"{_reused_how(origin.get('path'))} {origin.get('path')}")
        lines.append(f"  incremental: {_plural(incremental['recorded_arrays'], 'array')} recorded; {reused}")
    lines.append(f"  steps: {_format_steps(summary['steps'])}")
    if "filter" in summary:
        globs = " or ".join(map(repr, summary["filter"]))
        lines.append(f"  matching {globs}: {_plural(summary['matched_count'], 'entry', 'entries')}, "
                     f"{human_bytes(summary['matched_bytes'])}, stored in "
                     f"{human_bytes(summary['matched_stored_bytes'])}")
    lines.append("")
    if "groups" in summary:
        lines.extend(_group_lines(summary["groups"], summary["depth"]))
    elif tree:
        lines.extend(_tree_lines(summary["entries"]))
    else:
        lines.extend(_summary_lines(summary["entries"], stored=summary["compressed_tensor_count"] > 0))
    return "\n".join(lines)


def _stored_line(summary: dict) -> str:
    """``  stored: 1.3 MiB for 1.8 MiB of tensors (1.44x); 2 of 4 tensors compressed (blosc zstd level 1)``."""
    logical, stored = summary["tensor_bytes"], summary["tensor_stored_bytes"]
    count, compressed = summary["tensor_count"], summary["compressed_tensor_count"]
    line = f"  stored: {human_bytes(stored)} for {human_bytes(logical)} of tensors ({ratio_text(logical, stored)}); "
    if compressed:
        line += f"{compressed} of {_plural(count, 'tensor')} compressed ({', '.join(summary['codecs'])})"
    else:
        line += "none compressed"
    unknown = summary["tensor_stored_unknown"]
    if unknown:
        line += (f"; {_plural(unknown, 'tensor')} not counted: {'its' if unknown == 1 else 'their'} shard index "
                 "cannot be read (dcp-zarr verify says why)")
    return line


def ratio_text(logical: int, stored: int | None) -> str:
    """Bytes over stored bytes, ``1.32x`` (``69.1x``, ``691x``: at most 6 characters below 100,000x); ``-`` where
    there is nothing to compare or the stored size is unknown."""
    if not stored or not logical:
        return "-"
    ratio = logical / stored
    return f"{ratio:.{2 if ratio < 10 else 1 if ratio < 100 else 0}f}x"


def _codec_text(codec: dict) -> str:
    """``blosc zstd level 1`` of an entry's codec (as its zarr.json names it, checked when the manifest was read)."""
    return codec_from_json(codec, "codec").description


def _summary_lines(entries: list[dict], *, stored: bool = False) -> list[str]:
    """The groups' table (with ``stored``, each group's stored bytes and ratio: for a store with compressed
    arrays), then the values."""
    groups = summary_groups(entries)
    width = max([len("group")] + [len(g["name"]) for g in groups])
    stored_header = f"  {'stored':>10}  {'ratio':>6}" if stored else ""
    lines = [f"{'group'.ljust(width)}  {'entries':>7}  {'tensors':>7}  {'bytes':>10}{stored_header}  dtypes"]
    for g in groups:
        stored_cells = ""
        if stored:
            known = g["stored_bytes"]
            stored_cells = (f"  {'?' if known is None else human_bytes(known):>10}  "
                            f"{ratio_text(g['nbytes'], known):>6}")
        lines.append(f"{g['name'].ljust(width)}  {g['entries']:>7}  {g['tensors']:>7}  "
                     f"{human_bytes(g['nbytes']):>10}{stored_cells}  {', '.join(g['dtypes']) or '-'}")
    values = summary_values(entries)
    if values:
        shown, left_out = shown_values(values)
        lines += ["", "values:"]
        lines += [f"  {v['name']} = {v['value']}" + (f"  (x{v['count']})" if v["count"] > 1 else "") for v in shown]
        if left_out:
            lines.append(f"  ... and {left_out} more, deeper in the tree (--tree lists them)")
    lines += ["", "every entry: --tree; groups of the first N name components: --depth N; some entries: --filter GLOB"]
    return lines


def _format_steps(steps: dict) -> str:
    if not steps:
        return "none saved"
    distinct: dict = {}
    for fqn, value in steps.items():
        distinct.setdefault(value, []).append(fqn)
    if len(distinct) == 1:
        (value, fqns), = distinct.items()
        return f"{_number(value)} ({len(fqns)} {'entry' if len(fqns) == 1 else 'entries'})"
    return ", ".join(f"{_number(v)} x{len(f)}" for v, f in sorted(distinct.items()))


def _group_lines(groups: list[dict], depth: int) -> list[str]:
    header = f"first {_plural(depth, 'name component')}"
    width = max([len(header)] + [len(g["name"]) for g in groups])
    lines = [f"{header.ljust(width)}  {'entries':>7}  {'tensors':>7}  {'bytes':>10}"]
    for g in groups:
        lines.append(f"{g['name'].ljust(width)}  {g['entries']:>7}  {g['tensors']:>7}  {human_bytes(g['nbytes']):>10}")
    return lines


def _tree_lines(entries: list[dict]) -> list[str]:
    rows: list[tuple[str, dict | None]] = []  # (indented name, the entry's row; None for a group)
    opened: list[str] = []
    for row in sorted(entries, key=lambda r: node_key(r["node"])):
        *groups, leaf = row["node"].split("/")
        common = 0
        while common < min(len(groups), len(opened)) and groups[common] == opened[common]:
            common += 1
        for depth in range(common, len(groups)):
            rows.append(("  " * depth + groups[depth] + "/", None))
        opened = groups
        rows.append(("  " * len(groups) + leaf, row))
    width = max((len(name) for name, row in rows if row is not None), default=0)
    lines = []
    for name, described in rows:
        lines.append(name if described is None else f"{name.ljust(width)}  {_describe(described)}")
    return lines


def _describe(row: dict) -> str:
    if row["kind"] == "value":
        return f"value  {value_text(row)}"
    if row["kind"] == "object":
        return f"object  {human_bytes(row['nbytes'])} (torch.save bytes)"
    shape = "[" + ", ".join(map(str, row["shape"])) + "]"
    known = row.get("stored_bytes")
    stored = f"stored {'?' if known is None else human_bytes(known):>10} {ratio_text(row['nbytes'], known):>6}"
    text = f"{row['dtype']:<13} {shape:<14} {human_bytes(row['nbytes']):>10}  {stored}  {_layout(row)}"
    source = row.get("source") or {}
    if source.get("type") == "dtensor":
        text += "  DTensor(" + ", ".join(source.get("placements", [])) + ")"
    return text


def _layout(row: dict) -> str:
    """``2 chunks 8x4``, or ``1 shard 18x13, chunks 9x13``: zarr-python's words (module docstring)."""
    if not row["chunk_shape"]:
        return "1 chunk (a scalar)"
    stored = "x".join(map(str, row["chunk_shape"]))
    codec = row.get("codec")
    compressed = f", {codec_from_json(codec, 'codec').label}" if codec else ""
    if row["inner_chunk_shape"]:
        inner = "x".join(map(str, row["inner_chunk_shape"]))
        return f"{_plural(row['chunks'], 'shard')} {stored}, chunks {inner}{compressed}"
    return f"{_plural(row['chunks'], 'chunk')} {stored}{compressed}"


def _reused_how(origin: str | None) -> str:
    """How a save reused chunks of ``origin``: hard links in a directory, copies within the service elsewhere (an
    object store's server-side copy; bytes through the process where the two stores share no client)."""
    if origin is None or directory_of(origin) is not None:
        return "linked from"
    return "copied within the store from"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _number(value) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _plural(n: int, noun: str, nouns: str | None = None) -> str:
    return f"{n} {noun if n == 1 else nouns or noun + 's'}"
