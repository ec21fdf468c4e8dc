#!/usr/bin/env bash
# Run the demo's 2-rank save phase N times (default 100) and count abnormal exits (docs/usage.md "Clean exits").
# Exit status 1 if any run exited non-zero or printed "terminate called".
set -uo pipefail
runs="${1:-100}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
failed=0
for i in $(seq 1 "$runs"); do
  if ! torchrun --nproc-per-node 2 "$(dirname "$0")/train_resume.py" --phase train --root "$work/run" \
      > "$work/run.log" 2>&1 || grep -q "terminate called" "$work/run.log"; then
    failed=$((failed + 1))
    echo "run $i exited abnormally:"; grep -m 3 -E "terminate called|exitcode|Error" "$work/run.log"
  fi
  rm -rf "$work/run"
done
echo "$((runs - failed)) of $runs runs exited cleanly"
[ "$failed" -eq 0 ]
