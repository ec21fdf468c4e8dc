"""dcp_zarr.integrations.accelerate: accelerate's own ``save_state`` / ``load_state`` of an FSDP2 model write and read
zarr stores at accelerate's paths, resume at another world size bit-exactly from the latest ``checkpoint_N``, and
still read what accelerate wrote before the switch (real accelerate 1.16.0, real gloo ranks).

accelerate on CPU: 1.16.0 makes a run an FSDP run only on GPU-like devices (``AcceleratorState.__init__`` looks for
``MULTI_GPU``, ``MULTI_XPU``, ..., never ``MULTI_CPU``), although FSDP2 itself shards on CPU over gloo. So each rank
builds its accelerator with ``cpu=True`` and the FSDP plugin, then makes the three assignments accelerate makes on its
GPU path (``_as_accelerate_does_for_fsdp_on_gpu``). From there everything is accelerate's: ``prepare`` shards the model
with ``fully_shard`` and wraps the optimizer; ``save_state`` / ``load_state`` run whole, with the adapter's routing.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

import dcp_zarr
from dcp_zarr.errors import FrameworkNotInstalledError, FrameworkVersionError
from tests.support.compare import assert_state_equal
from tests.support.models import full_state, make_model, train_steps
from tests.support.ranks import run_ranks, start_forkserver

pytestmark = [pytest.mark.frameworks, pytest.mark.distributed, pytest.mark.slow]

ADAPTER = "dcp_zarr.integrations.accelerate"
FSDP_FUNCTIONS = ("save_fsdp_model", "load_fsdp_model", "save_fsdp_optimizer", "load_fsdp_optimizer")
# checkpoint_8 saved by accelerate itself (before the switch), then checkpoint_9 and checkpoint_10 by ZarrAccelerator.
# Sorted as text, the latest would be checkpoint_9.
BEFORE_THE_SWITCH, ZARR_ITERATIONS = 8, (9, 10)


# --------------------------------------------------------------------------------------------------
# Rank programs
# --------------------------------------------------------------------------------------------------


def _as_accelerate_does_for_fsdp_on_gpu(accelerator, plugin) -> None:
    """accelerate 1.16.0's state.py, AcceleratorState.__init__, where a GPU run has an FSDP plugin."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def _zarr_accelerator(project_dir: str, state_dict_type: str = "SHARDED_STATE_DICT"):
    from accelerate.utils import FullyShardedDataParallelPlugin, ProjectConfiguration

    from dcp_zarr.integrations.accelerate import ZarrAccelerator

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=state_dict_type)
    accelerator = ZarrAccelerator(cpu=True, fsdp_plugin=plugin, project_config=ProjectConfiguration(
        project_dir=project_dir, automatic_checkpoint_naming=True))
    return accelerator, plugin


