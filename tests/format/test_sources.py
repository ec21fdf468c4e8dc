"""Describing what each saved tensor was (format/sources.py), once per kind of holder."""

from __future__ import annotations

import torch

from dcp_zarr.format.sources import PLAIN_TENSOR, SourceDescriptions, describe_source


def test_holders_of_one_kind_share_one_description():
    describe = SourceDescriptions()

    first, second = describe(torch.zeros(3)), describe(torch.ones(2, 2))

    assert first is second and first == describe_source(torch.zeros(3)) == {"type": PLAIN_TENSOR}
    assert describe("not a tensor") == {"type": "unknown"} and describe("not a tensor") is not first
