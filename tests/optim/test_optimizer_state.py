"""Optimizer state across key forms, state_dict types and world sizes, with real FSDP2 runs (gloo, CPU).

Two launches serve every test: 2 ranks train FSDP2 ToyModels and save them in each form (FQN via get_state_dict,
int ids via ``optimizer.state_dict()``, flattened, full, and the accelerate #3971 setup); then 3 ranks load
them in other forms (so every load also changes the world size) and report what they got. ToyModel's ``embed``
is frozen and ``spare`` never gets a gradient, so 2 of its 19 params have no Adam state.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
import zarr
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from dcp_zarr import ZarrLoadPlanner, ZarrReader, ZarrSavePlanner, ZarrWriter, assert_step_present
from tests.support.compare import assert_state_equal
from tests.support.models import (
    full_state,
    load_checkpoint,
    make_model,
    make_optimizer,
    prime_optimizer,
    shard_fsdp2,
    train_steps,
)
from tests.support.ranks import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SAVE_WORLD, LOAD_WORLD = 2, 3
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
# strict=False: torch 2.13's set_state_dict refuses optimizer state lacking a requires_grad param (``spare``).
LENIENT = StateDictOptions(strict=False)


# -- rank programs ---------------------------------------------------------------------------------------------------


def _fsdp2(world_size, seed, prime=True, optimizer=None, train_embed=False):
    model = make_model(seed)
    if train_embed:  # the accelerate setup: the first param trains, so the first missing key is state.0.step
        model.embed.weight.requires_grad_(True)
    model = shard_fsdp2(model, world_size)
    optim = (optimizer or make_optimizer)(model)
    if prime:
        prime_optimizer(model, optim)  # state for exactly the params that train
    return model, optim


def _save_all(rank, world_size, root):
    model, optim = _fsdp2(world_size, seed=0, prime=False)
    train_steps(model, optim, 2)
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, planner=ZarrSavePlanner(), storage_writer=ZarrWriter(f"{root}/fqn"))
    dcp.save({"optim": optim.state_dict()}, planner=ZarrSavePlanner(), storage_writer=ZarrWriter(f"{root}/int"))
    dcp.save({"optim": get_optimizer_state_dict(model, optim, options=FLAT)}, planner=ZarrSavePlanner(),
             storage_writer=ZarrWriter(f"{root}/flat"))
    full_msd, full_osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    dcp.save({"model": full_msd, "optim": full_osd}, planner=ZarrSavePlanner(),
             storage_writer=ZarrWriter(f"{root}/full"))
    reference = full_state(model, optim)

    acc_model, acc_optim = _fsdp2(world_size, seed=0, prime=False, train_embed=True)
    train_steps(acc_model, acc_optim, 2)
    dcp.save({"optimizer": get_optimizer_state_dict(acc_model, acc_optim)},
             storage_writer=ZarrWriter(f"{root}/accelerate"), planner=ZarrSavePlanner())
    return {"reference": reference, "accelerate": full_state(acc_model, acc_optim)}


def _optim_state(model, optim):
    full = full_state(model, optim)
    return None if full is None else full["optim"]


def _error(load) -> str:
    try:
        load()
    except BaseException as exc:  # CheckpointException is a BaseException
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _int_from_fqn(world_size, root):
    model, optim = _fsdp2(world_size, seed=1)
    request = {"optim": optim.state_dict()}
    planner = ZarrLoadPlanner()
    dcp.load(request, storage_reader=ZarrReader(f"{root}/fqn"), planner=planner)
    optim.load_state_dict(request["optim"])
    steps = assert_step_present(optim, f"{root}/fqn", model=model)
    return {"optim": _optim_state(model, optim), "translated": len(planner.translated), "steps": steps}


def _fqn_from_int(world_size, root):
    model, optim = _fsdp2(world_size, seed=1)
    request = {"optim": get_optimizer_state_dict(model, optim)}
    dcp.load(request, storage_reader=ZarrReader(f"{root}/int"), planner=ZarrLoadPlanner())
    set_optimizer_state_dict(model, optim, request["optim"], options=LENIENT)
    return _optim_state(model, optim)


def _int_from_flattened(world_size, root):
    model, optim = _fsdp2(world_size, seed=1)
    request = {"optim": optim.state_dict()}
    dcp.load(request, storage_reader=ZarrReader(f"{root}/flat"), planner=ZarrLoadPlanner())
    optim.load_state_dict(request["optim"])
    return _optim_state(model, optim)


def _flattened_from_fqn(world_size, root):
    model, optim = _fsdp2(world_size, seed=1)
    request = {"optim": get_optimizer_state_dict(model, optim, options=FLAT)}
    dcp.load(request, storage_reader=ZarrReader(f"{root}/fqn"), planner=ZarrLoadPlanner())
    set_optimizer_state_dict(model, optim, request["optim"], options=StateDictOptions(
        flatten_optimizer_state_dict=True, strict=False))
    return _optim_state(model, optim)


def _full_from_sharded(world_size, root):
    model, optim = _fsdp2(world_size, seed=1)
    full = StateDictOptions(full_state_dict=True)
    msd, osd = get_state_dict(model, optim, options=full)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=ZarrReader(f"{root}/fqn"), planner=ZarrLoadPlanner())
    loaded = {"model": dict(state["model"]), "optim": {"state": dict(state["optim"]["state"]),
                                                       "param_groups": list(state["optim"]["param_groups"])}}
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(full_state_dict=True, strict=False))
    return {"loaded": loaded if torch.distributed.get_rank() == 0 else None,
            "after_set": full_state(model, optim)}


def _sharded_from_full_with_stock_planner(world_size, root):
    model, optim = _fsdp2(world_size, seed=1)
    load_checkpoint(model, optim, ZarrReader(f"{root}/full"))  # plain dcp.load: matching form
    return full_state(model, optim)


def _params_without_state(world_size, root):
    def request():
        # A stateless optimizer: get_state_dict fakes a step on every requires_grad param, ``spare`` included,
        # which never had state (NeMo-Automodel #2071).
        model, optim = _fsdp2(world_size, seed=1, prime=False)
        msd, osd = get_state_dict(model, optim)
        return model, optim, {"model": msd, "optim": osd}

    _, _, state = request()
    stock = _error(lambda: dcp.load(state, storage_reader=ZarrReader(f"{root}/fqn")))
    model, optim, state = request()
    planner = ZarrLoadPlanner()
    dcp.load(state, storage_reader=ZarrReader(f"{root}/fqn"), planner=planner)
    requested_spare = [fqn for fqn in state["optim"]["state"] if fqn.startswith("spare.")]
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"], options=LENIENT)
    return {"stock": stock, "skipped": planner.skipped, "requested_spare": requested_spare,
            "full": full_state(model, optim)}


def _accelerate_3971(world_size, root):
    model, optim = _fsdp2(world_size, seed=1, train_embed=True)
    request = {"optimizer": optim.state_dict()}
    stock = _error(lambda: dcp.load(request, storage_reader=ZarrReader(f"{root}/accelerate")))
    dcp.load(request, storage_reader=ZarrReader(f"{root}/accelerate"), planner=ZarrLoadPlanner())
    optim.load_state_dict(request["optimizer"])
    return {"stock": stock, "optim": _optim_state(model, optim)}


def _mismatched_tables(world_size, root):
    def without_spare(model):
        return torch.optim.AdamW([p for n, p in model.named_parameters() if not n.startswith("spare")], lr=1e-2)

    def reversed_order(model):
        return torch.optim.AdamW(list(model.parameters())[::-1], lr=1e-2)

    errors = {}
    for name, build in (("count", without_spare), ("shape", reversed_order)):
        _, optim = _fsdp2(world_size, seed=1, optimizer=build)
        request = {"optim": optim.state_dict()}
        errors[name] = _error(lambda request=request: dcp.load(request, storage_reader=ZarrReader(f"{root}/fqn"),
                                                               planner=ZarrLoadPlanner()))  # called at once, here
    return errors


def _amsgrad(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, amsgrad=True)


def _missing_keys(world_size, root):
    model, optim = _fsdp2(world_size, seed=1, optimizer=_amsgrad)
    request = {"optim": get_optimizer_state_dict(model, optim)}
    return _error(lambda: dcp.load(request, storage_reader=ZarrReader(f"{root}/fqn"), planner=ZarrLoadPlanner()))


def _partial_load(world_size, root):
    model, optim = _fsdp2(world_size, seed=1, optimizer=_amsgrad)
    request = {"optim": get_optimizer_state_dict(model, optim)}
    planner = ZarrLoadPlanner(allow_partial_load=True)
    dcp.load(request, storage_reader=ZarrReader(f"{root}/fqn"), planner=planner)
    set_optimizer_state_dict(model, optim, request["optim"], options=LENIENT)
    return {"skipped": planner.skipped, "optim": _optim_state(model, optim)}


def _step_checks(rank, world_size, root):
    model, optim = _fsdp2(world_size, seed=1)
    request = {"optim": optim.state_dict()}
    dcp.load(request, storage_reader=ZarrReader(f"{root}/fqn"), planner=ZarrLoadPlanner())
    optim.load_state_dict(request["optim"])
    params = [p for group in optim.param_groups for p in group["params"]]  # id 3 is blocks.0.down.weight
    step = optim.state[params[3]]["step"]
    original = step.clone()
    errors = {}
    if rank == 1:
        del optim.state[params[3]]["step"]
    errors["missing_on_one_rank"] = _error(lambda: assert_step_present(optim, model=model))
    optim.state[params[3]]["step"] = original.clone()
    if rank == 2:
        optim.state[params[3]]["step"].add_(1)
    errors["differs_across_ranks"] = _error(lambda: assert_step_present(optim, model=model))
    optim.state[params[3]]["step"] = original + 5
    errors["differs_from_checkpoint"] = _error(lambda: assert_step_present(optim, f"{root}/fqn"))
    optim.state[params[3]]["step"] = original.clone()
    errors["state_lost"] = _error(lambda: assert_step_present(
        torch.optim.AdamW(model.parameters()), ZarrReader(f"{root}/fqn"), model=model))
    return errors


def _load_all(rank, world_size, root):
    results = {
        "int_from_fqn": _int_from_fqn(world_size, root),
        "fqn_from_int": _fqn_from_int(world_size, root),
        "int_from_flattened": _int_from_flattened(world_size, root),
        "flattened_from_fqn": _flattened_from_fqn(world_size, root),
        "full_from_sharded": _full_from_sharded(world_size, root),
        "sharded_from_full": _sharded_from_full_with_stock_planner(world_size, root),
        "params_without_state": _params_without_state(world_size, root),
        "accelerate": _accelerate_3971(world_size, root),
        "mismatch": _mismatched_tables(world_size, root),
        "missing": _missing_keys(world_size, root),
        "partial": _partial_load(world_size, root),
        "steps": _step_checks(rank, world_size, root),
    }
    return results


# -- launches --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("optimizer_state"))
    return root, run_ranks(_save_all, SAVE_WORLD, root)[0]


@pytest.fixture(scope="module")
def loaded(checkpoints):
    root, _ = checkpoints
    return run_ranks(_load_all, LOAD_WORLD, root)


@pytest.fixture(scope="module")
def reference(checkpoints):
    return checkpoints[1]["reference"]


def without_empty_state(optim_state: dict) -> dict:
    """Optimizer state with params whose state is ``{}`` left out: torch's unflatten gives stateless params one."""
    return {**optim_state, "state": {fqn: s for fqn, s in optim_state["state"].items() if s}}


