"""dcp_zarr.integrations.lightning: Lightning's own Trainer and Fabric, on CPU gloo ranks, save distributed
checkpoints as dcp_zarr stores (beside Lightning's meta.pt), load them at another world size bit-exact, and resume
from the latest step; each strategy's ``compression`` and ``incremental`` reach its stores (incremental saves link
the chunks of the checkpoint saved before, and ModelCheckpoint's deletions of older ones leave the newest whole); the
adapter fails loudly when Lightning is missing or its internals moved.

Ranks are started by tests/support/ranks.py with torchrun's environment (LOCAL_RANK set), so Lightning takes them as
launched externally and starts no processes of its own; the gloo group is already up, which Lightning accepts.

What CPU does not allow: Lightning's FSDPStrategy (FSDP1) wraps a model with ``device_id=root_device.index``, None on
CPU, which FSDP1 refuses without an accelerator. Its FSDP1 test wraps the model in ``configure_model`` with
``device_id=torch.device("cpu")`` instead, which Lightning supports (it leaves a wrapped model as it is); everything
else, saving and loading included, is Lightning's own code.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import os
import shutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
import zarr
from lightning.fabric.strategies import fsdp as fabric_fsdp
from lightning.fabric.strategies import model_parallel as fabric_model_parallel
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import fsdp as trainer_fsdp
from lightning.pytorch.strategies import model_parallel as trainer_model_parallel
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

import dcp_zarr.integrations
from dcp_zarr import Compression, open_checkpoint
from dcp_zarr.errors import FrameworkNotInstalledError, FrameworkVersionError
from dcp_zarr.integrations import framework
from dcp_zarr.integrations.lightning import (
    WRITTEN_FOR,
    ZarrFabricFSDPStrategy,
    ZarrFabricModelParallelStrategy,
    ZarrFSDPStrategy,
    ZarrModelParallelStrategy,
)
from tests.support.compare import assert_state_equal
from tests.support.ranks import run_ranks

pytestmark = [pytest.mark.frameworks, pytest.mark.distributed, pytest.mark.slow]

ADAPTER = "dcp_zarr.integrations.lightning"
# The whole state on every rank (cpu_offload=True, rank 0 only, fails for FSDP1 on CPU: "setStorage: ... out of
# bounds for storage of size 0").
FULL = StateDictOptions(full_state_dict=True)
# Every float array compressed: the tests' tensors are far under Compression's 64 KiB default (min_ratio=0: no
# sample asked, so none is stored as it is for shrinking too little).
EVERY_FLOAT_ARRAY = Compression(min_bytes=0, min_ratio=0)


# --------------------------------------------------------------------------------------------------
# The user's side: a model, its data, a LightningModule, a Trainer
# --------------------------------------------------------------------------------------------------


def make_net() -> nn.Sequential:
    # Odd dims: fully_shard splits 17 rows unevenly over 2 and 3 ranks.
    return nn.Sequential(nn.Linear(13, 17), nn.ReLU(), nn.Linear(17, 5))


def shard_linears(net: nn.Module, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(net, mesh=mesh)


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(96, 13, generator=g), torch.randn(96, 5, generator=g))


def full_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The state Lightning's Trainer strategies save (``state_dict``, ``optimizer_0``), unsharded, on every rank."""
    return {"state_dict": get_model_state_dict(module, options=FULL),
            "optimizer_0": get_optimizer_state_dict(module, optimizer, options=FULL)}


