"""Describing what each saved tensor was (format/sources.py), once per kind of holder."""

from __future__ import annotations

import torch

from dcp_zarr.format.sources import PLAIN_TENSOR, SHARDED_TENSOR, SourceDescriptions, describe_source


def test_holders_of_one_kind_share_one_description():
    describe = SourceDescriptions(None)

    first, second = describe(torch.zeros(3)), describe(torch.ones(2, 2))

    assert first is second and first == describe_source(torch.zeros(3), None) == {"type": PLAIN_TENSOR}
    assert describe("not a tensor") == {"type": "unknown"} and describe("not a tensor") is not first


def test_a_sharded_tensor_is_told_by_the_type_planning_passes_in():
    """format/ names no private torch module: the ShardedTensor type comes from planning/dcp_internals.py."""

    class Stand(torch.Tensor):  # stands for torch's ShardedTensor, a Tensor subclass
        pass

    value = torch.zeros(2).as_subclass(Stand)
    assert describe_source(value, Stand) == {"type": SHARDED_TENSOR}
    assert describe_source(value, None) == {"type": PLAIN_TENSOR}