def manifest(root, name) -> dict:
    with open(f"{root}/{name}/zarr.json") as f:
        return json.load(f)["attributes"]["dcp_zarr"]


# -- what is recorded ------------------------------------------------------------------------------------------------


def test_manifest_records_the_param_table_of_each_saved_form(checkpoints):
    root, _ = checkpoints
    forms = {name: [(t["path"], t["key_form"]) for t in manifest(root, name)["optimizers"]]
             for name in ("fqn", "int", "flat", "full", "accelerate")}
    assert forms == {"fqn": [(["optim"], "fqn")], "int": [(["optim"], "int")], "flat": [(["optim"], "flattened")],
                     "full": [(["optim"], "fqn")], "accelerate": [(["optimizer"], "fqn")]}
    fqn_table = manifest(root, "fqn")["optimizers"][0]
    flat_table = manifest(root, "flat")["optimizers"][0]
    int_table = manifest(root, "int")["optimizers"][0]
    # The flattened form's ids come from the saved key order: they must agree with the nested form's.
    assert [(p["id"], p["fqn"]) for p in flat_table["params"]] == [(p["id"], p["fqn"]) for p in fqn_table["params"]]
    assert [(p["id"], p["state_keys"]) for p in int_table["params"]] == \
        [(p["id"], p["state_keys"]) for p in fqn_table["params"]]
    assert {p["fqn"] for p in fqn_table["params"] if not p["state_keys"]} == {"embed.weight", "spare.weight",
                                                                              "spare.bias"}
    assert manifest(root, "fqn")["state_dict_type"] == "sharded" and manifest(root, "full")["state_dict_type"] == "full"


