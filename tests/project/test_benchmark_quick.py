"""The checkpoint benchmarks run end to end (``python -m benchmarks.X``, ranks under torchrun) and write complete,
stamped results. Only that they work and report what they promise; no timing is asserted (shared, noisy machines).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

REPO_ROOT = Path(__file__).resolve().parents[2]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without torchrun's variables, so that a plain-python launch really is world size 1."""
    torchrun_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {**{k: v for k, v in os.environ.items() if k not in torchrun_vars}, **extra}


def run_benchmark(module: str, *args: str, world_size: int | None = 2, env: dict | None = None) -> None:
    """``python -m benchmarks.MODULE`` under torchrun (``world_size`` ranks; --standalone: a free port), or under
    plain python (``world_size=None``)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world_size)]
    launcher = torchrun if world_size else [sys.executable]
    proc = subprocess.run([*launcher, "-m", f"benchmarks.{module}", *args], cwd=REPO_ROOT, env=env or clean_env(),
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:  # torchrun's failure summary buries the ranks' own errors: show those first
        clues = [line for line in proc.stderr.splitlines() if any(w in line for w in ("Error", "error", "File "))]
        pytest.fail(f"exit {proc.returncode}\nerror lines:\n" + "\n".join(clues[-60:])
                    + f"\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}")


def numbers(tree):
    if isinstance(tree, dict):
        for value in tree.values():
            yield from numbers(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from numbers(value)
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        yield tree


def assert_stamped(result: dict, out: Path) -> None:
    stamp = result["stamp"]
    assert stamp["commit"] and stamp["torch"] and stamp["zarr"] and stamp["python"] and stamp["nproc"] >= 1
    assert stamp["kernel"] and "benchmarks." in stamp["command"]
    assert stamp["commit"] in out.with_suffix(".md").read_text()


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("quick") / "r.json"
    run_benchmark("checkpoint_throughput", "--quick", "--manager", "--out", str(out))
    result = json.loads(out.read_text())
    assert_stamped(result, out)
    return result


def test_quick_run_measures_every_kind_and_ratio(quick_run):
    assert quick_run["config"]["kinds"] == ["zarr", "fs", "raw"] and quick_run["config"]["world_size"] == 2
    assert set(quick_run["measurements"]) == {f"{op}/{kind}" for op in ("save", "load") for kind in (
        "zarr", "fs", "raw")} | {"async/zarr", "manager/sync", "manager/async blocking", "async/bare blocking"}
    assert {"save_speedup_zarr_vs_fs", "save_zarr_fraction_of_raw", "load_speedup_zarr_vs_fs",
            "load_zarr_fraction_of_raw", "async_blocking_fraction", "manager_sync_vs_bare_save",
            "manager_async_vs_bare_blocking"} <= set(quick_run["ratios"])
    assert quick_run["footprint"]["save/fs"]["files"] >= 1 and quick_run["footprint"]["save/zarr"]["files"] > 100


def test_quick_run_keeps_every_repeats_time_for_every_rank(quick_run):
    save = quick_run["measurements"]["save/zarr"]
    assert len(save["times_s"]) == quick_run["config"]["repeats"] == 2
    assert all(len(per_rank) == 2 for per_rank in save["rank_times_s"])
    assert len(quick_run["measurements"]["async/zarr"]["blocking_times_s"]) == 2
    assert all(math.isfinite(n) and n >= 0 for n in numbers(quick_run["measurements"]))
    assert all(m["median_s"] > 0 and m["gbps"] > 0 for m in quick_run["measurements"].values())


def test_quick_run_loads_back_what_it_saved(quick_run):
    assert quick_run["checks"] and all(quick_run["checks"].values()), quick_run["checks"]


def test_resharded_load_of_a_two_rank_checkpoint_at_world_size_one(tmp_path):
    saved, out = tmp_path / "saved", tmp_path / "reshard.json"
    run_benchmark("checkpoint_throughput", "--quick", "--kinds", "zarr,fs", "--save-only", str(saved))
    run_benchmark("checkpoint_throughput", "--quick", "--repeats", "1", "--kinds", "zarr,fs", "--reshard-from",
                  str(saved), "--out", str(out), world_size=None)
    result = json.loads(out.read_text())
    assert result["config"]["world_size"] == 1
    for kind in ("zarr", "fs"):
        entry = result["measurements"][f"reshard/{kind}"]
        assert entry["saved_world_size"] == 2 and entry["rank_needed_bytes"] == result["state_dict"]["rank_bytes"]
        assert entry["rank_read_amplification"][0] >= 0.9
    assert "reshard_load_speedup_zarr_vs_fs" in result["ratios"] and all(result["checks"].values())


BLOCK_DCP_ZARR = """
import sys


