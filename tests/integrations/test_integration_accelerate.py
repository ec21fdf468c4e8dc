"""dcp_zarr.integrations.accelerate: accelerate's own ``save_state`` / ``load_state`` of an FSDP2 model write and read
zarr stores at accelerate's paths, resume at another world size bit-exactly from the latest ``checkpoint_N``, and
still read what accelerate wrote before the switch, and compress floats when given ``compression`` (real accelerate
1.16.0, real gloo ranks).

accelerate on CPU: 1.16.0 makes a run an FSDP run only on GPU-like devices (``AcceleratorState.__init__`` looks for
``MULTI_GPU``, ``MULTI_XPU``, ..., never ``MULTI_CPU``), although FSDP2 itself shards on CPU over gloo. So each rank
builds its accelerator with ``cpu=True`` and the FSDP plugin, then makes the three assignments accelerate makes on its
GPU path (``_as_accelerate_does_for_fsdp_on_gpu``). From there everything is accelerate's: ``prepare`` shards the model
with ``fully_shard`` and wraps the optimizer; ``save_state`` / ``load_state`` run whole, with the adapter's routing.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
import shutil
import sys
import warnings
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
# Every float array compressed: the toy model's tensors are far under Compression's 64 KiB default (min_ratio=0: no
# sample asked, so none is stored as it is for shrinking too little).
EVERY_FLOAT_ARRAY = dcp_zarr.Compression(min_bytes=0, min_ratio=0)


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


def _zarr_accelerator(project_dir: str, state_dict_type: str = "SHARDED_STATE_DICT", total_limit: int | None = None,
                      compression=None):
    from accelerate.utils import FullyShardedDataParallelPlugin, ProjectConfiguration

    from dcp_zarr.integrations.accelerate import ZarrAccelerator

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=state_dict_type)
    accelerator = ZarrAccelerator(cpu=True, fsdp_plugin=plugin, project_config=ProjectConfiguration(
        project_dir=project_dir, automatic_checkpoint_naming=True, total_limit=total_limit), compression=compression)
    return accelerator, plugin


def _prepared(project_dir: str, seed: int, total_limit: int | None = None, compression=None):
    """A ZarrAccelerator (FSDP2, sharded state, automatic checkpoint naming under ``project_dir``, ``compression``)
    and the toy model and its AdamW, prepared."""
    accelerator, plugin = _zarr_accelerator(project_dir, total_limit=total_limit, compression=compression)
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


def train_and_save_compressed(rank, world_size, project_dir):
    """Rank program: a ZarrAccelerator compressing every float array, a step trained, ``save_state()``; the saved
    state (rank 0)."""
    accelerator, model, optimizer = _prepared(project_dir, seed=3, compression=EVERY_FLOAT_ARRAY)
    train_steps(model, optimizer, 1)
    accelerator.save_state()
    return full_state(model, optimizer.optimizer)


def _warned(call) -> list[str]:
    """The warnings ``call()`` gave from dcp_zarr's adapter."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught if str(w.message).startswith("ZarrAccelerator")]


def resume(rank, world_size, project_dir, checkpoint=None):
    """Rank program: a model prepared from another seed, then ``load_state(checkpoint)``; its full state (rank 0)
    and the adapter's warnings (every rank)."""
    accelerator, model, optimizer = _prepared(project_dir, seed=1)
    said = _warned(lambda: accelerator.load_state(checkpoint))
    assert _accelerates_own_fsdp_functions_in_place()
    return full_state(model, optimizer.optimizer), said


def _refusal(call, kind: type[Exception] = ValueError) -> str | None:
    try:
        call()
    except kind as refused:
        return f"{type(refused).__name__}: {refused}"
    return None


def refusals(rank, world_size, project_dir):
    """Rank program: what a ZarrAccelerator's save_state / load_state raise for FSDP2 with FULL_STATE_DICT (one
    torch.save file, not DCP)."""
    accelerator, plugin = _zarr_accelerator(project_dir, state_dict_type="FULL_STATE_DICT")
    _as_accelerate_does_for_fsdp_on_gpu(accelerator, plugin)
    model = make_model(0)
    accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    return [_refusal(accelerator.save_state), _refusal(accelerator.load_state)]


