"""The toy models the multi-process tests train, shard, save and load, as a checkpointing user would.

Models
    One architecture, ``ToyModel``, serves every layout, so a checkpoint saved under any layout loads
    into any other. Its dims are odd on purpose: torch.chunk splits them unevenly and leaves some ranks
    with empty shards at world size 4.

Save / load, with any DCP storage writer / reader
    ``save_checkpoint(model, optim, writer)`` / ``load_checkpoint(model, optim, reader)``;
    whole rank programs (for ``tests.support.ranks.run_ranks``): ``train_and_save(rank, world_size, layout, writer)``
    and ``load_fresh(rank, world_size, layout, reader)``, both returning ``full_state`` (rank 0 only).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

__all__ = [
    "LAYOUTS",
    "ToyModel",
    "build",
    "full_state",
    "load_checkpoint",
    "load_fresh",
    "local_shapes",
    "make_batch",
    "make_model",
    "make_optimizer",
    "make_tp_model",
    "prime_optimizer",
    "save_checkpoint",
    "shard",
    "shard_fsdp2",
    "shard_fsdp_tp",
    "shard_hsdp",
    "train_and_save",
    "train_steps",
]

# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------

VOCAB = 17  # embedding rows: 17 -> 9/8 on 2 ranks, 6/6/5 on 3, 5/5/5/2 on 4
DIM = 13  # model width: 13 -> 7/6, 5/5/3, 4/4/4/1
HIDDEN = 5  # block hidden: 5 -> 3/2, 2/2/1, 2/2/1/0 (an empty shard at world size 4)
FFN = 18  # tensor-parallel hidden: must be even (TP splits it in two); FSDP then splits each half 5/4
OUT = 3  # output features: 3 -> 2/1, 1/1/1, 1/1/1/0 (an empty shard at world size 4)
TOKENS = 24  # one flat batch: 2-D activations, so the root's output is not a view (FSDP2 warns on views)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class FeedForward(nn.Module):
    """The pair that tensor parallelism splits: ``up`` column-wise, ``down`` row-wise."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, FFN)
        self.down = nn.Linear(FFN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class ToyModel(nn.Module):
    """embed -> 2 blocks -> ffn -> norm -> head, with odd dims.

    ``embed.weight`` is frozen and ``spare`` is never called, so after training the optimizer has
    Adam state for neither: optimizer state dicts cover only some parameters.
    """

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.embed.weight.requires_grad_(False)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ffn = FeedForward()
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, OUT)
        self.spare = nn.Linear(DIM, OUT)  # never used in forward: never gets a gradient

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(self.ffn(x)))


def make_model(seed: int = 0) -> ToyModel:
    """A deterministic, unsharded ToyModel (same values on every rank for the same seed)."""
    torch.manual_seed(seed)
    return ToyModel()


# Every layout uses the same ToyModel; the alias names the intent where TP is involved.
make_tp_model = make_model


def make_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic ``(tokens, target)``: tokens ``(TOKENS,)`` int64, target ``(TOKENS, OUT)`` float32."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    target = torch.randn(TOKENS, OUT, generator=g)
    return tokens, target


# --------------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------------


def _fully_shard_blocks_and_root(model: ToyModel, mesh) -> ToyModel:
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def shard_fsdp2(model: ToyModel, world_size: int) -> ToyModel:
    """FSDP2 on a 1-D CPU mesh: each block, then the root (which holds embed, ffn, norm, head, spare)."""
    return _fully_shard_blocks_and_root(model, init_device_mesh("cpu", (world_size,)))


def shard_hsdp(model: ToyModel, world_size: int = 4) -> ToyModel:
    """HSDP: replicate over "rep" (2), shard over "shard" (world_size // 2); placements (Replicate(), Shard(0))."""
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("rep", "shard"))
    return _fully_shard_blocks_and_root(model, mesh)


def shard_fsdp_tp(model: ToyModel, world_size: int = 4) -> ToyModel:
    """TP over "tp" (2) on ``ffn`` (up column-wise, down row-wise), then FSDP2 over "dp" (world_size // 2)."""
    mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model.ffn, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return _fully_shard_blocks_and_root(model, mesh["dp"])


LAYOUTS = ("plain", "fsdp2", "hsdp", "fsdp_tp")


