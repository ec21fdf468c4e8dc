"""How tests/data/format1-fsdp2-3ranks was made: ``python tests/data/make_format1.py`` at commit b343249
(dcp_zarr format version 1, torch 2.14.1, zarr 3.1.6). Kept for the record; run today it writes the current format.

The store holds a 3-rank FSDP2 ToyModel (uneven and empty shards) after 2 AdamW steps, the optimizer state keyed by
FQN, a JSON value, a torch.save value and a replicated plain tensor. ``expected.pt`` is rank 0's full state of the
same run (``tests.support.models.full_state``), what any load of the store must reproduce.
"""

from __future__ import annotations

import os
import shutil
import sys

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from dcp_zarr import ZarrWriter  # noqa: E402
from tests.support.models import build, full_state, train_steps  # noqa: E402
from tests.support.ranks import run_ranks  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
STORE = os.path.join(HERE, "format1-fsdp2-3ranks")


def extras() -> dict:
    return {"step": 7, "shape": torch.Size([3, 4]), "scale": torch.arange(5.0)}


def save_fixture(rank: int, world_size: int, path: str):
    model, optim = build("fsdp2", world_size, seed=0)
    train_steps(model, optim, 2)
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd, "extra": extras()}, storage_writer=ZarrWriter(path))
    return full_state(model, optim)


if __name__ == "__main__":
    shutil.rmtree(STORE, ignore_errors=True)
    expected = run_ranks(save_fixture, 3, STORE)[0]
    torch.save(expected, os.path.join(STORE, "..", "format1-expected.pt"))