class TinyModule(L.LightningModule):
    def __init__(self, fsdp1: bool = False, frozen: bool = False):
        super().__init__()
        self.fsdp1 = fsdp1
        self.frozen = frozen  # the first layer never changes (lr 0, no weight decay): chunks an incremental save links
        self.net = make_net()
        self.at_start: dict = {}

    def configure_model(self) -> None:
        if self.fsdp1:
            from torch.distributed.fsdp import FullyShardedDataParallel

            self.net = FullyShardedDataParallel(self.net, device_id=torch.device("cpu"))
        else:
            shard_linears(self.net, self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        if self.frozen:
            first = list(self.net[0].parameters())
            rest = [p for p in self.parameters() if all(p is not f for f in first)]
            return torch.optim.AdamW([{"params": first, "lr": 0.0, "weight_decay": 0.0}, {"params": rest}], lr=1e-2)
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def on_train_start(self) -> None:
        # After Lightning restored the checkpoint (ckpt_path=...), before the first step of this run. Only then: a
        # fresh optimizer has no state yet, which get_optimizer_state_dict would make with a step of its own. A copy:
        # the optimizer's "step" tensors come back as themselves, and training counts them up in place.
        if self.trainer.global_step:
            state = full_state(self, self.trainer.optimizers[0])
            self.at_start = {"step": self.trainer.global_step, "state": copy.deepcopy(state)}


def fit(rank: int, world_size: int, kind: str, ckpt_dir: str, max_steps: int, ckpt_path: str | None = None,
        compression: Compression | None = None, incremental: bool = False, save_top_k: int = -1,
        frozen: bool = False):
    """Rank program: ``Trainer.fit`` with the adapter's strategy (given ``compression`` and ``incremental``), a
    ModelCheckpoint every 2 steps (``save_top_k``: all kept by default, and last.ckpt), the first layer ``frozen`` or
    not; rank 0 returns the step and state at the start of training and at its end."""
    torch.manual_seed(rank + 10 * world_size)  # a different init everywhere: only a load makes states agree
    if kind == "fsdp1":
        strategy = ZarrFSDPStrategy(compression=compression, incremental=incremental)
    else:
        strategy = ZarrModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1,
                                             compression=compression, incremental=incremental)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=max_steps,
        default_root_dir=os.path.dirname(ckpt_dir), logger=False, enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=save_top_k, save_last=True)])
    module = TinyModule(fsdp1=kind == "fsdp1", frozen=frozen)
    trainer.fit(module, torch.utils.data.DataLoader(dataset(), batch_size=4), ckpt_path=ckpt_path)
    end = full_state(module, trainer.optimizers[0])
    if rank == 0:
        return {"start_step": module.at_start.get("step", 0), "start": module.at_start.get("state"),
                "end_step": trainer.global_step, "end": end}
    return None


def stored(path: Path) -> dict:
    return open_checkpoint(path).load_full_state_dict()


def meta(path: Path) -> dict:
    return torch.load(path / "meta.pt", weights_only=False)  # Lightning's own file, written by this test's run


# --------------------------------------------------------------------------------------------------
# Trainer + ZarrModelParallelStrategy (FSDP2)
# --------------------------------------------------------------------------------------------------


@dataclass
class Trained:
    ckpt_dir: Path
    end: dict  # the state after the last step, as the 2 ranks held it
    files: dict[str, set[str]]  # checkpoint name -> its files, as saved (the resume test adds to the directory)
    global_step: dict[str, int]  # checkpoint name -> meta.pt's global_step
    stored: dict[str, dict]  # checkpoint name -> its full state, read offline
    attributes: dict[str, dict]  # checkpoint name -> the root group's attributes, read by zarr-python


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Trained:
    """2 ranks, 4 steps: checkpoints at steps 2 and 4, and last.ckpt saved at both (the second replacing the first)."""
    ckpt_dir = tmp_path_factory.mktemp("trainer") / "checkpoints"
    result = run_ranks(fit, 2, "fsdp2", str(ckpt_dir), 4)[0]
    assert result["end_step"] == 4
    names = sorted(os.listdir(ckpt_dir))
    return Trained(ckpt_dir, result["end"], {n: set(os.listdir(ckpt_dir / n)) for n in names},
                   {n: meta(ckpt_dir / n)["global_step"] for n in names}, {n: stored(ckpt_dir / n) for n in names},
                   {n: dict(zarr.open_group(ckpt_dir / n, mode="r").attrs) for n in names})


def test_trainer_checkpoints_are_dcp_zarr_stores_beside_lightnings_meta_pt(trained):
    # Nothing else in the directory: no staging area (.dcp-zarr-staging) left behind
    assert sorted(trained.files) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    for name, files in trained.files.items():
        # Written by ZarrWriter, not DCP's FileSystemWriter (.metadata and one __<rank>_0.distcp per rank)
        assert {"zarr.json", "meta.pt", "state_dict", "optimizer_0"} <= files, files
        assert not [f for f in files if f == ".metadata" or f.endswith(".distcp")], files
        assert "dcp_zarr" in trained.attributes[name]
        assert trained.stored[name]["state_dict"]["net.0.weight"].shape == (17, 13)  # global, however sharded
    assert trained.global_step == {"epoch=0-step=2.ckpt": 2, "epoch=0-step=4.ckpt": 4, "last.ckpt": 4}


def test_trainer_checkpoint_holds_the_trained_state_bit_exact(trained):
    assert_state_equal(trained.stored["epoch=0-step=4.ckpt"], trained.end)


def test_saving_to_the_same_path_again_replaces_the_checkpoint(trained):
    # last.ckpt was saved at step 2, then again at step 4 (global_step above)
    assert_state_equal(trained.stored["last.ckpt"], trained.end)


