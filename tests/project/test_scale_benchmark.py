"""python -m benchmarks.scale --quick runs end to end, and at its small sizes shows what the README's scale table
claims: a manifest that does not grow with the saving world size and one read item per tensor for a loading rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_quick_scale_run_writes_its_tables_and_results(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.scale", "--quick", "--repeats", "1", "--out",
                           str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "scale.json").read_text())
    assert report["stamp"]["commit"] in (tmp_path / "scale.md").read_text()
    assert "| fsdp | 64 |" in (tmp_path / "scale.md").read_text()
    rows = report["rows"]
    for layout in ("fsdp", "hsdp", "fsdp_tp"):
        by_world = {r["world"]: r for r in rows if r["layout"] == layout and r["entries"] == 100}
        for key in ("zarr_manifest_bytes", "zarr_root_bytes"):  # neither grows with the world size
            assert by_world[64][key] <= 1.05 * by_world[8][key], (layout, key)
        assert by_world[8]["zarr_root_bytes"] > by_world[8]["zarr_manifest_bytes"]  # the root holds the manifest
    fsdp = {r["world"]: r for r in rows if r["layout"] == "fsdp" and r["entries"] == 100}
    assert fsdp[64]["dcp_metadata_bytes"] > 5 * fsdp[8]["dcp_metadata_bytes"]  # DCP's grows with the ranks
    assert all(r["zarr_read_items"] == r["entries"] for r in rows)
    check_planning(tmp_path, report)


def check_planning(out: Path, report: dict) -> None:
    """The quick run's planning measures: every kind's bytes per save and load, one rank's planning and the
    coordinator's CPU. Byte counts are pickles, deterministic: dcp_zarr's per rank do not grow with the tensors."""
    planning = json.loads((out / "planning.json").read_text())
    assert planning.pop("stamp")["dcp_zarr_sources"] and planning == report["planning"]
    assert "| fsdp | 64 | 2000 |" in (out / "planning.md").read_text()
    assert planning["checked_ranks"] == {"fsdp": 16, "hsdp": 16, "fsdp_tp": 16}
    points = {(p["layout"], p["world"], p["entries"]): p for p in planning["wire"]}
    assert set(points) == {(layout, world, entries) for layout in ("fsdp", "hsdp", "fsdp_tp") for world in (8, 64)
                           for entries in (100, 2000)}
    for (layout, world, entries), point in points.items():
        assert set(point["save"]) == {"dcp_zarr", "dcp_default", "dcp_cached_later", "no_collectives"}
        assert set(point["load"]) == {"dcp_zarr", "dcp_default"}
        assert point["save"]["no_collectives"] == {"per_rank": 0, "coordinator": 0}
        assert point["dcp_exact"] == (entries == 100)
        for kind in ("dcp_zarr", "dcp_default", "dcp_cached_later"):
            traffic = point["save"][kind]
            assert 0 < traffic["per_rank"] < traffic["coordinator"], (layout, world, entries, kind)
        for kind in ("dcp_zarr", "dcp_default"):
            assert 0 < point["load"][kind]["per_rank"] < point["load"][kind]["coordinator"]
        zarr, dcp = point["save"]["dcp_zarr"], point["save"]["dcp_default"]
        assert zarr["plans_up"] < 300 * world and zarr["results_up"] < 300 * world  # a Summary, a RankReport
        assert zarr["broadcast"] < 200  # ZarrSavePlanner's Metadata is empty
        assert dcp["per_rank"] > 20 * zarr["per_rank"]
    for layout in ("fsdp", "hsdp", "fsdp_tp"):
        for world in (8, 64):
            small, large = points[(layout, world, 100)], points[(layout, world, 2000)]
            for op in ("save", "load"):  # 20x the tensors: dcp_zarr's bytes stay (a digit more), DCP's grow
                assert large[op]["dcp_zarr"]["per_rank"] <= 1.01 * small[op]["dcp_zarr"]["per_rank"], (layout, op)
                assert large[op]["dcp_default"]["per_rank"] > 15 * small[op]["dcp_default"]["per_rank"]
            assert large["save"]["dcp_cached_later"]["per_rank"] > 15 * small["save"]["dcp_cached_later"]["per_rank"]
        assert points[(layout, 64, 100)]["save"]["dcp_zarr"]["per_rank"] < 1.2 * points[(layout, 8, 100)]["save"][
            "dcp_zarr"]["per_rank"]
    for found in planning["rank_planning"].values():
        assert set(found["worlds"]) == {"8", "64"} and found["entries"] == 100
        for times in found["worlds"].values():
            assert times["total_s"] > 0 and times["warm_total_s"] > 0 and times["writes"] > 0
    assert {c["layout"] for c in planning["coordinator_cpu"]} == {"fsdp", "hsdp", "fsdp_tp"}
    for c in planning["coordinator_cpu"]:
        assert c["world"] == 64 and c["total_s"] >= c["finish_s"] > 0
