"""The CUDA path: saves from CUDA tensors and DTensors of every dtype, loads into CUDA and into CPU, resharded loads
between CUDA and CPU ranks, and ``dcp.async_save`` staging CUDA tensors through pinned buffers.

Skipped where ``torch.cuda.is_available()`` is False (every machine but a lent GPU one): ``benchmarks/gpu_check.sh``
runs this file there. The rank processes join gloo groups (run_ranks): DCP's own collectives move only Python
objects, on the CPU backend, and these DTensors never communicate (``from_local`` without its check), so a CUDA
rank needs no NCCL here; benchmarks/gpu_bench.py saves and loads through NCCL's group.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_zarr import ZarrReader, ZarrWriter
from tests.support.compare import assert_state_equal
from tests.support.states import DTYPES, blank_like, random_bits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device (torch.cuda.is_available() is False): the CUDA path needs one")

# Odd shapes: edge chunks are partial, and two ranks' Shard(0) halves are uneven. BIG spans several 1 MiB inner
# chunks of one shard, so the IO threads copy it from the device in pieces.
SHAPE = (37, 11)
BIG = (1031, 1027)


def on(tree, device):
    """``tree`` with every tensor copied to ``device`` (always a copy: a snapshot), other leaves as they are."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device, copy=True)
    if isinstance(tree, dict):
        return {k: on(v, device) for k, v in tree.items()}
    return tree


def every_dtype(seed: int) -> dict[str, torch.Tensor]:
    """Arbitrary bit patterns of every stored dtype (CPU tensors), and a large bf16 and fp32 tensor."""
    state = {str(dtype).removeprefix("torch."): random_bits(SHAPE, dtype, seed + i) for i, dtype in enumerate(DTYPES)}
    state["big_bf16"] = random_bits(BIG, torch.bfloat16, seed + 100)
    state["big_fp32"] = random_bits(BIG, torch.float32, seed + 101)
    return state


def save(state, path: str, **writer_kwargs) -> None:
    dcp.save(state, storage_writer=ZarrWriter(path, **writer_kwargs))


def load(target, path: str):
    dcp.load(target, storage_reader=ZarrReader(path))
    return target


def test_every_dtype_saved_from_cuda_loads_into_cuda_and_into_cpu(tmp_path):
    expected = every_dtype(seed=0)
    expected["strided"] = random_bits((12, 10), torch.float32, 7).t()[1::2]  # a non-contiguous view
    expected["scalar"] = random_bits((), torch.float64, 8)
    expected["empty"] = torch.empty((0, 4), dtype=torch.bfloat16)
    on_device = on(expected, "cuda")
    path = str(tmp_path / "cuda.zarr")
    save({"t": on_device, "step": 3}, path)

    into_cuda = load({"t": on(blank_like(expected), "cuda"), "step": 0}, path)
    assert all(t.device.type == "cuda" for t in into_cuda["t"].values()), "a load keeps the target's device"
    assert_state_equal({"t": on(into_cuda["t"], "cpu"), "step": into_cuda["step"]}, {"t": expected, "step": 3})
    into_cpu = load({"t": blank_like(expected), "step": 0}, path)
    assert_state_equal(into_cpu, {"t": expected, "step": 3})


def test_a_save_waits_for_the_work_queued_on_the_callers_stream(tmp_path):
    # The IO threads copy on streams of their own; without waiting for the caller's stream they would copy the
    # tensor before the queued fill, which the sleep holds back, has run.
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        tensor = torch.zeros(BIG, device="cuda")
        torch.cuda._sleep(200_000_000)  # about 0.1 s of device time before the fill
        tensor.fill_(7.0)
        save({"w": tensor}, str(tmp_path / "stream.zarr"), thread_count=4)
    back = load({"w": torch.zeros(BIG)}, str(tmp_path / "stream.zarr"))["w"]
    assert torch.equal(back, torch.full(BIG, 7.0)), "the save copied the tensor before the caller's stream filled it"


