"""``dcp-zarr list`` and ``dcp-zarr prune``: a CheckpointManager's root seen and pruned from the command line.

Neither imports torch. ``prune`` takes the root's lease like a manager would, so it refuses while a job's manager
holds the root, and applies the same retention as ``CheckpointManager(keep_last=..., keep_every=...)``.
"""

from __future__ import annotations

import textwrap

from dcp_zarr.lifecycle.folders import folder_state
from dcp_zarr.lifecycle.lease import LEASE_KEY, Lease
from dcp_zarr.lifecycle.listing import StepStore
from dcp_zarr.lifecycle.retention import steps_to_delete
from dcp_zarr.lifecycle.root import CheckpointRoot
from dcp_zarr.lifecycle.step_forms import STEP_NAME_FORMS
from dcp_zarr.storage import storage_class
from dcp_zarr.store_io.commit import strategy as commit_strategy
from dcp_zarr.tools.inspection import human_bytes

DCP_SHARD_SUFFIX = ".distcp"
_WIDTH = 118  # the details' lines, wrapped


def list_root(root: CheckpointRoot) -> dict:
    """Every step store of ``root`` with its state in words a user can act on (``state``: ``complete``,
    ``incomplete``, ``mixed: ...`` or ``not dcp_zarr: ...``; ``detail``: what it is and what to do, None when
    complete), its leftovers and who holds it. A committed store whose folder holds another format's checkpoint too
    is flagged (``mixed``: the detail)."""
    lease = Lease(root)
    holder = lease.why_live(root.read_json(LEASE_KEY))
    steps = []
    for store in root.step_stores():
        mixed = mixed_folder(root, store.name) if store.complete and not store.folder else None
        row = {"step": store.step, "store": store.name, "complete": store.complete, "nbytes": root.size(store.name),
               "other_format": store.other_format, "mixed": mixed, **_state(root, store, mixed)}
        steps.append(row)
    return {
        "root": root.url,
        "held": holder,
        "steps": steps,
        "leftovers": root.leftovers() + [f"{kind} record of step {step}" for kind, step in root.records()],
    }


def _state(root: CheckpointRoot, store: StepStore, mixed: str | None) -> dict:
    """``state``, a word or two, and ``detail``: what it is and what to do (None for a complete store)."""
    location = root.location(store.name)
    if mixed:
        return {"state": "mixed: a dcp_zarr store and DCP's files", "detail": f"the folder {mixed}"}
    if store.complete:
        return {"state": "complete", "detail": None}
    if store.other_format:
        return {"state": f"not dcp_zarr: {store.other_format}",
                "detail": "listed, never pruned nor loaded by a CheckpointManager"}
    why = (folder_state(root, store.name).why_incomplete() if store.folder
           else "no committed zarr.json: its save was interrupted, or is still running")
    return {"state": "incomplete", "detail": f"{why}; nothing loads it. Remove it once no job saves here: "
                                             f"{commit_strategy(storage_class(location)).removal(location)}"}


def mixed_folder(root: CheckpointRoot, name: str) -> str | None:
    """What the folder of the committed store ``name`` is when it also holds another format's checkpoint, and what
    to do (None when it does not), as a phrase whose subject is the folder: torchtitan's resume loads DCP's files
    where they are, so keeping the zarr store means deleting them."""
    other = root.other_format(name)
    if other is None:
        return None
    location = root.location(name)
    if not root.holds_dcp_checkpoint(name):
        return (f"holds both a committed dcp_zarr store and {other}; dcp_zarr reads the store, other tools the "
                f"other files. Keep one: move the other files out of {location} to keep the store")
    shards = sum(f.endswith(DCP_SHARD_SUFFIX) for f in root.names(name))
    return (f"holds both a committed dcp_zarr store and DCP's files (.metadata and {shards} {DCP_SHARD_SUFFIX} "
            f"file{'s' if shards != 1 else ''}), as a run that switched back to DCP's own checkpointing leaves it; "
            "torchtitan's resume loads DCP's files, not the store, and `dcp-zarr inspect` refuses the folder. "
            f"Keep one: rm {location}/.metadata {location}/*{DCP_SHARD_SUFFIX} keeps the zarr store")


def format_root_list(listing: dict) -> str:
    steps = listing["steps"]
    complete = sum(row["complete"] for row in steps)
    lines = [f"{listing['root']}: {len(steps)} checkpoint{'s' if len(steps) != 1 else ''}, {complete} complete"]
    if listing["held"]:
        lines.append(f"  in use: a CheckpointManager holds it ({listing['held']}); `dcp-zarr prune` refuses until "
                     "that job stops")
    else:
        lines.append("  not in use: no CheckpointManager holds it now, so `dcp-zarr prune` may run")
    if not steps:
        lines.append(f"  no step stores (names recognized: {', '.join(STEP_NAME_FORMS)}; point it at the folder "
                     "that holds them)")
    width = max((len(row["store"]) for row in steps), default=0)
    for row in steps:
        lines.append(f"  {row['step']:>10}  {row['store'].ljust(width)}  {human_bytes(row['nbytes']):>10}  "
                     f"{row['state']}")
        if row["detail"]:
            lines.extend(textwrap.wrap(row["detail"], _WIDTH, initial_indent=" " * 14, subsequent_indent=" " * 14,
                                       break_on_hyphens=False, break_long_words=False))
    if listing["leftovers"]:
        lines.append("  left by saves or deletions that stopped (a manager or `dcp-zarr prune` removes them):")
        lines.extend(f"    {name}" for name in listing["leftovers"])
    return "\n".join(lines)


def prune_root(root: CheckpointRoot, keep_last: int, keep_every: int | None, dry_run: bool) -> dict:
    """Delete what retention would (oldest first), and what stopped saves left; nothing at all with ``dry_run``."""
    lease = Lease(root)
    lease.acquire()  # refuses while a live manager holds the root
    try:
        names = {s.step: s.name for s in root.step_stores() if s.complete}
        complete = sorted(names)
        doomed = steps_to_delete(complete, keep_last, keep_every)
        sizes = {step: root.size(names[step]) for step in doomed}
        leftovers = root.clean_leftovers(dry_run=dry_run)
        for step in doomed:
            if not dry_run:
                root.delete_step(step, names[step])
    finally:
        lease.release()
    return {"root": root.url, "dry_run": dry_run, "deleted": doomed, "deleted_bytes": sum(sizes.values()),
            "kept": [s for s in complete if s not in doomed], "leftovers_removed": leftovers}


def format_prune(result: dict) -> str:
    verb = "would delete" if result["dry_run"] else "deleted"
    lines = [f"{result['root']}: {verb} {len(result['deleted'])} checkpoint(s), "
             f"{human_bytes(result['deleted_bytes'])}: steps {', '.join(map(str, result['deleted'])) or 'none'}",
             f"  kept: steps {', '.join(map(str, result['kept'])) or 'none'}"]
    if result["leftovers_removed"]:
        lines.append(f"  {'would remove' if result['dry_run'] else 'removed'} leftovers of stopped saves:")
        lines.extend(f"    {name}" for name in result["leftovers_removed"])
    return "\n".join(lines)
