"""Names that drift: torch.compile's ``_orig_mod.`` and activation checkpointing's ``_checkpoint_wrapped_module.``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.api import CheckpointException

from dcp_zarr import ZarrReader, ZarrSavePlanner, ZarrWriter
from dcp_zarr.optim.load_planner import ZarrLoadPlanner
from dcp_zarr.optim.prefixes import (
    PrefixTolerantLoadPlanner,
    WrapperPrefixError,
    WrapperPrefixLoadMixin,
    canonical_name,
    strip_wrapper_prefixes,
    wrapper_renames,
)

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
              pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")]


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))


def save(state, path):
    dcp.save(state, planner=ZarrSavePlanner(), storage_writer=ZarrWriter(path))


def same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_canonical_names_drop_wrapper_components_anywhere():
    assert canonical_name("_orig_mod.layers.0._checkpoint_wrapped_module.attn.w") == "layers.0.attn.w"
    assert canonical_name("layers.0._fsdp_wrapped_module.w") == "layers.0.w"
    assert canonical_name("module.orig_mod.w") == "module.orig_mod.w"  # DDP's "module." and look-alikes stay


def test_loading_a_plain_checkpoint_into_a_compiled_model_fails_by_default_and_loads_with_the_planner(tmp_path):
    source = make_model(0)
    save({"model": source.state_dict(), "extra": {"epoch": 5}}, tmp_path / "ckpt.zarr")
    compiled = torch.compile(make_model(1))  # wrapping only; nothing is compiled until it runs
    state = {"model": compiled.state_dict(), "extra": {"epoch": 0}}
    assert next(iter(state["model"])).startswith("_orig_mod.")

    with pytest.raises(CheckpointException, match=r"Missing key in checkpoint state_dict: model\._orig_mod\."):
        dcp.load(state, storage_reader=ZarrReader(tmp_path / "ckpt.zarr"))
    planner = PrefixTolerantLoadPlanner()
    dcp.load(state, storage_reader=ZarrReader(tmp_path / "ckpt.zarr"), planner=planner)

    assert same(compiled._orig_mod.state_dict(), source.state_dict())  # loaded in place, into the model itself
    assert state["extra"] == {"epoch": 5}  # non-tensor values reach the caller's dict too
    assert planner.wrapper_renames["model._orig_mod.0.weight"] == "model.0.weight"


def test_a_checkpoint_saved_from_a_compiled_model_loads_into_a_plain_one(tmp_path):
    source = torch.compile(make_model(0))
    save({"model": source.state_dict()}, tmp_path / "ckpt.zarr")
    target = make_model(1)

    dcp.load({"model": target.state_dict()}, storage_reader=ZarrReader(tmp_path / "ckpt.zarr"),
             planner=PrefixTolerantLoadPlanner())

    assert same(target.state_dict(), source._orig_mod.state_dict())


def test_compiled_and_activation_checkpointed_submodules_inside_the_name_are_matched(tmp_path):
    source = make_model(0)
    params = dict(source.named_parameters())
    # Optimizer state keyed by parameter names, as a training loop that uses named_parameters() builds it.
    save({"model": source.state_dict(), "optim": {"state": {k: {"exp_avg": v * 2} for k, v in params.items()}}},
         tmp_path / "ckpt.zarr")
    target = make_model(1)
    target[1][0] = checkpoint_wrapper(target[1][0])
    target[1][1] = torch.compile(target[1][1])
    names = [n for n, _ in target.named_parameters()]
    assert "1.0._checkpoint_wrapped_module.weight" in names and "1.1._orig_mod.weight" in names
    optim_state = {n: {"exp_avg": torch.zeros_like(p)} for n, p in target.named_parameters()}

    dcp.load({"optim": {"state": optim_state}}, storage_reader=ZarrReader(tmp_path / "ckpt.zarr"),
             planner=PrefixTolerantLoadPlanner())

    assert torch.equal(optim_state["1.0._checkpoint_wrapped_module.weight"]["exp_avg"], params["1.0.weight"] * 2)
    assert torch.equal(optim_state["1.1._orig_mod.bias"]["exp_avg"], params["1.1.bias"] * 2)


def test_rename_wrapped_false_raises_an_error_that_names_the_wrapper(tmp_path):
    save({"model": make_model(0).state_dict()}, tmp_path / "ckpt.zarr")
    state = {"model": torch.compile(make_model(1)).state_dict()}

    with pytest.raises(CheckpointException, match=r"carry '_orig_mod\.' \(added by torch\.compile\)"):
        dcp.load(state, storage_reader=ZarrReader(tmp_path / "ckpt.zarr"),
                 planner=PrefixTolerantLoadPlanner(rename_wrapped=False))


def test_the_mixin_composes_with_zarr_load_planner(tmp_path):
    class PrefixTolerantZarrPlanner(WrapperPrefixLoadMixin, ZarrLoadPlanner):
        pass

    source = make_model(0)
    save({"model": source.state_dict()}, tmp_path / "ckpt.zarr")
    compiled = torch.compile(make_model(1))

    dcp.load({"model": compiled.state_dict()}, storage_reader=ZarrReader(tmp_path / "ckpt.zarr"),
             planner=PrefixTolerantZarrPlanner())

    assert same(compiled._orig_mod.state_dict(), source.state_dict())


def test_strip_wrapper_prefixes_renames_keys_and_shares_the_tensors():
    compiled = torch.compile(make_model(0))
    state = {"model": compiled.state_dict(), "step": 3}

    stripped = strip_wrapper_prefixes(state)

    assert list(stripped["model"]) == list(make_model(0).state_dict())
    assert stripped["model"]["0.weight"] is state["model"]["_orig_mod.0.weight"]
    assert stripped["step"] == 3
    with pytest.raises(WrapperPrefixError, match="both become"):
        strip_wrapper_prefixes({"_orig_mod.w": 1, "w": 2})


def test_ambiguous_matches_are_refused_rather_than_guessed():
    with pytest.raises(WrapperPrefixError, match="matches several entries"):
        wrapper_renames(["m.w"], ["m._orig_mod.w", "m._checkpoint_wrapped_module.w"])
    assert wrapper_renames(["m.w", "m.other"], ["m._orig_mod.w"]) == {"m.w": "m._orig_mod.w"}
