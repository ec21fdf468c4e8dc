"""``dcp-zarr list`` and ``dcp-zarr prune``: a CheckpointManager's root seen and pruned from the command line.

Neither imports torch. ``prune`` takes the root's lease like a manager would, so it refuses while a job's manager
holds the root, and applies the same retention as ``CheckpointManager(keep_last=..., keep_every=...)``.
"""

from __future__ import annotations

from dcp_zarr.lifecycle.lease import LEASE_KEY, Lease
from dcp_zarr.lifecycle.root import STEP_NAME_FORMS, CheckpointRoot, steps_to_delete
from dcp_zarr.tools.inspection import human_bytes


def list_root(root: CheckpointRoot) -> dict:
    stores = root.step_stores()
    lease = Lease(root)
    holder = lease.why_live(root.read_json(LEASE_KEY))
    return {
        "root": root.url,
        "held": holder,
        "steps": [{"step": s.step, "store": s.name, "complete": s.complete, "nbytes": root.size(s.name),
                   "other_format": s.other_format} for s in stores],
        "leftovers": root.leftovers() + [f"{kind} record of step {step}" for kind, step in root.records()],
    }


def format_root_list(listing: dict) -> str:
    lines = [f"{listing['root']}: {'a manager holds it: ' + listing['held'] if listing['held'] else 'no live manager'}"]
    if not listing["steps"]:
        lines.append(f"  no step stores (names recognized: {', '.join(STEP_NAME_FORMS)}; point it at the folder "
                     "that holds them)")
    for row in listing["steps"]:
        state = ("complete" if row["complete"] else f"not a dcp_zarr store: {row['other_format']}"
                 if row.get("other_format") else "incomplete (never loaded)")
        lines.append(f"  {row['step']:>10}  {row['store']}  {human_bytes(row['nbytes']):>10}  {state}")
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
