"""Where the kernels run: a CUDA GPU, or the Triton interpreter on the CPU.

Triton reads ``TRITON_INTERPRET`` when an ``@triton.jit`` function is *defined*,
so the choice must be made before ``ot_triton_jax.core.kernels`` is first imported.
Each frontend calls :func:`configure` with what it knows about the GPU (torch:
``torch.cuda.is_available()``; JAX: a ``gpu`` backend) before it imports the
kernels. Setting ``TRITON_INTERPRET=1`` yourself forces the interpreter.

This module imports no framework.
"""

from __future__ import annotations

import os
import sys

_configured: bool | None = None


def configure(has_gpu: bool) -> bool:
    """Choose GPU or interpreter once; return True when kernels run on the GPU.

    Later calls return the first answer: kernels cannot be redefined for the
    other mode inside one process.
    """
    global _configured
    if os.environ.get("TRITON_CACHE_DIR") == "":
        # jax_triton 0.3.1 sets it to "" on import; Triton then cannot compile anything.
        del os.environ["TRITON_CACHE_DIR"]
    if _configured is not None:
        return _configured
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        _configured = False
    elif not has_gpu:
        if "ot_triton_jax.core.kernels" in sys.modules:
            raise RuntimeError(
                "ot_triton_jax.core.kernels was imported before the runtime was configured; "
                "without a GPU set TRITON_INTERPRET=1 before importing it"
            )
        os.environ["TRITON_INTERPRET"] = "1"
        _configured = False
    else:
        _configured = True
    return _configured


def on_gpu() -> bool:
    """True when kernels were configured to run on a CUDA GPU."""
    if _configured is None:
        raise RuntimeError("ot_triton_jax.core.runtime.configure() has not been called yet")
    return _configured
