"""Entries several ranks save under one key must agree, or the save is refused and nothing is committed."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_zarr import ReplicaMismatchError, ZarrWriter, open_checkpoint
from tests.support.faults import causes
from tests.support.ranks import run_ranks


def save_state(rank: int, world_size: int, path: str, kind: str, **writer_options):
    if kind == "divergent":  # the example: rank 1's w and rank 0's v would be silently lost
        state = {"w": torch.full((rank + 1, 3), float(rank)), "v": torch.full((2,), float(rank)), "same": torch.ones(4)}
    elif kind == "divergent values":
        state = {"rng": {"seed": 1000 + rank, "name": "mt"}, "step": torch.tensor(float(rank))}
    elif kind == "large divergent":
        state = {"big": torch.full((64, 64), float(rank))}
    elif kind == "per-rank keys":
        state = {f"rng.rank{rank}": {"seed": 1000 + rank}, f"buf.rank{rank}": torch.full((rank + 1,), float(rank))}
    else:
        state = {"w": torch.arange(6.0).reshape(2, 3), "lr": 0.1, "step": torch.tensor(3.0)}
    try:
        dcp.save(state, storage_writer=ZarrWriter(path, **writer_options))
    except CheckpointException as exc:
        return [f"{type(cause).__name__}: {cause}" for cause in causes(exc)]
    return None


def leftovers(path: str) -> list[str]:
    return [name for name in os.listdir(os.path.dirname(path)) if name != os.path.basename(path)]


def refused(results) -> str:
    messages = ["\n".join(m) for m in results if m]
    assert len(messages) == len(results), f"every rank must see the refusal: {results}"
    assert "ReplicaMismatchError" in messages[0], messages[0]
    return messages[0]


@pytest.mark.slow
@pytest.mark.distributed
def test_divergent_shapes_and_values_are_refused_naming_each_key_and_rank(tmp_path):
    path = str(tmp_path / "ckpt.zarr")
    message = refused(run_ranks(save_state, 2, path, "divergent"))
    assert "'w'" in message and "shape [1, 3] on rank 0" in message and "shape [2, 3] on rank 1" in message
    assert "per-rank keys" in message and "DTensor" in message
    assert "'same'" not in message
    assert not os.path.exists(path) and leftovers(path) == []


@pytest.mark.slow
@pytest.mark.distributed
def test_divergent_values_are_refused_after_writing_and_nothing_is_left(tmp_path):
    path = str(tmp_path / "ckpt.zarr")
    message = refused(run_ranks(save_state, 3, path, "divergent values"))
    assert "'rng.seed'" in message and "'step'" in message and "rank 0 vs rank 1 vs rank 2" in message
    assert "'rng.name'" not in message
    assert not os.path.exists(path) and leftovers(path) == []


@pytest.mark.slow
@pytest.mark.distributed
def test_identical_replicas_and_per_rank_keys_save_as_before(tmp_path):
    for kind in ("identical", "per-rank keys"):
        path = str(tmp_path / f"{kind}.zarr")
        assert run_ranks(save_state, 2, path, kind) == [None, None]
        ckpt = open_checkpoint(path)
        assert len(ckpt) > 0
    assert set(open_checkpoint(str(tmp_path / "per-rank keys.zarr")).entries) == {
        "rng.rank0.seed", "rng.rank1.seed", "buf.rank0", "buf.rank1"}


@pytest.mark.slow
@pytest.mark.distributed
def test_large_tensors_are_compared_by_value_only_when_asked(tmp_path):
    small = str(tmp_path / "small.zarr")
    assert run_ranks(save_state, 2, small, "large divergent", replica_check_bytes=1024) == [None, None]
    every = str(tmp_path / "all.zarr")
    assert "'big'" in refused(run_ranks(save_state, 2, every, "large divergent", check_replicas="all"))
    default = str(tmp_path / "default.zarr")  # 16 KiB is under the default limit
    assert "'big'" in refused(run_ranks(save_state, 2, default, "large divergent"))


@pytest.mark.distributed
def test_check_replicas_none_keeps_dcps_behaviour(tmp_path):
    path = str(tmp_path / "ckpt.zarr")
    assert run_ranks(save_state, 2, path, "divergent", check_replicas="none") == [None, None]
    assert open_checkpoint(path).entries["w"].shape in ((1, 3), (2, 3))


def test_an_unknown_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="check_replicas='some'"):
        ZarrWriter("x", check_replicas="some")


def test_the_error_is_exported():
    assert issubclass(ReplicaMismatchError, ValueError)


@pytest.mark.slow
@pytest.mark.distributed
def test_the_cost_benchmark_runs(tmp_path):
    """What the check costs a save: benchmarks.checkpoint_throughput with ZarrWriter's three modes as kinds."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    kinds = [f"zarr-dcp:check_replicas={mode}" for mode in ("none", "small", "all")]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "benchmarks.checkpoint_throughput", "--quick", "--repeats", "1", "--kinds",
                           ",".join(kinds), "--target", str(tmp_path), "--out", str(tmp_path / "r.json")],
                          cwd=Path(__file__).resolve().parents[2], env={**env, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert all(f"save/{kind}" in result["measurements"] for kind in kinds) and all(result["checks"].values())