def test_trainer_resumes_last_at_three_ranks_bit_exact(trained):
    # In the first run's directory, as a job resubmitted with ckpt_path="last" would: ModelCheckpoint then knows its
    # last.ckpt (from the checkpoint's callback state) and saves it again, rather than last-v1.ckpt beside it.
    ckpt_dir = trained.ckpt_dir
    result = run_ranks(fit, 3, "fsdp2", str(ckpt_dir), 6, "last")[0]
    assert result["start_step"] == 4
    assert_state_equal(result["start"], trained.stored["epoch=0-step=4.ckpt"])
    assert result["end_step"] == 6
    assert sorted(os.listdir(ckpt_dir)) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt",
                                            "last.ckpt"]
    assert meta(ckpt_dir / "last.ckpt")["global_step"] == 6
    assert_state_equal(stored(ckpt_dir / "last.ckpt"), result["end"])
    assert_state_equal(stored(ckpt_dir / "epoch=0-step=6.ckpt"), result["end"])


def test_trainer_resumes_a_named_checkpoint_at_one_rank_bit_exact(trained, tmp_path):
    step_2 = trained.ckpt_dir / "epoch=0-step=2.ckpt"
    result = run_ranks(fit, 1, "fsdp2", str(tmp_path / "checkpoints"), 3, str(step_2))[0]
    assert result["start_step"] == 2
    assert_state_equal(result["start"], trained.stored["epoch=0-step=2.ckpt"])


def codecs(path: Path) -> dict[str, str | None]:
    """Each float array of the store at ``path`` but 0-d ones (AdamW's step counters): its compressor, or None where
    it is stored as it is."""
    return {fqn: entry.codec and entry.codec["configuration"]["cname"]
            for fqn, entry in open_checkpoint(path).entries.items()
            if entry.dtype_name == "torch.float32" and entry.shape}


def test_trainer_with_compression_saves_compressed_stores_and_resumes_from_one_bit_exact(tmp_path):
    first = run_ranks(fit, 2, "fsdp2", str(tmp_path / "first"), 2, None, EVERY_FLOAT_ARRAY)[0]
    step_2 = tmp_path / "first" / "epoch=0-step=2.ckpt"
    compressed = codecs(step_2)
    # the weights and biases, and AdamW's moments
    assert {"state_dict.net.0.weight", "state_dict.net.2.bias", "optimizer_0.state.net.0.weight.exp_avg_sq"} <= \
        set(compressed)
    assert set(compressed.values()) == {"lz4"}, compressed
    assert_state_equal(stored(step_2), first["end"])
    result = run_ranks(fit, 1, "fsdp2", str(tmp_path / "second"), 3, str(step_2))[0]
    assert result["start_step"] == 2
    assert_state_equal(result["start"], first["end"])


def chunk_record(path: Path) -> dict | None:
    """The manifest's ``chunks`` (as any JSON reader sees the root zarr.json), None for a save that records none."""
    return json.loads((path / "zarr.json").read_text())["attributes"]["dcp_zarr"].get("chunks")


def chunk_files(path: Path, fqn: str) -> list[Path]:
    """The files of the array saved as ``fqn`` in the store at ``path``, its zarr.json aside."""
    node = path / open_checkpoint(path).entries[fqn].node
    return sorted(file for file in node.rglob("*") if file.is_file() and file.name != "zarr.json")


@pytest.fixture(scope="module")
def incremental_run(tmp_path_factory) -> tuple[Path, dict]:
    """2 ranks, 6 steps, ``incremental=True``, the first layer frozen: a checkpoint every 2 steps, ModelCheckpoint
    keeping the newest alone (``save_top_k=1``: each save of steps 4 and 6 is followed by the deletion of the one
    before), and last.ckpt saved after each. Each save's base is the one saved just before it: step 2's last.ckpt
    that of step 4, step 4 that of the new last.ckpt, ..."""
    ckpt_dir = tmp_path_factory.mktemp("incremental") / "checkpoints"
    result = run_ranks(fit, 2, "fsdp2", str(ckpt_dir), 6, incremental=True, save_top_k=1, frozen=True)[0]
    assert result["end_step"] == 6
    return ckpt_dir, result


def test_incremental_saves_link_the_unchanged_chunks_of_the_checkpoint_saved_before(incremental_run):
    ckpt_dir, _ = incremental_run
    step_6, last = ckpt_dir / "epoch=0-step=6.ckpt", ckpt_dir / "last.ckpt"
    assert chunk_record(step_6)["incremental_from"]["path"] == str(last)  # last.ckpt as saved at step 4
    assert chunk_record(last)["incremental_from"]["path"] == str(step_6)
    frozen = chunk_files(step_6, "state_dict.net.0.weight") + chunk_files(step_6, "state_dict.net.0.bias")
    # Only the frozen layer's chunks: the trained weights, AdamW's moments and step counters changed, so written
    assert frozen and chunk_record(step_6)["incremental_from"]["reused_chunks"] == len(frozen)
    # step 6 and last.ckpt: the checkpoints these chunks were first saved in, and linked from since, are gone
    assert {os.stat(file).st_nlink for file in frozen} == {2}


