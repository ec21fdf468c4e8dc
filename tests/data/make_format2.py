"""How tests/data/format2-fsdp2-3ranks was made: ``python tests/data/make_format2.py`` at commit 9d6882a (dcp_zarr
format version 2: chunk keys ``c/0/1``; torch 2.14.1, zarr 3.1.6). Kept for the record; run today it writes the
current format.

The same state as the format-1 store (``make_format1.save_fixture``); ``format2-expected.pt`` is rank 0's full state
of this run.
"""

from __future__ import annotations

import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.data.make_format1 import save_fixture  # noqa: E402
from tests.support.ranks import run_ranks  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
STORE = os.path.join(HERE, "format2-fsdp2-3ranks")

if __name__ == "__main__":
    shutil.rmtree(STORE, ignore_errors=True)
    expected = run_ranks(save_fixture, 3, STORE)[0]
    torch.save(expected, os.path.join(HERE, "format2-expected.pt"))
