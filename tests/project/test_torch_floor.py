"""torch is not an install requirement (pyproject.toml): every module of dcp_zarr that imports torch checks it first
(dcp_zarr/torch_floor.py), so where torch is missing or older than the floor the DCP parts fail to import with one
TorchRequiredError naming what is missing and the command that fixes it, while the readers import as before."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from dcp_zarr.torch_floor import TORCH_FLOOR, release

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "dcp_zarr"


def modules_importing_torch() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        names = [alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names]
        names += [node.module or "" for node in tree.body if isinstance(node, ast.ImportFrom)]
        if any(name == "torch" or name.startswith("torch.") for name in names):
            module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
            found.append(module.removesuffix(".__init__"))
    return found


# Imports each module named on the command line in a process whose torch is missing ("missing") or a stand-in of an
# old release ("2.10.0"); prints, per module, the error's type and message (or "imported").
_IMPORT_EACH = r"""
import importlib, json, sys, types
torch = sys.argv[1]
if torch == "missing":
    sys.modules["torch"] = None  # `import torch` raises ImportError
else:
    sys.modules["torch"] = types.ModuleType("torch")
    sys.modules["torch"].__version__ = torch
found = {}
for module in sys.argv[2:]:
    for name in [m for m in sys.modules if m == "dcp_zarr" or m.startswith("dcp_zarr.")]:
        del sys.modules[name]  # each module imported afresh, as in a new program
    try:
        importlib.import_module(module)
        found[module] = "imported"
    except Exception as exc:
        found[module] = f"{type(exc).__name__}: {exc}"
try:
    from dcp_zarr import ZarrWriter
    found["from dcp_zarr import ZarrWriter"] = "imported"
except Exception as exc:
    found["from dcp_zarr import ZarrWriter"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(found))
"""

# What looks at stores never imports torch (the CLI's looking commands, zarr's data types, offline reading).
TORCH_FREE = ["dcp_zarr", "dcp_zarr.tools.cli", "dcp_zarr.format.zarr_dtypes", "dcp_zarr.offline",
              "dcp_zarr.tools.inspection", "dcp_zarr.tools.verify", "dcp_zarr.tools.diff"]


def import_each(torch: str, modules: list[str]) -> dict[str, str]:
    done = subprocess.run([sys.executable, "-c", _IMPORT_EACH, torch, *modules], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_modules_that_import_torch_are_the_dcp_parts_and_none_the_readers_need():
    modules = modules_importing_torch()
    assert {"dcp_zarr.writer", "dcp_zarr.reader", "dcp_zarr.lifecycle.manager", "dcp_zarr.planning.save_planner",
            "dcp_zarr.optim.load_planner", "dcp_zarr.integrations.torchtitan"} <= set(modules)
    assert not set(TORCH_FREE) & set(modules)


@pytest.mark.slow
@pytest.mark.parametrize("torch", ["missing", "2.10.0"])
def test_without_a_torch_of_the_floor_every_dcp_part_fails_with_one_error_and_the_readers_import(torch):
    floor = ".".join(map(str, TORCH_FLOOR))
    found = import_each(torch, [*modules_importing_torch(), *TORCH_FREE])

    for module in [*modules_importing_torch(), "from dcp_zarr import ZarrWriter"]:
        message = found[module]
        assert message.startswith("TorchRequiredError: "), (module, message)
        assert f"need torch>={floor}" in message and "pip install" in message and "'torch>=" in message, message
        if torch == "missing":
            assert "cannot be imported here" in message, message
        else:
            assert f"this is torch {torch}" in message, message
    for module in TORCH_FREE:
        assert found[module] == "imported", (module, found[module])


def test_a_torch_version_is_read_to_its_release():
    assert release("2.14.1+cu130") == (2, 14) and release("2.16.0.dev20261201") == (2, 16)
    assert release("2.13.0a0+git1234") == (2, 13) and TORCH_FLOOR == (2, 11)
    with pytest.raises(ValueError, match="MAJOR.MINOR"):
        release("nightly")