def test_save_top_k_deleting_older_checkpoints_leaves_the_newest_whole(incremental_run):
    ckpt_dir, result = incremental_run
    assert sorted(os.listdir(ckpt_dir)) == ["epoch=0-step=6.ckpt", "last.ckpt"]  # steps 2 and 4 deleted
    assert_state_equal(stored(ckpt_dir / "epoch=0-step=6.ckpt"), result["end"])
    assert_state_equal(stored(ckpt_dir / "last.ckpt"), result["end"])


def test_an_incremental_trainer_resumes_from_its_newest_checkpoint_bit_exact(incremental_run, tmp_path):
    ckpt_dir, first = incremental_run
    step_6 = ckpt_dir / "epoch=0-step=6.ckpt"
    result = run_ranks(fit, 1, "fsdp2", str(tmp_path / "checkpoints"), 7, str(step_6), incremental=True,
                       save_top_k=1, frozen=True)[0]
    assert result["start_step"] == 6
    assert_state_equal(result["start"], first["end"])


# --------------------------------------------------------------------------------------------------
# Trainer + ZarrFSDPStrategy (FSDP1, state_dict_type="sharded")
# --------------------------------------------------------------------------------------------------


def test_fsdp1_trainer_saves_dcp_zarr_stores_and_resumes_at_three_ranks_bit_exact(tmp_path):
    first = run_ranks(fit, 2, "fsdp1", str(tmp_path / "first"), 2)[0]
    step_2 = tmp_path / "first" / "epoch=0-step=2.ckpt"
    assert {"zarr.json", "meta.pt"} <= set(os.listdir(step_2))
    saved = stored(step_2)
    # FSDPStrategy saves the model under "model" where ModelParallelStrategy says "state_dict"
    assert_state_equal({"state_dict": saved["model"], "optimizer_0": saved["optimizer_0"]}, first["end"])
    result = run_ranks(fit, 3, "fsdp1", str(tmp_path / "second"), 3, str(step_2))[0]
    assert result["start_step"] == 2
    # The optimizer state too, which FSDP1 reads with load_sharded_optimizer_state_dict and a FileSystemReader
    assert_state_equal(result["start"], first["end"])


# --------------------------------------------------------------------------------------------------
# Fabric + ZarrFabricModelParallelStrategy (FSDP2) and ZarrFabricFSDPStrategy (FSDP1)
# --------------------------------------------------------------------------------------------------


def fabric_for(kind: str, world_size: int) -> L.Fabric:
    if kind == "fsdp1":
        strategy = ZarrFabricFSDPStrategy()
    else:
        strategy = ZarrFabricModelParallelStrategy(shard_linears, data_parallel_size=world_size, tensor_parallel_size=1)
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    return fabric


def fabric_model(fabric: L.Fabric, kind: str):
    net = make_net()
    if kind == "fsdp1":  # wrapped here, on CPU, as the Trainer's FSDP1 test does in configure_model
        from torch.distributed.fsdp import FullyShardedDataParallel

        net = FullyShardedDataParallel(net, device_id=torch.device("cpu"))
    model = fabric.setup_module(net)
    return model, fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))


def fabric_train_and_save(rank: int, world_size: int, kind: str, zarr_path: str, lightning_path: str | None):
    """Rank program: train, ``fabric.save`` at step 3 and again at step 4 to the same path; with ``lightning_path``,
    also save the same state through Lightning's own strategy (DCP's FileSystemWriter), and at ``switched.ckpt``
    beside it first through Lightning's strategy, then through the adapter's. Rank 0 returns the state at step 4."""
    from lightning.fabric.wrappers import _unwrap_objects

    fabric = fabric_for(kind, world_size)
    torch.manual_seed(0)
    model, optimizer = fabric_model(fabric, kind)
    x, y = dataset()[rank::world_size]
    for step in range(1, 5):
        fabric.backward(F.mse_loss(model(x[step * 4:(step + 1) * 4]), y[step * 4:(step + 1) * 4]))
        optimizer.step()
        optimizer.zero_grad()
        if step >= 3:
            fabric.save(zarr_path, {"model": model, "optimizer": optimizer, "step": step})
    if lightning_path:
        state = _unwrap_objects({"model": model, "optimizer": optimizer, "step": 4})
        fabric_model_parallel.ModelParallelStrategy.save_checkpoint(fabric.strategy, lightning_path, state)
        switched = os.path.join(os.path.dirname(lightning_path), "switched.ckpt")
        fabric_model_parallel.ModelParallelStrategy.save_checkpoint(fabric.strategy, switched, state)
        fabric.save(switched, state)
    end = full_state(model.module, optimizer.optimizer)
    return {"state_dict": end["state_dict"], "optimizer": end["optimizer_0"]} if rank == 0 else None


