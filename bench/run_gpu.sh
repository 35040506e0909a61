#!/usr/bin/env bash
# Everything the GPU machine runs, in one call: GPU tests, then the benchmarks.
# On the device machine (repo root, wheels in .whl/):  bash bench/run_gpu.sh [sweep|tests|bench|suite|suite_a|suite_b|multiscale|ncu|all|SCRIPT.py]...
# Logs go to $LOGS; result JSON to bench/results/; both are packed into $OUT/gpu_run.tgz when $OUT is set.
# STEP_TIMEOUT (seconds, default 900) bounds each step, so that a slow step still leaves the archive.
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=${LOGS:-/tmp/gpu_logs}; mkdir -p "$LOGS"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv > "$LOGS/gpu.txt"
status=0
T=${STEP_TIMEOUT:-900}
run_step() {
  case $1 in
    sweep) timeout "$T" python3 bench/sweep_plans.py 2>&1 | tee "$LOGS/sweep.log" || status=1 ;;
    tests) timeout "$T" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests 2>&1 | tee "$LOGS/gpu_tests.log" || status=1 ;;
    suite) timeout 600 python3 bench/suite.py 2>&1 | tee "$LOGS/suite.log" || status=1 ;;
    # without flash-sinkhorn's kept autotuning results (bench/results/flash_autotune) the suite takes ~700 s
    # on the H100: two device calls, each one step; the second merges its rows into the first's JSON (copy
    # that JSON and the new autotuning results back into the checkout between them)
    suite_a) timeout 580 python3 bench/suite.py --only "sinkhorn_10it|jax" --merge 2>&1 | tee "$LOGS/suite_a.log" || status=1 ;;
    suite_b) timeout 580 python3 bench/suite.py --only "samples_loss" --merge 2>&1 | tee "$LOGS/suite_b.log" || status=1 ;;
    # issue 15: the multiscale GPU tests (first compile of the block-sparse kernels), then its benchmark
    multiscale)
      timeout "$T" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_multiscale_gpu.py 2>&1 | tee "$LOGS/gpu_tests_multiscale.log" || status=1
      run_step bench/bench_multiscale.py ;;
    # issue 15's first-call target: cold Triton cache at 2^20 with and without the parallel prewarm, then its GPU test
    firstcall)
      timeout 300 python3 bench/probe_first_call.py 2>&1 | tee "$LOGS/probe_first_call.log" || status=1
      timeout 300 python3 bench/probe_first_call.py --no-prewarm 2>&1 | tee "$LOGS/probe_first_call_no_prewarm.log" || status=1
      timeout "$T" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_multiscale_gpu.py -k first_call 2>&1 | tee "$LOGS/gpu_test_first_call.log" || status=1 ;;
    # what session 14 built without a GPU, in one ~10-minute call: cold first call with and without the
    # prewarm, every multiscale GPU test (Anderson finishing, OTT-convention option, prewarm), the
    # uniform rows to 2^20 and the randn row at 2^16 (Anderson vs the old 200-step stall)
    verify14)
      run_step firstcall
      timeout 360 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_multiscale_gpu.py -k "not first_call" 2>&1 | tee "$LOGS/gpu_tests_multiscale.log" || status=1
      timeout 240 python3 bench/bench_multiscale.py --big 0 2>&1 | tee "$LOGS/bench_multiscale.log" || status=1
      timeout 120 python3 bench/bench_multiscale.py --sizes 65536 --big 0 --data randn 2>&1 | tee "$LOGS/bench_multiscale_randn.log" || status=1 ;;
    # what session 15 left unrun for lack of device time: the d = 64 float32 test at 65536 points (the
    # retuned plan), the dense GPU tests, then the whole suite (OTT online peers; the 65536 x 64 row)
    verify15)
      timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_torch_sinkhorn_gpu.py 2>&1 | tee "$LOGS/gpu_tests_dense.log" || status=1
      run_step suite ;;
    # session 16: the FP16 parts for d > 16 (kernels/split.py): the dense torch GPU tests (d = 17, 64, 256
    # against float64, the scale test), then the solve-level A/B against TF32 parts
    verify16)
      timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_torch_sinkhorn_gpu.py 2>&1 | tee "$LOGS/gpu_tests_dense.log" || status=1
      timeout 220 python3 bench/probe_fp16_solve.py 2>&1 | tee "$LOGS/probe_fp16_solve.log" || status=1 ;;
    # issue 16's profiler evidence: Nsight Compute on the LSE half-step of the bar workloads
    ncu)
      for w in "65536 64 float32" "65536 64 tf32" "65536 3 float32" "65536 3 tf32" "262144 3 float32"; do
        timeout 120 /usr/local/cuda/bin/ncu --kernel-name regex:lse_update_kernel --launch-skip 4 --launch-count 1 \
          --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy \
          python3 bench/ncu_target.py $w 2>&1 | tee "$LOGS/ncu_lse_${w// /_}.log" || status=1
      done ;;
    # session 19 (torch solve host path), three device calls on the final code: (a) the suite, the host
    # probe, the HVP and multiscale GPU tests; (b) the dense torch / JAX GPU tests; (c) the mHC GPU tests
    verify19a)
      run_step suite
      run_step bench/probe_solve_host.py
      timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_hvp_gpu.py 2>&1 | tee "$LOGS/gpu_tests_hvp.log" || status=1
      timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_multiscale_gpu.py 2>&1 | tee "$LOGS/gpu_tests_multiscale.log" || status=1 ;;
    verify19b)
      timeout 560 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --durations=15 tests/test_torch_sinkhorn_gpu.py \
        tests/test_torch_graphs_gpu.py tests/test_torch_launch.py tests/test_torch_compile_samples_loss.py tests/test_jax_gpu.py \
        tests/test_jax_summation.py tests/test_jax_vmap.py tests/test_lse_pair.py 2>&1 | tee "$LOGS/gpu_tests_dense.log" || status=1 ;;
    verify19c)
      timeout 560 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --durations=10 tests/test_mhc_gpu.py 2>&1 | tee "$LOGS/gpu_tests_mhc.log" || status=1 ;;
    # session 21 (the gradient's softmin mean on the tensor cores, the packed parts' ones column), in one
    # call: cold first call at 2^20, the multiscale GPU tests, the uniform rows with the JAX twin and 2^22,
    # the HVP row at 2^18, the phase probe at 2^20
    verify21)
      timeout 150 python3 bench/probe_first_call.py 2>&1 | tee "$LOGS/probe_first_call.log" || status=1
      timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_multiscale_gpu.py 2>&1 | tee "$LOGS/gpu_tests_multiscale.log" || status=1
      timeout 240 python3 bench/bench_multiscale.py --jax 2>&1 | tee "$LOGS/bench_multiscale.log" || status=1
      timeout 90 python3 bench/bench_multiscale.py --hvp 262144 2>&1 | tee "$LOGS/bench_multiscale_hvp.log" || status=1
      timeout 60 python3 bench/probe_multiscale_phases.py --sizes 1048576 2>&1 | tee "$LOGS/phases.log" || status=1 ;;
    # session 19: pipe utilizations and stall reasons of the current LSE half-step for the two rows at or
    # above their bars (tensor, XU = MUFU exp2, FMA, ALU pipes; stall reasons per issued instruction)
    ncu19)
      for w in "65536 64 tf32" "65536 3 float32"; do
        timeout 170 /usr/local/cuda/bin/ncu --kernel-name regex:lse_update_kernel --launch-skip 4 --launch-count 1 \
          --section SpeedOfLight --section Occupancy --section WarpStateStats \
          --metrics "regex:sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active,regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,sm__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active" \
          python3 bench/ncu_target.py $w 2>&1 | tee "$LOGS/ncu19_lse_${w// /_}.log" || status=1
      done ;;
    bench) for b in bench/bench_sinkhorn.py bench/bench_jax_sinkhorn.py bench/bench_mhc.py; do run_step "$b"; done ;;
    all) run_step tests; run_step bench ;;
    # the restructuring issue's device run: OT / JAX / compile / vmap GPU tests, the new mHC GPU tests
    # (CUDA graphs, inductor, no sync, JAX agreement), then the benchmarks it asks for
    issue12)
      timeout "$T" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_jax_gpu.py tests/test_torch_sinkhorn_gpu.py \
        tests/test_torch_launch.py tests/test_jax_vmap.py tests/test_torch_compile_samples_loss.py tests/test_mhc_gpu.py \
        -k "not (forward_gpu or unrolled_grad or implicit_converged or low_precision)" 2>&1 | tee "$LOGS/gpu_tests.log" || status=1
      for b in bench/bench_sinkhorn.py bench/bench_jax_vmap.py; do run_step "$b"; done
      timeout "$T" python3 bench/bench_mhc.py --headline 2>&1 | tee "$LOGS/bench_mhc_headline.log" || status=1 ;;
    # the second-order issue's device run: HVP accuracy / memory tests, then the HVP benchmark
    issue13)
      timeout "$T" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE -s tests/test_hvp_gpu.py 2>&1 | tee "$LOGS/gpu_tests_hvp.log" || status=1
      run_step bench/bench_hvp.py ;;
    *) timeout "$T" python3 "$1" 2>&1 | tee "$LOGS/$(basename "$1" .py).log" || status=1 ;;
  esac
}
for step in ${*:-all}; do run_step "$step"; done
if [ -n "${OUT:-}" ]; then
  cp bench/results/*.json "$LOGS/" 2>/dev/null
  tar czf "$OUT/gpu_run.tgz" -C "$LOGS" .
fi
exit $status
