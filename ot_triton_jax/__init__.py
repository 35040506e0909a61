"""ot_triton_jax: entropic optimal transport on streaming Triton kernels.

The top level is the JAX API; it is imported lazily so that ``torch_api`` (which
uses ``ot_triton_jax.kernels`` and ``ot_triton_jax.launch_plans``) never imports jax.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it (imported on first access)
_LAZY = {
    "sinkhorn": ".jax_sinkhorn",
    "SinkhornOutput": ".jax_sinkhorn",
    "samples_loss": ".jax_samples_loss",
    "sinkhorn_divergence": ".jax_samples_loss",
    "mhc_sinkhorn": ".jax_mhc",
    "to_torch": ".interop",
    "from_torch": ".interop",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name], __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'ot_triton_jax' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
