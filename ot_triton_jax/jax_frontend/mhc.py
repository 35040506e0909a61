"""mHC: batched Sinkhorn-Knopp on the fused Triton kernels (JAX frontend).

``mhc_sinkhorn(logits)`` is the JAX twin of ``torch_api.mhc_sinkhorn``: the
same kernels (``core/kernels/mhc.py``) with the same launch plans
(``core.mhc_plans.mhc_plan``) and the same validation rules and messages
(``core.mhc_checks``), through :func:`ot_triton_jax.jax_frontend.launch.launch`
(``jax_triton.triton_call`` on a GPU, a DLPack ``buffer_callback`` into the
Triton interpreter or the GPU otherwise).

Semantics (float32 arithmetic, result in the input dtype; float64 logits are
cast to float32 for the kernels and the result and gradient cast back):

    P = exp(M);  then ``iters`` times:  P <- P / (1^T P + eps)   (normalize columns)
                                        P <- P / (P 1 + eps)     (normalize rows)

``start="rows"`` normalizes rows first. ``eps`` >= 0 is added to every
denominator, the first one included (``exp(M_ij) / (sum_i exp(M_ij) + eps)``);
the first normalization subtracts the column max (eps rescaled to match), so
finite logits never overflow. See ``torch_api.mhc`` for the full statement
(underflow, NaN).

Differentiation: ``jax.custom_vjp``. ``backward="unrolled"`` (default) is the
exact gradient of the ``iters``-step map, computed by a kernel that replays
the forward on chip (only the logits are saved as residual; beyond the
plan's SEG iterations its cost grows as iters^2 / (2 SEG), see torch_api.mhc);
``backward="implicit"`` is the gradient of the Sinkhorn fixed point (the
corrected system (diag(c) - R^T diag(r)^-1 R) v = s_c - R^T diag(r)^-1 s_r
solved in the kernel), exact only when the forward has converged. No
forward-mode (``jax.jvp``) and no second derivatives.

Batching: any leading batch shape. ``jax.vmap`` of ``mhc_sinkhorn`` and of
``jax.grad`` through it folds the mapped axis into the batch
(``custom_vmap`` rules on both kernel calls): a vmapped call is one kernel
launch per pass, not a loop.

Bad input: shapes, dtypes and static options are checked at trace time
(``ValueError`` / ``TypeError`` naming the argument). Finite logits are checked
only on request: ``check_finite=True`` with a concrete ``logits`` (eager call;
reads the result of a reduction on the host). By default
(``check_finite=False``), and always under ``jit``/``grad``/``vmap`` tracing,
a NaN or +inf logit makes its own matrix NaN (output and gradient) and nothing
else; a -inf logit is an exact zero entry (NaN only if a whole row or column
is -inf).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .launch import kernels_on_gpu, launch
from ..core import mhc_checks as rules
from ..core.mhc_plans import mhc_plan

kernels_on_gpu()  # before the kernels are imported: GPU or interpreter

from ..core.kernels.mhc import (  # noqa: E402
    mhc_backward_implicit_kernel,
    mhc_backward_unrolled_kernel,
    mhc_forward_kernel,
)

__all__ = ["mhc_sinkhorn", "BACKWARDS", "STARTS"]

BACKWARDS = rules.BACKWARDS
STARTS = rules.STARTS
_CAST_HINT = ".astype(jnp.float32)"

_BWD_KERNELS = {"unrolled": mhc_backward_unrolled_kernel, "implicit": mhc_backward_implicit_kernel}


def _launch_one(kind, kernel, arrays, dtype, shape, iters, rows_first, eps, backend):
    """Run one mHC kernel on (..., n, n) arrays; returns a (..., n, n) array of ``dtype``."""
    n = shape[-1]
    batch = int(np.prod(shape[:-2], dtype=np.int64))
    if batch == 0:
        return jnp.zeros(shape, dtype)
    plan = mhc_plan(kind, batch, n, iters, rows_first, eps > 0, kernels_on_gpu())
    flat = [jnp.reshape(a, (batch, n, n)) for a in arrays]
    params = jnp.asarray([eps], jnp.float32)
    (out,) = launch(kernel, plan, [*flat, params, batch],
                    [jax.ShapeDtypeStruct((batch, n, n), dtype)], backend=backend)
    return jnp.reshape(out, shape)


def _fold_batched(axis_size, in_batched, *args):
    """custom_vmap helper: every argument with the mapped axis leading."""
    return [a if b else jnp.broadcast_to(a, (axis_size,) + a.shape) for a, b in zip(args, in_batched)]


def _forward_op(logits, iters, rows_first, eps, backend):
    @jax.custom_batching.custom_vmap
    def op(x):
        return _launch_one("forward", mhc_forward_kernel, [x], x.dtype, x.shape, iters,
                           rows_first, eps, backend)

    @op.def_vmap
    def _rule(axis_size, in_batched, x):
        (x,) = _fold_batched(axis_size, in_batched, x)
        return op(x), True

    return op(logits)


def _backward_op(logits, g, iters, backward, rows_first, eps, backend):
    kernel = _BWD_KERNELS[backward]

    @jax.custom_batching.custom_vmap
    def op(x, ct):
        return _launch_one(backward, kernel, [x, ct], x.dtype, x.shape, iters, rows_first, eps,
                           backend)

    @op.def_vmap
    def _rule(axis_size, in_batched, x, ct):
        x, ct = _fold_batched(axis_size, in_batched, x, ct)
        return op(x, ct), True

    return op(logits, g)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _mhc(logits, iters, backward, rows_first, eps, backend):
    return _forward_op(logits, iters, rows_first, eps, backend)


def _mhc_fwd(logits, iters, backward, rows_first, eps, backend):
    return _forward_op(logits, iters, rows_first, eps, backend), logits


def _mhc_bwd(iters, backward, rows_first, eps, backend, logits, g):
    g = jnp.asarray(g, logits.dtype)
    return (_backward_op(logits, g, iters, backward, rows_first, eps, backend),)


_mhc.defvjp(_mhc_fwd, _mhc_bwd)


def mhc_sinkhorn(logits, iters: int = 20, *, backward: str = "unrolled", start: str = "cols",
                 eps: float = 0.0, check_finite: bool = False, backend: str | None = None):
    """Doubly-stochastic matrices from (..., n, n) logits by ``iters`` Sinkhorn-Knopp steps.

    Args:
      logits: (..., n, n) array, float32 / bfloat16 / float16 / float64, 2 <= n <= 64.
        Arithmetic is float32; float64 logits (``jax_enable_x64``) are cast to
        float32 and the result (and the gradient) cast back to float64.
      iters: number T of (column, row) normalization pairs, >= 1 (static).
      backward: "unrolled" (exact gradient of the T-step map) or "implicit"
        (fixed-point gradient; exact only at convergence). Static.
      start: "cols" (normalize columns first, the mHC paper's T_r(T_c(.))) or "rows".
      eps: added to every normalization denominator, >= 0 (static Python float;
        reaches the kernel as a run-time array, so a new value does not recompile
        the Triton kernel).
      check_finite: checked only on request. False (default): no value is read
        on the host; a NaN / +inf logit gives its own matrix NaN, a -inf logit
        a zero entry. True: when ``logits`` is concrete (not traced), raise
        ValueError if a logit is NaN or +-inf (a reduction and a device-to-host
        read); traced logits are not checked.
      backend: ``jax_launch`` backend ("triton_call", "callback", "auto"/None).

    Returns:
      An array of the shape and dtype of ``logits``.

    ``jax.vmap`` of this function, and of ``jax.grad`` through it, folds the
    mapped axis into the kernels' batch (``custom_vmap`` rules on the forward
    and backward launches): one launch per pass, not a loop.
    """
    logits = jnp.asarray(logits)
    iters, backward, rows_first, eps = rules.options(iters, backward, start, eps)
    rules.logits_shape(logits.shape)
    rules.logits_dtype(str(jnp.dtype(logits.dtype)), _CAST_HINT)
    if check_finite and not isinstance(logits, jax.core.Tracer) and logits.size:
        rules.finite(bool(jnp.all(jnp.isfinite(logits))))
    if jnp.dtype(logits.dtype) == jnp.dtype(jnp.float64):
        out = _mhc(logits.astype(jnp.float32), iters, backward, rows_first, eps, backend)
        return out.astype(jnp.float64)
    return _mhc(logits, iters, backward, rows_first, eps, backend)