def refusals_on_cpu(rank, world_size, project_dir):
    """Rank program: the issue's script on CPU: FSDP2 with sharded state, as accelerate leaves a CPU run (it drops
    the plugin), then save_state and load_state."""
    accelerator, _ = _zarr_accelerator(project_dir)
    model = make_model(0)
    accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    return [_refusal(accelerator.save_state), _refusal(accelerator.load_state)]


def resume_refusals(rank, world_size, project_dirs):
    """Rank program: ``load_state()`` in each of ``project_dirs``; what each raised."""
    from dcp_zarr.errors import NotACheckpointError

    accelerator, _, _ = _prepared(project_dirs[0], seed=1)
    raised = []
    for project_dir in project_dirs:
        accelerator.project_configuration.project_dir = project_dir
        raised.append(_refusal(accelerator.load_state, NotACheckpointError))
    return raised


def save_past_a_partial_checkpoint(rank, world_size, project_dir, partial):
    """Rank program: with total_limit=2, ``save_state()`` numbered past the interrupted ``partial`` (what
    docs/accelerate.md used to advise), then what it advises now: remove it, save under its number."""
    accelerator, _, _ = _prepared(project_dir, seed=2, total_limit=2)
    accelerator.project_configuration.iteration = int(partial.rsplit("_", 1)[1]) + 1
    refused = _refusal(accelerator.save_state)
    after_refusal = sorted(os.listdir(Path(project_dir) / "checkpoints"))
    if accelerator.is_main_process:
        shutil.rmtree(partial)
    accelerator.wait_for_everyone()
    accelerator.project_configuration.iteration -= 1
    accelerator.save_state()
    return refused, after_refusal


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


@pytest.fixture(scope="module")
def resumed(saved_at_two_ranks):
    """``load_state()`` of that project at 3 ranks and at 1: each rank's (full state, warnings), by world size."""
    project_dir, _ = saved_at_two_ranks
    return {world_size: run_ranks(resume, world_size, str(project_dir), timeout=240) for world_size in (3, 1)}


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


def with_interrupted_saves(project_dir: Path, copy: Path) -> Path:
    """A copy of ``project_dir`` with what two killed saves leave above checkpoint_10: checkpoint_11 with the model's
    staging area only (killed before its commit), checkpoint_12 with the model committed and nothing else (killed
    while the optimizer was saved). accelerate's own choice would be checkpoint_12."""
    shutil.copytree(project_dir, copy)
    latest = checkpoint_dir(copy, ZARR_ITERATIONS[-1])
    staging = checkpoint_dir(copy, 11) / ".dcp-zarr-staging" / "pytorch_model_fsdp_0.partial-0a"
    shutil.copytree(latest / "pytorch_model_fsdp_0", staging)
    os.remove(staging / "zarr.json")
    shutil.copytree(latest / "pytorch_model_fsdp_0", checkpoint_dir(copy, 12) / "pytorch_model_fsdp_0")
    return copy


@pytest.mark.parametrize("world_size", [3, 1])
def test_load_state_resumes_the_latest_checkpoint_at_another_world_size(saved_at_two_ranks, resumed, world_size):
    _, saved = saved_at_two_ranks
    with pytest.raises(AssertionError):  # the saves differ, so which one was loaded shows
        assert_state_equal(saved[ZARR_ITERATIONS[0]], saved[ZARR_ITERATIONS[1]])
    loaded, _ = resumed[world_size][0]
    assert_state_equal(loaded, saved[ZARR_ITERATIONS[-1]])


def test_a_rank_without_saved_random_states_is_warned(resumed):
    """accelerate logs "Could not load random states" at INFO, on the main process only: unseen by default."""
    said = {world_size: [warned for _, warned in results] for world_size, results in resumed.items()}
    assert said[1] == [[]] and said[3][:2] == [[], []]
    [warning] = said[3][2]
    assert f"{os.sep}random_states_2.pkl does not exist" in warning
    assert "holds random_states_0.pkl, random_states_1.pkl: it was saved by 2 process(es)" in warning
    assert "rank 2 keeps its own random states and its accelerator.step (0)" in warning
    assert "set_seed" in warning and "Could not load random states" in warning