def fabric_load(rank: int, world_size: int, kind: str, paths: list[str]):
    """Rank program: ``fabric.load`` each checkpoint into a freshly initialised model and optimizer."""
    fabric = fabric_for(kind, world_size)
    torch.manual_seed(7)
    model, optimizer = fabric_model(fabric, kind)
    loaded = []
    for path in paths:
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(path, state)
        end = full_state(model.module, optimizer.optimizer)
        loaded.append((state["step"], {"state_dict": end["state_dict"], "optimizer": end["optimizer_0"]}))
    return loaded if rank == 0 else None


@pytest.fixture(scope="module")
def fabric_saved(tmp_path_factory) -> tuple[Path, Path, dict]:
    root = tmp_path_factory.mktemp("fabric")
    zarr_path, lightning_path = root / "step.ckpt", root / "lightning.ckpt"
    end = run_ranks(fabric_train_and_save, 2, "fsdp2", str(zarr_path), str(lightning_path))[0]
    return zarr_path, lightning_path, end


def test_fabric_saves_a_dcp_zarr_store_and_loads_it_at_one_rank_bit_exact(fabric_saved):
    zarr_path, _, end = fabric_saved
    assert {"zarr.json", "meta.pt"} <= set(os.listdir(zarr_path))
    assert not (zarr_path / ".metadata").exists()
    saved = stored(zarr_path)
    assert_state_equal({"state_dict": saved["model"], "optimizer": saved["optimizer"]}, end)
    [(step, state)] = run_ranks(fabric_load, 1, "fsdp2", [str(zarr_path)])[0]
    assert step == 4  # from meta.pt of the second save, which replaced the first
    assert_state_equal(state, end)


def test_a_save_replaces_a_checkpoint_lightnings_own_strategy_wrote_at_its_path(fabric_saved):
    zarr_path, _, end = fabric_saved
    switched = zarr_path.parent / "switched.ckpt"  # saved by Lightning's strategy, then by the adapter's
    assert sorted(os.listdir(switched)) == ["meta.pt", "model", "optimizer", "zarr.json"]
    assert not [name for name in os.listdir(switched.parent) if name.startswith(".")]
    saved = stored(switched)
    assert_state_equal({"state_dict": saved["model"], "optimizer": saved["optimizer"]}, end)


def test_checkpoints_lightnings_own_strategy_wrote_still_load(fabric_saved):
    zarr_path, lightning_path, end = fabric_saved
    assert (lightning_path / ".metadata").is_file()  # DCP's FileSystemWriter
    loaded = run_ranks(fabric_load, 3, "fsdp2", [str(lightning_path), str(zarr_path)])[0]
    for step, state in loaded:
        assert step == 4
        assert_state_equal(state, end)


def test_fsdp1_fabric_saves_a_dcp_zarr_store_and_loads_it_at_three_ranks_bit_exact(tmp_path):
    path = tmp_path / "step.ckpt"
    end = run_ranks(fabric_train_and_save, 2, "fsdp1", str(path), None)[0]
    assert {"zarr.json", "meta.pt"} <= set(os.listdir(path))
    saved = stored(path)
    assert_state_equal({"state_dict": saved["model"], "optimizer": saved["optimizer"]}, end)
    [(step, state)] = run_ranks(fabric_load, 3, "fsdp1", [str(path)])[0]
    assert step == 4
    assert_state_equal(state, end)


# --------------------------------------------------------------------------------------------------
# When Lightning is missing or changed (simulated in this process)
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def fresh_import(monkeypatch):
    """Import the adapter anew (as a process would first import it), leaving the loaded one in place afterwards."""
    monkeypatch.setattr(dcp_zarr.integrations, "lightning", sys.modules[ADAPTER], raising=False)
    monkeypatch.delitem(sys.modules, ADAPTER)
    return lambda: importlib.import_module(ADAPTER)


def test_without_lightning_importing_the_adapter_says_what_to_install(monkeypatch, fresh_import):
    for name in [n for n in sys.modules if n == "lightning" or n.startswith("lightning.")]:
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: "import lightning" raises ImportError
    with pytest.raises(FrameworkNotInstalledError, match=f"pip install 'lightning=={WRITTEN_FOR}'"):
        fresh_import()


def test_a_lightning_without_the_helpers_raises_framework_version_error(monkeypatch, fresh_import):
    monkeypatch.delattr(fabric_model_parallel, "_distributed_checkpoint_load")
    monkeypatch.setattr(framework, "installed_version", lambda distribution: "2.7.0")
    with pytest.raises(FrameworkVersionError) as raised:
        fresh_import()
    message = str(raised.value)
    assert "written against lightning 2.6.6" in message and "lightning 2.7.0 does not have" in message
    assert "lightning.fabric.strategies.model_parallel._distributed_checkpoint_load" in message


