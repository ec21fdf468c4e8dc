"""Environments of readers we do not control, built once and kept under ``.reader-envs/`` (git-ignored; CI builds them
fresh): zarr-python alone in a venv with nothing of ours (Python 3.11: zarr 3.1; 3.12: the newest zarr), the reading
install (``pip install .`` into a venv without torch, with xarray and the zarrs codec pipeline), and zarrita.js.

Where an interpreter or ``node`` is missing the tests are skipped, except under CI (``CI=true``), where that fails:
these machines have both, so a skip there would hide a gap."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENVS = REPO / ".reader-envs"
ZARRITA = ("zarrita@0.7.5", "@zarrita/storage@0.2.0")  # the release the docs' table was made with


def unavailable(what: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{what}: CI's machine must have it (tests/readers/environments.py)")
    pytest.skip(f"{what} (CI requires it)")


def python(version: str) -> str:
    """A working interpreter of ``version`` ("3.11"): on PATH, else pyenv's (its shims fail unless selected)."""
    candidates = [shutil.which(f"python{version}") or ""]
    candidates += sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}*/bin/python{version}")))
    for candidate in candidates:
        if candidate and subprocess.run([candidate, "-c", f"import sys; assert sys.version.startswith('{version}.')"],
                                        capture_output=True).returncode == 0:
            return candidate
    unavailable(f"no working Python {version}")
    raise AssertionError  # unreachable: unavailable() fails or skips


def _venv(name: str, version: str, *requirements: str, refresh: tuple[str, ...] = ()) -> str:
    """The venv ``name`` with ``requirements`` (installed once), and ``refresh`` reinstalled every session."""
    home = ENVS / name
    interpreter = str(home / "bin" / "python")
    if not (home / ".complete").exists():
        shutil.rmtree(home, ignore_errors=True)
        subprocess.run([python(version), "-m", "venv", str(home)], check=True, timeout=300)
        _pip(interpreter, "install", "-q", "-U", "pip")
        _pip(interpreter, "install", "-q", *requirements)
        (home / ".complete").touch()
    if refresh:
        _pip(interpreter, "install", "-q", "--no-deps", "--force-reinstall", *refresh)
    return interpreter


def _pip(interpreter: str, *args: str) -> None:
    done = subprocess.run([interpreter, "-m", "pip", *args], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"pip {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


def zarr_alone(version: str) -> str:
    """Python ``version`` with ``pip install zarr`` and nothing else: a user who never installed dcp-zarr."""
    return _venv(f"zarr-alone-{version}", version, "zarr")


def reading_install() -> str:
    """Python 3.12 with ``pip install .`` of this tree (no torch in the venv), xarray and the zarrs pipeline. The
    tree is reinstalled each session, so the venv reads with the code under test."""
    return _venv("reading-install", "3.12", str(REPO), "xarray", "zarrs", refresh=(str(REPO),))


def zarrita() -> Path:
    """A folder where ``node`` imports zarrita.js."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        unavailable("node and npm are not installed")
    home = ENVS / "zarrita-js"
    if not (home / ".complete").exists():
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir(parents=True)
        subprocess.run(["npm", "install", "--silent", "--no-audit", "--no-fund", *ZARRITA], cwd=home, check=True,
                       timeout=600, capture_output=True)
        (home / ".complete").touch()
    shutil.copy(Path(__file__).parent / "zarrita_read.mjs", home / "zarrita_read.mjs")
    return home


__all__ = ["python", "reading_install", "zarr_alone", "zarrita"]