def test_load_state_passes_over_a_checkpoint_whose_save_was_killed_and_says_so(saved_at_two_ranks, tmp_path):
    project_dir, saved = saved_at_two_ranks
    copy = with_interrupted_saves(project_dir, tmp_path / "run")
    (loaded, said), (_, said_on_rank_1) = run_ranks(resume, 2, str(copy), timeout=240)
    assert_state_equal(loaded, saved[ZARR_ITERATIONS[-1]])
    [warning] = said
    assert f"resuming from {checkpoint_dir(copy, 10)}, not from the newer checkpoint_12 (optimizer_0 is missing; " \
           "random_states_0.pkl, which accelerate writes after every store of a save, is missing), checkpoint_11 " \
           "(pytorch_model_fsdp_0 was never committed; optimizer_0 is missing; random_states_0.pkl" in warning
    assert "whose saves were interrupted. Remove them before the next save_state()" in warning
    assert "iteration = 11" in warning
    assert said_on_rank_1 == []  # once, from the main process, as accelerate logs


def test_with_no_complete_checkpoint_load_state_raises_one_error_naming_what_it_found(saved_at_two_ranks, tmp_path):
    project_dir, _ = saved_at_two_ranks
    interrupted = with_interrupted_saves(project_dir, tmp_path / "run")
    for iteration in (BEFORE_THE_SWITCH, *ZARR_ITERATIONS):
        shutil.rmtree(checkpoint_dir(interrupted, iteration))
    never_saved = tmp_path / "fresh"
    only_partial, nothing = run_ranks(resume_refusals, 1, [str(interrupted), str(never_saved)], timeout=240)[0]
    folder = interrupted / "checkpoints"
    assert only_partial is not None and only_partial.startswith(
        f"IncompleteCheckpointError: ZarrAccelerator.load_state: no complete checkpoint to resume from in {folder}: "
        "every save there was interrupted: checkpoint_12 (optimizer_0 is missing; ")
    assert "checkpoint_11 (pytorch_model_fsdp_0 was never committed; " in only_partial
    assert f"rm -r {folder / 'checkpoint_11'} {folder / 'checkpoint_12'}) and start afresh" in only_partial
    assert "zarr.json" not in only_partial
    assert nothing == (f"NotACheckpointError: ZarrAccelerator.load_state: no checkpoint to resume from: "
                       f"{never_saved / 'checkpoints'} does not exist (accelerate's automatic_checkpoint_naming saves "
                       "there). Call save_state() first, or pass load_state(input_dir)")


def test_with_total_limit_save_state_refuses_to_prune_complete_checkpoints_past_an_interrupted_one(
        saved_at_two_ranks, tmp_path):
    """accelerate's total_limit deletes the lowest checkpoint_N first, whatever they hold: saving checkpoint_12 past
    the interrupted checkpoint_11 with total_limit=2 would delete checkpoint_8, 9 and 10 and keep checkpoint_11."""
    project_dir, _ = saved_at_two_ranks
    copy = tmp_path / "run"
    shutil.copytree(project_dir, copy)
    partial = checkpoint_dir(copy, 11)
    (partial / ".dcp-zarr-staging" / "pytorch_model_fsdp_0.partial-0a").mkdir(parents=True)
    refused, after_refusal = run_ranks(save_past_a_partial_checkpoint, 1, str(copy), str(partial), timeout=240)[0]
    assert refused is not None and refused.startswith(
        f"ValueError: ZarrAccelerator.save_state: {copy / 'checkpoints'} holds checkpoint_11 (pytorch_model_fsdp_0 "
        "was never committed; ")
    assert "with total_limit=2 accelerate would count it and delete complete checkpoints" in refused
    assert f"Nothing was saved. Remove it (rm -r {partial})" in refused
    assert after_refusal == ["checkpoint_10", "checkpoint_11", "checkpoint_8", "checkpoint_9"]
    # the advice: remove it and save under its number; accelerate then keeps the two newest, both complete
    assert sorted(os.listdir(copy / "checkpoints")) == ["checkpoint_10", "checkpoint_11"]
    assert dcp_zarr.open_checkpoint(str(partial / "optimizer_0")).entries


def test_a_checkpoint_accelerate_wrote_before_the_switch_still_loads(saved_at_two_ranks):
    project_dir, saved = saved_at_two_ranks
    checkpoint = checkpoint_dir(project_dir, BEFORE_THE_SWITCH)
    loaded, _ = run_ranks(resume, 3, str(project_dir), str(checkpoint), timeout=240)[0]
    assert_state_equal(loaded, saved[BEFORE_THE_SWITCH])


