"""The messages DCP carries for ZarrWriter and ZarrReader in place of plans, each O(1) in the tensors a rank holds,
and the coordinator's checks.

A save planned locally:

1. Each rank's plan, gathered by DCP: a ``Summary`` (its rank, the world it sees, the digest of its entries, one
   digest of the replica checksums per group of ranks that hold the same boxes, and the writer's options that decide
   who writes what) instead of its items.
2. The coordinator's answer, scattered by DCP: a ``Ticket`` (the save's id and staging location; whether the digests
   differed, so that the ranks exchange what differs; which replica groups disagreed, so that their ranks report
   the checksums of each key instead of writing).
3. Each rank's write result, gathered by DCP: one ``WriteResult`` holding a ``RankReport`` (the values and object
   sizes it wrote, the chunk objects it stored, and checksums only when asked for), instead of one per item.

A load: each rank's ``LoadSummary`` (its place in the reader's process group) and the coordinator's ``LoadTicket``
(whether the ranks share reads); each rank keeps its read items.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from typing import Any, NamedTuple

from dcp_zarr.errors import PlanMismatchError
from dcp_zarr.format.compression import Compression
from dcp_zarr.planning.replicas import ranks_text
from dcp_zarr.store_io.chunk_reuse import ReuseCounts

REPORT_FQN = "__dcp_zarr_rank_report__"  # no state dict has it: node names starting "__" are refused


class Summary(NamedTuple):
    rank: int  # in DCP's process group, as this rank's planner sees it
    world_size: int
    digest: str  # entries.structure_digest
    replica_digests: tuple[tuple[str, str], ...]  # (replica group, digest of its keys' checksums)
    # ZarrWriter's options that decide who writes what (PLAN_OPTIONS, in order). A default may differ between ranks
    # (aggregate_below follows the mount type each rank sees): ranks that disagree would write different layouts.
    options: tuple[int | str | None, ...] = ()
    # With compression, the floating-point arrays whose sample of this rank's part did not compress enough
    # (planning/compression_sample.py): usually none, so the message stays small.
    poorly_compressed: frozenset[str] = frozenset()


class PlanOptions(NamedTuple):
    """ZarrWriter's options that decide who writes what and how it is laid out: the inputs of a save's plan besides
    its entries and world (write_plan.py), which every rank's ``Summary`` carries so that ranks that differ are
    refused. An option added here is in the plan's cache key and in the check alike."""

    inner_chunk_bytes: int
    aggregate_below: int
    exchange_bytes: int
    compression: Compression | None
    records_chunks: bool = False  # incremental: one object per chunk, each recorded (format/chunk_record.py)
    # incremental: the nodes of the arrays that changed whole, or not at all, in the earlier checkpoint, laid out as a
    # full save lays them out instead (format/chunk_record.py, ChunkRecord.changed_whole and unchanged_whole); every
    # rank reads them from that record
    whole_arrays: frozenset[str] = frozenset()

    def summarized(self) -> tuple[int | str | bool | None, ...]:
        """As a ``Summary`` carries them: compression as its one string, the whole arrays as their count and digest
        (a large model's thousands of names would otherwise travel in every rank's message), or None."""
        compression = None if self.compression is None else self.compression.key()
        return (self.inner_chunk_bytes, self.aggregate_below, self.exchange_bytes, compression, self.records_chunks,
                _names_digest(self.whole_arrays))


def _names_digest(names: frozenset[str]) -> str | None:
    if not names:  # nearly every save: nothing more in the message, which every rank sends
        return None
    digest = hashlib.blake2b("\n".join(sorted(names)).encode(), digest_size=8).hexdigest()
    return f"{len(names)} array{'' if len(names) == 1 else 's'} ({digest})"


PLAN_OPTIONS = PlanOptions._fields


class Ticket(NamedTuple):
    save_id: str
    staging_location: str
    exchange: bool  # the digests differed: exchange.py runs before anything is written
    detail_groups: frozenset[str]  # replica groups whose checksums differed: report them, write nothing
    stored_plain: frozenset[str] = frozenset()  # arrays some rank's sample found not to compress: not compressed


class RankReport(NamedTuple):
    values: dict  # fqn -> JSON document of each value this rank wrote
    objects: dict  # fqn -> bytes of each torch.save value this rank wrote
    checksums: dict  # (fqn, offsets) -> crc32c, for replica groups that disagreed (or on an exchange)
    chunks: Any = None  # in a save that records its chunks: the rank's saving/incremental.ChunkReport
    stored: ReuseCounts | None = None  # the chunk objects the rank stored (linked, written) and their bytes
    fills: dict | None = None  # fqn -> the one element of each array this rank kept in its fill_value (fill_values.py)


