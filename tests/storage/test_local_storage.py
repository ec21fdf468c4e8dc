"""What a local directory says it can do beyond the contract (tests/storage/test_storage_contract.py): where its roots
are, and how ``link_from`` falls back to copying where a hard link cannot be made."""

from __future__ import annotations

import errno
import os

import pytest
import zarr.storage

from dcp_zarr.storage import LocalStorage, local, open_storage, storage_class, store_objects
from dcp_zarr.storage.retry import Retrying


def test_a_local_location_is_its_own_directory_and_names_under_it_are_paths(tmp_path):
    root = tmp_path / "ckpt.zarr"
    assert storage_class(str(root)).directory(str(root)) == str(root)
    assert LocalStorage.directory(f"file://{root}") == str(root)
    assert LocalStorage.directory("relative.zarr") == os.path.abspath("relative.zarr")
    assert open_storage(str(tmp_path)).location("ckpt.zarr") == str(root)
    assert storage_class("s3://bucket/ckpt.zarr").directory("s3://bucket/ckpt.zarr") is None


def test_a_prefix_that_is_a_file_lists_nothing(tmp_path):
    storage = LocalStorage(str(tmp_path / "ckpt.zarr"))
    storage.write("model/zarr.json", [b"{}"])
    assert storage.list_names("model/zarr.json") == []
    assert LocalStorage(str(tmp_path / "absent")).list_names() == []


@pytest.mark.parametrize("code", [errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP],
                         ids=["another-file-system", "no-links-allowed", "too-many-links", "no-links-there"])
def test_where_no_hard_link_can_be_made_the_bytes_are_copied(tmp_path, monkeypatch, code):
    source, target = LocalStorage(str(tmp_path / "step-1.zarr")), LocalStorage(str(tmp_path / "step-2.zarr"))
    source.write("model/w/c.0.0", [b"weights"])

    def refused(*args):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(local.os, "link", refused)
    target.link_from(source, "model/w/c.0.0")
    assert target.read("model/w/c.0.0") == b"weights"
    assert not os.path.samefile(source.location("model/w/c.0.0"), target.location("model/w/c.0.0"))


def test_any_other_link_error_is_raised(tmp_path, monkeypatch):
    source, target = LocalStorage(str(tmp_path / "step-1.zarr")), LocalStorage(str(tmp_path / "step-2.zarr"))
    source.write("model/w/c.0.0", [b"weights"])

    def no_space(*args):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(local.os, "link", no_space)
    with pytest.raises(OSError, match="injected"):
        target.link_from(source, "model/w/c.0.0")


def test_an_object_of_another_backend_is_copied_into_the_directory(tmp_path):
    memory = zarr.storage.MemoryStore()
    source = store_objects.open_store(memory, Retrying())
    source.write("model/w/c.0.0", [b"from memory"])
    target = LocalStorage(str(tmp_path / "ckpt.zarr"))
    target.link_from(source, "model/w/c.0.0")
    assert target.read("model/w/c.0.0") == b"from memory"
    assert os.stat(target.location("model/w/c.0.0")).st_nlink == 1


def test_writing_a_linked_key_replaces_its_file_and_leaves_the_earlier_checkpoint_alone(tmp_path):
    source, target = LocalStorage(str(tmp_path / "step-1.zarr")), LocalStorage(str(tmp_path / "step-2.zarr"))
    source.write("model/w/c.0.0", [b"weights"])
    target.link_from(source, "model/w/c.0.0")

    target.write("model/w/c.0.0", [b"new!"])

    assert (source.read("model/w/c.0.0"), target.read("model/w/c.0.0")) == (b"weights", b"new!")
    assert os.stat(source.location("model/w/c.0.0")).st_nlink == 1


def test_a_write_never_follows_a_symbolic_link_left_at_its_key(tmp_path):
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    storage = LocalStorage(str(tmp_path / "ckpt.zarr"))
    storage.write("model/w/zarr.json", [b"{}"])
    os.remove(storage.location("model/w/zarr.json"))
    os.symlink(outside, storage.location("model/w/zarr.json"))

    storage.write("model/w/zarr.json", [b"{}"])

    assert outside.read_bytes() == b"keep"
