#!/usr/bin/env bash
# The GPU path in one command, on a machine with CUDA and no network (benchmarks/README.md, "GPU check"): 1. installs
# .whl/*.whl into a private target (the project is never pip-installed; --install-wheels: on a --dry-run too), 2. (a)
# tests/save_load/test_cuda_path.py, 3. (b-d) python -m benchmarks.gpu_bench, even when (a) failed: one lent GPU slot
# shows both; exits non-zero if either failed. GPU_CHECK_COMMIT stamps the commit (that machine's tree has no .git).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)" PY="${PYTHON:-python3}" DRY=0 INSTALL="" OUT="benchmarks/results/gpu" BENCH_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --install-wheels) INSTALL=1 ;;
    --out) [ $# -ge 2 ] || { echo "gpu_check: --out needs a directory" >&2; exit 2; }; OUT="$2"; shift ;;
    --) shift; BENCH_ARGS=("$@"); break ;;
    *) echo "gpu_check: unknown argument $1 (takes --dry-run, --out DIR, --install-wheels, -- BENCH_ARGS)" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$INSTALL" ] || INSTALL=$((1 - DRY))
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)" || { echo "gpu_check: cannot create --out $OUT" >&2; exit 2; }
export BENCH_COMMIT="${GPU_CHECK_COMMIT:-${BENCH_COMMIT:-}}" PYTHONUNBUFFERED=1 PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
START=$SECONDS
step() { echo "[gpu_check $((SECONDS - START))s] $*"; }
if [ "$INSTALL" = 1 ]; then  # 1. the environment
  SITE="${GPU_CHECK_SITE:-/tmp/gpu-check-site}"
  shopt -s nullglob; wheels=(.whl/*.whl); shopt -u nullglob
  [ ${#wheels[@]} -gt 0 ] || { echo "gpu_check: no wheels in $REPO/.whl: run 'bash benchmarks/gpu_wheels.sh' where pip" \
    "reaches PyPI, and carry .whl to this machine" >&2; exit 2; }
  step "installing ${#wheels[@]} wheels into $SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}" \
    || { echo "gpu_check: installing .whl/*.whl into $SITE failed" >&2; exit 2; }
  # zarr finds the bf16/fp8 data types through entry points: a dist-info beside the wheels, made from pyproject.toml,
  # points it at dcp_zarr's modules in the working tree (dcp_zarr also registers them when imported).
  "$PY" - "$SITE" <<'PY' || { echo "gpu_check: writing dcp_zarr's entry points into the target failed" >&2; exit 2; }
import pathlib, sys, tomllib
project = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
info = pathlib.Path(sys.argv[1]) / f"dcp_zarr-{project['version']}.dist-info"
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
(info / "entry_points.txt").write_text("\n".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items())
                                                 for group, entries in project.get("entry-points", {}).items()))
PY
  export PYTHONPATH="$SITE:$PYTHONPATH"
fi
"$PY" - "$DRY" <<'PY' || { echo "gpu_check: the environment is not ready (see above)" >&2; exit 2; }
import sys, torch, zarr, numcodecs, crc32c, dcp_zarr  # the packages dcp_zarr needs
print(f"gpu_check: Python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}, available: "
      f"{torch.cuda.is_available()}), zarr {zarr.__version__}, numcodecs {numcodecs.__version__}, dcp_zarr from "
      f"{dcp_zarr.__file__}")
if sys.argv[1] == "0" and not torch.cuda.is_available():
    sys.exit("gpu_check: torch.cuda.is_available() is False here; use --dry-run on a machine without CUDA")
PY
status=0
step "(a) tests/save_load/test_cuda_path.py"  # 2.
# --noconftest: the suite's conftest imports moto, which that machine lacks
"$PY" -m pytest -q -rs --noconftest -p no:cacheprovider tests/save_load/test_cuda_path.py 2>&1 | tee "$OUT/cuda_tests.log"
tests_rc=${PIPESTATUS[0]}
if [ "$tests_rc" -ne 0 ]; then
  echo "gpu_check: tests/save_load/test_cuda_path.py failed (pytest exit $tests_rc; $OUT/cuda_tests.log)" >&2; status=1
elif [ "$DRY" = 0 ] && grep -q "skipped" "$OUT/cuda_tests.log"; then
  echo "gpu_check: tests/save_load/test_cuda_path.py skipped tests on a CUDA machine ($OUT/cuda_tests.log)" >&2; status=1
fi
step "(b-d) python -m benchmarks.gpu_bench"  # 3.
dry=(); [ "$DRY" = 1 ] && dry=(--dry-run)
"$PY" -m benchmarks.gpu_bench "${dry[@]}" --out "$OUT" "${BENCH_ARGS[@]}" 2>&1 | tee "$OUT/gpu_bench.log"
bench_rc=${PIPESTATUS[0]}
[ "$bench_rc" -eq 0 ] || { echo "gpu_check: benchmarks.gpu_bench failed (exit $bench_rc; $OUT/gpu_bench.log)" >&2; status=1; }
step "done: $OUT/gpu_check.json, $OUT/gpu_check.md (exit $status)"
exit $status