def shard(model: ToyModel, layout: str, world_size: int) -> ToyModel:
    """Apply ``layout`` to ``model``; "plain" leaves it unsharded (replicated on every rank)."""
    if layout == "plain":
        return model
    if layout == "fsdp2":
        return shard_fsdp2(model, world_size)
    if layout in ("hsdp", "fsdp_tp"):
        if world_size % 2 or world_size < 4:
            raise ValueError(f"layout {layout!r} needs an even world size >= 4, got {world_size}")
        return shard_hsdp(model, world_size) if layout == "hsdp" else shard_fsdp_tp(model, world_size)
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # All parameters, frozen and unused included, as a careless user would: they get no Adam state.
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def build(layout: str, world_size: int, seed: int = 0) -> tuple[ToyModel, torch.optim.Optimizer]:
    """A fresh ``make_model(seed)`` sharded as ``layout`` and its AdamW (no state yet)."""
    model = shard(make_model(seed), layout, world_size)
    return model, make_optimizer(model)


def local_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Each parameter's local (this rank's) shape; the full shape for plain tensors."""
    return {
        name: tuple((p.to_local() if isinstance(p, DTensor) else p).shape)
        for name, p in model.named_parameters()
    }


# --------------------------------------------------------------------------------------------------
# Training, saving, loading
# --------------------------------------------------------------------------------------------------


def _loss(model: nn.Module, batch_seed: int) -> torch.Tensor:
    tokens, target = make_batch(batch_seed)
    return nn.functional.mse_loss(model(tokens), target)


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, n: int, first_batch: int = 0) -> None:
    """``n`` optimizer steps on ``make_batch(first_batch + i)``; every rank sees the same batch."""
    for i in range(n):
        optimizer.zero_grad(set_to_none=True)
        _loss(model, first_batch + i).backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def prime_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create Adam state for exactly the parameters that train, without changing any parameter.

    ``get_state_dict`` on a stateless optimizer would instead fake a step on *every* requires_grad
    parameter, ``spare`` included, and the load would then ask the checkpoint for state it never had
    ("Missing key in checkpoint state_dict: optim.state.spare.bias.step", NeMo-Automodel #2071).
    A real backward at lr=0 gives state to the same parameters as training did.
    """
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    train_steps(model, optimizer, 1, first_batch=-1)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr


def save_checkpoint(model: nn.Module, optim: torch.optim.Optimizer, writer, planner=None) -> None:
    """``dcp.save({"model": ..., "optim": ...})`` of ``get_state_dict`` through ``writer``, with ``planner`` (None:
    DCP's own, which a ZarrWriter takes over and plans locally: the line users write)."""
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, storage_writer=writer, planner=planner)


def load_checkpoint(model: nn.Module, optim: torch.optim.Optimizer, reader, planner=None) -> None:
    """Load a ``save_checkpoint`` checkpoint through ``reader`` into ``model``/``optim`` (any layout).

    ``set_state_dict`` runs with ``strict=False`` because, strict, torch 2.13 refuses optimizer state
    that lacks a requires_grad parameter ("Missing optimizer state for parameter 'spare.weight'"), and
    ``spare`` never trains. The model keys cannot mismatch: they come from this same model, and
    ``dcp.load`` has already failed on any key the checkpoint lacks.
    """
    if not optim.state:
        prime_optimizer(model, optim)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=reader, planner=planner)
    set_state_dict(
        model,
        optim,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=StateDictOptions(strict=False),
    )


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any] | None:
    """The unsharded ``{"model": ..., "optim": ...}`` as plain CPU tensors and Python values, on rank 0.

    Collective: every rank must call it. Other ranks get None (DCP gathers full tensors to rank 0 only
    when offloading to CPU). Optimizer state is keyed by parameter FQN, so it compares across layouts.
    Call it after training or loading: on a stateless optimizer ``get_state_dict`` first fakes a step.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, optim, options=options)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    return _plain({"model": msd, "optim": osd})


def _plain(value: Any) -> Any:
    if isinstance(value, DTensor):
        raise TypeError("full_state got a DTensor; expected full tensors")
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def train_and_save(rank: int, world_size: int, layout: str, writer, steps: int = 2, seed: int = 0):
    """Rank program: build ``layout``, train ``steps`` AdamW steps, save through ``writer``.

    Returns ``(full_state, local_shapes)``: the full state of what was saved (rank 0; None elsewhere)
    and this rank's local parameter shapes.
    """
    model, optim = build(layout, world_size, seed)
    train_steps(model, optim, steps)
    save_checkpoint(model, optim, writer)
    return full_state(model, optim), local_shapes(model)


def load_fresh(rank: int, world_size: int, layout: str, reader, seed: int = 1):
    """Rank program: build ``layout`` from a different seed, load through ``reader``, return ``full_state``."""
    model, optim = build(layout, world_size, seed)
    load_checkpoint(model, optim, reader)
    return full_state(model, optim)