def test_zarr_shows_the_hyperparameters_of_each_form_as_attributes_of_the_group_holding_them(checkpoints, reference):
    root, saved = checkpoints

    def attributes(name: str, node: str) -> dict:  # zarr-python's view: consolidated, as zarr opens it by default
        return dict(zarr.open_group(f"{root}/{name}", mode="r")[node].attrs)

    def plain(group: dict) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in group.items()}

    (group,) = reference["optim"]["param_groups"]
    assert group["lr"] == 1e-2 and group["betas"] == (0.9, 0.999) and len(group["params"]) == 19
    assert attributes("fqn", "optim/param_groups/0") == plain(group)
    assert attributes("full", "optim/param_groups/0") == plain(group)
    assert attributes("int", "optim/param_groups/0") == {**plain(group), "params": list(range(19))}
    (accelerate_group,) = saved["accelerate"]["optim"]["param_groups"]
    assert attributes("accelerate", "optimizer/param_groups/0") == plain(accelerate_group)
    # the flattened form keeps no groups: its param_groups.{fqn}.{k} keys are attributes of the optimizer's group
    assert attributes("flat", "optim") == {f"param_groups.{fqn}.{k}": v for fqn in group["params"]
                                           for k, v in plain(group).items() if k != "params"}


def test_step_is_saved_once_as_a_scalar_under_its_params_key(checkpoints):
    root, _ = checkpoints
    entries = manifest(root, "fqn")["entries"]
    steps = {key: e for key, e in entries.items() if key.endswith(".step")}
    assert len(steps) == 16
    assert all(e["kind"] == "tensor" and e["shape"] == [] and e["saved_shards"] == 1 for e in steps.values())


