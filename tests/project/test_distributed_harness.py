"""The multi-process harness in tests/support/ (ranks, models, compare), proven with DCP's own FileSystemWriter/Reader.

Launches are the expensive part, so the checkpoint tests share four of them:
2 ranks save FSDP2 -> 3 ranks load it; 4 ranks save FSDP2, HSDP and FSDP+TP -> 1 rank loads all three.
"""

from __future__ import annotations

import os
import subprocess
import time
import traceback

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter

from tests.support.compare import assert_state_equal
from tests.support.models import load_fresh, train_and_save
from tests.support.ranks import run_ranks

TRAINED = [
    f"{module}.{kind}"
    for module in ("blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down", "ffn.up", "ffn.down", "head", "norm")
    for kind in ("weight", "bias")
]
UNTRAINED = ["embed.weight", "spare.weight", "spare.bias"]  # frozen; never used in forward
WS4_LAYOUTS = ("fsdp2", "hsdp", "fsdp_tp")


# ------------------------------------------------------------------------------------------------
# Rank programs (module-level so they pickle)
# ------------------------------------------------------------------------------------------------


def _identify(rank, world_size):
    return {
        "rank": rank,
        "world_size": world_size,
        "dist_rank": dist.get_rank(),
        "dist_world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "omp_threads": os.environ["OMP_NUM_THREADS"],
        "torch_threads": torch.get_num_threads(),
    }


def _raise_unless_last(rank, world_size):
    if rank == 0:
        raise ValueError("rank 0 exploded")
    if rank == 1:  # as dcp.save raises it: a BaseException carrying each rank's cause
        try:
            raise OSError("rank 1 disk on fire")
        except OSError as cause:
            failures = {1: (cause, traceback.extract_tb(cause.__traceback__))}
        raise CheckpointException("save failed", failures)
    time.sleep(600)  # stuck; a collective would not do: gloo notices the dead peers and raises


def _hang(rank, world_size, pid_dir):
    sleeper = subprocess.Popen(["sleep", "600"])
    with open(os.path.join(pid_dir, f"rank{rank}"), "w") as f:
        f.write(f"{os.getpid()} {sleeper.pid}")
    time.sleep(600)


def _save_layouts(rank, world_size, writers):
    return {layout: train_and_save(rank, world_size, layout, writer) for layout, writer in writers.items()}


def _load_layouts(rank, world_size, layout, readers):
    return {name: load_fresh(rank, world_size, layout, reader) for name, reader in readers.items()}


# ------------------------------------------------------------------------------------------------
# The launcher
# ------------------------------------------------------------------------------------------------


def _gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (reaped, or a zombie left to whoever adopted it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.distributed
def test_run_ranks_returns_each_ranks_result_in_rank_order():
    results = run_ranks(_identify, 2)

    assert [r["rank"] for r in results] == [0, 1]
    for rank, r in enumerate(results):
        assert (r["dist_rank"], r["world_size"], r["dist_world_size"]) == (rank, 2, 2)
        assert r["backend"] == "gloo"
        assert (r["omp_threads"], r["torch_threads"]) == ("1", 1)


@pytest.mark.slow
@pytest.mark.distributed
def test_raising_ranks_fail_the_launch_with_every_traceback_without_waiting_for_the_timeout():
    start = time.monotonic()
    with pytest.raises(AssertionError) as raised:
        run_ranks(_raise_unless_last, 3, timeout=60)
    elapsed = time.monotonic() - start

    text = str(raised.value)
    assert "ValueError: rank 0 exploded" in text
    assert "CheckpointException ranks:dict_keys([1])" in text and "OSError: rank 1 disk on fire" in text
    assert text.count("in _raise_unless_last") >= 2  # full tracebacks, not just messages
    assert "rank 2 killed" in text and "_raise_unless_last" in text.split("rank 2 killed")[1]  # its stack
    assert elapsed < 30


@pytest.mark.slow
@pytest.mark.distributed
def test_hanging_ranks_are_killed_with_what_they_started_after_the_timeout(tmp_path):
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"timed out after timeout=5s") as raised:
        run_ranks(_hang, 2, str(tmp_path), timeout=5)
    elapsed = time.monotonic() - start

    assert 5 <= elapsed < 20
    assert "in _hang" in str(raised.value)  # the hung ranks' Python stacks
    pids = [int(pid) for rank in range(2) for pid in (tmp_path / f"rank{rank}").read_text().split()]
    assert all(_gone(pid) for pid in pids)
    rank_pids = pids[0::2]
    assert not any(os.path.exists(f"/proc/{pid}") for pid in rank_pids)  # reaped, no zombies


@pytest.mark.distributed
def test_run_ranks_rejects_unpicklable_functions_before_starting_anything():
    with pytest.raises(TypeError, match="module-level fn"):
        run_ranks(lambda rank, world_size: None, 1)


# ------------------------------------------------------------------------------------------------
# assert_state_equal
# ------------------------------------------------------------------------------------------------


