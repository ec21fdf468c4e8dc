"""A store's files on disk, as tests inspect and damage them: digests of a whole tree, its chunk files, the files it
shares with another store (hard links of an incremental save), and the root ``zarr.json`` (and its dcp_zarr manifest)
read and edited in place."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from typing import Any

__all__ = ["chunk_files", "drop_root_copies", "edit_json", "edit_root_copies", "edit_root_manifest", "file_identities",
           "new_files", "root_copies", "root_manifest", "store_bytes", "tree_digest"]


def tree_digest(root: str) -> dict[str, str]:
    """relative path -> sha256 of every file (and "dir" for every directory) under ``root``."""
    digest = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            digest[os.path.relpath(os.path.join(dirpath, name), root)] = "dir"
        for name in filenames:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                digest[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return digest


def chunk_files(root: str) -> list[str]:
    """Relative paths of every chunk (or shard) file: ``c.0.1`` and a 0-d array's ``c`` (format 3), or everything
    under a ``c`` directory (format 1 and 2)."""
    found = []
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            parts = rel.split(os.sep)
            if "c" in parts[:-1] or parts[-1] == "c" or parts[-1].startswith("c."):
                found.append(rel)
    return sorted(found)


def root_manifest(path) -> dict:
    """The manifest: the ``dcp_zarr`` attribute of the root ``zarr.json``."""
    with open(os.path.join(path, "zarr.json")) as f:
        return json.load(f)["attributes"]["dcp_zarr"]


def edit_json(file, edit: Callable[[Any], Any]) -> None:
    """Rewrite the JSON document in ``file`` after ``edit`` changed it in place."""
    with open(file) as f:
        document = json.load(f)
    edit(document)
    with open(file, "w") as f:
        json.dump(document, f)


def edit_root_manifest(path, edit: Callable[[dict], Any]) -> None:
    """Rewrite the root ``zarr.json`` after ``edit`` changed its manifest in place."""
    edit_json(os.path.join(path, "zarr.json"), lambda root: edit(root["attributes"]["dcp_zarr"]))


def root_copies(path) -> dict:
    """node path -> the copy of its ``zarr.json`` in the root (the manifest's ``nodes``, format 6)."""
    return root_manifest(path)["nodes"]


def edit_root_copies(path, edit: Callable[[dict], Any]) -> None:
    """Rewrite the root ``zarr.json`` after ``edit`` changed the nodes' copies in place."""
    edit_root_manifest(path, lambda manifest: edit(manifest["nodes"]))


def drop_root_copies(path) -> None:
    """Remove the nodes' copies from the root, as stores saved before they existed were: each array's own
    ``zarr.json`` is then the one read."""
    edit_root_manifest(path, lambda manifest: manifest.pop("nodes"))


def file_identities(root) -> dict[str, tuple[int, int]]:
    """relative path -> (st_dev, st_ino) of every file under ``root``: two stores share a file where they share one."""
    found = {}
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            path = os.path.join(dirpath, name)
            info = os.stat(path)
            found[os.path.relpath(path, root)] = (info.st_dev, info.st_ino)
    return found


def new_files(root, earlier) -> dict[str, int]:
    """relative path -> size of every file under ``root`` that is not a hard link to a file of ``earlier`` (its only
    link, or an inode none of ``earlier``'s files has): what a save from ``earlier`` wrote anew."""
    shared = set(file_identities(earlier).values())
    found = {}
    for rel, identity in file_identities(root).items():
        info = os.stat(os.path.join(root, rel))
        if info.st_nlink == 1 or identity not in shared:
            found[rel] = info.st_size
    return found


def store_bytes(root) -> int:
    """The bytes of every file under ``root``."""
    return sum(os.stat(os.path.join(dirpath, name)).st_size
               for dirpath, _, filenames in os.walk(root) for name in filenames)