# -- loads across key forms, state_dict types and world sizes --------------------------------------------------------


def test_fqn_save_loads_into_int_id_request_on_fsdp2(loaded, reference):
    assert_state_equal(reference["optim"], loaded[0]["int_from_fqn"]["optim"])
    assert loaded[0]["int_from_fqn"]["translated"] > 0


def test_step_is_read_back_on_every_rank_equal_to_the_saved_value(loaded):
    for rank_result in loaded:
        steps = rank_result["int_from_fqn"]["steps"]
        assert sorted(steps) == list(range(1, 17)) and set(steps.values()) == {2.0}


def test_int_id_save_loads_into_fqn_request(loaded, reference):
    assert_state_equal(reference["optim"], loaded[0]["fqn_from_int"])


def test_flattened_save_loads_into_int_id_request(loaded, reference):
    assert_state_equal(reference["optim"], loaded[0]["int_from_flattened"])


def test_nested_save_loads_into_flattened_request(loaded, reference):
    assert_state_equal(reference["optim"], without_empty_state(loaded[0]["flattened_from_fqn"]))


def test_sharded_save_loads_into_full_state_dict_request(loaded, reference):
    result = loaded[0]["full_from_sharded"]
    assert_state_equal(reference, result["loaded"])
    # torch's set_state_dict(full_state_dict=True) turns the ``betas`` tuple into a list (stock planner too), so
    # after it only the tensors are compared.
    assert_state_equal(reference["model"], result["after_set"]["model"])
    assert_state_equal(reference["optim"]["state"], result["after_set"]["optim"]["state"])


def test_full_save_loads_into_sharded_request_with_the_stock_planner(loaded, reference):
    assert_state_equal(reference, loaded[0]["sharded_from_full"])


def test_accelerate_3971_stock_dcp_fails_and_zarr_planner_loads_bit_exact(loaded, checkpoints):
    result = loaded[0]["accelerate"]
    assert "Missing key in checkpoint state_dict: optimizer.state.0.step." in result["stock"]
    assert_state_equal(checkpoints[1]["accelerate"]["optim"], result["optim"])


