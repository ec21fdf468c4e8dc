"""A writer's and a reader's settings: made once, checked as they are made, and what depends on the storage asked of
its class (storage/registry.py), not of the path's form."""

from __future__ import annotations

import dataclasses

import pytest

from dcp_zarr import ZarrReader, ZarrWriter
from dcp_zarr.loading.settings import LoadSettings
from dcp_zarr.saving.settings import SaveSettings
from dcp_zarr.storage import register_storage, unregister_storage
from dcp_zarr.storage.base import Storage


class _RenamingStorage(Storage):  # never opened: only its class's capabilities are asked
    commits_by_rename = True
    transfers_pause_collector = True


@pytest.fixture
def renaming_scheme():
    register_storage("renamefs", _RenamingStorage)
    yield "renamefs"
    unregister_storage("renamefs")


def test_a_storage_that_commits_by_rename_is_replaced_by_default_and_pauses_the_collector(renaming_scheme):
    save = SaveSettings(path=f"{renaming_scheme}://bucket/ckpt.zarr")
    assert save.replaces() and save.pauses_collector()
    assert LoadSettings(path=f"{renaming_scheme}://bucket/ckpt.zarr").pauses_collector()


def test_an_object_store_is_not_replaced_by_default_nor_pauses_the_collector():
    save = SaveSettings(path="memory://ckpt.zarr")
    assert not save.replaces() and not save.pauses_collector()
    assert SaveSettings(path="memory://ckpt.zarr", overwrite=True).replaces()
    assert not LoadSettings(path="memory://ckpt.zarr").pauses_collector()


def test_a_local_directory_is_replaced_by_default_and_pauses_the_collector(tmp_path):
    save = SaveSettings(path=str(tmp_path / "ckpt.zarr"))
    assert save.replaces() and save.pauses_collector()
    assert not SaveSettings(path=str(tmp_path / "ckpt.zarr"), overwrite=False).replaces()


def test_settings_are_checked_where_they_are_made():
    with pytest.raises(ValueError, match="check_replicas='some'"):
        SaveSettings(path="x", check_replicas="some")
    with pytest.raises(ValueError, match="exchange_bytes=0"):
        LoadSettings(path="x", exchange_bytes=0)
    with pytest.raises(ValueError, match="read_once='false'"):
        ZarrReader("x", read_once="false")


def test_checkpoint_id_gives_the_writer_and_reader_settings_another_path_and_nothing_else(tmp_path):
    writer, reader = ZarrWriter(tmp_path / "a", thread_count=3), ZarrReader(tmp_path / "a", thread_count=5)
    before = writer.settings, reader.settings
    writer.reset(tmp_path / "b")
    reader.reset(tmp_path / "b")
    for old, new in zip(before, (writer.settings, reader.settings)):
        assert new.path == str(tmp_path / "b")
        assert {f.name: getattr(old, f.name) for f in dataclasses.fields(old) if f.name != "path"} == {
            f.name: getattr(new, f.name) for f in dataclasses.fields(new) if f.name != "path"}
    assert (writer.settings.thread_count, reader.settings.thread_count) == (3, 5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        writer.settings.path = "elsewhere"  # type: ignore[misc]
