"""torch_api: the PyTorch frontend of ot_triton_jax.

``sinkhorn``, ``sinkhorn_divergence`` and ``hvp`` (OTT-JAX conventions), ``SamplesLoss`` (GeomLoss conventions) and
the mHC layer ``FusedMHC`` / ``mhc_sinkhorn``, all on the Triton kernels of
``ot_triton_jax.core.kernels``. Importing this package never imports jax.

Without a CUDA device the kernels run under the Triton interpreter (slow; for
tests and small problems).
"""

from __future__ import annotations

import importlib

import torch

from ot_triton_jax.core import runtime as _runtime

_runtime.configure(torch.cuda.is_available())

_LAZY = {
    "sinkhorn": ".sinkhorn_solver",
    "SinkhornOutput": ".sinkhorn_solver",
    "MultiscaleOptions": ".sinkhorn_solver",
    "MultiscaleSinkhornOutput": ".sinkhorn_solver",
    "sinkhorn_divergence": ".divergence",
    "SinkhornDivergenceOutput": ".divergence",
    "SamplesLoss": ".samples_loss",
    "mhc_sinkhorn": ".mhc",
    "FusedMHC": ".mhc",
    "hvp": ".hessian_vector",
    "HVPInfo": ".hessian_vector",
    "ImplicitOptions": ".hessian_vector",
    "sinkhorn_batch": ".batched",
    "BatchedSinkhornOutput": ".batched",
    "segment_sinkhorn": ".batched",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name == "distributed":  # torch_api.distributed: the sharded solves (torch.distributed)
        return importlib.import_module(".distributed", __name__)
    if name in _LAZY:
        value = globals()[name] = getattr(importlib.import_module(_LAZY[name], __name__), name)
        return value
    raise AttributeError(f"module 'torch_api' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