def test_state_of_params_that_had_none_at_save_is_dropped_and_reported(loaded, reference):
    result = loaded[0]["params_without_state"]
    assert "Missing key in checkpoint state_dict: optim.state.spare." in result["stock"]
    assert sorted(result["skipped"]) == sorted(f"optim.state.spare.{p}.{s}" for p in ("weight", "bias")
                                               for s in ("exp_avg", "exp_avg_sq", "step"))
    assert all("had no optimizer state when saved" in why for why in result["skipped"].values())
    assert result["requested_spare"] == []  # removed from the caller's state dict, not just left unread
    assert_state_equal(reference, result["full"])


# -- refusals and errors ---------------------------------------------------------------------------------------------


def test_different_param_count_is_refused_naming_both_sides(loaded):
    for rank_result in loaded:  # every rank raises, none hangs
        message = rank_result["mismatch"]["count"]
        assert "ParamTableMismatchError" in message and "different numbers of params" in message
        assert "checkpoint: optimizer 'optim' in fqn form: 19 params, groups of [19]" in message
        assert "requested:  optimizer 'optim' in int form: 17 params, groups of [17]" in message


def test_shape_mismatch_under_the_same_id_is_refused_naming_both_sides(loaded):
    message = loaded[0]["mismatch"]["shape"]
    assert "ParamTableMismatchError" in message and "different shapes" in message
    assert ("requested 'optim.state.2.exp_avg' (param id 2 (group 0), shape [3]) <- saved "
            "'optim.state.blocks.0.up.bias.exp_avg' (param id 2 'blocks.0.up.bias' (group 0), shape [5])") in message


def test_missing_key_error_lists_keys_nearest_forms_types_and_fix(loaded):
    message = loaded[0]["missing"]
    assert "MissingKeysError" in message and "16 of " in message
    assert "optim.state.blocks.0.up.weight.max_exp_avg_sq: the checkpoint holds ['exp_avg', 'exp_avg_sq', " \
           "'step'] for param id 1 'blocks.0.up.weight' (group 0), not 'max_exp_avg_sq'" in message
    assert "nearest saved: optim.state.blocks.0.up.weight.exp_avg_sq" in message
    assert "... and 8 more" in message
    assert "Checkpoint: state_dict_type sharded, saved world size 2; optimizer 'optim' in fqn form" in message
    assert "Requested:  state_dict_type sharded; optimizer 'optim' in fqn form" in message
    assert "Fix: " in message and "allow_partial_load=True" in message


def test_partial_load_loads_the_rest_and_reports_what_it_skipped(loaded, reference):
    result = loaded[0]["partial"]
    assert len(result["skipped"]) == 16 and all(k.endswith(".max_exp_avg_sq") for k in result["skipped"])
    loaded_state = {fqn: {k: v for k, v in s.items() if k != "max_exp_avg_sq"}
                    for fqn, s in result["optim"]["state"].items()}
    assert_state_equal(reference["optim"]["state"], loaded_state)


# -- assert_step_present ---------------------------------------------------------------------------------------------


def test_step_check_names_a_param_missing_its_step_on_one_rank(loaded):
    for rank_result in loaded:
        message = rank_result["steps"]["missing_on_one_rank"]
        assert "OptimizerStepError" in message
        assert "rank 1: param id 3 'blocks.0.down.weight' has optimizer state ['exp_avg', 'exp_avg_sq'] but no " \
               "'step'" in message


def test_step_check_names_a_param_whose_step_differs_across_ranks(loaded):
    message = loaded[0]["steps"]["differs_across_ranks"]
    assert "param id 3 'blocks.0.down.weight' has different steps across ranks: {0: 2.0, 1: 2.0, 2: 3.0}" in message


def test_step_check_compares_with_the_checkpoint(loaded):
    message = loaded[0]["steps"]["differs_from_checkpoint"]
    assert "param id 3 has step 7, the checkpoint has 2 for param id 3 'blocks.0.down.weight' (group 0)" in message
    lost = loaded[0]["steps"]["state_lost"]
    assert "failed for 16 parameter(s)" in lost
    assert "param id 1 'blocks.0.up.weight' has no optimizer state, but the checkpoint has step 2" in lost