def test_async_save_stages_cuda_tensors_in_pinned_buffers_kept_for_the_next_save(tmp_path):
    source = every_dtype(seed=20)
    state = on(source, "cuda")
    writer = ZarrWriter(cache_staged_state_dict=True)
    staged = writer.stage(state)
    # DCP's stager pins (cudaHostRegister) only buffers of at least 5 bytes; each tensor here is larger.
    unpinned = [k for k, t in staged.items() if t.device.type != "cpu" or not t.is_pinned()]
    assert not unpinned, f"staged copies not in pinned host memory: {unpinned}"
    pointers = {k: t.data_ptr() for k, t in staged.items()}
    del staged  # as if its save were done: the writer now stages the next save into the same buffers

    expected = []
    for i in range(2):
        expected.append(on(state, "cpu"))
        future = dcp.async_save(state, storage_writer=writer, checkpoint_id=str(tmp_path / f"{i}.zarr"))
        for t in state.values():  # training goes on once the call returns: the save must not see this
            t.logical_not_() if t.dtype == torch.bool else t.view(torch.uint8).bitwise_not_()
        future.result()
    again = writer.stage(state)
    assert {k: t.data_ptr() for k, t in again.items()} == pointers, "the kept pinned buffers were not reused"
    del again
    writer.close()
    for i, saved in enumerate(expected):
        assert_state_equal(on(load(on(blank_like(source), "cuda"), str(tmp_path / f"{i}.zarr")), "cpu"), saved)


# --- rank programs: DTensors on CUDA and CPU meshes ---------------------------------------------------------------


def full_tensors(seed: int) -> dict[str, torch.Tensor]:
    """The global tensors every rank program shares (made on each rank from the seed, on the CPU)."""
    return {"w_fp32": random_bits(SHAPE, torch.float32, seed), "w_bf16": random_bits(SHAPE, torch.bfloat16, seed + 1),
            "w_fp8": random_bits(SHAPE, torch.float8_e4m3fn, seed + 2), "big": random_bits(BIG, torch.bfloat16, seed)}


def _mesh(device_type: str, world_size: int):
    from torch.distributed.device_mesh import init_device_mesh

    if device_type == "cuda":
        torch.cuda.set_device(0)  # every CUDA rank here is rank 0 of its job, on the one GPU
    return init_device_mesh(device_type, (world_size,))


def _pieces(full: dict[str, torch.Tensor], mesh, placements) -> dict[str, torch.Tensor]:
    """This rank's piece of each full tensor under ``placements`` (CPU tensors)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    for name, tensor in full.items():
        shape, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
        out[name] = tensor[tuple(slice(o, o + s) for o, s in zip(offset, shape))].contiguous()
    return out


def _sharded(full: dict[str, torch.Tensor], mesh, placements, device: str) -> dict:
    """Each rank's DTensor of each full tensor, built from its own piece (no collective)."""
    from torch.distributed.tensor import DTensor

    return {name: DTensor.from_local(piece.to(device), mesh, placements, run_check=False,
                                     shape=full[name].shape, stride=full[name].stride())
            for name, piece in _pieces(full, mesh, placements).items()}


def save_dtensors(rank, world_size, path, device, seed):
    from torch.distributed.tensor import Shard

    mesh = _mesh(device, world_size)
    dcp.save({"model": _sharded(full_tensors(seed), mesh, [Shard(0)], device)},
             storage_writer=ZarrWriter(path, thread_count=3))
    return True


def load_dtensors(rank, world_size, path, device, seed, shard_dim):
    """Load into zeroed DTensors sharded along ``shard_dim``; return whether each local piece is the expected one."""
    from torch.distributed.tensor import Shard

    mesh = _mesh(device, world_size)
    full = full_tensors(seed)
    target = {"model": _sharded({k: torch.zeros_like(v) for k, v in full.items()}, mesh, [Shard(shard_dim)], device)}
    dcp.load(target, storage_reader=ZarrReader(path, thread_count=3))
    assert all(t.to_local().device.type == device for t in target["model"].values())
    got = {name: t.to_local().to("cpu") for name, t in target["model"].items()}
    assert_state_equal(got, _pieces(full, mesh, [Shard(shard_dim)]))
    return True


