#!/usr/bin/env bash
# Train a small FSDP2 model on 2 CPU ranks, save it as a Zarr store, resume it on 3 ranks, print the store tree.
set -euo pipefail
ckpt="${1:-${TMPDIR:-/tmp}/dcp-zarr-demo/step-3.zarr}"
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
torchrun --nproc-per-node 2 "$(dirname "$0")/train_resume.py" --phase train --ckpt "$ckpt"
torchrun --nproc-per-node 3 "$(dirname "$0")/train_resume.py" --phase resume --ckpt "$ckpt"
