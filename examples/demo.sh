#!/usr/bin/env bash
# Train a small FSDP2 model on 2 CPU ranks with a checkpoint after every step (CheckpointManager, one Zarr store per
# step), resume the latest on 3 ranks, print the steps kept and the store tree.
set -euo pipefail
root="${1:-${TMPDIR:-/tmp}/dcp-zarr-demo}"
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
torchrun --nproc-per-node 2 "$(dirname "$0")/train_resume.py" --phase train --root "$root"
torchrun --nproc-per-node 3 "$(dirname "$0")/train_resume.py" --phase resume --root "$root"
dcp-zarr list "$root"
