"""Property-based round trips (hypothesis): whatever is saved loads back bit-exact.

* One process: random nested state dicts (dicts, lists, tuples), tensors of every supported dtype with shapes of rank
  0 to 5 (0-size dims included), views with odd strides, and non-tensor values (JSON-able or not), saved with random
  inner-chunk sizes so that shards, edge inner chunks and plain chunks all occur.
* Several processes (tests/support/ranks.py's ``run_ranks``): random world sizes and meshes, DTensors sharded at random
  (uneven, empty and nested shards), loaded back at the same world size under another sharding and at world size 1.

Examples are derandomized (the same every run) and bounded: 300 + 60 examples, about 20 s on two idle cores.
"""

from __future__ import annotations

import math
import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from dcp_zarr import ZarrReader, ZarrSavePlanner, ZarrWriter
from tests.support.compare import assert_state_equal
from tests.support.random_placements import full_tensor, save_and_reload_sharded
from tests.support.ranks import run_ranks, start_forkserver
from tests.support.states import DTYPES, blank_like, random_bits

pytestmark = [pytest.mark.slow]

warnings.filterwarnings("ignore", message=".*torch.distributed is (disabled|unavailable|not initialized).*")

SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# -- strategies ------------------------------------------------------------------------------------------------------

keys = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_-", min_size=1, max_size=6).filter(
    lambda k: not k.startswith("__"))
shapes = st.lists(st.integers(0, 7), min_size=0, max_size=5).filter(lambda s: math.prod(s) <= 3000)


@st.composite
def tensors(draw):
    shape = draw(shapes)
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    view = draw(st.sampled_from(["plain", "transposed", "strided", "expanded"]))
    g = torch.Generator().manual_seed(seed)
    if view == "transposed" and len(shape) >= 2:
        return random_bits(shape[::-1], dtype, g).transpose(0, -1)
    if view == "strided" and shape:
        base = random_bits([2 * shape[0] + 1, *shape[1:]], dtype, g)
        return base[1::2]
    if view == "expanded" and shape and shape[0] > 1:
        return random_bits([1, *shape[1:]], dtype, g).expand(shape)
    return random_bits(shape, dtype, g)


json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))
plain_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.tuples(inner, inner),
                            # not empty: DCP itself loses an empty dict inside a list (FileSystemWriter too)
                            st.dictionaries(keys, inner, min_size=1, max_size=3),
                            # A dict is a state-dict container (DCP turns its keys into str) unless a tuple holds it.
                            st.tuples(st.dictionaries(st.integers(-3, 3), inner, max_size=3))),
    max_leaves=6,
)
# Tagged JSON beyond plain JSON: bytes and sets. (b"" and frozensets are tagged too, see EDGES, but inside a list
# that also holds a non-JSON value they go into torch.save bytes, where weights_only=True refuses them.)
tagged_values = st.one_of(st.frozensets(st.integers(0, 9), max_size=3).map(set), st.binary(min_size=1, max_size=16))
# Not JSON at all: stored as torch.save bytes, loaded with weights_only=True.
object_values = st.one_of(st.lists(st.integers(0, 5), max_size=3).map(torch.Size),
                          st.builds(lambda t: (t, "with a tensor inside"), tensors()))
leaves = st.one_of(tensors(), tensors(), plain_values, tagged_values, object_values)
nested = st.recursive(
    leaves,
    lambda inner: st.one_of(st.dictionaries(keys, inner, min_size=1, max_size=3),
                            st.lists(st.one_of(tensors(), inner), min_size=1, max_size=3)),
    max_leaves=10,
)
state_dicts = st.dictionaries(keys, nested, min_size=1, max_size=4)
_g = torch.Generator().manual_seed(5)
EDGES = {  # always run, whatever hypothesis draws: a scalar, rank 5, a 0-size dim, of the exotic dtypes
    "model": {"scalar": random_bits((), torch.bfloat16, _g),
              "rank5": random_bits((2, 1, 3, 1, 2), torch.complex128, _g),
              "empty": random_bits((3, 0, 2), torch.float8_e5m2, _g), "bits": random_bits((5, 7), torch.uint64, _g)},
    "step": 3,
    "tagged": {"empty_bytes": b"", "frozen": frozenset({1, 2})},
}


