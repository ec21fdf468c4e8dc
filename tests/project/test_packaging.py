"""What ``pip install dcp-zarr`` pulls: the library's own needs only, and no torch (a node keeps its own build; the
DCP parts check it at import: dcp_zarr/torch_floor.py); each framework adapter an extra of its own, admitting the
release its adapter was written for, which the test extra pins (pyproject.toml)."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO_ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
# What the library imports at run time (dcp_zarr/, not its tests or adapters), torch aside: the user brings it
LIBRARY_NEEDS = {"zarr", "numcodecs", "fsspec", "ml-dtypes", "crc32c", "numpy", "xxhash"}
ADAPTERS = {"torchtitan": "dcp_zarr.integrations.torchtitan", "lightning": "dcp_zarr.integrations.lightning",
            "accelerate": "dcp_zarr.integrations.accelerate"}


def names(requirements: list[str]) -> dict[str, Requirement]:
    parsed = [Requirement(r) for r in requirements]
    return {r.name.lower().replace("_", "-"): r for r in parsed}


def test_the_plain_install_pulls_only_what_the_library_needs():
    assert set(names(PROJECT["dependencies"])) == LIBRARY_NEEDS


@pytest.mark.parametrize("framework", sorted(ADAPTERS))
def test_each_adapter_has_an_extra_admitting_its_release_which_the_test_extra_pins(framework):
    pytest.importorskip(framework)  # the adapter module imports its framework
    written_for = importlib.import_module(ADAPTERS[framework]).WRITTEN_FOR
    extras = PROJECT["optional-dependencies"]
    (requirement,) = names(extras[framework]).values()
    assert requirement.name == framework and requirement.specifier.contains(written_for), requirement
    assert str(names(extras["test"])[framework].specifier) == f"=={written_for}"


def test_the_torch_floor_is_the_one_the_test_extra_installs_the_code_checks_and_the_docs_name():
    from dcp_zarr.torch_floor import TORCH_FLOOR

    floor = str(names(PROJECT["optional-dependencies"]["test"])["torch"].specifier).removeprefix(">=")
    assert floor == ".".join(map(str, TORCH_FLOOR))
    assert f"torch {floor} and later" in (REPO_ROOT / "README.md").read_text()
    assert f"**torch {floor} and later**" in (REPO_ROOT / "docs" / "compatibility.md").read_text()
