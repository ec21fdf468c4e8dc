#!/usr/bin/env bash
# The GPU path in one command (benchmarks/README.md, "GPU check"): on a machine with CUDA and no network,
#   1. installs the wheels of .whl/ (benchmarks/gpu_wheels.sh downloads them) into a private target, and puts
#      that and the working tree on PYTHONPATH: the project is never pip-installed there;
#   2. (a) runs tests/test_cuda_path.py;
#   3. (b, c, d) runs benchmarks/gpu_bench.py: 8 GB saved and loaded through ZarrWriter/Reader,
#      FileSystemWriter/Reader and raw writes, on /dev/shm and local disk; dcp.async_save against a
#      device-to-pinned copy; peak GPU memory and host RSS. JSON and Markdown into --out.
# --dry-run runs the same steps on the CPU (gloo, 32 MB, 1 repeat) with the Python environment as it is, installing
# nothing, so that CI tests this script. --install-wheels installs the wheels in a dry run too (to test that step).
# Every argument after -- goes to gpu_bench.py (e.g. -- --size-gb 4 --disk-dir /mnt/nvme).
#
# The commit is stamped from GPU_CHECK_COMMIT, else from git (the device machine's copy of the tree has no .git).
# The exit status is non-zero if the tests or the benchmark failed; the benchmark runs even when the tests fail,
# so that one lent GPU slot shows both.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"
PY="${PYTHON:-python3}"
DRY=0
INSTALL=""
OUT="benchmarks/results/gpu"
BENCH_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --install-wheels) INSTALL=1 ;;
    --out) [ $# -ge 2 ] || { echo "gpu_check: --out needs a directory" >&2; exit 2; }; OUT="$2"; shift ;;
    --) shift; BENCH_ARGS=("$@"); break ;;
    *) echo "gpu_check: unknown argument $1 (takes --dry-run, --out DIR, --install-wheels, -- BENCH_ARGS)" >&2
       exit 2 ;;
  esac
  shift
done
[ -n "$INSTALL" ] || INSTALL=$((1 - DRY))
mkdir -p "$OUT" || { echo "gpu_check: cannot create --out $OUT" >&2; exit 2; }
OUT="$(cd "$OUT" && pwd)"
START=$SECONDS
step() { echo "[gpu_check $((SECONDS - START))s] $*"; }

# 1. The environment.
if [ "$INSTALL" = 1 ]; then
  SITE="${GPU_CHECK_SITE:-/tmp/gpu-check-site}"
  shopt -s nullglob
  wheels=(.whl/*.whl)
  shopt -u nullglob
  if [ ${#wheels[@]} -eq 0 ]; then
    echo "gpu_check: no wheels in $REPO/.whl: run 'bash benchmarks/gpu_wheels.sh' where pip reaches PyPI, and" \
         "carry .whl to this machine" >&2
    exit 2
  fi
  step "installing ${#wheels[@]} wheels into $SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "${wheels[@]}" || { echo "gpu_check: installing .whl/*.whl into $SITE failed" >&2; exit 2; }
  # The project's zarr entry points (bf16/fp8 data types) without installing it: a dist-info beside the wheels,
  # made from pyproject.toml, points zarr at dcp_zarr's modules, which import from the working tree. (dcp_zarr
  # registers the types itself when imported; this covers zarr reading such an array before anything imports it.)
  "$PY" - "$SITE" <<'EOF' || { echo "gpu_check: writing dcp_zarr's entry points into the target failed" >&2; exit 2; }
import pathlib, sys, tomllib
project = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
info = pathlib.Path(sys.argv[1]) / f"dcp_zarr-{project['version']}.dist-info"
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
sections = [f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in entries.items())
            for group, entries in project.get("entry-points", {}).items()]
(info / "entry_points.txt").write_text("\n".join(sections))
EOF
  export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
"$PY" - <<'EOF' || { echo "gpu_check: the environment lacks a package dcp_zarr needs (see above)" >&2; exit 2; }
import sys, torch, zarr, numcodecs, crc32c, dcp_zarr
print(f"gpu_check: Python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}, "
      f"available: {torch.cuda.is_available()}), zarr {zarr.__version__}, numcodecs {numcodecs.__version__}, "
      f"dcp_zarr from {dcp_zarr.__file__}")
EOF
if [ "$DRY" = 0 ] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: torch.cuda.is_available() is False here; use --dry-run on a machine without CUDA" >&2
  exit 2
fi
status=0

# 2. (a) The CUDA-path tests. --noconftest: tests/conftest.py imports the S3 fixtures' moto, which the GPU machine
# lacks; this file needs none of its fixtures (the marker checks it arms are for the whole suite's selections).
step "(a) tests/test_cuda_path.py"
"$PY" -m pytest -q -rs --noconftest -p no:cacheprovider tests/test_cuda_path.py 2>&1 | tee "$OUT/cuda_tests.log"
tests_rc=${PIPESTATUS[0]}
if [ "$tests_rc" -ne 0 ]; then
  echo "gpu_check: tests/test_cuda_path.py failed (pytest exit $tests_rc; $OUT/cuda_tests.log)" >&2
  status=1
elif [ "$DRY" = 0 ] && grep -q "skipped" "$OUT/cuda_tests.log"; then
  echo "gpu_check: tests/test_cuda_path.py skipped tests on a CUDA machine ($OUT/cuda_tests.log)" >&2
  status=1
fi
step "(a) done"

# 3. (b, c, d) The measurements.
step "(b-d) benchmarks/gpu_bench.py"
dry=()
[ "$DRY" = 1 ] && dry=(--dry-run)
"$PY" benchmarks/gpu_bench.py "${dry[@]}" --out "$OUT" "${BENCH_ARGS[@]}" 2>&1 | tee "$OUT/gpu_bench.log"
bench_rc=${PIPESTATUS[0]}
if [ "$bench_rc" -ne 0 ]; then
  echo "gpu_check: benchmarks/gpu_bench.py failed (exit $bench_rc; $OUT/gpu_bench.log)" >&2
  status=1
fi
step "done: $OUT/gpu_check.json, $OUT/gpu_check.md (exit $status)"
exit $status
