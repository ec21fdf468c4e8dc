"""The torch releases between CI's two (the floor and the newest) run the tests that touch DCP through .ci/torch-matrix,
once per change of torch_private.py or planning/dcp_internals.py, what dcp_zarr imports or reads of torch's internals
(docs/compatibility.md): its last result must be of those files as they are."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_matrix_ran_on_the_torch_internals_of_this_tree_and_passed():
    report = (REPO / "benchmarks" / "reports" / "torch-matrix.md").read_text()
    files = (REPO / "dcp_zarr" / "torch_private.py", REPO / "dcp_zarr" / "planning" / "dcp_internals.py")
    internals = hashlib.sha256(b"".join(path.read_bytes() for path in files)).hexdigest()
    recorded = re.search(r"torch_private\.py \+ dcp_internals\.py sha256: ([0-9a-f]{16})", report)
    assert recorded and recorded[1] == internals[:16], (
        "torch_private.py or dcp_internals.py changed since the last torch matrix: run `bash .ci/torch-matrix` and "
        "commit its report")
    rows = re.findall(r"^\| (2\.\d+) \| ([^|]+) \| [^|]+ \| ([^|]+) \|$", report, re.MULTILINE)
    assert {"2.12", "2.13", "2.14"} <= {release for release, _, _ in rows}, rows
    for release, torch, result in rows:
        assert torch.strip().startswith(release + ".") and " passed" in result and "failed" not in result \
            and "error" not in result, (release, torch, result)
