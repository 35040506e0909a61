#!/usr/bin/env bash
# Everything the GPU machine runs, in one call: GPU tests, then the benchmarks.
# On the device machine (repo root, wheels in .whl/):  bash bench/run_gpu.sh [sweep|tests|bench|all]...
# Logs and JSON go to $OUT (if set) and bench/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
what=${*:-all}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
status=0
for step in $what; do
  case $step in
    sweep) python3 bench/sweep_plans.py 2>&1 | tee "$OUT/sweep.log" || status=1 ;;
    tests) python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" || status=1 ;;
    bench)
      for b in bench/bench_sinkhorn.py bench/bench_mhc.py bench/bench_jax_sinkhorn.py; do
        [ -f "$b" ] && { python3 "$b" 2>&1 | tee "$OUT/$(basename "$b" .py).log" || status=1; }
      done ;;
    all) bash "$0" tests bench || status=1 ;;
    *) python3 "$step" 2>&1 | tee "$OUT/$(basename "$step" .py).log" || status=1 ;;
  esac
done
exit $status