class BlockDcpZarr:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "dcp_zarr":
            raise ImportError("dcp_zarr blocked for this test")


sys.meta_path.insert(0, BlockDcpZarr())
"""


def test_dcps_own_writer_and_raw_io_are_measured_without_dcp_zarr(tmp_path):
    # A sitecustomize on PYTHONPATH makes every `import dcp_zarr` fail, as a broken package would.
    (tmp_path / "sitecustomize.py").write_text(BLOCK_DCP_ZARR)
    out = tmp_path / "r.json"
    run_benchmark("checkpoint_throughput", "--quick", "--repeats", "1", "--kinds", "fs,raw", "--out", str(out),
                  world_size=None, env=clean_env(PYTHONPATH=str(tmp_path)))
    assert set(json.loads(out.read_text())["measurements"]) == {"save/fs", "load/fs", "save/raw", "load/raw"}


def test_entries_quick_times_every_kind_interleaved_and_counts_files(tmp_path):
    """entries --quick on 2 ranks: every kind (one with writer options), two zarr thread counts, kept stores, a frozen
    collector; the zarr store is 2 files per array (60 arrays) and the root's, and nothing is left behind."""
    out = tmp_path / "e.json"
    run_benchmark("entries", "--quick", "--kinds", "zarr,zarr-dcp:aggregate_below=0,fs,raw-io",
                  "--zarr-threads", "0,2", "--fs-threads", "1", "--keep-stores", "--gc-freeze", "--target",
                  str(tmp_path / "t"), "--out", str(out))
    result = json.loads(out.read_text())
    assert_stamped(result, out)
    saved = {"zarr/0", "zarr/2", "zarr-dcp:aggregate_below=0/0", "fs/1", "raw-io/4"}
    assert set(result["medians_s"]) == {f"{op}/{k}" for op in ("save", "load") for k in saved}
    assert all(t > 0 for t in result["medians_s"].values())
    assert result["files"]["zarr"]["files"] == 2 * 60 + 1 and result["keep_stores"] and result["gc_freeze"]
    assert {"save_speedup_zarr_vs_best_fs", "load_speedup_zarr_vs_raw_io"} <= set(result)
    assert list((tmp_path / "t").iterdir()) == [], "every store is removed at the end"


def test_compression_measures_every_kind_on_tmpfs_and_behind_a_throttled_link(tmp_path):
    """compression at its smallest, on 2 ranks it spawns: a row per kind and target, every load equal, the zarr
    kinds' per-part ratios, and the bandwidth target's verdicts (python -m benchmarks.compression, no torchrun)."""
    out = tmp_path / "c.json"
    run_benchmark("compression", "--mb", "2", "--states", "bf16", "--steps", "1", "--repeats", "1", "--warmup", "0",
                  "--threads", "2", "--targets", "tmpfs,throttled", "--kinds", "zarr,zarr-zstd,dcp", "--json",
                  str(out), world_size=None)
    result = json.loads(out.read_text())
    assert_stamped(result, out)
    rows = {(r["target"], r["kind"]): r for r in result["rows"]}
    assert set(rows) == {(t, k) for t in ("tmpfs", "throttled") for k in ("zarr", "zarr-zstd", "dcp")}
    assert all(r["ratio"] > 0 and r["save_median_s"] > 0 and r["load_median_s"] > 0 for r in rows.values())
    assert rows["tmpfs", "zarr-zstd"]["ratio"] > rows["tmpfs", "zarr"]["ratio"], "the compressed kind stores less"
    assert set(rows["tmpfs", "zarr-zstd"]["ratio_by_group"]) == {"weights", "exp_avg", "exp_avg_sq"}
    assert result["checks"] and all(result["checks"].values()), result["checks"]
    assert {v["target"].split(":")[0] for v in result["verdicts"]} == {"tmpfs", "throttled (200 MB/s per rank)"}
