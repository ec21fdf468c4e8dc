"""Requests and bytes through an object store per save and load, counted at a real S3 server on 127.0.0.1 (issue
25's targets): PUTs per save and GETs per load at most 2 x arrays + 8 + 4 x ranks, and the bytes a load reads at
most 1.1x the tensors' bytes, for FSDP, HSDP and DDP layouts of small tensors (pieces of about 4 KB a rank)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_zarr import ZarrReader, ZarrSavePlanner, ZarrWriter
from dcp_zarr.testing.shardings import in_layout
from tests.support.compare import assert_state_equal
from tests.support.ranks import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.s3,
              pytest.mark.usefixtures("aws_environment")]

REPO_ROOT = Path(__file__).resolve().parents[2]
WORLD_SIZE = 4
ARRAYS = 48
SHAPE = (96, 40)  # fp32: 15 KB an array, about 4 KB a rank


def full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {f"layers.{i}.w": torch.randn(SHAPE, generator=g) for i in range(ARRAYS)}


def save(rank, world_size, url, options, layout):
    state = in_layout(layout, world_size, full_state())
    dcp.save(state, storage_writer=ZarrWriter(url, storage_options=options), planner=ZarrSavePlanner())


def load(rank, world_size, url, options, layout):
    target = {k: torch.zeros_like(v) for k, v in in_layout(layout, world_size, full_state()).items()}
    dcp.load(target, storage_reader=ZarrReader(url, storage_options=options))
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in target.items()}


@pytest.mark.parametrize("layout", ["fsdp", "hsdp", "ddp"])
def test_an_object_store_serves_two_requests_an_array_and_each_byte_once(s3, layout):
    url, options = f"s3://{s3.bucket}/{layout}-{uuid.uuid4().hex[:8]}.zarr", s3.storage_options()
    with s3.counting() as saved:
        run_ranks(save, WORLD_SIZE, url, options, layout)
    with s3.counting() as loaded:
        results = run_ranks(load, WORLD_SIZE, url, options, layout)
    for state in results:
        assert_state_equal(state, full_state())
    most = 2 * ARRAYS + 8 + 4 * WORLD_SIZE
    assert saved.requests["PUT"] <= most, saved
    assert loaded.requests["GET"] <= most, loaded
    assert loaded.gets["ckpt.zarr/zarr.json".replace("ckpt.zarr", url.rsplit("/", 1)[-1])] == 1, loaded.gets
    tensor_bytes = ARRAYS * SHAPE[0] * SHAPE[1] * 4
    assert loaded.bytes_out <= 1.1 * tensor_bytes, (loaded.bytes_out, tensor_bytes)


def run_benchmark(tmp_path, *args: str) -> dict:
    out = tmp_path / "traffic.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.storage_traffic", *args, "--out", str(out)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_simulation_counts_the_same_requests_from_the_plans_at_more_ranks(tmp_path):
    """--simulate (what the report's 1,024-rank figures come from) on a small job: collective I/O's requests within
    the limit for every layout, and without it one per rank's piece."""
    rows = run_benchmark(tmp_path, "--simulate", "16", "--arrays", "12", "--shape", "256x64")["rows"]
    by = {(r["layout"], r["collective"]): r for r in rows}
    for layout in ("fsdp", "hsdp", "ddp"):
        row = by[(layout, True)]
        assert row["puts_per_save"] == 2 * 12 + 1 and row["gets_per_load"] == 12 + 1, row
        assert row["read_x"] <= 1.1, row
    without = by[("fsdp", False)]
    assert without["puts_per_save"] == 12 * 16 + 12 + 1 and without["gets_per_load"] == 16 * 12 + 16, without


def test_the_benchmark_counts_at_the_proxy_each_kind_in_processes_of_its_own(tmp_path):
    """A real run through the proxy: each kind's first save and load in fresh ranks and a later one, the requests of
    each counted at the server, the floor beside dcp_zarr's saves, every load equal (the run fails otherwise)."""
    report = run_benchmark(tmp_path, "--states", "fsdp,ddp", "--arrays", "6", "--latency-ms", "0", "--kinds",
                           "zarr,zarr-off,fsspec", "--fresh", "1", "--repeats", "1")
    by = {(r["state"], r["kind"]): r for r in report["rows"]}
    assert set(by) == {(s, k) for s in ("fsdp", "ddp") for k in ("zarr", "zarr-off", "fsspec")}
    assert by[("fsdp", "zarr")]["counts"]["save"]["requests"]["PUT"] == by[("fsdp", "zarr")]["objects"] == 2 * 6 + 1
    assert by[("ddp", "zarr")]["counts"]["load"]["requests"]["GET"] == 6 + 1
    assert by[("ddp", "zarr-off")]["counts"]["load"]["requests"]["GET"] == 2 * (6 + 1)  # every rank reads everything
    for row in by.values():
        assert len(row["first_s"]["save"]) == len(row["later_s"]["load"]) == 1 and row["ratios"]["first_vs_later_save"]
    assert len(by[("fsdp", "zarr")]["later_s"]["floor"]) == 1 and not by[("fsdp", "fsspec")]["later_s"]["floor"]
    assert (tmp_path / "traffic.md").read_text().count("| s3, 0 ms | ") == len(by) + 2  # and a floor row per state
    assert report["stamp"]["commit"] in (tmp_path / "traffic.md").read_text()


def test_the_quick_run_times_first_and_later_saves_against_the_floor_and_judges_the_targets(tmp_path):
    """--quick: the small and large states, obstore, s3fs and DCP's FsspecWriter at the server itself, one fresh set
    of ranks each, one later round; objects listed (DCP's: one per rank and the metadata), every target judged."""
    report = run_benchmark(tmp_path, "--quick")
    by = {(r["state"], r["kind"]): r for r in report["rows"]}
    assert set(by) == {(s, k) for s in ("small", "large") for k in ("zarr", "zarr-s3fs", "fsspec")}
    for state in ("small", "large"):
        zarr, s3fs, fsspec = (by[(state, k)] for k in ("zarr", "zarr-s3fs", "fsspec"))
        assert zarr["objects"] == s3fs["objects"] > fsspec["objects"] and zarr["storage"] == "s3"
        assert all(t > 0 for t in [*zarr["first_s"]["save"], *zarr["later_s"]["save"], *zarr["later_s"]["floor"]])
        assert zarr["ratios"]["later_save_vs_floor"] > 0 and fsspec["ratios"]["later_save_vs_floor"] is None
        assert zarr["ratios"]["load_speed_vs_peer"] > 0 and fsspec["ratios"]["load_speed_vs_peer"] == 1.0
    judged = {(v["state"], v["target"].split()[0]) for v in report["verdicts"]}
    assert judged == {(s, t) for s in ("small", "large") for t in ("first_vs_later_save", "first_vs_later_load",
                                                                   "later_save_vs_floor", "load_speed_vs_peer")}
    assert "| s3 | floor |" in (tmp_path / "traffic.md").read_text()
