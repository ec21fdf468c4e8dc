#!/usr/bin/env bash
# Download into .whl/ (git-ignored) the wheels the lent GPU machine lacks for dcp_zarr, so that benchmarks/gpu_check.sh
# can install them there without a network. Run it here, where pip reaches PyPI: bash benchmarks/gpu_wheels.sh [DIR]
# That machine: Python 3.12 (CPython, manylinux x86-64) with torch 2.11 (CUDA 13), numpy 2.5, ml_dtypes, fsspec,
# tensorstore, xarray, pytest, psutil, pyyaml, packaging and typing-extensions, and no network. The pins are the set
# CI's Python 3.12 pass runs (zarr 3.4, numpy 2.5), inside pyproject.toml's ranges; each wheel's Requires-Dist was
# checked against the machine's packages: zarr -> donfig, google-crc32c, msgspec, numcodecs, numpy, packaging,
# typing-extensions>=4.14; numcodecs -> numpy, typing_extensions (crc32c is its extra, which dcp_zarr needs itself);
# donfig -> pyyaml. typing_extensions travels although the machine has one: zarr 3.4 needs >= 4.14.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${1:-.whl}"
LIMIT_MIB=40  # the working tree and the wheels travel together, 64 MiB at most
WHEELS=(zarr==3.4.2 numcodecs==0.17.1 msgspec==0.23.0 donfig==0.8.1.post1 google-crc32c==1.9.0 crc32c==2.9.post0
        typing_extensions==4.16.0)
mkdir -p "$DEST"
rm -f "$DEST"/*.whl  # only the pinned versions: two wheels of one name stop pip's install there
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d "$DEST" "${WHEELS[@]}"
found="$(find "$DEST" -maxdepth 1 -type f -name '*.whl' | wc -l)"  # exactly one per pin: a stray one would install too
if [ "$found" -ne "${#WHEELS[@]}" ]; then
  echo "gpu_wheels: expected ${#WHEELS[@]} wheels in $DEST, found $found:" >&2; ls -1 "$DEST" >&2; exit 1
fi
ls -l "$DEST"/*.whl | awk '{printf "  %9d  %s\n", $5, $NF}'
total="$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)"
echo "gpu_wheels: $found wheels, $(awk -v b="$total" 'BEGIN { printf "%.1f", b / 1048576 }') MiB in $DEST (limit $LIMIT_MIB MiB)"
[ "$total" -le $((LIMIT_MIB * 1048576)) ] || { echo "gpu_wheels: $DEST is over the $LIMIT_MIB MiB limit" >&2; exit 1; }
