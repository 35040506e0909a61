"""Parity harness (``python -m parity``): our solvers against OTT-JAX and GeomLoss.

For now a short report on one problem: torch_api.sinkhorn and
ot_triton_jax.sinkhorn against OTT-JAX (cost, potentials, marginal error,
time). Runs on the GPU when there is one, under the Triton interpreter otherwise.
"""
