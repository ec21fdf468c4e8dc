"""Whether a ZipNN-class codec is worth building (issue 43, item 3): ZipNN's ratio, speed and exactness beside the
blosc codec dcp_zarr writes (zstd level 1, bit shuffle), on one thread, on 4096 x 4096 tensors drawn as trained
weights and AdamW state are distributed.

Needs the ``zipnn`` package, which dcp_zarr does not depend on: run it in a venv of its own, from the repository
root: ``python -m venv /tmp/zvenv && /tmp/zvenv/bin/pip install zipnn numcodecs && /tmp/zvenv/bin/python -m
benchmarks.studies.compression_zipnn``. The result is in benchmarks/reports/compression.md ("A ZipNN codec?").
"""

from __future__ import annotations

import time

import torch
from numcodecs import blosc


def cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    weights = torch.randn(4096, 4096, generator=g) * 0.02
    moment = torch.randn(4096, 4096, generator=g) * 1e-3
    return {"bf16 weights": weights.bfloat16(), "fp32 weights": weights,
            "bf16 exp_avg_sq": moment.pow(2).bfloat16(), "fp32 exp_avg": moment}


def main() -> None:
    from zipnn import ZipNN

    print("| data | ZipNN ratio | ZipNN exact | ZipNN changed its input | ZipNN compress GB/s | ZipNN decompress GB/s "
          "| blosc ratio | blosc compress GB/s | blosc decompress GB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, tensor in cases().items():
        raw = tensor.view(torch.uint8).numpy().tobytes()
        dtype = "bfloat16" if tensor.dtype == torch.bfloat16 else "float32"
        zipnn = ZipNN(input_format="byte", bytearray_dtype=dtype, threads=1)
        given = bytearray(raw)  # ZipNN 0.5.4 reorders the bytes of the buffer it is given, in place
        start = time.perf_counter()
        packed = zipnn.compress(given)
        compress_s = time.perf_counter() - start
        mutated = bytes(given) != raw
        start = time.perf_counter()
        unpacked = zipnn.decompress(packed)
        decompress_s = time.perf_counter() - start
        exact = bytes(unpacked) == raw

        units = tensor.view(torch.int16 if tensor.dtype == torch.bfloat16 else torch.int32).numpy()
        start = time.perf_counter()
        stored = blosc.compress(units, b"zstd", 1, blosc.BITSHUFFLE, 0, typesize=units.itemsize)
        blosc_s = time.perf_counter() - start
        out = bytearray(len(raw))
        start = time.perf_counter()
        blosc.decompress(stored, out)
        blosc_back_s = time.perf_counter() - start
        assert bytes(out) == raw
        gb = len(raw) / 1e9
        print(f"| {name} | {len(raw) / len(packed):.3f}x | {exact} | {mutated} | {gb / compress_s:.2f} "
              f"| {gb / decompress_s:.2f} | {len(raw) / len(stored):.3f}x | {gb / blosc_s:.2f} "
              f"| {gb / blosc_back_s:.2f} |")


if __name__ == "__main__":
    main()