def test_a_helper_with_another_signature_raises_framework_version_error(monkeypatch, fresh_import):
    monkeypatch.setattr(trainer_model_parallel, "_distributed_checkpoint_save", lambda state, path, writer: None)
    with pytest.raises(FrameworkVersionError, match=r"model_parallel\._distributed_checkpoint_save\(state, path\)"):
        fresh_import()


def test_a_strategy_that_no_longer_calls_the_helper_raises_framework_version_error(monkeypatch, fresh_import):
    def inlined_save(strategy, checkpoint, filepath, storage_options=None):  # a Lightning calling dcp.save itself
        dcp.save({"state_dict": checkpoint.pop("state_dict")}, checkpoint_id=filepath)

    monkeypatch.setattr(trainer_model_parallel.ModelParallelStrategy, "save_checkpoint", inlined_save)
    with pytest.raises(FrameworkVersionError, match=r"model_parallel\.ModelParallelStrategy\.save_checkpoint"):
        fresh_import()


def lightning_style_save(strategy, checkpoint, filepath, storage_options=None):
    """Lightning 2.6.6's save, reduced to what matters here: the helper looked up in its module when called."""
    path = Path(filepath)
    path.mkdir(parents=True, exist_ok=True)
    trainer_model_parallel._distributed_checkpoint_save({"state_dict": checkpoint.pop("state_dict")}, path)
    torch.save(checkpoint, path / "meta.pt")


def test_the_helper_points_at_dcp_zarr_only_while_the_strategy_saves(monkeypatch, tmp_path):
    monkeypatch.setattr(trainer_model_parallel.ModelParallelStrategy, "save_checkpoint", lightning_style_save)
    lightnings_helper = trainer_model_parallel._distributed_checkpoint_save
    weights = {"w": torch.arange(6.0).reshape(2, 3)}
    ZarrModelParallelStrategy().save_checkpoint({"state_dict": weights, "global_step": 1}, tmp_path / "a.ckpt")
    assert trainer_model_parallel._distributed_checkpoint_save is lightnings_helper
    assert_state_equal(stored(tmp_path / "a.ckpt"), {"state_dict": weights})

    def failing_save(strategy, checkpoint, filepath, storage_options=None):
        assert trainer_model_parallel._distributed_checkpoint_save is not lightnings_helper
        raise OSError("disk full")

    monkeypatch.setattr(trainer_model_parallel.ModelParallelStrategy, "save_checkpoint", failing_save)
    with pytest.raises(OSError, match="disk full"):
        ZarrModelParallelStrategy().save_checkpoint({"state_dict": weights}, tmp_path / "b.ckpt")
    assert trainer_model_parallel._distributed_checkpoint_save is lightnings_helper


def test_a_lightning_strategy_saving_on_another_thread_meanwhile_gets_lightnings_helper(monkeypatch, tmp_path):
    def save_and_another_thread_saves(strategy, checkpoint, filepath, storage_options=None):
        other = threading.Thread(target=lightning_style_save, args=(None, {"state_dict": {"w": torch.ones(2)}},
                                                                        tmp_path / "plain.ckpt"))
        other.start()
        other.join()
        lightning_style_save(strategy, checkpoint, filepath)

    monkeypatch.setattr(trainer_model_parallel.ModelParallelStrategy, "save_checkpoint", save_and_another_thread_saves)
    ZarrModelParallelStrategy().save_checkpoint({"state_dict": {"w": torch.zeros(2)}}, tmp_path / "zarr.ckpt")
    assert (tmp_path / "zarr.ckpt" / "zarr.json").is_file()
    assert (tmp_path / "plain.ckpt" / ".metadata").is_file()  # DCP's FileSystemWriter, as Lightning's strategy saves


def test_a_failed_save_over_a_checkpoint_lightnings_own_strategy_wrote_puts_it_back(monkeypatch, tmp_path):
    path = tmp_path / "last.ckpt"
    dcp.save({"state_dict": {"w": torch.ones(2)}}, checkpoint_id=path)  # DCP's FileSystemWriter, as Lightning saves
    before = sorted(os.listdir(path))
    monkeypatch.setattr(trainer_model_parallel.ModelParallelStrategy, "save_checkpoint", lightning_style_save)
    unsupported = {"w": torch.zeros(2, dtype=torch.float8_e4m3fnuz)}
    with pytest.raises(BaseException, match="not supported by dcp_zarr"):  # DCP's CheckpointException is one
        ZarrModelParallelStrategy().save_checkpoint({"state_dict": unsupported}, path)
    assert sorted(os.listdir(path)) == before
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def test_a_save_that_no_longer_goes_through_the_helper_is_refused(monkeypatch, tmp_path):
    def inlined_save(strategy, checkpoint, filepath, storage_options=None):  # a Lightning calling dcp.save itself
        dcp.save({"state_dict": checkpoint.pop("state_dict")}, checkpoint_id=filepath)

    monkeypatch.setattr(trainer_model_parallel.ModelParallelStrategy, "save_checkpoint", inlined_save)
    with pytest.raises(FrameworkVersionError, match="ZarrModelParallelStrategy.save_checkpoint going through"):
        ZarrModelParallelStrategy().save_checkpoint({"state_dict": {"w": torch.ones(2)}}, tmp_path / "a.ckpt")


