"""``assert_step_present``: after a resume, check the optimizer really has its ``step``, everywhere, as saved.

A lost ``step`` is silent: Adam restarts its bias correction and the first updates after resume are far too large.
"""

from __future__ import annotations

import os

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch
import torch.distributed as dist
from torch import nn

from dcp_zarr.errors import OptimizerStepError, ParamTableMismatchError
from dcp_zarr.format.optimizer_tables import OptimizerTable, ParamEntry, tables_of_manifest
from dcp_zarr.reader import ZarrReader

_LISTED = 10


def assert_step_present(optimizer: torch.optim.Optimizer, checkpoint_path_or_reader=None, *,
                        process_group=None, model: nn.Module | None = None,
                        checkpoint_key: str | None = None) -> dict[int, float]:
    """Raise ``OptimizerStepError`` unless every parameter with optimizer state has a ``step`` that agrees.

    Checks, for every parameter of ``optimizer`` (numbered by position across param_groups, as torch.optim does):
    a parameter with state has a ``step``; when torch.distributed is initialised, every rank has state for the
    same parameters and the same ``step`` for each (collective: call it on every rank of ``process_group``);
    with a checkpoint (a path or a ``ZarrReader``), each parameter's ``step`` equals the saved one, and a
    parameter has state exactly when it had state at save.

    ``model`` names parameters in errors and matches them to the checkpoint by FQN; without it they are matched
    by id. ``checkpoint_key`` picks the optimizer (its path, dotted, e.g. ``"optim"``) when the checkpoint holds
    several. Returns ``{param id: step}`` of this rank.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    names = _names(model, params)
    steps: dict[int, float] = {}
    problems: list[str] = []
    for pid, param in enumerate(params):
        state = optimizer.state.get(param) or {}
        if not state:
            continue
        if "step" not in state:
            problems.append(f"{_describe(pid, names)} has optimizer state {sorted(state)} but no 'step'")
            continue
        steps[pid] = _as_float(state["step"])
    if dist.is_available() and dist.is_initialized():
        problems += _across_ranks(steps, problems, names, process_group)
    if checkpoint_path_or_reader is not None and not problems:
        problems += _against_checkpoint(steps, params, names, checkpoint_path_or_reader, checkpoint_key)
    if problems:
        listed = problems[:_LISTED] + ([f"... and {len(problems) - _LISTED} more"] if len(problems) > _LISTED else [])
        raise OptimizerStepError(f"optimizer step check failed for {len(problems)} parameter(s):\n  "
                                 + "\n  ".join(listed))
    return steps


def _names(model: nn.Module | None, params: list) -> list[str | None]:
    if model is None:
        return [None] * len(params)
    by_identity = {id(p): name for name, p in model.named_parameters()}
    return [by_identity.get(id(p)) for p in params]


def _describe(pid: int, names: list[str | None]) -> str:
    return f"param id {pid}" + (f" {names[pid]!r}" if names[pid] else "")


def _as_float(step) -> float:
    if isinstance(step, torch.Tensor):
        local = step.to_local() if hasattr(step, "to_local") else step  # a replicated DTensor holds it whole
        return float(local.detach().cpu().item())
    return float(step)


def _across_ranks(steps: dict[int, float], local_problems: list[str], names: list, process_group) -> list[str]:
    # Gather the local problems too, so every rank raises the same error instead of some waiting for the others.
    world = dist.get_world_size(process_group)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (steps, local_problems), group=process_group)
    problems = [f"rank {rank}: {p}" for rank, (_, theirs) in enumerate(gathered) for p in theirs]
    every_pid = sorted({pid for rank_steps, _ in gathered for pid in rank_steps})
    for pid in every_pid:
        values = {rank: rank_steps.get(pid) for rank, (rank_steps, _) in enumerate(gathered)}
        without = [rank for rank, value in values.items() if value is None]
        if without:
            problems.append(f"{_describe(pid, names)} has optimizer state on ranks "
                            f"{[r for r in values if r not in without]} but none on ranks {without}")
        elif len(set(values.values())) > 1:
            problems.append(f"{_describe(pid, names)} has different steps across ranks: {values}")
    return problems


def _against_checkpoint(steps: dict[int, float], params: list, names: list, source, key: str | None) -> list[str]:
    reader = source if isinstance(source, ZarrReader) else ZarrReader(os.fspath(source))
    if reader.manifest is None:
        reader.read_metadata()
    table = _pick_table(tables_of_manifest(reader.manifest), key, reader.path)
    matched = _match(table, params, names)
    problems = []
    for pid, entry in enumerate(matched):
        if entry is None:
            if pid in steps:
                problems.append(f"{_describe(pid, names)} has state (step {steps[pid]:g}) but is not in the "
                                f"checkpoint's {table.summary()}")
            continue
        saved = _as_float(reader.read_entry(table.state_key(entry, "step"))) if "step" in entry.state_keys else None
        if saved is None and entry.state_keys:
            problems.append(f"{_describe(pid, names)}: the checkpoint holds {list(entry.state_keys)} for "
                            f"{table.describe(entry)} but no 'step'")
        elif saved is None and pid in steps:
            problems.append(f"{_describe(pid, names)} has state (step {steps[pid]:g}) but had none at save "
                            f"({table.describe(entry)})")
        elif saved is not None and pid not in steps:
            problems.append(f"{_describe(pid, names)} has no optimizer state, but the checkpoint has step {saved:g} "
                            f"for {table.describe(entry)}: its state was not loaded")
        elif saved is not None and steps[pid] != saved:
            problems.append(f"{_describe(pid, names)} has step {steps[pid]:g}, the checkpoint has {saved:g} for "
                            f"{table.describe(entry)}")
    return problems


def _pick_table(tables: list[OptimizerTable], key: str | None, where: str) -> OptimizerTable:
    if key is not None:
        chosen = [t for t in tables if t.name == key]
    else:
        chosen = tables
    if len(chosen) != 1:
        raise ValueError(f"{where}: {'no' if not chosen else len(chosen)} optimizer state dicts"
                         + (f" at {key!r}" if key else "")
                         + f" (the checkpoint holds {[t.name for t in tables]}); pass checkpoint_key= to pick one")
    return chosen[0]


def _match(table: OptimizerTable, params: list, names: list) -> list[ParamEntry | None]:
    if all(names) and all(p.fqn is not None for p in table.params):
        by_fqn = {p.fqn: p for p in table.params}
        return [by_fqn.get(name) for name in names]
    if len(table.params) != len(params) or any(p.id is None for p in table.params):
        raise ParamTableMismatchError(
            f"cannot match the optimizer's {len(params)} params by id to the checkpoint's {table.summary()}; "
            "pass model= to match them by name")
    by_id = {p.id: p for p in table.params}
    return [by_id.get(pid) for pid in range(len(params))]
