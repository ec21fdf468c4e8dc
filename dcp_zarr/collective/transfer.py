"""The messages of collective I/O: a round of point-to-point transfers, after every rank says it can go on.

Each round starts with one all-reduce of a flag (O(1) bytes a rank): a rank that failed (a tensor it could not
pack, a chunk it could not read, a block it could not write) says so, and then every rank stops at that point and
raises, the failing ranks their own error and the others one naming them. No rank is left waiting for a message
that will never come, and no rank goes on with data a failed rank did not send. Within a round, each rank sends at
most one message to each other rank and knows, without being told, the size of every message it receives.

Messages go on the process group's own device: host memory for gloo (a group with a CPU backend), the current
CUDA device for a group that has only NCCL.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch
import torch.distributed as dist

from dcp_zarr.errors import CollectiveIOError

# What an aggregator holds at once, and a rank sends in one round (ZarrWriter's and ZarrReader's exchange_bytes).
DEFAULT_EXCHANGE_BYTES = 256 << 20
_TAG = 0x7A52  # "zR": messages of dcp_zarr's collective I/O (gloo matches tags; NCCL orders messages per pair)


class Group:
    """A process group as collective I/O uses it: this rank, the world, and ranks in the group's numbering."""

    def __init__(self, group=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.device = _group_device(group)

    def global_rank(self, rank: int) -> int:
        if self.group is None or self.group is dist.group.WORLD:
            return rank
        return dist.get_global_rank(self.group, rank)

    def same_everywhere(self, digest: bytes) -> bool:
        """Whether every rank passed the same ``digest``: one all-reduce (MAX) of 32 bytes a rank, whatever the
        number of ranks, of two 62-bit parts of it and their negations (the largest and the smallest of each)."""
        digest = digest.ljust(16, b"\0")
        parts = [int.from_bytes(digest[i: i + 8], "little") & ((1 << 62) - 1) for i in (0, 8)]
        both = torch.tensor([*parts, *(-p for p in parts)], dtype=torch.int64, device=self.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        largest, smallest = both[:2].tolist(), [-n for n in both[2:].tolist()]
        return largest == smallest

    def check(self, failure: BaseException | None, where: str) -> None:
        """Every rank passes here together: raise on every rank if any rank failed (``failure`` is this rank's)."""
        flag = torch.tensor([1 if failure is not None else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if not int(flag.item()):
            return
        flags = [torch.zeros(1, dtype=torch.int32, device=self.device) for _ in range(self.size)]
        mine = torch.tensor([1 if failure is not None else 0], dtype=torch.int32, device=self.device)
        dist.all_gather(flags, mine, group=self.group)
        failed = [r for r, f in enumerate(flags) if int(f.item())]
        if failure is not None:
            raise failure
        shown = ", ".join(map(str, failed[:8])) + (f" and {len(failed) - 8} more" if len(failed) > 8 else "")
        raise CollectiveIOError(f"{where}: rank{'s' if len(failed) > 1 else ''} {shown} of the process group "
                                "failed (their own errors say why); this rank stopped with them")

    def exchange(self, sends: Mapping[int, Sequence[torch.Tensor]], receives: Mapping[int, Sequence[torch.Tensor]]
                 ) -> None:
        """Send the messages ``sends[peer]`` and fill the buffers ``receives[peer]`` (flat uint8 tensors on
        ``self.device``, the k-th of a pair sized alike on both sides), all at once; returns when every message of
        this rank is done."""
        ops = [dist.P2POp(dist.irecv, buffer, self.global_rank(peer), self.group, _TAG + k)
               for peer, buffers in receives.items() for k, buffer in enumerate(buffers) if buffer.numel()]
        ops += [dist.P2POp(dist.isend, buffer, self.global_rank(peer), self.group, _TAG + k)
                for peer, buffers in sends.items() for k, buffer in enumerate(buffers) if buffer.numel()]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()


def _group_device(group) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "cpu:" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


# Each part of a message starts at a multiple of this, so that its bytes can be viewed as any dtype in place.
ALIGNMENT = 16


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def padded(message: torch.Tensor) -> torch.Tensor:
    """``message`` (flat uint8) with zeros after it up to the next multiple of ALIGNMENT."""
    extra = aligned(message.numel()) - message.numel()
    if not extra:
        return message
    return torch.cat([message, torch.zeros(extra, dtype=torch.uint8, device=message.device)])


def as_message(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor on ``device`` (a view when it already is one, else a copy)."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.device != device:
        flat = flat.to(device)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=device)
