"""benchmarks/scale.py --quick runs end to end, and at its small sizes shows what the README's scale table claims:
a manifest that does not grow with the saving world size and one read item per tensor for a loading rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "scale.py"


def test_quick_scale_run_writes_its_table_plot_and_results(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--repeats", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "scale.json").read_text())
    assert (tmp_path / "scale.png").stat().st_size > 0 and "| fsdp | 64 |" in (tmp_path / "scale.md").read_text()
    rows = report["rows"]
    for layout in ("fsdp", "hsdp", "fsdp_tp"):
        by_world = {r["world"]: r for r in rows if r["layout"] == layout and r["entries"] == 100}
        for key in ("zarr_manifest_bytes", "zarr_root_bytes"):  # neither grows with the world size
            assert by_world[64][key] <= 1.05 * by_world[8][key], (layout, key)
        assert by_world[8]["zarr_root_bytes"] > by_world[8]["zarr_manifest_bytes"]  # the root holds the manifest
    fsdp = {r["world"]: r for r in rows if r["layout"] == "fsdp" and r["entries"] == 100}
    assert fsdp[64]["dcp_metadata_bytes"] > 5 * fsdp[8]["dcp_metadata_bytes"]  # DCP's grows with the ranks
    assert all(r["zarr_read_items"] == r["entries"] for r in rows)
    assert report["format1_validation_s"]["boxes"] == 10_000
    assert set(report["interleaved_load_planning_s"]) == {"8", "64"}