def save_from_a_cuda_rank_and_a_cpu_rank(rank, world_size, path, seed):
    """Rank 0's tensors are on CUDA, rank 1's on the CPU; ``shared`` is held by both (a replica, checked equal)."""
    device = "cuda" if rank == 0 else "cpu"
    full = full_tensors(seed)
    state = {f"rank{rank}": {k: v.to(device) for k, v in full.items()}, "shared": full["w_bf16"].to(device)}
    dcp.save(state, storage_writer=ZarrWriter(path, thread_count=3, check_replicas="all"))
    return True


@pytest.mark.slow
@pytest.mark.distributed
def test_cuda_dtensors_saved_on_one_gpu_load_resharded_on_two_cpu_ranks(tmp_path):
    from tests.support.ranks import run_ranks

    path = str(tmp_path / "from-cuda.zarr")
    assert run_ranks(save_dtensors, 1, path, "cuda", 5) == [True]
    assert run_ranks(load_dtensors, 1, path, "cuda", 5, 0) == [True]  # back into CUDA DTensors
    assert run_ranks(load_dtensors, 2, path, "cpu", 5, 1) == [True, True]  # columns now, on two CPU ranks


@pytest.mark.slow
@pytest.mark.distributed
def test_dtensors_saved_on_two_cpu_ranks_load_resharded_into_cuda(tmp_path):
    from tests.support.ranks import run_ranks

    path = str(tmp_path / "from-cpu.zarr")
    assert run_ranks(save_dtensors, 2, path, "cpu", 9) == [True, True]
    assert run_ranks(load_dtensors, 1, path, "cuda", 9, 1) == [True]
    # and into plain CUDA tensors, without a process group
    full = full_tensors(9)
    back = load({"model": {k: torch.zeros_like(v, device="cuda") for k, v in full.items()}}, path)
    assert_state_equal(on(back["model"], "cpu"), full)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_save_from_a_cuda_rank_and_a_cpu_rank_loads_into_cuda(tmp_path):
    from tests.support.ranks import run_ranks

    path = str(tmp_path / "mixed.zarr")
    assert run_ranks(save_from_a_cuda_rank_and_a_cpu_rank, 2, path, 13) == [True, True]
    full = full_tensors(13)
    expected = {"rank0": full, "rank1": full, "shared": full["w_bf16"]}
    back = load(on(blank_like(expected), "cuda"), path)
    assert_state_equal(on(back, "cpu"), expected)


def load_into_cuda_on_rank0(rank, world_size, path, seed):
    """Rank 0 loads into CUDA tensors, rank 1 into CPU ones; every tensor is needed whole by both, so each is read
    by one of them and sent to the other over gloo (host memory): rank 0 receives into a staging buffer and copies
    it to the device, and sends what it read from host memory."""
    full = full_tensors(seed)
    device = "cuda" if rank == 0 else "cpu"
    target = {"model": {k: torch.zeros_like(v, device=device) for k, v in full.items()}}
    reader = ZarrReader(path, thread_count=3, read_once=True)
    dcp.load(target, storage_reader=reader)
    assert_state_equal(on(target["model"], "cpu"), full)
    return reader.bytes_read


@pytest.mark.slow
@pytest.mark.distributed
def test_reads_done_once_deliver_into_cuda_tensors(tmp_path):
    from tests.support.ranks import run_ranks

    path = str(tmp_path / "plain.zarr")
    full = full_tensors(17)
    save({"model": full}, path)
    read = run_ranks(load_into_cuda_on_rank0, 2, path, 17)
    stored = sum(v.numel() * v.element_size() for v in full.values())
    assert sum(read) < 1.5 * stored, (read, stored)  # each tensor read once, not by both ranks