def test_a_load_that_no_longer_goes_through_the_helper_is_refused(monkeypatch, tmp_path):
    def inlined_load(strategy, checkpoint_path, weights_only=None):  # a Lightning calling dcp.load itself
        dcp.load({"state_dict": {"w": torch.zeros(2)}}, checkpoint_id=checkpoint_path)
        return {}

    monkeypatch.setattr(trainer_model_parallel.ModelParallelStrategy, "save_checkpoint", lightning_style_save)
    monkeypatch.setattr(trainer_model_parallel.ModelParallelStrategy, "load_checkpoint", inlined_load)
    ZarrModelParallelStrategy().save_checkpoint({"state_dict": {"w": torch.ones(2)}}, tmp_path / "a.ckpt")
    with pytest.raises(FrameworkVersionError, match="ZarrModelParallelStrategy.load_checkpoint going through"):
        ZarrModelParallelStrategy().load_checkpoint(tmp_path / "a.ckpt")


# Each strategy, the module of Lightning's that its save_checkpoint calls the helper in, and Lightning's class there
STRATEGIES = {
    "ZarrModelParallelStrategy": (ZarrModelParallelStrategy, trainer_model_parallel, "ModelParallelStrategy"),
    "ZarrFSDPStrategy": (ZarrFSDPStrategy, trainer_fsdp, "FSDPStrategy"),
    "ZarrFabricModelParallelStrategy": (ZarrFabricModelParallelStrategy, fabric_model_parallel,
                                        "ModelParallelStrategy"),
    "ZarrFabricFSDPStrategy": (ZarrFabricFSDPStrategy, fabric_fsdp, "FSDPStrategy"),
}


def strategy_of(cls: type, **kwargs):
    return cls(shard_linears, **kwargs) if cls is ZarrFabricModelParallelStrategy else cls(**kwargs)


def reduced_save(module, name: str):
    """Lightning 2.6.6's save_checkpoint of the strategy ``name``, reduced to the helper looked up in its module."""

    def save(strategy, *args, **kwargs):
        state, path = (args[1], args[0]) if "Fabric" in name else args[:2]
        Path(path).mkdir(parents=True, exist_ok=True)
        module._distributed_checkpoint_save(state, Path(path))

    return save


def strategy_save(strategy, name: str, path: Path, state: dict) -> None:
    if "Fabric" in name:
        strategy.save_checkpoint(path, state)
    else:
        strategy.save_checkpoint(state, path)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_each_strategy_gives_its_compression_to_its_stores(monkeypatch, tmp_path, name):
    cls, module, lightnings = STRATEGIES[name]
    monkeypatch.setattr(getattr(module, lightnings), "save_checkpoint", reduced_save(module, name))
    weights = {"w": torch.arange(6.0).reshape(2, 3), "steps": torch.arange(3)}
    zstd = Compression("zstd", min_bytes=0, min_ratio=0)
    # "zstd": Compression("zstd"), whose 64 KiB w's 24 bytes are under: stored as they are
    for i, (compression, codec) in enumerate([(EVERY_FLOAT_ARRAY, "lz4"), (zstd, "zstd"), ("zstd", None),
                                              (None, None)]):
        path = tmp_path / f"{i}.ckpt"
        strategy_save(strategy_of(cls, compression=compression), name, path, {"model": weights})
        entries = open_checkpoint(path).entries
        assert (entries["model.w"].codec and entries["model.w"].codec["configuration"]["cname"]) == codec
        assert entries["model.steps"].codec is None  # an integer tensor is never compressed
        assert_state_equal(stored(path), {"model": weights})


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_bad_compression_is_refused_as_the_strategy_is_built_naming_it(name):
    cls = STRATEGIES[name][0]
    choices = r"pass one of the compressors \('zstd', 'lz4', 'lz4hc', 'blosclz', 'zlib'\), True \(lz4\)"
    with pytest.raises(ValueError, match=rf"^{name}: compression='zst' names no compressor: {choices}"):
        strategy_of(cls, compression="zst")
    with pytest.raises(TypeError, match=rf"^{name}: compression=3 is not a compression choice: {choices}"):
        strategy_of(cls, compression=3)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_each_strategy_saves_incrementally_from_the_checkpoint_it_saved_before_when_asked(monkeypatch, tmp_path,
                                                                                          name):
    cls, module, lightnings = STRATEGIES[name]
    monkeypatch.setattr(getattr(module, lightnings), "save_checkpoint", reduced_save(module, name))
    weights = {"w": torch.arange(6.0).reshape(2, 3), "steps": torch.arange(3)}
    for incremental in (False, True):
        strategy = strategy_of(cls, incremental=incremental)
        for i in range(2):
            path = tmp_path / f"{incremental}-{i}.ckpt"
            strategy_save(strategy, name, path, {"model": weights})
            assert_state_equal(stored(path), {"model": weights})
        record = chunk_record(path)
        if incremental:  # both arrays unchanged: linked
            origin = record["incremental_from"]
            assert (origin["path"], origin["reused_chunks"]) == (str(tmp_path / "True-0.ckpt"), 2)
        else:
            assert record is None


