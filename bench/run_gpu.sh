#!/usr/bin/env bash
# The GPU machine's run: install the peers' wheels, then the GPU tests and/or the benchmark suite,
# each step bounded in time, and pack logs and results into $OUT/gpu_run.tgz.
#
#   bash bench/run_gpu.sh tests                 # pytest -m gpu, 6 workers on the one GPU (~380 s on an H200; bound: 570 s)
#   bash bench/run_gpu.sh quick                 # every area, reduced (~400 s)      (bound: 580 s)
#   bash bench/run_gpu.sh suite_a               # sinkhorn samples_loss jax mhc (~410 s)
#   bash bench/run_gpu.sh suite_b               # multiscale hvp (~450 s)
#   bash bench/run_gpu.sh suite AREA...         # the named areas
#
# One device call takes one 10-minute step: the GPU tests in one call (six pytest-xdist workers share the
# GPU; most of a test's time is Triton and XLA compiling on the CPU), the full suite suite_a and suite_b in
# two more.
# Wheels (Python 3.12, no network on the machine): .whl/ in the repository root, made by
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl \
#     jax-triton==0.3.1 ott-jax==0.6.0 jaxopt==0.8.5 geomloss==0.3.1 flash-sinkhorn==0.4.1 \
#     pytest-xdist==3.8.0 execnet==2.1.2
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
LOGS=${LOGS:-/tmp/gpu_logs}; mkdir -p "$LOGS"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv > "$LOGS/gpu.txt"
# BOUND: seconds for the step (default 570 / 580); keep it below the device call's own limit, or the
# call is killed first. Whatever ends the script (the step's end, its bound, a TERM from the device
# call's limit), the logs and the results written so far are packed into $OUT/gpu_run.tgz
status=0
pack() {
  [ -n "${OUT:-}" ] && tar czf "$OUT/gpu_run.tgz" -C "$LOGS" . -C "$PWD" bench/results bench/peer_autotune_cache
}
trap 'pack; exit $status' EXIT
trap 'status=143; exit' TERM INT
step() {  # step SECONDS LOGNAME COMMAND...
  local bound=${BOUND:-$1} log=$2; shift 2
  timeout "$bound" "$@" 2>&1 | tee "$LOGS/$log.log" || status=1
}
case ${1:-quick} in
  tests)   step 570 gpu_tests python3 -m pytest -q -m gpu -n 6 -p no:cacheprovider -rfE --durations=15 tests ;;
  quick)   step 580 suite_quick python3 bench/suite.py --quick ;;
  suite_a) step 580 suite_a python3 bench/suite.py --area sinkhorn samples_loss jax mhc ;;
  suite_b) step 580 suite_b python3 bench/suite.py --area multiscale hvp ;;
  suite)   shift; step 580 suite python3 bench/suite.py --area "$@" ;;
  *) echo "unknown step $1" >&2; status=2 ;;
esac
