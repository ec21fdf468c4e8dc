"""What an older dcp_zarr says of a store a newer one wrote: a newer format version, or a data type it does not store,
each named with the fix (an upgrade); and dcp_zarr's own readers never write into a store they read."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_zarr import ZarrReader
from dcp_zarr.errors import MalformedMetadataError
from dcp_zarr.format import manifest as manifest_module
from dcp_zarr.offline import open_checkpoint
from dcp_zarr.tools.cli import main as dcp_zarr_cli
from tests.support.states import save_plain
from tests.support.stores import edit_root_manifest, tree_digest

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def store(tmp_path) -> str:
    path = str(tmp_path / "ckpt.zarr")
    save_plain({"model": {"w": torch.randn(6, 4, dtype=torch.bfloat16), "b": torch.arange(4.0)}, "step": 3}, path)
    return path


def test_a_store_of_a_newer_format_is_refused_naming_its_version_and_the_upgrade(store):
    edit_root_manifest(store, lambda manifest: manifest.update(format_version=manifest_module.FORMAT_VERSION + 1))

    with pytest.raises(MalformedMetadataError) as refused:
        open_checkpoint(store)
    message = str(refused.value)
    assert f"format version {manifest_module.FORMAT_VERSION + 1} is newer than this dcp_zarr" in message
    assert "pip install -U dcp-zarr" in message and store in message


def test_a_data_type_this_dcp_zarr_does_not_store_is_refused_naming_it_and_the_upgrade(store):
    edit_root_manifest(store, lambda manifest: manifest["entries"]["model.w"].update(dtype="torch.float4_e2m1fn_x2"))

    with pytest.raises(MalformedMetadataError) as refused:
        open_checkpoint(store)
    message = str(refused.value)
    assert "'model.w'" in message and "'torch.float4_e2m1fn_x2'" in message and "pip install -U dcp-zarr" in message


def test_dcp_zarrs_own_readers_write_nothing_into_the_store(store, tmp_path, capsys):
    other = str(tmp_path / "other.zarr")
    save_plain({"model": {"w": torch.zeros(6, 4, dtype=torch.bfloat16), "b": torch.arange(4.0)}, "step": 3}, other)
    before = tree_digest(store)

    target = {"model": {"w": torch.empty(6, 4, dtype=torch.bfloat16), "b": torch.empty(4)}, "step": 0}
    dcp.load(target, storage_reader=ZarrReader(store), no_dist=True)
    open_checkpoint(store).load_full_state_dict()
    for command in (["inspect", store], ["inspect", "--tree", store], ["verify", "--no-progress", store],
                    ["diff", store, other], ["list", str(tmp_path)]):
        dcp_zarr_cli(command)
    capsys.readouterr()

    assert tree_digest(store) == before