def test_on_cpu_the_refusal_says_accelerate_turned_fsdp_off_and_how_to_turn_it_on(tmp_path):
    """The issue's script on CPU: accelerate 1.16.0 drops the FSDP plugin there (no GPU-like device)."""
    project_dir = tmp_path / "run"
    on_save, on_load = run_ranks(refusals_on_cpu, 1, str(project_dir), timeout=240)[0]
    for refused in (on_save, on_load):
        assert refused is not None and "FSDP was asked for (an fsdp_plugin, or ACCELERATE_USE_FSDP=true)" in refused
        assert "accelerator.state has distributed_type=MULTI_CPU and fsdp_plugin=None" in refused
        assert "only when its processes are on GPU-like devices" in refused and "never on CPU" in refused
        assert ("accelerator.state.distributed_type = DistributedType.FSDP; accelerator.state.fsdp_plugin = "
                "<your FullyShardedDataParallelPlugin>; PartialState._shared_state['distributed_type'] = "
                "DistributedType.FSDP") in refused
        assert "launch with FSDP" not in refused
    assert "ZarrAccelerator.save_state" in on_save and "ZarrAccelerator.load_state" in on_load
    assert not project_dir.exists() or not files_under(project_dir), files_under(project_dir)


def test_anything_but_fsdp2_sharded_state_is_refused_before_anything_is_written(tmp_path):
    project_dir = tmp_path / "run"
    full_save, full_load = run_ranks(refusals, 1, str(project_dir), timeout=240)[0]
    for refused in (full_save, full_load):
        assert refused is not None and "fsdp_version=2, state_dict_type=FULL_STATE_DICT" in refused
        assert "ZarrAccelerator" in refused and "state_dict_type='SHARDED_STATE_DICT'" in refused
    assert not project_dir.exists() or not files_under(project_dir), files_under(project_dir)


def test_with_compression_save_state_compresses_the_float_arrays_and_load_state_resumes_exactly(tmp_path):
    project_dir = tmp_path / "run"
    saved = run_ranks(train_and_save_compressed, 2, str(project_dir), timeout=240)[0]
    checkpoint = checkpoint_dir(project_dir, 0)
    for store in ("pytorch_model_fsdp_0", "optimizer_0"):
        arrays = [entry for entry in dcp_zarr.open_checkpoint(str(checkpoint / store)).entries.values()
                  if entry.dtype_name == "torch.float32" and entry.shape]  # all but 0-d ones (AdamW's steps)
        assert arrays and all(entry.codec and entry.codec["configuration"]["cname"] == "lz4" for entry in arrays)
    assert_state_equal(state_in_stores(checkpoint), saved)
    loaded, _ = run_ranks(resume, 1, str(project_dir), timeout=240)[0]
    assert_state_equal(loaded, saved)


@pytest.mark.parametrize(("value", "error", "said"), [("zst", ValueError, "names no compressor"),
                                                      (3, TypeError, "is not a compression choice")])
def test_a_bad_compression_is_refused_as_the_accelerator_is_built_before_accelerate_sets_up(value, error, said):
    from accelerate.state import AcceleratorState, PartialState

    from dcp_zarr.integrations.accelerate import ZarrAccelerator

    before = (dict(PartialState._shared_state), dict(AcceleratorState._shared_state))
    with pytest.raises(error, match=rf"^ZarrAccelerator: compression={value!r} {said}: pass one of the "
                                    r"compressors \('zstd', 'lz4', 'lz4hc', 'blosclz', 'zlib'\), True \(lz4\)"):
        ZarrAccelerator(cpu=True, compression=value)
    assert (dict(PartialState._shared_state), dict(AcceleratorState._shared_state)) == before


def test_the_signature_is_accelerates_with_compression():
    from accelerate import Accelerator

    from dcp_zarr.integrations.accelerate import ZarrAccelerator

    ours = inspect.signature(ZarrAccelerator).parameters
    assert [p for p in ours if p != "compression"] == list(inspect.signature(Accelerator).parameters)
    assert ours["compression"].kind is inspect.Parameter.KEYWORD_ONLY and ours["compression"].default is None


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
