"""``ot_triton_jax.hvp``: an explicit Hessian-vector product in x or y, with the CG record.

The same numbers as ``jax.jvp(jax.grad(loss), (x,), (v,))`` (the ``custom_jvp`` of
:mod:`.implicit`), with the conjugate-gradient record returned: one forward solve, then
the Hessian of reg_ot_cost applied to v by streaming CG
(:mod:`ot_triton_jax.core.implicit_derivatives`). For ``loss="sinkhorn_divergence"``
(OTT's debiased divergence, symmetric self terms) the HVP in x is
H_xy(v) - 1/2 (H_xx(v, v)_x + H_xx(v, v)_y). Works under ``jax.jit`` and ``jax.vmap``.
``tau_a``, ``tau_b`` < 1 (OTT's KL-relaxed marginals): the derivative of the envelope gradient with
the potentials of the relaxed fixed point moving (:mod:`ot_triton_jax.core.implicit_derivatives`).
The torch twin is ``torch_api.hvp``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from ..core import checks as rules
from ..core.implicit_solve import ImplicitOptions, implicit_options
from ..core.options import LoopOptions
from .checks import READER, check_backend, check_iterations
from .divergence import _divergence_jit
from .implicit import ImplicitConfig, hessian_apply
from .leading_batch import is_batch, over_batch
from .sinkhorn_solver import as_f32, check_problem, check_taus, solve_problem

__all__ = ["hvp", "HVPInfo", "ImplicitOptions"]


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["cg_iterations", "cg_residual", "cg_converged", "solve_converged"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class HVPInfo:
    """The record of :func:`hvp`: CG iterations and final relative residual (the largest over
    the solves of a divergence), whether every CG solve met its tolerance, whether every
    forward Sinkhorn solve converged."""

    cg_iterations: jax.Array
    cg_residual: jax.Array
    cg_converged: jax.Array
    solve_converged: jax.Array


def _record(infos, solved) -> HVPInfo:
    k = jnp.max(jnp.stack([i[0] for i in infos])).astype(jnp.int32)
    rel = jnp.max(jnp.stack([i[1] for i in infos]))
    ok = jnp.all(jnp.stack([i[2] for i in infos]))
    return HVPInfo(k, rel, ok, solved)


@functools.partial(jax.jit, static_argnames=("wrt", "loss", "opts", "backend", "implicit", "taus"))
def _hvp_jit(x, y, a, b, v, eps, scale, threshold, wrt, loss, opts, backend, implicit, taus=(1.0, 1.0)):
    x32, y32, a32, b32, v32, eps, scale, threshold = as_f32(x, y, a, b, v, eps, scale, threshold)
    cfg = ImplicitConfig(opts.precision, backend, implicit, taus)
    s = 1.0 / scale
    tangents = (v32, None, None, None) if wrt == "x" else (None, v32, None, None)
    pick = 0 if wrt == "x" else 1
    want = (wrt == "x", wrt == "y", False, False)
    if loss == "reg_ot_cost":
        out = solve_problem(x32, y32, a32, b32, eps, scale, threshold, None, opts, backend, implicit, taus)
        res, info = hessian_apply(cfg, x32, y32, a32, b32, eps, s, out.f, out.g, tangents, want)
        return res[pick], _record([info], out.converged)
    _, dout = _divergence_jit(x32, y32, a32, b32, eps, scale, threshold, 0.0, opts=opts, backend=backend,
                              static_b=False, symmetric=True, taus=taus)
    (f, g), hx, hy = dout.potentials
    res, info = hessian_apply(cfg, x32, y32, a32, b32, eps, s, f, g, tangents, want)
    z, w, (hf, hg) = (x32, a32, hx) if wrt == "x" else (y32, b32, hy)
    (sx, sy, _, _), info_self = hessian_apply(cfg, z, z, w, w, eps, s, hf, hg, (v32, v32, None, None),
                                              (True, True, False, False), symmetric=taus[0] == taus[1])
    solved = dout.converged[0] & dout.converged[1] & dout.converged[2]
    return res[pick] - 0.5 * (sx + sy), _record([info, info_self], solved)


def hvp(
    x: jax.Array,
    y: jax.Array,
    v: jax.Array,
    *,
    wrt: str = "x",
    a: jax.Array | None = None,
    b: jax.Array | None = None,
    epsilon: Any,
    scale_cost: Any = 1.0,
    loss: str = "reg_ot_cost",
    threshold: Any = 1e-3,
    inner_iterations: int = 10,
    min_iterations: int = 0,
    max_iterations: int = 2000,
    precision: str = "float32",
    implicit: ImplicitOptions | None = None,
    backend: str | None = None,
    tau_a: float = 1.0,
    tau_b: float = 1.0,
) -> tuple[jax.Array, HVPInfo]:
    """Hessian of ``loss`` (OTT conventions, as :func:`ot_triton_jax.sinkhorn`) in ``wrt`` applied to v.

    ``v`` has the shape of the cloud ``wrt``; the other arguments are those of
    :func:`ot_triton_jax.sinkhorn`. Returns (hvp float32 with v's shape, :class:`HVPInfo`).
    CG options: ``implicit`` (:class:`ImplicitOptions`); a ``RuntimeWarning`` is issued
    when CG stops unconverged. ``tau_a``, ``tau_b``: OTT's relaxed marginals (module docstring).
    x (B, n, d), y (B, m, d), v like the cloud ``wrt``, a (B, n), b (B, m): B problems as ``jax.vmap``
    of this call (:mod:`.leading_batch`), the HVPs (B, ...) and the :class:`HVPInfo` fields (B,).
    """
    taus = check_taus(tau_a, tau_b)
    rules.hvp_args(wrt, loss)
    if is_batch(x, y):
        kw = dict(wrt=wrt, epsilon=epsilon, scale_cost=scale_cost, loss=loss, threshold=threshold,
                  inner_iterations=inner_iterations, min_iterations=min_iterations, max_iterations=max_iterations,
                  precision=precision, implicit=implicit, backend=backend, tau_a=tau_a, tau_b=tau_b)
        return over_batch(lambda x, y, a, b, v: hvp(x, y, v, a=a, b=b, **kw), x, y, a, b, (v,), what="hvp")
    x, y, a, b = check_problem(x, y, a, b, epsilon, scale_cost, taus)
    v = jnp.asarray(v)
    rules.hvp_direction(READER, v, x if wrt == "x" else y, wrt)
    inner, lo, hi = check_iterations(threshold, inner_iterations, min_iterations, max_iterations)
    check_backend(backend)
    return _hvp_jit(x, y, a, b, v, epsilon, scale_cost, threshold, wrt=wrt, loss=loss,
                    opts=LoopOptions(precision, inner, lo, hi), backend=backend, implicit=implicit_options(implicit),
                    taus=taus)
