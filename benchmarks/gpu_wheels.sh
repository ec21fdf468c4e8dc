#!/usr/bin/env bash
# Download, into .whl/ (git-ignored), the wheels that the lent GPU machine lacks for dcp_zarr, so that
# benchmarks/gpu_check.sh can install them there without a network. Run it here, where pip reaches PyPI.
#
# That machine: Python 3.12 (CPython, manylinux x86-64) with torch 2.11 (CUDA 13), numpy 2.5, ml_dtypes, fsspec,
# tensorstore, xarray, pytest, psutil, pyyaml, packaging and typing-extensions, and no network. It lacks zarr and
# what zarr needs beyond that list. The pins are the set CI's Python 3.12 pass runs (zarr 3.4, numpy 2.5), each
# inside pyproject.toml's ranges; every wheel's Requires-Dist was checked against the machine's packages:
#   zarr 3.4.2          -> donfig, google-crc32c, msgspec, numcodecs, numpy, packaging, typing-extensions>=4.14
#   numcodecs 0.17.1    -> numpy, typing_extensions (crc32c is its extra, which dcp_zarr needs itself)
#   donfig 0.8.1.post1  -> pyyaml (on the machine)
#   msgspec, google-crc32c, crc32c, typing_extensions -> nothing
# typing_extensions travels although the machine has one: zarr 3.4 needs >= 4.14, and that one's version is unknown.
#
# Usage: bash benchmarks/gpu_wheels.sh [DIR]   (DIR defaults to .whl in the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${1:-.whl}"
LIMIT_MIB=40  # the working tree and the wheels travel together, 64 MiB at most

WHEELS=(
  zarr==3.4.2
  numcodecs==0.17.1
  msgspec==0.23.0
  donfig==0.8.1.post1
  google-crc32c==1.9.0
  crc32c==2.9.post0
  typing_extensions==4.16.0
)

mkdir -p "$DEST"
# One version of each package only: two wheels of one name stop pip's install there. Older downloads go first.
for spec in "${WHEELS[@]}"; do
  name="${spec%%==*}"
  file_prefix="$(echo "$name" | tr '-' '_')"
  version="${spec##*==}"
  for old in "$DEST/$file_prefix"-*.whl; do
    [ -e "$old" ] || continue
    case "$old" in "$DEST/$file_prefix-$version-"*) ;; *) echo "gpu_wheels: removing $old (not $spec)"; rm -f "$old" ;; esac
  done
done

PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d "$DEST" "${WHEELS[@]}"

# Exactly one wheel per pinned package, and nothing else: a stray wheel would be installed there too.
expected="${#WHEELS[@]}"
found="$(find "$DEST" -maxdepth 1 -type f -name '*.whl' | wc -l)"
if [ "$found" -ne "$expected" ]; then
  echo "gpu_wheels: expected $expected wheels in $DEST, found $found:" >&2
  ls -1 "$DEST" >&2
  exit 1
fi

ls -l "$DEST"/*.whl | awk '{printf "  %9d  %s\n", $5, $NF}'
total_bytes="$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)"
total_mib="$(awk -v b="$total_bytes" 'BEGIN { printf "%.1f", b / 1048576 }')"
echo "gpu_wheels: $found wheels, $total_mib MiB in $DEST (limit $LIMIT_MIB MiB)"
if [ "$total_bytes" -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "gpu_wheels: $DEST holds $total_mib MiB, over the $LIMIT_MIB MiB limit" >&2
  exit 1
fi