def stored_totals(results: list[list]) -> ReuseCounts | None:
    """The chunk objects every rank of a save planned locally stored, and their bytes, summed from the write results
    the coordinator's ``finish`` is given; None for results that do not say (a save DCP planned)."""
    stored = [result.storage_data.stored for rank_results in results for result in rank_results
              if result.index.fqn == REPORT_FQN and isinstance(result.storage_data, RankReport)]
    if not stored or any(counts is None for counts in stored):
        return None
    return ReuseCounts(*(sum(column) for column in zip(*stored)))


class LoadSummary(NamedTuple):
    """A rank's load plan as DCP gathers it: its rank and world in the reader's process group, nothing per item (the
    rank keeps its read items)."""

    rank: int
    world_size: int


class LoadTicket(NamedTuple):
    """The coordinator's answer to a load's summaries: whether the ranks share reads (every rank of the load is the
    same rank of the reader's process group)."""

    together: bool


def planned_locally(plans: list) -> bool:
    """Whether the gathered plans are ``Summary`` messages (a save planned on every rank) rather than DCP's plans;
    raises naming the ranks where some are and some are not."""
    here = [isinstance(plan.storage_data, Summary) for plan in plans]
    if any(here) and not all(here):
        raise PlanMismatchError(
            f"{ranks_text([r for r, h in enumerate(here) if h])} planned this save locally (DCP's own planner or "
            f"ZarrSavePlanner) and {ranks_text([r for r, h in enumerate(here) if not h])} through a planner that "
            "plans for itself: every rank must pass dcp.save a planner of the same kind. Nothing was written")
    return bool(plans) and here[0]


def check_summaries(summaries: list[Summary]) -> tuple[bool, frozenset[str]]:
    """(whether the ranks' structures differ, the replica groups whose checksums differ when they do not). Raises
    when the planner's
    process group is not the one DCP saves on: the ranks would then disagree on everything else."""
    world_size = len(summaries)
    for dcp_rank, summary in enumerate(summaries):
        if summary.rank != dcp_rank or summary.world_size != world_size:
            raise PlanMismatchError(
                f"DCP's rank {dcp_rank} of {world_size} is rank {summary.rank} of {summary.world_size} in "
                "ZarrSavePlanner's process group: pass ZarrSavePlanner(process_group=...) the group given to "
                "dcp.save (default: the whole world)")
    _check_options(summaries)
    differ = len({s.digest for s in summaries}) > 1
    if differ:  # the exchange finds the true replicas, and each rank reports the checksum of each
        return True, frozenset()
    digests: dict[str, set[str]] = defaultdict(set)
    for summary in summaries:
        for group, digest in summary.replica_digests:
            digests[group].add(digest)
    return differ, frozenset(group for group, found in digests.items() if len(found) > 1)


def _check_options(summaries: list[Summary]) -> None:
    """Raises naming each option the ranks disagree on, and which ranks have which value."""
    ranks_of: dict[tuple[int | str | None, ...], list[int]] = defaultdict(list)
    for rank, summary in enumerate(summaries):
        ranks_of[summary.options].append(rank)
    if len(ranks_of) < 2:
        return
    found, names = [], set()
    for i, name in enumerate(PLAN_OPTIONS):
        values: dict[int | str | None, list[int]] = defaultdict(list)
        for options, ranks in ranks_of.items():
            values[options[i] if i < len(options) else None] += ranks
        if len(values) > 1:
            names.add(name)
            found.append(f"{name}: " + "; ".join(f"{value} on {_ranks_text(sorted(ranks))}"
                                                  for value, ranks in sorted(values.items(), key=lambda kv: kv[1])))
    earlier = ("; whole_arrays are the arrays that changed whole or not at all in the incremental_from checkpoint, "
               "which each rank read: pass every rank the same incremental_from, and replace nothing there while a "
               "save reads it"
               if "whole_arrays" in names else "")
    raise PlanMismatchError(
        "ZarrWriter's options differ across the ranks of this save, which would then write different layouts: "
        + ", ".join(found) + ". Pass every rank's ZarrWriter the same values (aggregate_below's default follows the "
        "file system each rank sees the path on: pass it explicitly where ranks see different ones)" + earlier)


def _ranks_text(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"rank {shown}" if len(ranks) == 1 else f"ranks {shown}"
