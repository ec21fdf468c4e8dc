"""Which complete checkpoints retention deletes (``CheckpointManager(keep_last=, keep_every=)``, ``dcp-zarr
prune``)."""

from __future__ import annotations

from collections.abc import Iterable


def steps_to_delete(complete: list[int], keep_last: int | None, keep_every: int | None,
                    protected: Iterable[int] = frozenset()) -> list[int]:
    """Which of the ``complete`` steps retention deletes: all but the newest ``keep_last`` (none without it), the
    multiples of ``keep_every``, the newest one and ``protected``, oldest first."""
    if keep_last is None or not complete:
        return []
    complete = sorted(complete)
    keep = set(complete[-keep_last:]) | {complete[-1]} | set(protected)
    if keep_every is not None:
        keep |= {s for s in complete if s % keep_every == 0}
    return [s for s in complete if s not in keep]
