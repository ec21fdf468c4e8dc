"""What gets checkpointed: an FSDP2 transformer-like model with AdamW state, or many small tensors.

Also the state-dict walks the benchmark needs: byte counts, zeroed copies to load into, equality checks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelConfig:
    layers: int
    hidden: int
    vocab: int
    dtype: str

    @property
    def heads(self) -> int:
        return max(1, self.hidden // 64) if self.hidden % 64 == 0 else 1

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Block(nn.Module):
    """Pre-norm attention + MLP: about 12 * hidden**2 parameters."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, h))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class TransformerLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg.hidden, cfg.heads) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _init_local_shards(model: nn.Module, seed: int) -> None:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            if "norm" in name:
                local.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                values = torch.randn(local.shape, generator=generator, dtype=torch.float32) * 0.02
                local.copy_(values)


def build_sharded_state_dict(cfg: ModelConfig, mesh, device: torch.device, seed: int = 0) -> dict[str, Any]:
    """FSDP2-shard the model, take one AdamW step, return ``{"model": ..., "optim": ...}``.

    Built on the meta device and materialised shard by shard, so no rank ever holds the whole model.
    """
    with torch.device("meta"):
        model = TransformerLM(cfg).to(DTYPES[cfg.dtype])
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    _init_local_shards(model, seed + dist.get_rank())

    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(cfg.vocab, (2, 17), device=device, generator=None)
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}


def small_tensor_state_dict(
    count: int, rank: int, world_size: int, device: torch.device, seed: int = 0
) -> dict[str, torch.Tensor]:
    """``count`` float32 tensors of 64..1024 elements in total, each owned by one rank (distinct keys, no dedup)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    sizes = torch.randint(64, 1025, (count,), generator=generator).tolist()
    return {
        f"small.{i:06d}": torch.randn(n, generator=generator).to(device)
        for i, n in enumerate(sizes)
        if i % world_size == rank
    }


# --- state-dict walks ---------------------------------------------------------------------------------------------


def tensor_leaves(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from tensor_leaves(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from tensor_leaves(value)


def map_tensors(tree: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {key: map_tensors(value, fn) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_tensors(value, fn) for value in tree)
    return copy.deepcopy(tree)


def local_view(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_bytes(tree: Any) -> int:
    """Bytes this rank holds: DTensor local shards plus plain tensors (replicated scalars such as ``step`` included)."""
    return sum(local_view(t).numel() * t.element_size() for t in tensor_leaves(tree))


def global_bytes(tree: Any) -> int:
    """Bytes of the logical (unsharded) state dict: DTensors at global size, plain tensors once."""
    return sum(t.numel() * t.element_size() for t in tensor_leaves(tree))


def zeroed_copy(tree: Any) -> Any:
    """A state dict of the same sharding to load into, zero-filled so a load that skips data shows."""
    return map_tensors(tree, torch.zeros_like)


def fill_zeros(tree: Any) -> None:
    with torch.no_grad():
        for tensor in tensor_leaves(tree):
            local_view(tensor).zero_()


def has_nonzero(tree: Any) -> bool:
    return any(bool(local_view(t).any()) for t in tensor_leaves(tree))


def locally_equal(a: Any, b: Any) -> bool:
    """Same structure, same local tensor bytes, same non-tensor leaves (on this rank)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        la, lb = local_view(a), local_view(b)
        return la.dtype == lb.dtype and la.shape == lb.shape and torch.equal(la, lb)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(locally_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(locally_equal(x, y) for x, y in zip(a, b))
    return a == b
