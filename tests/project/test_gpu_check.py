"""benchmarks/gpu_check.sh --dry-run runs every step of the GPU check on the CPU and writes a complete result, so
the script is known to work before a GPU is lent; and its schema check rejects results that lack what it promises.

No timing is asserted (shared, noisy machines): only that every timing is there, finite and positive.
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
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO_ROOT / "benchmarks"


def gpu_bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_bench", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[dict, Path, str]:
    out = tmp_path_factory.mktemp("gpu-check")
    # This interpreter for the script's python3, and no torchrun variables: the benchmark is world size 1.
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHON"] = sys.executable
    proc = subprocess.run(["bash", str(BENCHMARKS / "gpu_check.sh"), "--dry-run", "--out", str(out)], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"gpu_check.sh --dry-run exited {proc.returncode}\nstdout:\n{proc.stdout[-6000:]}\n"
                    f"stderr:\n{proc.stderr[-4000:]}")
    return json.loads((out / "gpu_check.json").read_text()), out, proc.stdout


def positive_times(values) -> bool:
    return bool(values) and all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in values)


@pytest.mark.slow
@pytest.mark.distributed  # the benchmark is a 1-rank gloo process group
def test_the_dry_run_measures_every_kind_on_both_targets_and_loads_back_equal(dry_run):
    result, out, _ = dry_run
    assert gpu_bench("--check", str(out / "gpu_check.json")).returncode == 0
    assert result["dry_run"] is True and result["backend"] == "gloo" and result["repeats"] == 1
    assert result["torch"] == torch.__version__ and result["commit"] and result["date"]
    assert result["state"]["bytes"] >= 32_000_000 and set(result["state"]["bytes_by_dtype"]) == {"bfloat16",
                                                                                                   "float32"}
    for name in ("shm", "disk"):
        target = result["targets"][name]
        if target.get("skipped"):
            continue  # a machine whose /dev/shm is too small: the schema check still demands one measured target
        assert set(target["save"]) == {"zarr", "zarr-plain", "fs", "raw"}, name
        assert set(target["load"]) == {"zarr", "zarr-plain", "fs"}, name
        for op in ("save", "load"):
            for kind, entry in target[op].items():
                assert entry["bytes"] == result["state"]["bytes"], (name, op, kind)
                assert positive_times(entry["times_s"] + [entry["median_s"], entry["gbps"]]), (name, op, kind)
                assert entry["peak_gpu_extra_bytes"] is None, "no GPU, so no GPU memory figure"
                assert entry["peak_rss_extra_bytes"] >= 0
        assert target["loads_equal"] is True
        assert set(result["ratios"][name]) == {"save_zarr_vs_fs", "save_zarr_fraction_of_raw", "load_zarr_vs_fs",
                                               "save_plain_vs_fs", "save_plain_vs_planned"}
    a = result["async"]
    assert positive_times(a["blocking_times_s"] + a["total_times_s"] + a["copy_times_s"])
    assert positive_times([a["first_blocking_s"], a["first_total_s"], a["blocking_vs_copy"]])
    assert a["loads_equal"] is True and a["pinned"] is False  # nothing to pin for without CUDA
    assert a["staging_held_bytes"] > 0  # the plain line's buffers, kept for the next save
    assert set(a["peers"]) == {"zarr-one-writer", "fs", "fs-cache"}
    for kind in ("zarr-one-writer", "fs"):
        assert positive_times([a["peers"][kind]["median_blocking_s"], a["peers"][kind]["blocking_vs_copy"]]), kind
    assert "failed" in a["peers"]["fs-cache"] or a["peers"]["fs-cache"]["median_blocking_s"] > 0  # DCP pins: CUDA
    assert positive_times([step["elapsed_s"] for step in result["steps"]] + [result["elapsed_s"]])


@pytest.mark.slow
@pytest.mark.distributed
def test_the_dry_run_writes_the_markdown_table_and_runs_the_cuda_tests_as_skipped(dry_run):
    result, out, stdout = dry_run
    table = (out / "gpu_check.md").read_text()
    assert f"commit {result['commit']}" in table and "| shm | zarr |" in table and "dcp.async_save" in table
    assert all(f"- {name}: " in table for name in result["targets_met"])
    log = (out / "cuda_tests.log").read_text()
    assert "skipped" in log and "failed" not in log and "no CUDA device" in log, log[-2000:]
    assert "(a) tests/save_load/test_cuda_path.py" in stdout and "(b-d) python -m benchmarks.gpu_bench" in stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_the_schema_check_rejects_missing_fields_and_bad_timings(dry_run, tmp_path):
    result, _, _ = dry_run
    measured = next(name for name, target in result["targets"].items() if "save" in target)
    breakages = {
        "a missing field": lambda r: r.pop("commit"),
        "a zero time": lambda r: r["targets"][measured]["save"]["zarr"]["times_s"].__setitem__(0, 0.0),
        "a NaN time": lambda r: r["targets"][measured]["load"]["fs"].__setitem__("median_s", float("nan")),
        "a missing kind": lambda r: r["targets"][measured]["save"].pop("raw"),
        "a load that differed": lambda r: r["targets"][measured].__setitem__("loads_equal", False),
        "a GPU figure without a GPU": lambda r: r["targets"][measured]["save"]["fs"].__setitem__(
            "peak_gpu_extra_bytes", 5),
        "async times missing": lambda r: r["async"].__setitem__("copy_times_s", []),
        "a failed step": lambda r: r.__setitem__("failures", ["disk failed: OSError: injected"]),
        "every target skipped": lambda r: r.__setitem__("targets", {"shm": {"skipped": "injected"}}),
    }
    for i, breaking in enumerate(breakages.values()):
        broken = copy.deepcopy(result)
        breaking(broken)
        (tmp_path / f"{i}.json").write_text(json.dumps(broken))
    proc = gpu_bench("--check", *(str(tmp_path / f"{i}.json") for i in range(len(breakages))))
    verdicts = dict(zip(breakages, proc.stdout.splitlines()))
    assert proc.returncode == 1 and all("invalid" in v for v in verdicts.values()), verdicts


@pytest.mark.slow
def test_the_default_state_dict_is_at_least_8_gb_of_bf16_and_fp32_with_a_few_large_tensors():
    proc = gpu_bench("--layout-only")
    assert proc.returncode == 0, proc.stderr[-2000:]
    layout = [(name, shape, getattr(torch, dtype.removeprefix("torch."))) for name, shape, dtype in json.loads(
        proc.stdout)]
    sizes = [math.prod(shape) * dtype.itemsize for _, shape, dtype in layout]
    assert sum(sizes) >= 8e9
    assert {dtype for _, _, dtype in layout} == {torch.bfloat16, torch.float32}
    assert sum(size >= 1e9 for size in sizes) == 2, "two large tensors of a GB each"
    assert len({name for name, _, _ in layout}) == len(layout), "every name once"
