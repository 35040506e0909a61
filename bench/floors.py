"""Hardware floors of the streaming workloads: the time below which no kernel can run them.

Rates measured on the H100 (80GB HBM3) by micro-benchmarks: exp2 4.17e12 /s (special-function units,
Triton kernel), FP32 FMA 32.6e12 /s (Triton kernel), TF32 GEMM 369e12 flop/s and BF16/FP16 GEMM
686e12 flop/s (cuBLAS, 8192^3), HBM copy 3.03e12 B/s. The floors use these rates on any device.

One LSE half-step over n x m pairs is bounded by the largest of: n m exponentials at the exp2 rate;
2 n m d flop per tensor-core product ("float32" runs the cross term as three products of split
operands, "tf32" as one) at the FP16 rate where the kernels take FP16 operands
(launch_plans.fp16_operands(d)) and the TF32 rate otherwise; one FP32 add per pair; the clouds and
potentials read once from HBM. A solve's floor is that bound times its half-steps:

* ``sinkhorn_10it`` / ``jax_sinkhorn_100it``: 2 per iteration (a g- and an f-update) plus OTT's final
  marginal check: 2 iters + 1;
* ``samples_loss_grad`` (GeomLoss's debiased anneal + gradient in x, n == m): with L eps values,
  L + 2 sweeps (initialisation, one per eps, the final extrapolation) of 4 softmins (x<-y, y<-x,
  x<-x, y<-y), then 2 backward passes (P y and Q x), each counted as one half-step: 4 (L + 2) + 2.

mHC (B matrices n x n, float32) is bounded by memory: forward 2 x 4 n^2 bytes per matrix (read the
logits, write the result), forward + backward 5 x 4 n^2 (also read the logits and the output gradient,
write the input gradient).
"""

from __future__ import annotations

EXP2_RATE = 4.17e12   # exp2 per s
TF32_RATE = 369e12    # TF32 flop per s
FP16_RATE = 686e12    # FP16 flop per s
FMA_RATE = 32.6e12    # FP32 FMA per s
HBM_RATE = 3.03e12    # bytes per s
CONSTANTS = {"exp2_per_s": EXP2_RATE, "tf32_flop_per_s": TF32_RATE, "fp16_flop_per_s": FP16_RATE,
             "fp32_fma_per_s": FMA_RATE, "hbm_bytes_per_s": HBM_RATE,
             "source": "H100 80GB HBM3 micro-benchmarks (exp2, FMA: Triton kernels; GEMM: cuBLAS 8192^3; HBM copy)"}
TENSOR_PRODUCTS = {"float32": 3, "tf32": 1}
FP32_OPS_PER_PAIR = 1  # the running sum's add: the exp2 argument can come out of the tensor cores
WORKLOADS = ("sinkhorn_10it", "jax_sinkhorn_100it", "samples_loss_grad")


def half_step_seconds(n: int, m: int, d: int, precision: str) -> dict[str, float]:
    """Lower bounds in seconds of one LSE half-step over n x m pairs, one per unit."""
    from ot_triton_jax.core.launch_plans import fp16_operands  # framework-free
    pairs = n * m
    rate = FP16_RATE if fp16_operands(d) else TF32_RATE
    return {"exp2": pairs / EXP2_RATE, "tensor": TENSOR_PRODUCTS[precision] * 2.0 * pairs * d / rate,
            "fp32_fma": FP32_OPS_PER_PAIR * pairs / FMA_RATE, "hbm": (n + m) * (d + 2) * 4 / HBM_RATE}


def floor_ms(workload: str, n: int, m: int, d: int, precision: str, half_steps: int) -> tuple[float, str]:
    """(floor in ms, the unit that bounds it) of ``half_steps`` LSE half-steps of ``workload``."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}")
    if workload == "samples_loss_grad" and n != m:
        raise ValueError("samples_loss_grad floors count the self terms as n x m pairs: they need n == m")
    terms = half_step_seconds(n, m, d, precision)
    unit = max(terms, key=terms.__getitem__)
    return half_steps * terms[unit] * 1e3, unit


def sinkhorn_half_steps(iterations: int) -> int:
    return 2 * iterations + 1


def samples_loss_half_steps(diameter: float, blur: float, scaling: float) -> int:
    from ot_triton_jax.core.schedules import epsilon_schedule  # numpy only
    return 4 * (len(epsilon_schedule(2, diameter, blur, scaling)) + 2) + 2


def mhc_floor_bytes(n: int, mode: str) -> int:
    """Bytes per n x n float32 matrix: mode "fwd" or "fwd_bwd"."""
    return (2 if mode == "fwd" else 5) * 4 * n * n


def mhc_floor_ms(batch: int, n: int, mode: str) -> float:
    return batch * mhc_floor_bytes(n, mode) / HBM_RATE * 1e3