def test_assert_state_equal_accepts_identical_bits_and_names_the_first_differing_path():
    a = {"model": {"w": torch.tensor([1.0, -0.0])}, "optim": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]}}
    same = {"model": {"w": torch.tensor([1.0, -0.0])}, "optim": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]}}
    assert_state_equal(a, same)

    sign = {"model": {"w": torch.tensor([1.0, 0.0])}, "optim": same["optim"]}
    with pytest.raises(AssertionError, match=r"\['model'\]\['w'\]: tensors differ first at index \(1,\)"):
        assert_state_equal(a, sign)  # -0.0 == 0.0 numerically, but not bit-exact
    lr = {"model": same["model"], "optim": {"param_groups": [{"lr": 0.2, "betas": (0.9, 0.99)}]}}
    with pytest.raises(AssertionError, match=r"\['param_groups'\]\[0\]\['lr'\]: 0.1 vs 0.2"):
        assert_state_equal(a, lr)
    with pytest.raises(AssertionError, match=r"\['model'\]\['w'\]: torch.float32\[2\] vs torch.float64\[2\]"):
        assert_state_equal(a, {"model": {"w": torch.tensor([1.0, -0.0], dtype=torch.float64)}, "optim": a["optim"]})
    with pytest.raises(AssertionError, match=r"state\['model'\]: keys only in first \[\], only in second \['x'\]"):
        assert_state_equal(a, {"model": {"w": a["model"]["w"], "x": 1}, "optim": a["optim"]})


# ------------------------------------------------------------------------------------------------
# Checkpoints through DCP's FileSystemWriter / FileSystemReader
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ws2_fsdp2(tmp_path_factory):
    """FSDP2 trained 2 steps on 2 ranks and saved; returns (path, full state saved)."""
    path = tmp_path_factory.mktemp("ws2_fsdp2")
    results = run_ranks(_save_layouts, 2, {"fsdp2": FileSystemWriter(path)})
    return path, results[0]["fsdp2"][0]


@pytest.fixture(scope="module")
def ws4_saves(tmp_path_factory):
    """FSDP2, HSDP and FSDP+TP each trained 2 steps on 4 ranks and saved, in one launch.

    Returns {layout: (path, full state saved, [local shapes of rank 0..3])}.
    """
    root = tmp_path_factory.mktemp("ws4")
    paths = {layout: root / layout for layout in WS4_LAYOUTS}
    results = run_ranks(_save_layouts, 4, {layout: FileSystemWriter(path) for layout, path in paths.items()})
    return {
        layout: (paths[layout], results[0][layout][0], [r[layout][1] for r in results]) for layout in WS4_LAYOUTS
    }


@pytest.fixture(scope="module")
def ws4_loaded_unsharded(ws4_saves):
    """Each 4-rank checkpoint loaded into a plain model in a 1-process group, in one launch."""
    readers = {layout: FileSystemReader(path) for layout, (path, _, _) in ws4_saves.items()}
    return run_ranks(_load_layouts, 1, "plain", readers)[0]


@pytest.mark.slow
@pytest.mark.distributed
def test_training_gives_adam_state_to_trained_params_only(ws2_fsdp2):
    _, saved = ws2_fsdp2
    state = saved["optim"]["state"]

    assert sorted(state) == sorted(TRAINED)
    for fqn in TRAINED:
        assert sorted(state[fqn]) == ["exp_avg", "exp_avg_sq", "step"]
        assert state[fqn]["step"].item() == 2
    assert sorted(saved["model"]) == sorted(TRAINED + UNTRAINED)


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_checkpoint_from_2_ranks_loads_bit_exact_into_3_ranks(ws2_fsdp2):
    path, saved = ws2_fsdp2

    loaded = run_ranks(_load_layouts, 3, "fsdp2", {"fsdp2": FileSystemReader(path)})

    assert_state_equal(loaded[0]["fsdp2"], saved)
    assert loaded[1] == loaded[2] == {"fsdp2": None}  # full_state is rank 0's


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_on_4_ranks_splits_odd_dims_unevenly_with_empty_shards(ws4_saves):
    shapes = ws4_saves["fsdp2"][2]

    def rows(fqn):
        return [s[fqn][0] for s in shapes]

    assert rows("embed.weight") == [5, 5, 5, 2]
    assert rows("blocks.0.up.weight") == [2, 2, 1, 0]
    assert rows("blocks.0.down.weight") == [4, 4, 4, 1]
    assert rows("head.weight") == [1, 1, 1, 0]
    assert rows("spare.bias") == [1, 1, 1, 0]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", WS4_LAYOUTS)
def test_checkpoint_from_4_ranks_loads_bit_exact_into_an_unsharded_model(layout, ws4_saves, ws4_loaded_unsharded):
    _, saved, _ = ws4_saves[layout]

    assert_state_equal(ws4_loaded_unsharded[layout], saved)


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_tp_shards_the_tp_pair_over_both_mesh_dims(ws4_saves):
    shapes = ws4_saves["fsdp_tp"][2]

    assert [s["ffn.up.weight"] for s in shapes] == [(5, 13), (5, 13), (4, 13), (4, 13)]
    assert [s["ffn.down.weight"] for s in shapes] == [(7, 9), (7, 9), (6, 9), (6, 9)]
    assert [s["blocks.0.up.weight"] for s in shapes] == [(3, 13), (3, 13), (2, 13), (2, 13)]
