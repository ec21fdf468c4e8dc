"""Would compression pay? Ratio and single-thread speed of zarr's codecs on the benchmark model's state dict.

Encodes the FSDP2 model's weights and AdamW state (world size 1, after one optimizer step) in 1 MiB pieces, as
dcp_zarr's inner chunks are, with numcodecs' zstd, lz4 and blosc. Compare the speeds with the write speed of the
target storage: a codec slower than the storage saves time only where spare cores run it.

    python benchmarks/compression.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.distributed as dist
from ckpt_model import DTYPES, ModelConfig, build_sharded_state_dict
from numcodecs import LZ4, Blosc, Zstd
from torch.distributed.device_mesh import init_device_mesh

PIECE_BYTES = 1 << 20


def codecs(itemsize: int) -> dict:
    return {
        "zstd level 1": Zstd(level=1),
        "lz4": LZ4(),
        "blosc zstd 1, byte shuffle": Blosc(cname="zstd", clevel=1, shuffle=Blosc.SHUFFLE, typesize=itemsize),
        "blosc lz4 5, byte shuffle": Blosc(cname="lz4", clevel=5, shuffle=Blosc.SHUFFLE, typesize=itemsize),
    }


def tensor_groups(state_dict: dict) -> dict[str, list[np.ndarray]]:
    """Raw bytes of the weights, exp_avg and exp_avg_sq (scalars left out)."""
    groups: dict[str, list[np.ndarray]] = {"weights": [], "exp_avg": [], "exp_avg_sq": []}

    def walk(tree, name: str, group: str | None) -> None:
        if isinstance(tree, dict):
            for key, value in tree.items():
                walk(value, str(key), group or ("weights" if key == "model" else None))
        elif isinstance(tree, torch.Tensor) and tree.numel() > 1:
            local = tree.to_local() if hasattr(tree, "to_local") else tree
            target = group if group == "weights" else name if name in groups else None
            if target:
                groups[target].append(local.contiguous().view(torch.uint8).numpy())

    walk(state_dict, "", None)
    return groups


def measure(arrays: list[np.ndarray], codec) -> tuple[float, float]:
    """(compression ratio, MB/s on one thread) over 1 MiB pieces."""
    raw = sum(a.nbytes for a in arrays)
    compressed = 0
    start = time.perf_counter()
    for array in arrays:
        for i in range(0, array.nbytes, PIECE_BYTES):
            compressed += len(codec.encode(array[i:i + PIECE_BYTES]))
    return raw / compressed, raw / (time.perf_counter() - start) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    args = parser.parse_args()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # FSDP2 needs a group; no port
    try:
        Blosc.use_threads = False  # one thread, like one IO thread of a writer
        cfg = ModelConfig(args.layers, args.hidden, args.vocab, args.dtype)
        state_dict = build_sharded_state_dict(cfg, init_device_mesh("cpu", (1,)), torch.device("cpu"))
        itemsize = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
        print(f"{cfg}: 1 MiB pieces, one thread")
        for group, arrays in tensor_groups(state_dict).items():
            size = sum(a.nbytes for a in arrays) / 1e6
            for name, codec in codecs(itemsize).items():
                ratio, speed = measure(arrays, codec)
                print(f"  {group:10s} {size:8.1f} MB  {name:28s} ratio {ratio:5.3f}  {speed:6.0f} MB/s")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