def _prepared(project_dir: str, seed: int):
    """A ZarrAccelerator (FSDP2, sharded state, automatic checkpoint naming under ``project_dir``) and the toy
    model and its AdamW, prepared."""
    accelerator, plugin = _zarr_accelerator(project_dir)
    _as_accelerate_does_for_fsdp_on_gpu(accelerator, plugin)
    model = make_model(seed)
    # Not `spare`, which never trains: on a fresh optimizer accelerate's load_state (torch's get_optimizer_state_dict)
    # fakes a step for every parameter it holds, and would then ask the checkpoint for state `spare` never had.
    optimizer = torch.optim.AdamW([p for name, p in model.named_parameters() if not name.startswith("spare.")],
                                  lr=1e-2, weight_decay=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def _accelerates_own_fsdp_functions_in_place() -> bool:
    import accelerate.accelerator
    import accelerate.utils.fsdp_utils

    return all(getattr(accelerate.accelerator, name) is getattr(accelerate.utils.fsdp_utils, name)
               for name in FSDP_FUNCTIONS)


def train_and_save_each_step(rank, world_size, project_dir):
    """Rank program: train a step and save, three times: first with accelerate's own ``Accelerator.save_state`` (a
    run before the switch), then ``ZarrAccelerator.save_state()`` twice. Returns each save's full state (rank 0) and
    whether ``accelerate.accelerator`` named accelerate's own functions again after each save."""
    from accelerate import Accelerator

    accelerator, model, optimizer = _prepared(project_dir, seed=0)
    accelerator.project_configuration.iteration = BEFORE_THE_SWITCH
    saved, restored = {}, []
    for step, save_state in enumerate([lambda: Accelerator.save_state(accelerator)] + [accelerator.save_state] * 2):
        train_steps(model, optimizer, 1, first_batch=step)
        save_state()
        restored.append(_accelerates_own_fsdp_functions_in_place())
        saved[BEFORE_THE_SWITCH + step] = full_state(model, optimizer.optimizer)
    return saved, restored


def resume(rank, world_size, project_dir, checkpoint=None):
    """Rank program: a model prepared from another seed, then ``load_state(checkpoint)``; its full state (rank 0)."""
    accelerator, model, optimizer = _prepared(project_dir, seed=1)
    accelerator.load_state(checkpoint)
    assert _accelerates_own_fsdp_functions_in_place()
    return full_state(model, optimizer.optimizer)


def _refusal(call) -> str | None:
    try:
        call()
    except ValueError as refused:
        return str(refused)
    return None


def refusals(rank, world_size, project_dir):
    """Rank program: what a ZarrAccelerator's save_state / load_state raise where accelerate would not go through DCP:
    a CPU run as accelerate leaves it (not FSDP), then FSDP2 with FULL_STATE_DICT (one torch.save file)."""
    accelerator, plugin = _zarr_accelerator(project_dir, state_dict_type="FULL_STATE_DICT")
    accelerator.prepare(make_model(0), torch.optim.AdamW(make_model(0).parameters()))
    raised = [_refusal(accelerator.save_state)]
    _as_accelerate_does_for_fsdp_on_gpu(accelerator, plugin)
    return raised + [_refusal(accelerator.save_state), _refusal(accelerator.load_state)]


# --------------------------------------------------------------------------------------------------
# Fixtures and helpers
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_at_two_ranks(tmp_path_factory):
    """The project directory two ranks saved checkpoint_8 (accelerate's), 9 and 10 (zarr) in; each save's state."""
    start_forkserver()
    project_dir = tmp_path_factory.mktemp("accelerate") / "run"
    results = run_ranks(train_and_save_each_step, 2, str(project_dir), timeout=240)
    assert all(all(restored) for _, restored in results), "accelerate.accelerator was left routed after a save"
    return project_dir, results[0][0]


def checkpoint_dir(project_dir: Path, iteration: int) -> Path:
    return project_dir / "checkpoints" / f"checkpoint_{iteration}"


def state_in_stores(directory: Path) -> dict:
    """A checkpoint_N's model and optimizer as full tensors, read from its stores without a process group."""
    model = dcp_zarr.open_checkpoint(str(directory / "pytorch_model_fsdp_0")).load_full_state_dict()
    optimizer = dcp_zarr.open_checkpoint(str(directory / "optimizer_0")).load_full_state_dict()
    return {"model": model["model"], "optim": optimizer["optimizer"]}


def files_under(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.rglob("*") if path.is_file())


# --------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------


def test_save_state_writes_dcp_zarr_stores_at_accelerates_paths(saved_at_two_ranks):
    project_dir, _ = saved_at_two_ranks
    assert sorted(os.listdir(project_dir / "checkpoints")) == ["checkpoint_10", "checkpoint_8", "checkpoint_9"]
    for iteration in (BEFORE_THE_SWITCH, *ZARR_ITERATIONS):
        visible = sorted(name for name in os.listdir(checkpoint_dir(project_dir, iteration)) if name[0] != ".")
        assert visible == ["optimizer_0", "pytorch_model_fsdp_0", "random_states_0.pkl", "random_states_1.pkl"]
    for iteration in ZARR_ITERATIONS:
        for store in ("pytorch_model_fsdp_0", "optimizer_0"):
            path = checkpoint_dir(project_dir, iteration) / store
            assert (path / "zarr.json").is_file()
            assert dcp_zarr.open_checkpoint(str(path)).entries  # a dcp_zarr manifest, not just any zarr group
            written = files_under(path)
            assert not [name for name in written if name.endswith(".distcp") or name == ".metadata"], written
    # what accelerate writes itself, so that the assertions above can tell the two apart
    assert ".metadata" in files_under(checkpoint_dir(project_dir, BEFORE_THE_SWITCH) / "pytorch_model_fsdp_0")


def test_the_stores_hold_exactly_what_was_trained(saved_at_two_ranks):
    project_dir, saved = saved_at_two_ranks
    for iteration in ZARR_ITERATIONS:
        assert_state_equal(state_in_stores(checkpoint_dir(project_dir, iteration)), saved[iteration])


@pytest.mark.parametrize("world_size", [3, 1])
def test_load_state_resumes_the_latest_checkpoint_at_another_world_size(saved_at_two_ranks, world_size):
    project_dir, saved = saved_at_two_ranks
    with pytest.raises(AssertionError):  # the saves differ, so which one was loaded shows
        assert_state_equal(saved[ZARR_ITERATIONS[0]], saved[ZARR_ITERATIONS[1]])
    loaded = run_ranks(resume, world_size, str(project_dir), timeout=240)[0]
    assert_state_equal(loaded, saved[ZARR_ITERATIONS[-1]])


def test_load_state_passes_over_a_checkpoint_whose_save_was_killed(saved_at_two_ranks, tmp_path):
    """What a save killed before its stores' commit leaves: checkpoint_11 with the model's staging area only, and
    checkpoint_12 with the model committed but not the optimizer. accelerate's own choice would be checkpoint_12."""
    project_dir, saved = saved_at_two_ranks
    copy = tmp_path / "run"
    shutil.copytree(project_dir, copy)
    latest = checkpoint_dir(copy, ZARR_ITERATIONS[-1])
    killed_early = checkpoint_dir(copy, 11)
    staging = killed_early / ".dcp-zarr-staging" / "pytorch_model_fsdp_0.partial-0a"
    shutil.copytree(latest / "pytorch_model_fsdp_0", staging)
    os.remove(staging / "zarr.json")
    killed_later = checkpoint_dir(copy, 12)
    shutil.copytree(latest / "pytorch_model_fsdp_0", killed_later / "pytorch_model_fsdp_0")
    loaded = run_ranks(resume, 2, str(copy), timeout=240)[0]
    assert_state_equal(loaded, saved[ZARR_ITERATIONS[-1]])


def test_a_checkpoint_accelerate_wrote_before_the_switch_still_loads(saved_at_two_ranks):
    project_dir, saved = saved_at_two_ranks
    checkpoint = checkpoint_dir(project_dir, BEFORE_THE_SWITCH)
    loaded = run_ranks(resume, 3, str(project_dir), str(checkpoint), timeout=240)[0]
    assert_state_equal(loaded, saved[BEFORE_THE_SWITCH])


def test_anything_but_fsdp2_sharded_state_is_refused_before_anything_is_written(tmp_path):
    project_dir = tmp_path / "run"
    not_fsdp, full_save, full_load = run_ranks(refusals, 1, str(project_dir), timeout=240)[0]
    assert not_fsdp is not None and "distributed_type=MULTI_CPU" in not_fsdp
    for refused in (full_save, full_load):
        assert refused is not None and "fsdp_version=2, state_dict_type=FULL_STATE_DICT" in refused
    for refused in (not_fsdp, full_save, full_load):
        assert "ZarrAccelerator" in refused and "state_dict_type='SHARDED_STATE_DICT'" in refused
    assert not project_dir.exists() or not files_under(project_dir), files_under(project_dir)


# --------------------------------------------------------------------------------------------------
# When accelerate is missing or has changed (simulated in this process, then restored)
# --------------------------------------------------------------------------------------------------


def _import_adapter_afresh(monkeypatch):
    monkeypatch.delitem(sys.modules, ADAPTER, raising=False)
    return importlib.import_module(ADAPTER)


def test_without_accelerate_the_import_says_what_to_install(monkeypatch):
    for name in [n for n in sys.modules if n == "accelerate" or n.startswith("accelerate.")]:
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: importing it raises ImportError
    monkeypatch.setitem(sys.modules, "accelerate", None)
    with pytest.raises(FrameworkNotInstalledError, match=r"pip install 'accelerate==1\.16\.0'"):
        _import_adapter_afresh(monkeypatch)


def _save_state_calling_through_fsdp_utils():
    """A save_state as a later accelerate might write it, in accelerate.accelerator's own namespace, calling the FSDP
    functions as attributes of their module (which a swap of accelerate.accelerator's names would never reach)."""
    import accelerate.accelerator

    source = (
        "def save_state(self, output_dir=None, safe_serialization=True, **save_model_func_kwargs):\n"
        "    from accelerate.utils import fsdp_utils\n"
        "    fsdp_utils.save_fsdp_model(self.state.fsdp_plugin, self, self._models[0], output_dir)\n"
        "    fsdp_utils.save_fsdp_optimizer(self.state.fsdp_plugin, self, self._optimizers[0], self._models[0], "
        "output_dir)\n")
    defined: dict = {}
    exec(compile(source, "<a later accelerate>", "exec"), vars(accelerate.accelerator), defined)
    return defined["save_state"]


def _reordered_save_fsdp_model(fsdp_plugin, accelerator, model, output_dir, model_index=0, use_dcp=True,
                               adapter_only=False):
    return None


CHANGES = {  # what a later accelerate might do: (module, attribute, its replacement made when needed, or None to
    # delete it; what the error names)
    "a helper gone": ("accelerate.utils.fsdp_utils", "_prepare_sd_options", None,
                      "accelerate.utils.fsdp_utils._prepare_sd_options"),
    "parameters reordered": ("accelerate.accelerator", "save_fsdp_model", lambda: _reordered_save_fsdp_model,
                             "accelerate.accelerator.save_fsdp_model"),
    "save_state calling the functions elsewhere": (
        "accelerate.accelerator", "Accelerator.save_state", _save_state_calling_through_fsdp_utils,
        "Accelerator.save_state calling save_fsdp_model by its name in accelerate.accelerator"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_changed_internals_fail_the_import_naming_both_versions(monkeypatch, change):
    module_name, attribute, make_replacement, named = CHANGES[change]
    owner = importlib.import_module(module_name)
    *parents, leaf = attribute.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    if make_replacement is None:
        monkeypatch.delattr(owner, leaf)
    else:
        monkeypatch.setattr(owner, leaf, make_replacement())
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",  # as a later release's metadata would say
                        lambda name: "1.17.0" if name == "accelerate" else real_version(name))
    with pytest.raises(FrameworkVersionError) as raised:
        _import_adapter_afresh(monkeypatch)
    message = str(raised.value)
    assert named in message
    assert "written against accelerate 1.16.0" in message and "accelerate 1.17.0 does not have" in message
