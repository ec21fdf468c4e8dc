"""Which blosc compressor and shuffle suit a checkpoint (docs/compression.md, "Which compressor"): the ratio of each
on a model and its AdamW state after a few real steps, per kind of array, and each one's speed on one thread.

One process, no ranks: blosc alone through numcodecs, on the arrays a save would compress (64 KiB or more), cut in
1 MiB chunks as a save cuts them. ``python -m benchmarks.studies.compression_codecs [--hidden 512] [--steps 3]``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F
from numcodecs import blosc

from benchmarks.harness import STACK_HEAD, _TransformerLM, stack

CODECS = [("lz4", "bitshuffle"), ("zstd", "bitshuffle"), ("zstd", "shuffle"), ("lz4", "shuffle"), ("zstd", "noshuffle")]
SHUFFLES = {"noshuffle": blosc.NOSHUFFLE, "shuffle": blosc.SHUFFLE, "bitshuffle": blosc.BITSHUFFLE}
CHUNK_BYTES = 1 << 20
MIN_BYTES = 64 << 10


def trained(dtype: torch.dtype, hidden: int, steps: int) -> dict[str, list[torch.Tensor]]:
    """The weights, ``exp_avg`` and ``exp_avg_sq`` of every parameter of 64 KiB or more after ``steps`` AdamW steps,
    initialised as harness.trained_stack_state initialises its model."""
    model = _TransformerLM(stack(hidden, dtype), embed=False).to(dtype)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                param.copy_(torch.randn(param.shape, generator=g) * 0.02)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        x = torch.randn(4, 32, hidden, generator=g).to(dtype)
        labels = torch.randint(STACK_HEAD, (128,), generator=g)
        F.cross_entropy(model(x).flatten(0, 1).float(), labels).backward()
        optim.step()
        optim.zero_grad()
    large = [p for p in model.parameters() if p.numel() * p.element_size() >= MIN_BYTES]
    return {"weights": [p.detach() for p in large], "exp_avg": [optim.state[p]["exp_avg"] for p in large],
            "exp_avg_sq": [optim.state[p]["exp_avg_sq"] for p in large]}


def chunks(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    found = []
    for tensor in tensors:
        units = tensor.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[tensor.element_size()])
        flat = units.numpy().reshape(-1)
        step = CHUNK_BYTES // flat.itemsize
        found += [flat[i: i + step] for i in range(0, flat.size, step)]
    return found


def stored(pieces: list[np.ndarray], cname: str, shuffle: str) -> tuple[int, float]:
    """(compressed bytes, seconds on one thread, best of 3)."""
    best = float("inf")
    size = 0
    for _ in range(3):
        start = time.perf_counter()
        size = sum(len(blosc.compress(p.view(np.uint8), cname.encode(), 1, SHUFFLES[shuffle], 0,
                                      typesize=p.itemsize)) for p in pieces)
        best = min(best, time.perf_counter() - start)
    return size, best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    print("| dtype | arrays | " + " | ".join(f"{c}, {s}" for c, s in CODECS) + " |")
    print("|---|---|" + "---|" * len(CODECS))
    for dtype in (torch.bfloat16, torch.float32):
        kinds = {kind: chunks(tensors) for kind, tensors in trained(dtype, args.hidden, args.steps).items()}
        totals = {codec: [0, 0, 0.0] for codec in CODECS}
        for kind, pieces in kinds.items():
            raw = sum(p.nbytes for p in pieces)
            cells = []
            for codec in CODECS:
                size, seconds = stored(pieces, *codec)
                totals[codec][0] += raw
                totals[codec][1] += size
                totals[codec][2] += seconds
                cells.append(f"{raw / size:.3f}x")
            print(f"| {str(dtype).removeprefix('torch.')} | {kind} | " + " | ".join(cells) + " |")
        print(f"| {str(dtype).removeprefix('torch.')} | all three | "
              + " | ".join(f"{raw / size:.3f}x, {raw / seconds / 1e9:.2f} GB/s" for raw, size, seconds in
                           totals.values()) + " |")
    # float8 (a byte: byte shuffle is none): the bf16 weights scaled into e4m3's normal range, as an fp8 run keeps them
    bf16_weights = trained(torch.bfloat16, args.hidden, args.steps)["weights"]
    weights = [(w.float() * 20).to(torch.float8_e4m3fn) for w in bf16_weights]
    pieces = chunks(weights)
    raw = sum(p.nbytes for p in pieces)
    print("| float8_e4m3fn | weights | "
          + " | ".join(f"{raw / stored(pieces, *codec)[0]:.3f}x" for codec in CODECS) + " |")


if __name__ == "__main__":
    main()