def test_an_incremental_save_reuses_the_newest_checkpoint_its_strategy_saved_that_is_still_complete(monkeypatch,
                                                                                                   tmp_path):
    name = "ZarrModelParallelStrategy"
    monkeypatch.setattr(trainer_model_parallel.ModelParallelStrategy, "save_checkpoint",
                        reduced_save(trainer_model_parallel, name))
    strategy = ZarrModelParallelStrategy(incremental=True)
    state = {"model": {"w": torch.ones(4)}}

    def base_of(checkpoint: str) -> str | None:
        strategy_save(strategy, name, tmp_path / checkpoint, state)
        record = chunk_record(tmp_path / checkpoint)
        return Path(record["incremental_from"]["path"]).name if "incremental_from" in record else None

    assert base_of("a.ckpt") is None  # the first save: in full
    assert base_of("b.ckpt") == "a.ckpt"
    shutil.rmtree(tmp_path / "b.ckpt")  # as ModelCheckpoint deletes a checkpoint
    (tmp_path / "a.ckpt" / "zarr.json").rename(tmp_path / "a.json")  # a store no longer complete
    assert base_of("c.ckpt") is None
    (tmp_path / "a.json").rename(tmp_path / "a.ckpt" / "zarr.json")
    assert base_of("d.ckpt") == "c.ckpt"
    assert base_of("c.ckpt") == "d.ckpt"  # saved again: from the newest other one
    assert base_of("e.ckpt") == "c.ckpt"
    strategy_save(ZarrModelParallelStrategy(incremental=True), name, tmp_path / "f.ckpt", state)
    assert "incremental_from" not in chunk_record(tmp_path / "f.ckpt")  # another strategy's checkpoints: not its


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_bad_incremental_is_refused_as_the_strategy_is_built_naming_it(name):
    with pytest.raises(TypeError, match=rf"^{name}: incremental='yes' is not a choice: pass True"):
        strategy_of(STRATEGIES[name][0], incremental="yes")


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_each_strategys_signature_is_lightnings_with_compression_and_incremental(name):
    cls, module, lightnings = STRATEGIES[name]
    ours, theirs = inspect.signature(cls).parameters, inspect.signature(getattr(module, lightnings)).parameters
    assert [p for p in ours if p not in ("compression", "incremental")] == list(theirs)
    assert ours["compression"].kind is inspect.Parameter.KEYWORD_ONLY and ours["compression"].default is None
    assert ours["incremental"].kind is inspect.Parameter.KEYWORD_ONLY and ours["incremental"].default is False
    if "FSDP" in name:
        assert ours["state_dict_type"].default == "sharded"


def test_a_store_without_lightnings_meta_pt_gets_lightnings_own_error(monkeypatch, tmp_path):
    # A save killed between the store's commit and rank 0's meta.pt: Lightning's load refuses such a directory
    # before any helper is called, and that error, not FrameworkVersionError, is what the user should see.
    def lightning_style_load(strategy, checkpoint_path, weights_only=None):
        if not (Path(checkpoint_path) / "meta.pt").is_file():
            raise ValueError(f"The path {str(checkpoint_path)!r} does not point to a valid checkpoint.")
        return {}

    monkeypatch.setattr(trainer_model_parallel.ModelParallelStrategy, "save_checkpoint", lightning_style_save)
    monkeypatch.setattr(trainer_model_parallel.ModelParallelStrategy, "load_checkpoint", lightning_style_load)
    ZarrModelParallelStrategy().save_checkpoint({"state_dict": {"w": torch.ones(2)}}, tmp_path / "a.ckpt")
    (tmp_path / "a.ckpt" / "meta.pt").unlink()
    with pytest.raises(ValueError, match="does not point to a valid checkpoint"):
        ZarrModelParallelStrategy().load_checkpoint(tmp_path / "a.ckpt")