def _dense(value):
    """The same structure with every tensor a fresh contiguous one, to compare: ``contiguous()`` keeps the strides of
    an empty view, which tests/support/compare.py's comparison cannot view as bytes."""
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype).copy_(value)
    if isinstance(value, dict):
        return {k: _dense(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_dense(v) for v in value)
    return value


@settings(max_examples=300, **SETTINGS)
@given(state=state_dicts, inner_chunk_bytes=st.sampled_from([16, 64, 300, 4096, 1 << 20]),
       thread_count=st.integers(1, 4))
@example(state=EDGES, inner_chunk_bytes=16, thread_count=2)
def test_any_state_dict_round_trips_bit_exact_in_one_process(state, inner_chunk_bytes, thread_count):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt.zarr")
        loaded = blank_like(state)
        try:
            dcp.save(state, planner=ZarrSavePlanner(),
                     storage_writer=ZarrWriter(path, inner_chunk_bytes=inner_chunk_bytes,
                                                      thread_count=thread_count))
            dcp.load(loaded, storage_reader=ZarrReader(path, thread_count=thread_count))
        except BaseException as exc:  # CheckpointException is a BaseException, which hypothesis would not shrink
            raise AssertionError(f"{type(exc).__name__}: {exc}") from None
        assert_state_equal(_dense(loaded), _dense(state))


# -- several processes -----------------------------------------------------------------------------------------------


@st.composite
def placements(draw, mesh_ndim: int, ndim: int):
    shards = [f"S{d}" for d in range(ndim)]
    return [draw(st.sampled_from(shards) if shards and draw(st.integers(0, 3)) else st.just("R"))
            for _ in range(mesh_ndim)]


@st.composite
def sharded_cases(draw):
    world_size = draw(st.sampled_from([2, 3, 4]))
    mesh = (world_size,) if world_size != 4 or draw(st.booleans()) else (2, 2)
    specs = []
    for i in range(draw(st.integers(2, 4))):
        shape = draw(st.lists(st.integers(0, 11), min_size=0, max_size=3).filter(lambda s: math.prod(s) <= 800))
        specs.append({
            "name": f"t{i}",
            "shape": shape,
            "dtype": draw(st.sampled_from(DTYPES)),
            "seed": draw(st.integers(0, 2**31 - 1)),
            "save": draw(placements(len(mesh), len(shape))),
            "load": draw(placements(len(mesh), len(shape))),
        })
    return world_size, mesh, specs, draw(st.sampled_from([16, 256, 1 << 20]))


@pytest.fixture(scope="module", autouse=True)
def _forkserver():
    start_forkserver()  # ranks fork with dcp_zarr already imported (otherwise ~1 s of imports per rank and example)


NESTED_2D = (4, (2, 2), [  # always run: nested shards whose boundaries (3, 5, 8 of 10) share no divisor, empty shards
    {"name": "nested", "shape": [10, 3], "dtype": torch.bfloat16, "seed": 1, "save": ["S0", "S0"], "load": ["S1", "R"]},
    {"name": "crossed", "shape": [3, 5], "dtype": torch.int64, "seed": 2, "save": ["S1", "S0"], "load": ["S0", "S0"]},
    {"name": "scalar", "shape": [], "dtype": torch.complex64, "seed": 3, "save": ["R", "R"], "load": ["R", "R"]},
    {"name": "empty", "shape": [0, 4], "dtype": torch.float8_e4m3fn, "seed": 4, "save": ["S0", "S1"],
     "load": ["R", "S1"]},
], 16)


EMPTY_ALONG_DIM2 = (3, (3,), [  # found by this test: ranks 1 and 2 hold (11, 5, 0) of t3, rows but no elements
    {"name": "t1", "shape": [9], "dtype": torch.int8, "seed": 2568504, "save": ["S0"], "load": ["S0"]},
    {"name": "t3", "shape": [11, 5, 1], "dtype": torch.complex64, "seed": 1, "save": ["S2"], "load": ["R"]},
], 16)


@pytest.mark.distributed
@settings(max_examples=60, **SETTINGS)
@given(case=sharded_cases())
@example(case=NESTED_2D)
@example(case=EMPTY_ALONG_DIM2)
def test_random_shardings_at_random_world_sizes_round_trip_bit_exact(case):
    world_size, mesh, specs, inner_chunk_bytes = case
    event(f"mesh {mesh}")
    event(f"{sum(any(c != 'R' for c in s['save']) for s in specs)} of {len(specs)} tensors saved sharded")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt.zarr")
        assert run_ranks(save_and_reload_sharded, world_size, path, mesh, specs, inner_chunk_bytes, timeout=120) == \
            [True] * world_size
        full = {"model": {s["name"]: full_tensor(s) for s in specs}, "step": 7}
        loaded = blank_like(full)
        dcp.load(loaded, storage_reader=ZarrReader(path))  # world size 1: every tensor whole
        assert_state_equal(loaded, full)
