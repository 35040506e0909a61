"""ot_triton_jax: entropic optimal transport on streaming Triton kernels.

The top level is the JAX API; it is imported lazily so that ``torch_api`` (which
uses ``ot_triton_jax.core.kernels`` and ``ot_triton_jax.core.launch_plans``) never imports jax.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it (imported on first access)
_LAZY = {
    "sinkhorn": ".jax_frontend.sinkhorn_solver",
    "SinkhornOutput": ".jax_frontend.sinkhorn_solver",
    "MultiscaleOptions": ".jax_frontend.sinkhorn_solver",
    "MultiscaleSinkhornOutput": ".jax_frontend.sinkhorn_solver",
    "samples_loss": ".jax_frontend.samples_loss",
    "segment_sinkhorn": ".jax_frontend.segment",
    "last_multiscale_report": ".jax_frontend.samples_loss_multiscale",
    "sinkhorn_divergence": ".jax_frontend.divergence",
    "mhc_sinkhorn": ".jax_frontend.mhc",
    "hvp": ".jax_frontend.hessian_vector",
    "HVPInfo": ".jax_frontend.hessian_vector",
    "ImplicitOptions": ".jax_frontend.hessian_vector",
    "to_torch": ".jax_frontend.interop",
    "from_torch": ".jax_frontend.interop",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name == "distributed":  # ot_triton_jax.distributed: the solve sharded over a mesh
        return importlib.import_module(".jax_frontend.distributed", __name__)
    if name == "ott":  # ot_triton_jax.ott: OTT-JAX's geometry on the kernels (needs ott-jax)
        return importlib.import_module(".ott", __name__)
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name], __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'ot_triton_jax' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
