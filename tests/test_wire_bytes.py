"""What torch's collectives carry per rank does not grow with the tensors a rank holds when a save is planned locally
(ZarrSavePlanner) and when ZarrReader loads, while DCP's own planning grows with them (issue 24's target).

Counted with benchmarks/wire_bytes.py's counter (every tensor each collective touches on the rank, inputs and
outputs), on 4 real gloo ranks, for FSDP2 states of 240 and 960 tensors (AdamW state included).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.ranks import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import wire_bytes  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

WORLD_SIZE = 4
SMALL, LARGE = 240, 960
MAX_GROWTH = 1.2  # issue 24: at most 1.2x from 240 to 960 tensors
LOCALLY_PLANNED = ("zarr_local/save_first", "zarr_local/save_later", "load_zarr/load", "load_zarr_zlp/load")


def measure(rank: int, world_size: int, tensors: int, root: str) -> dict:
    """Rank program: the locally planned saves first (the process's first dcp.save), then loads, then DCP's own."""
    return wire_bytes.measure_rank(rank, world_size, ["zarr_local", "zarr_default"], tensors, root, saves=2)


@pytest.fixture(scope="module")
def counted(tmp_path_factory) -> dict[int, list[dict]]:
    return {n: run_ranks(measure, WORLD_SIZE, n, str(tmp_path_factory.mktemp(f"wire{n}"))) for n in (SMALL, LARGE)}


def growth(counted: dict[int, list[dict]], op: str) -> list[tuple[int, int, int]]:
    """(rank, bytes at SMALL, bytes at LARGE) of ``op`` on each rank."""
    return [(r, small["ops"][op]["bytes"], large["ops"][op]["bytes"])
            for r, (small, large) in enumerate(zip(counted[SMALL], counted[LARGE]))]


def test_every_rank_passed_the_counters_self_check(counted):
    assert all(r["self_check"]["ok"] for n in counted for r in counted[n])


@pytest.mark.parametrize("op", LOCALLY_PLANNED)
def test_locally_planned_saves_and_loads_carry_no_more_per_rank_for_four_times_the_tensors(counted, op):
    for rank, small, large in growth(counted, op):
        if large > MAX_GROWTH * small:
            grows = wire_bytes.what_grows(counted[SMALL][rank]["ops"][op], counted[LARGE][rank]["ops"][op],
                                          [r["ops"][op] for r in counted[LARGE]])
            pytest.fail(f"{op}, rank {rank}: {small:,} B for {SMALL} tensors, {large:,} B for {LARGE} "
                        f"({large / small:.2f}x > {MAX_GROWTH}x); what grows:\n" + "\n".join(grows))


def test_dcps_own_planning_with_zarr_writer_carries_more_per_rank_for_four_times_the_tensors(counted):
    # The same states and counter: what the test above would see if the saves were planned centrally.
    for rank, small, large in growth(counted, "zarr_default/save_first"):
        assert large > 2 * small, (rank, small, large)


def test_no_functional_collective_runs_in_a_save_or_load(counted):
    # DTensor's redistributions bypass the counted functions; a save or load of local shards makes none.
    assert {name: v for n in counted for r in counted[n] for op in r["ops"].values()
            for name, v in op["functional"].items()} == {}
