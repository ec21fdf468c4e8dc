"""Bit-exact comparison of nested states: tensors (by their bytes: -0.0/0.0 and NaN payloads differ), dicts, lists,
tuples and Python values, with the key path of the first difference in the error."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["assert_state_equal"]


def _element_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a (numel, itemsize) uint8 matrix: compares -0.0/0.0 and NaN payloads by their bits."""
    # clone: contiguous() keeps the odd strides of an empty tensor, which view(torch.uint8) then refuses
    flat = t.reshape(-1).clone() if t.numel() == 0 else t.contiguous().reshape(-1)
    return flat.view(torch.uint8).reshape(t.numel(), t.element_size())


def _first_difference(a: Any, b: Any, path: str) -> str | None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: {type(a).__name__} vs {type(b).__name__}"
        if isinstance(a, DTensor) or isinstance(b, DTensor):
            return f"{path}: DTensor found; compare full states (full_state)"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        differs = (_element_bytes(a) != _element_bytes(b)).any(dim=1)
        if differs.any():
            index = int(differs.nonzero()[0])
            where = tuple(int(i) for i in torch.unravel_index(torch.tensor(index), a.shape)) if a.dim() else ()
            x, y = a.reshape(-1)[index].item(), b.reshape(-1)[index].item()
            return f"{path}: tensors differ first at index {where}: {x!r} vs {y!r}"
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            only_a = sorted(set(a) - set(b), key=repr)
            only_b = sorted(set(b) - set(a), key=repr)
            return f"{path}: keys only in first {only_a}, only in second {only_b}"
        for key in a:
            found = _first_difference(a[key], b[key], f"{path}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return f"{path}: {type(a).__name__} of {len(a)} vs {type(b).__name__} of {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            found = _first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    if type(a) is not type(b):
        return f"{path}: {type(a).__name__} {a!r} vs {type(b).__name__} {b!r}"
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return None
    if a != b:
        return f"{path}: {a!r} vs {b!r}"
    return None


def assert_state_equal(a: Any, b: Any) -> None:
    """Bit-exact comparison of nested dicts/lists/tuples of tensors and Python values.

    Raises AssertionError naming the first differing key path,
    e.g. ``state['optim']['state']['head.weight']['exp_avg']``.
    """
    found = _first_difference(a, b, "state")
    if found:
        raise AssertionError(f"states differ at {found}")
