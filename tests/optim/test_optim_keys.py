"""Optimizer key spaces, in one process: finding optimizers in state dicts, translating keys, the planner's errors.

The tables are found in real torch state dicts (``optimizer.state_dict()``, ``get_optimizer_state_dict`` nested
and flattened) of the unsharded ToyModel, whose ``embed`` is frozen and ``spare`` never gets a gradient, so two of
its 19 params have no optimizer state. Loads here run ``dcp.load`` without a process group (DCP's single-process
mode); tests/optim/test_optimizer_state.py does the same with FSDP2 across processes.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_state_dict

from dcp_zarr import ParamTableMismatchError, ZarrLoadPlanner, ZarrReader, ZarrSavePlanner, ZarrWriter
from dcp_zarr.errors import MalformedMetadataError
from dcp_zarr.format.manifest import TensorEntry
from dcp_zarr.format.optimizer_tables import FLATTENED, FQN, INT, OptimizerTable, find_optimizers, tables_from_entries
from dcp_zarr.optim.keys import shape_mismatches, translate
from tests.support.compare import assert_state_equal
from tests.support.models import make_model, make_optimizer, prime_optimizer, train_steps

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

UNTRAINED = {"embed.weight", "spare.weight", "spare.bias"}
ADAM_STATE = ("exp_avg", "exp_avg_sq", "step")


def trained(seed=0, steps=2, optimizer=None):
    model = make_model(seed)
    optim = (optimizer or make_optimizer)(model)
    train_steps(model, optim, steps)
    return model, optim


def fresh(seed=1, optimizer=None):
    model = make_model(seed)
    optim = (optimizer or make_optimizer)(model)
    prime_optimizer(model, optim)  # state for the same params as training gives
    return model, optim


def table_of(state_dict) -> OptimizerTable:
    flat, paths = flatten_state_dict(state_dict)
    (table,) = find_optimizers(paths, flat.get)
    return table


# set_state_dict needs strict=False whenever a requires_grad param (``spare``) has no optimizer state: torch 2.13
# refuses such state dicts otherwise ("Missing optimizer state for parameter 'spare.weight'").


def fqn_state(model, optim, flatten=False):
    return get_optimizer_state_dict(model, optim, options=StateDictOptions(flatten_optimizer_state_dict=flatten))


def manifest_of(path) -> dict:
    with open(f"{path}/zarr.json") as f:
        return json.load(f)["attributes"]["dcp_zarr"]


def assert_same_int_state(expected: dict, actual: dict) -> None:
    # torch's unflatten of flattened optimizer state gives stateless requires_grad params an empty dict; that is
    # still "no state", so empty entries are left out of the comparison.
    def nonempty(state):
        return {pid: s for pid, s in state.items() if s}

    assert_state_equal(nonempty(expected["state"]), nonempty(actual["state"]))
    assert [g["params"] for g in expected["param_groups"]] == [g["params"] for g in actual["param_groups"]]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# -- finding optimizers ---------------------------------------------------------------------------------------------


def test_fqn_form_is_found_with_ids_groups_and_which_params_have_state():
    model, optim = trained()
    table = table_of({"optim": fqn_state(model, optim)})
    names = [name for name, _ in model.named_parameters()]
    assert table.path == ("optim",) and table.key_form == FQN and table.group_sizes == (19,)
    assert [(p.id, p.fqn, p.group) for p in table.params] == [(i, n, 0) for i, n in enumerate(names)]
    assert {p.fqn for p in table.params if not p.state_keys} == UNTRAINED
    assert all(p.state_keys == ADAM_STATE for p in table.params if p.fqn not in UNTRAINED)
    assert "lr" in table.group_keys and "params" not in table.group_keys


def test_int_form_is_found_with_ids_and_no_names():
    _, optim = trained()
    table = table_of({"optimizer": optim.state_dict()})
    assert table.key_form == INT and [p.id for p in table.params] == list(range(19))
    assert all(p.fqn is None for p in table.params)
    assert table.state_key(table.params[1], "step") == "optimizer.state.1.step"


def test_flattened_form_is_found_with_ids_in_saved_order_and_no_groups():
    model, optim = trained()
    table = table_of({"optim": fqn_state(model, optim, flatten=True)})
    assert table.key_form == FLATTENED and table.group_sizes is None
    assert [p.fqn for p in table.params] == [name for name, _ in model.named_parameters()]
    assert [p.id for p in table.params] == list(range(19))
    assert table.state_key(table.params[1], "exp_avg") == "optim.state.blocks.0.up.weight.exp_avg"
    assert table.group_key(table.params[1], "lr") == "optim.param_groups.blocks.0.up.weight.lr"


def test_flattened_nested_state_names_keep_their_dots():
    paths = {"o.param_groups.a.w.lr": ("o", "param_groups.a.w.lr"),
             "o.state.a.w.inner.x": ("o", "state.a.w.inner.x")}
    (table,) = find_optimizers(paths, lambda key: None)
    assert table.params[0].fqn == "a.w" and table.params[0].state_keys == ("inner.x",)


def test_optimizer_at_the_root_of_the_state_dict():
    _, optim = trained()
    table = table_of(optim.state_dict())
    assert table.path == () and table.state_key(table.params[1], "step") == "state.1.step"


def test_a_model_state_dict_is_not_an_optimizer():
    model, _ = trained()
    flat, paths = flatten_state_dict({"model": model.state_dict()})
    assert find_optimizers(paths, flat.get) == []


def test_flattened_ids_are_not_trusted_without_the_saved_order():
    model, optim = trained()
    flat, paths = flatten_state_dict({"optim": fqn_state(model, optim, flatten=True)})
    entries = {key: TensorEntry(key, tuple(path), "n", "torch.float32", (), ()) for key, path in paths.items()}
    (table,) = tables_from_entries(entries)  # no key_order: entries may be in plan order
    assert all(p.id is None for p in table.params)
    (table,) = tables_from_entries(entries, key_order=list(paths))
    assert [p.id for p in table.params] == list(range(19))


def test_table_json_round_trip_and_malformed_table():
    model, optim = trained()
    table = table_of({"optim": fqn_state(model, optim)})
    document = json.loads(json.dumps(table.to_json()))
    assert OptimizerTable.from_json(document) == table
    for field, value in (("key_form", "pickled"), ("params", [{"id": [1], "fqn": "a", "group": 0, "state_keys": []}]),
                         ("path", [{"a": 1}])):
        with pytest.raises(MalformedMetadataError, match="malformed optimizer table"):
            OptimizerTable.from_json({**document, field: value})


# -- translation ----------------------------------------------------------------------------------------------------


def test_int_request_maps_to_fqn_saved_keys_by_id():
    model, optim = trained()
    saved = table_of({"optim": fqn_state(model, optim)})
    request = table_of({"optim": optim.state_dict()})
    translation = translate(request, saved)
    assert translation.sources["optim.state.1.exp_avg"] == "optim.state.blocks.0.up.weight.exp_avg"
    assert translation.sources["optim.param_groups.0.lr"] == "optim.param_groups.0.lr"
    assert translation.keep == {"optim.param_groups.0.params"}
    assert not translation.missing and not translation.dropped


def test_fqn_request_maps_to_int_saved_keys_by_id():
    model, optim = trained()
    saved = table_of({"optim": optim.state_dict()})
    translation = translate(table_of({"optim": fqn_state(model, optim)}), saved)
    assert translation.sources["optim.state.head.bias.step"] == "optim.state.16.step"


def test_nested_request_reads_hyperparameters_from_flattened_keys():
    model, optim = trained()
    saved = table_of({"optim": fqn_state(model, optim, flatten=True)})
    translation = translate(table_of({"optim": optim.state_dict()}), saved)
    # Group 0's first param is embed.weight: its flattened hyperparameters stand for the group.
    assert translation.sources["optim.param_groups.0.lr"] == "optim.param_groups.embed.weight.lr"
    assert translation.sources["optim.state.3.step"] == "optim.state.blocks.0.down.weight.step"


def test_flattened_request_reads_hyperparameters_from_its_params_group():
    model, optim = trained()
    saved = table_of({"optim": optim.state_dict()})
    translation = translate(table_of({"optim": fqn_state(model, optim, flatten=True)}), saved)
    assert translation.sources["optim.param_groups.head.bias.lr"] == "optim.param_groups.0.lr"


def test_state_of_a_param_that_had_none_at_save_is_dropped_not_missing():
    model, optim = trained()
    saved = table_of({"optim": fqn_state(model, optim)})
    stateless = make_model(1)
    stateless_optim = make_optimizer(stateless)
    request = table_of({"optim": fqn_state(stateless, stateless_optim)})  # DCP fakes a step on every trainable param
    translation = translate(request, saved)
    assert set(translation.dropped) == {f"optim.state.spare.{k}.{s}" for k in ("weight", "bias") for s in ADAM_STATE}
    assert "frozen, or never got a gradient" in translation.dropped["optim.state.spare.bias.step"]
    assert not translation.missing


def test_a_state_name_the_checkpoint_lacks_is_missing():
    model, optim = trained()
    saved = table_of({"optim": fqn_state(model, optim)})
    amsgrad = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, amsgrad=True)  # noqa: E731
    request = table_of({"optim": fqn_state(*fresh(optimizer=amsgrad))})
    translation = translate(request, saved)
    assert len(translation.missing) == 16
    assert "not 'max_exp_avg_sq'" in translation.missing["optim.state.head.weight.max_exp_avg_sq"]


def test_different_param_counts_are_refused_naming_both_sides():
    model, optim = trained()
    saved = table_of({"optim": fqn_state(model, optim)})
    fewer = torch.optim.AdamW([p for n, p in model.named_parameters() if not n.startswith("spare")])
    train_steps(model, fewer, 1)
    with pytest.raises(ParamTableMismatchError) as raised:
        translate(table_of({"optim": fewer.state_dict()}), saved)
    message = str(raised.value)
    assert "different numbers of params" in message
    assert "checkpoint: optimizer 'optim' in fqn form: 19 params" in message
    assert "requested:  optimizer 'optim' in int form: 17 params" in message


def test_different_group_sizes_are_refused():
    model, optim = trained()
    saved = table_of({"optim": fqn_state(model, optim)})
    params = list(model.parameters())
    two_groups = torch.optim.AdamW([{"params": params[:5]}, {"params": params[5:]}])
    with pytest.raises(ParamTableMismatchError, match="param groups hold different numbers"):
        translate(table_of({"optim": two_groups.state_dict()}), saved)


def test_a_requested_group_spanning_saved_groups_is_refused():
    model = make_model(0)
    params = list(model.named_parameters())
    optim = torch.optim.AdamW([{"params": [p for _, p in params[:5]]}, {"params": [p for _, p in params[5:]]}])
    train_steps(model, optim, 1)
    saved = table_of({"optim": fqn_state(model, optim)})
    one_group = make_optimizer(model)
    train_steps(model, one_group, 1)
    with pytest.raises(ParamTableMismatchError, match=r"saved in different groups \[0, 1\]"):
        translate(table_of({"optim": fqn_state(model, one_group)}), saved)


def test_shape_mismatches_name_both_keys_and_params():
    model, optim = trained()
    saved = table_of({"optim": fqn_state(model, optim)})
    reordered = torch.optim.AdamW(list(model.parameters())[::-1])
    train_steps(model, reordered, 1)
    translation = translate(table_of({"optim": reordered.state_dict()}), saved)
    flat, _ = flatten_state_dict({"optim": reordered.state_dict()})
    saved_flat, _ = flatten_state_dict({"optim": fqn_state(model, optim)})
    shapes = lambda d: {k: tuple(v.shape) for k, v in d.items() if isinstance(v, torch.Tensor)}  # noqa: E731
    lines = shape_mismatches(translation, shapes(flat), shapes(saved_flat))
    assert lines, "a reversed param order must not map silently"
    # Reversed, id 2 is head.bias (3 rows); the checkpoint's id 2 is blocks.0.up.bias (5 rows).
    assert any("requested 'optim.state.2.exp_avg' (param id 2 (group 0), shape [3]) <- saved "
               "'optim.state.blocks.0.up.bias.exp_avg' (param id 2 'blocks.0.up.bias' (group 0), shape [5])"
               in line for line in lines), lines


# -- single-process loads through ZarrLoadPlanner -------------------------------------------------------------------


def test_manifest_records_one_table_per_optimizer(tmp_path):
    model, optim = trained()
    dcp.save({"model": model.state_dict(), "optim": fqn_state(model, optim), "raw": optim.state_dict(),
              "flat": fqn_state(model, optim, flatten=True)}, storage_writer=ZarrWriter(tmp_path / "c"),
             planner=ZarrSavePlanner())
    tables = {t["path"][0]: t for t in manifest_of(tmp_path / "c")["optimizers"]}
    assert {k: t["key_form"] for k, t in tables.items()} == {"optim": FQN, "raw": INT, "flat": FLATTENED}
    assert tables["optim"]["params"][1] == {"id": 1, "fqn": "blocks.0.up.weight", "group": 0,
                                            "state_keys": ["exp_avg", "exp_avg_sq", "step"]}
    assert [p["fqn"] for p in tables["flat"]["params"]] == [p["fqn"] for p in tables["optim"]["params"]]
    assert [p["id"] for p in tables["flat"]["params"]] == list(range(19))


def test_fqn_save_loads_into_an_int_request(tmp_path):
    model, optim = trained()
    dcp.save({"optim": fqn_state(model, optim)}, planner=ZarrSavePlanner(), storage_writer=ZarrWriter(tmp_path / "c"))
    _, target = fresh()
    request = {"optim": target.state_dict()}
    planner = ZarrLoadPlanner()
    dcp.load(request, storage_reader=ZarrReader(tmp_path / "c"), planner=planner)
    target.load_state_dict(request["optim"])
    assert_same_int_state(optim.state_dict(), target.state_dict())
    assert planner.translated["optim.state.1.step"] == "optim.state.blocks.0.up.weight.step"


def test_flattened_save_loads_into_an_int_request(tmp_path):
    model, optim = trained()
    dcp.save({"optim": fqn_state(model, optim, flatten=True)}, planner=ZarrSavePlanner(),
             storage_writer=ZarrWriter(tmp_path / "c"))
    _, target = fresh()
    request = {"optim": target.state_dict()}
    dcp.load(request, storage_reader=ZarrReader(tmp_path / "c"), planner=ZarrLoadPlanner())
    target.load_state_dict(request["optim"])
    assert_same_int_state(optim.state_dict(), target.state_dict())


def test_int_save_loads_into_fqn_and_flattened_requests(tmp_path):
    model, optim = trained()
    dcp.save({"optim": optim.state_dict()}, planner=ZarrSavePlanner(), storage_writer=ZarrWriter(tmp_path / "c"))
    for flatten in (False, True):
        target_model, target = fresh()
        request = {"optim": fqn_state(target_model, target, flatten=flatten)}
        dcp.load(request, storage_reader=ZarrReader(tmp_path / "c"), planner=ZarrLoadPlanner())
        set_state_dict(target_model, target, model_state_dict={}, optim_state_dict=request["optim"],
                       options=StateDictOptions(flatten_optimizer_state_dict=flatten, strict=False))
        assert_same_int_state(optim.state_dict(), target.state_dict())


def test_plain_dcp_load_of_the_matching_form_still_works(tmp_path):
    model, optim = trained()
    dcp.save({"optim": optim.state_dict()}, planner=ZarrSavePlanner(), storage_writer=ZarrWriter(tmp_path / "c"))
    _, target = fresh()
    request = {"optim": target.state_dict()}
    dcp.load(request, storage_reader=ZarrReader(tmp_path / "c"))
    target.load_state_dict(request["optim"])
    assert_same_int_state(optim.state_dict(), target.state_dict())


def test_non_tensor_state_of_int_keyed_params_lands_under_int_keys(tmp_path):
    # DCP spells dict keys as str in paths; its own load_bytes would put a non-tensor value at state["0"].
    def optimizer_state(count):
        return {"state": {0: {"count": count, "sum": torch.full((2,), float(count))}},
                "param_groups": [{"lr": 0.1, "params": [0]}]}

    dcp.save({"optim": optimizer_state(5)}, planner=ZarrSavePlanner(), storage_writer=ZarrWriter(tmp_path / "c"))
    request = {"optim": optimizer_state(0)}
    dcp.load(request, storage_reader=ZarrReader(tmp_path / "c"), planner=ZarrLoadPlanner())
    assert list(request["optim"]["state"]) == [0]
    assert request["optim"]["state"][0]["count"] == 5 and request["optim"]["state"][0]["sum"].tolist() == [5.0, 5.0]


def test_stock_planner_fails_where_zarr_planner_translates(tmp_path):
    model, optim = trained()
    dcp.save({"optimizer": fqn_state(model, optim)}, planner=ZarrSavePlanner(),
             storage_writer=ZarrWriter(tmp_path / "c"))
    _, target = fresh()
    with pytest.raises(CheckpointException, match=r"Missing key in checkpoint state_dict: optimizer\.state\.1\.step"):
        dcp.load({"optimizer": target.state_dict()}, storage_reader=ZarrReader(tmp_path / "c"))


def test_missing_key_error_lists_keys_nearest_forms_and_fix(tmp_path):
    model, optim = trained()
    dcp.save({"optim": fqn_state(model, optim)}, planner=ZarrSavePlanner(), storage_writer=ZarrWriter(tmp_path / "c"))
    amsgrad = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, amsgrad=True)  # noqa: E731
    _, target = fresh(optimizer=amsgrad)
    with pytest.raises(CheckpointException) as raised:
        dcp.load({"optim": target.state_dict()}, storage_reader=ZarrReader(tmp_path / "c"), planner=ZarrLoadPlanner())
    message = str(raised.value)
    assert "MissingKeysError" in message
    assert "16 of " in message and "requested keys have no counterpart" in message
    assert "optim.state.1.max_exp_avg_sq: the checkpoint holds ['exp_avg', 'exp_avg_sq', 'step'] for param id 1 " \
           "'blocks.0.up.weight' (group 0), not 'max_exp_avg_sq'" in message
    assert "nearest saved: optim.state" in message
    assert "... and 8 more" in message
    assert "Checkpoint: state_dict_type full, saved world size 1; optimizer 'optim' in fqn form" in message
    assert "Requested:  state_dict_type full; optimizer 'optim' in int form" in message
    assert "allow_partial_load=True" in message


def test_missing_key_error_points_at_a_renamed_optimizer(tmp_path):
    model, optim = trained()
    dcp.save({"optim": fqn_state(model, optim)}, planner=ZarrSavePlanner(), storage_writer=ZarrWriter(tmp_path / "c"))
    _, target = fresh()
    with pytest.raises(CheckpointException, match=r"request it under \['optim'\]"):
        dcp.load({"optimizer": target.state_dict()}, storage_reader=ZarrReader(tmp_path / "c"),
                 planner=ZarrLoadPlanner())


def test_partial_load_loads_the_rest_and_lists_what_it_skipped(tmp_path):
    model, optim = trained()
    dcp.save({"optim": fqn_state(model, optim)}, planner=ZarrSavePlanner(), storage_writer=ZarrWriter(tmp_path / "c"))
    amsgrad = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, amsgrad=True)  # noqa: E731
    _, target = fresh(optimizer=amsgrad)
    request = {"optim": target.state_dict()}
    planner = ZarrLoadPlanner(allow_partial_load=True)
    dcp.load(request, storage_reader=ZarrReader(tmp_path / "c"), planner=planner)
    assert sorted(planner.skipped) == sorted(f"optim.state.{i}.max_exp_avg_sq" for i in range(1, 17))
    assert "kept its requested value" in planner.skipped["optim.state.1.max_exp_avg_sq"]
    expected = optim.state_dict()["state"]
    for pid, state in request["optim"]["state"].items():
        for name in ADAM_STATE:
            assert torch.equal(state[name], expected[pid][name]), (pid, name)


def test_a_stateless_request_is_warned_about_not_silently_left_empty(tmp_path, caplog):
    model, optim = trained()
    dcp.save({"optim": fqn_state(model, optim)}, planner=ZarrSavePlanner(), storage_writer=ZarrWriter(tmp_path / "c"))
    unprimed = make_optimizer(make_model(1))
    planner = ZarrLoadPlanner()
    with caplog.at_level("WARNING", logger="dcp_zarr.optim.load_planner"):
        dcp.load({"optim": unprimed.state_dict()}, storage_reader=ZarrReader(tmp_path / "c"), planner=planner)
    assert len(planner.unrequested) == 16 * 3 and "optim.state.blocks.0.up.weight.step" in planner.unrequested
    assert "prime it" in caplog.text
