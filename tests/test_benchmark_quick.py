"""benchmarks/checkpoint_throughput.py runs end to end under torchrun and writes a valid result.

Only that the benchmark works and reports everything it promises; no timing is asserted (shared, noisy machines).
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO_ROOT / "benchmarks"
SCRIPT = BENCHMARKS / "checkpoint_throughput.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

sys.path.insert(0, str(BENCHMARKS))
from checkpoint_throughput import validate_result  # noqa: E402


def clean_env() -> dict[str, str]:
    """This environment without torchrun's variables, so a plain-python launch really is world size 1."""
    torchrun_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if k not in torchrun_vars}


def run_benchmark(*args: str, world_size: int | None = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    """Launch under torchrun (``world_size`` ranks), or under plain python (``world_size=None``)."""
    # --standalone: torchrun picks a free port instead of 29500, so parallel launches never meet.
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world_size)]
    launcher = torchrun if world_size else [sys.executable]
    proc = subprocess.run(
        [*launcher, str(SCRIPT), *args], cwd=REPO_ROOT, env=clean_env(), capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:  # torchrun's failure summary buries the ranks' own errors: show those first
        words = ("Error", "error", "Fatal", "terminate", "File ")
        clues = [line for line in proc.stderr.splitlines() if any(w in line for w in words)]
        pytest.fail(
            f"exit {proc.returncode}\nerror lines:\n" + "\n".join(clues[-60:])
            + f"\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
        )
    return proc


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("quick")
    run_benchmark("--quick", "--out", str(out / "r.json"), "--plot", str(out / "r.png"))
    return json.loads((out / "r.json").read_text()), out / "r.png"


@pytest.mark.slow
@pytest.mark.distributed
def test_quick_run_writes_a_result_that_passes_the_schema(quick_run):
    result, _ = quick_run
    validate_result(result)


@pytest.mark.slow
@pytest.mark.distributed
def test_quick_run_measures_every_writer_kind_by_default(quick_run):
    result, _ = quick_run
    assert result["config"]["kinds"] == ["zarr", "fs", "raw"]
    assert result["config"]["world_size"] == 2
    expected = {"save/zarr", "save/fs", "save/raw", "load/zarr", "load/fs", "async/zarr", "small/zarr", "small/fs"}
    assert expected <= set(result["measurements"])
    assert set(result["memory"]) == {"save/zarr", "save/fs", "save/raw"}
    assert {
        "save_speedup_zarr_vs_fs", "save_zarr_fraction_of_raw", "load_speedup_zarr_vs_fs",
        "small_tensors_save_speedup_zarr_vs_fs", "async_blocking_fraction",
    } <= set(result["ratios"])  # fmt: skip


@pytest.mark.slow
@pytest.mark.distributed
def test_quick_run_keeps_raw_times_for_every_repeat_and_rank(quick_run):
    result, _ = quick_run
    save = result["measurements"]["save/zarr"]
    assert len(save["times_s"]) == result["config"]["repeats"] == 2
    assert all(len(per_rank) == 2 for per_rank in save["rank_times_s"])
    async_save = result["measurements"]["async/zarr"]
    assert len(async_save["blocking_times_s"]) == len(async_save["total_times_s"]) == 2


@pytest.mark.slow
@pytest.mark.distributed
def test_quick_run_loads_back_what_it_saved(quick_run):
    result, _ = quick_run
    assert result["checks"] and all(result["checks"].values()), result["checks"]


@pytest.mark.slow
@pytest.mark.distributed
def test_quick_run_writes_a_png_plot(quick_run):
    _, png = quick_run
    data = png.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 1000


@pytest.mark.slow
@pytest.mark.distributed
def test_validate_result_rejects_missing_measurements_and_non_finite_numbers(quick_run):
    result, _ = quick_run
    missing = copy.deepcopy(result)
    del missing["measurements"]["async/zarr"]
    with pytest.raises(ValueError, match="async/zarr"):
        validate_result(missing)
    not_finite = copy.deepcopy(result)
    not_finite["measurements"]["save/fs"]["median_s"] = math.nan
    with pytest.raises(ValueError, match="not finite"):
        validate_result(not_finite)
    zero = copy.deepcopy(result)
    zero["ratios"]["load_speedup_zarr_vs_fs"] = 0.0
    with pytest.raises(ValueError, match="not positive"):
        validate_result(zero)


@pytest.mark.slow
@pytest.mark.distributed
def test_resharded_load_of_a_two_rank_checkpoint_at_world_size_one(tmp_path):
    saved = tmp_path / "saved"
    run_benchmark("--quick", "--save-only", str(saved))
    out = tmp_path / "reshard.json"
    quick_small = ("--quick", "--repeats", "1", "--small-tensors", "0", "--kinds", "zarr,fs")
    run_benchmark(*quick_small, "--reshard-from", str(saved), "--out", str(out), world_size=None)
    result = validate_result(json.loads(out.read_text()))
    assert result["config"]["world_size"] == 1
    for kind in ("zarr", "fs"):
        entry = result["measurements"][f"reshard/{kind}"]
        assert entry["saved_world_size"] == 2
        assert entry["rank_needed_bytes"] == result["state_dict"]["rank_bytes"]
    assert "reshard_load_speedup_zarr_vs_fs" in result["ratios"]
    assert all(result["checks"].values()), result["checks"]


BLOCK_DCP_ZARR = """
import sys


class BlockDcpZarr:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "dcp_zarr":
            raise ImportError("dcp_zarr blocked for this test")


sys.meta_path.insert(0, BlockDcpZarr())
"""


@pytest.mark.slow
def test_zarr_kind_without_dcp_zarr_fails_with_a_clear_message(tmp_path):
    # A sitecustomize on PYTHONPATH makes every `import dcp_zarr` fail, as a missing or broken package would.
    (tmp_path / "sitecustomize.py").write_text(BLOCK_DCP_ZARR)
    env = {**clean_env(), "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path / "r.json")],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "from dcp_zarr import ZarrWriter, ZarrReader" in proc.stderr and "--kinds fs,raw" in proc.stderr
    assert not (tmp_path / "r.json").exists()


@pytest.mark.slow
@pytest.mark.distributed
def test_entries_quick_times_every_writer_and_counts_files(tmp_path):
    """entries.py --quick on 2 ranks, with the raw writer, two zarr thread counts, kept stores and a frozen collector:
    every kind is timed, the zarr store is 2 files per array (60 arrays + the root), and nothing is left behind."""
    out = tmp_path / "e.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(BENCHMARKS / "entries.py"), "--quick", "--raw", "--zarr-threads", "0,2", "--fs-threads", "1",
         "--keep-stores", "--gc-freeze", "--target", str(tmp_path / "t"), "--out", str(out)],
        cwd=REPO_ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert set(result["medians_s"]) == {"save/zarr/0", "save/zarr/2", "save/null/1", "save/raw/1", "save/fs/1",
                                        "load/zarr/0", "load/zarr/2", "load/fs/1"}
    assert all(t > 0 for t in result["medians_s"].values())
    assert result["files"]["zarr"]["files"] == 2 * 60 + 1 and result["keep_stores"] and result["gc_freeze"]
    assert result["zarr_threads"] == [0, 2]
    assert list((tmp_path / "t").iterdir()) == [], "every store is removed at the end"


def test_file_ops_reports_every_operation_and_leaves_nothing_behind(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "file_ops.py"), "--target", str(tmp_path), "--count", "20",
                           "--repeats", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"{tmp_path}: 20 operations per run")
    timings = {line.rsplit(None, 2)[0].strip(): [float(t) for t in line.split()[-2:]] for line in lines[1:]}
    assert set(timings) == {"mkdir", "create + write 2 KiB", "one zarr array (mkdir, 2 files)"}
    assert all(fresh > 0 and after > 0 for fresh, after in timings.values())
    assert list(tmp_path.iterdir()) == [], "every timed directory is removed"


@pytest.mark.slow
def test_compression_reports_every_codec_on_every_group():
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "compression.py"), "--layers", "1", "--hidden", "64",
                           "--vocab", "128", "--dtype", "bfloat16"], cwd=BENCHMARKS, env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()[1:]]
    assert sorted({row[0] for row in rows}) == ["exp_avg", "exp_avg_sq", "weights"]
    assert len(rows) == 3 * 4
    ratios = [float(row[row.index("ratio") + 1]) for row in rows]
    assert all(r > 0.5 for r in ratios), ratios
