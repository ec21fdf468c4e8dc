"""What a ``CheckpointManager`` save did (``manager.last_save``, and its log line): the chunks it wrote, linked and
copied over every rank, and how long ``save()`` held the caller.

DCP hands the coordinator every rank's write results in ``finish``; each rank's ``RankReport`` says what that rank
stored (planning/protocol.py), so the coordinator's writer (``ReportingWriter``) adds them up there, and only there.
"""

from __future__ import annotations

from dataclasses import dataclass

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

from dcp_zarr.planning.protocol import stored_totals
from dcp_zarr.store_io.chunk_reuse import ReuseCounts
from dcp_zarr.writer import ZarrWriter


@dataclass(frozen=True)
class SaveReport:
    """What one complete save of a ``CheckpointManager`` did, over every rank. A chunk is one stored object of an
    array (a file on a file system, an object on an object store; a shard that several ranks fill counts once), its
    bytes as stored (compressed, with its checksums); the ``zarr.json`` documents are not counted.

    Args:
        step: the step saved.
        path: its store (``manager.path(step)``).
        written_chunks: chunks this save wrote.
        written_bytes: their bytes.
        linked_chunks: chunks an incremental save reused from the checkpoint before it by hard links (a root in a
            directory): no bytes written.
        linked_bytes: their bytes.
        copied_chunks: chunks an incremental save reused by server-side copies (a root on an object store): no
            bytes through the process.
        copied_bytes: their bytes.
        blocked_s: seconds ``save()`` held the caller: the whole save and its retention's decisions; with
            ``async_save``, until the state was staged (and any save still in flight waited for), not the upload.
    """

    step: int
    path: str
    written_chunks: int
    written_bytes: int
    linked_chunks: int
    linked_bytes: int
    copied_chunks: int
    copied_bytes: int
    blocked_s: float

    @classmethod
    def of(cls, step: int, path: str, stored: ReuseCounts, links: bool, blocked_s: float) -> SaveReport:
        """From what every rank ``stored``; its reused chunks are hard links where the root ``links`` (a directory),
        else server-side copies."""
        reused = (stored.linked_chunks, stored.linked_bytes)
        linked, copied = (reused, (0, 0)) if links else ((0, 0), reused)
        return cls(step, path, stored.written_chunks, stored.written_bytes, *linked, *copied, blocked_s)

    def __str__(self) -> str:
        """The log line's figures: ``step 7 saved (ckpts/step-00000007.zarr): chunks written 96 (100.5 MiB), ...``."""
        figures = ", ".join(f"{what} {chunks} ({_human_bytes(nbytes)})" for what, chunks, nbytes in (
            ("written", self.written_chunks, self.written_bytes), ("linked", self.linked_chunks, self.linked_bytes),
            ("copied", self.copied_chunks, self.copied_bytes)))
        return f"step {self.step} saved ({self.path}): chunks {figures}; save() held the caller {self.blocked_s:.2f} s"


class ReportingWriter(ZarrWriter):
    """A ``ZarrWriter`` that keeps what every rank stored (``stored_totals``) where DCP hands it every rank's write
    results: the coordinator's ``finish``. None elsewhere, and until the save is complete."""

    stored_totals: ReuseCounts | None = None

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        self.stored_totals = stored_totals(results)


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
