"""The streaming operations of :class:`ot_triton_jax.ott.PointCloud`, as functions of arrays.

Notation: x (n, d), y (m, d), C_ij = s |x_i - y_j|^2 (s = OTT's ``inv_scale_cost``), eps > 0.
Every function reduces over the y side (rows of the result are x); the geometry calls them with
(x, f) and (y, g) exchanged for OTT's other axis. Nothing n x m is formed: each is one to three
streaming passes of the kernels (``kernel_ops``) on clouds prepared once per call.

* :func:`softmin`: h_i = eps LSE_j((g_j - C_ij) / eps), the kernels' online log-sum-exp
  (``kernel_ops.lse_update``), a JAX primitive with JVP and batching rules. With W_ij = exp((g_j - C_ij - h_i) / eps)
  (rows summing to 1):

      dh_i = sum_j W_ij (dg_j - dC_ij) + (deps / eps) (h_i - sum_j W_ij (g_j - C_ij)),
      dC_ij = ds |x_i - y_j|^2 + 2 s <x_i - y_j, dx_i - dy_j>,

  every sum a pass of W (:func:`.plan_product.plan_product`, linear in the tangents), so reverse
  mode (its transpose) and derivatives of any order follow.
* :func:`lse`: OTT's ``apply_lse_kernel`` on one axis: eps log|sum_j vec_j exp((f_i + g_j -
  C_ij) / eps)| - f_i and its sign (f_i finite; -inf where f_i = -inf). Without vec it is h_i;
  with vec, h_i + eps log|q_i|, q = W vec: the weights W are at most 1, so the weighted sum is
  as stable as a log-sum-exp. Derivatives by composition.
* :func:`transport`: P V with P_ij = exp((f_i + g_j - C_ij) / eps) (one pass); :func:`marginal`:
  P 1; :func:`kernel_apply`: K V with K_ij = exp(-C_ij / eps). These read P or K in the linear
  domain: the entries of a Sinkhorn plan (and of K) are at most 1, so nothing overflows.
* :func:`mean_cost` and :func:`std_cost`: the mean and the standard deviation of the entries of
  C in closed form (O((n + m) d^2)), see their docstrings.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from ..jax_frontend import kernel_ops
from ..jax_frontend.kernel_ops import Cloud
from .plan_product import F32, centred, map_over_batch, plan_product

sg = jax.lax.stop_gradient


def prepare(x: jax.Array, y: jax.Array) -> tuple[Cloud, Cloud]:
    """The kernels' clouds of x and y (not differentiated: the rules differentiate x and y)."""
    return kernel_ops.clouds(sg(jnp.asarray(x, F32)), sg(jnp.asarray(y, F32)))


def _as32(*vals):
    return tuple(jnp.asarray(v, F32) for v in vals)


def softmin(x: jax.Array, y: jax.Array, g: jax.Array, eps: jax.Array, s: jax.Array, X: Cloud, Y: Cloud,
            precision: str = "float32") -> jax.Array:
    """``h_i = eps LSE_j((g_j - s |x_i - y_j|^2) / eps)`` (n,), one streaming pass; (X, Y) =
    :func:`prepare` (x, y). A primitive differentiable in x, y, g, eps, s to any order: its JVP is
    ``dh_i = sum_j W_ij (dg_j - dC_ij) + (deps / eps) (h_i - sum_j W_ij (g_j - C_ij))`` with the
    softmax weights ``W_ij = exp((g_j - C_ij - h_i) / eps)``, each sum a pass of
    :func:`.plan_product.plan_product`."""
    leaves, tree = jax.tree_util.tree_flatten((X, Y))
    return softmin_p.bind(jnp.asarray(x, F32), jnp.asarray(y, F32), jnp.asarray(g, F32), jnp.asarray(eps, F32),
                          jnp.asarray(s, F32), *leaves, precision=precision, cloud_tree=tree)


# A primitive rather than a custom_jvp: OTT's unrolled differentiation stages the reverse pass
# inside a while loop, and staging keeps a primitive's JVP rule (an HVP differentiates it again)
# where a custom_jvp would be replaced by its primal body (the bare kernel call).
softmin_p = Primitive("ot_triton_softmin")


def _softmin_impl(x, y, g, eps, s, *leaves, precision, cloud_tree):
    X, Y = jax.tree_util.tree_unflatten(cloud_tree, leaves)
    out, _ = kernel_ops.lse_update(X, Y, g, kernel_ops.make_params(eps, s), precision=precision)
    return -out


def _softmin_abstract(x, y, g, eps, s, *leaves, precision, cloud_tree):
    if g.shape != (y.shape[0],) or eps.shape or s.shape:
        raise ValueError(f"softmin: g {g.shape}, eps {eps.shape}, s {s.shape} for y {y.shape}; want g (m,), scalars")
    return jax.core.ShapedArray((x.shape[0],), F32)


def _softmin_jvp(primals, tangents, *, precision, cloud_tree):
    x, y, g, eps, s, *leaves = primals
    X, Y = jax.tree_util.tree_unflatten(cloud_tree, leaves)
    dx, dy, dg, deps, ds = (ad.instantiate_zeros(t) for t in tangents[:5])
    h = softmin(x, y, g, eps, s, X, Y, precision)
    d = x.shape[1]
    xc, yc = centred(x, y)
    gf = jnp.where(jnp.isfinite(g), g, 0.0)
    w = lambda v: plan_product(x, y, -h, g, eps, s, v, (X, Y), precision)  # noqa: E731
    # primal passes of W: [1, |y|^2, y_1 .. y_d, g]
    prim = w(jnp.concatenate([jnp.ones_like(gf)[:, None], jnp.sum(yc * yc, 1)[:, None], yc, gf[:, None]], 1))
    r, w_sq, w_y, w_g = prim[:, 0], prim[:, 1], prim[:, 2:2 + d], prim[:, 2 + d]
    w_c = jnp.sum(xc * xc, 1) * r + w_sq - 2 * jnp.sum(xc * w_y, 1)  # sum_j W_ij |x_i - y_j|^2
    # tangent pass (linear in dg, dy): [dg, dy_1 .. dy_d, <y, dy>]
    tan = w(jnp.concatenate([dg[:, None], dy, jnp.sum(yc * dy, 1)[:, None]], 1))
    w_dg, w_dy, w_ydy = tan[:, 0], tan[:, 1:1 + d], tan[:, 1 + d]
    w_dc = 2 * (jnp.sum(xc * dx, 1) * r - jnp.sum(xc * w_dy, 1) - jnp.sum(dx * w_y, 1) + w_ydy)
    dh = w_dg - ds * w_c - s * w_dc + (deps / eps) * (h - w_g + s * w_c)
    return h, dh


def _softmin_batch(args, dims, *, precision, cloud_tree):
    batched = [isinstance(dd, int) for dd in dims]
    args = [jnp.moveaxis(a, dd, 0) if b else a for a, dd, b in zip(args, dims, batched)]
    return map_over_batch(softmin_p, args, batched, precision=precision, cloud_tree=cloud_tree), 0


softmin_p.def_impl(_softmin_impl)
softmin_p.def_abstract_eval(_softmin_abstract)
mlir.register_lowering(softmin_p, mlir.lower_fun(_softmin_impl, multiple_results=False))
ad.primitive_jvps[softmin_p] = _softmin_jvp
batching.primitive_batchers[softmin_p] = _softmin_batch


def lse(x: jax.Array, y: jax.Array, f: jax.Array, g: jax.Array, eps, s, vec: jax.Array | None = None,
        precision: str = "float32") -> tuple[jax.Array, jax.Array]:
    """(value, sign) of ``eps log|sum_j vec_j exp((f_i + g_j - C_ij) / eps)| - f_i`` (vec = 1 when
    None; the sign is then ``[1.0]``), -inf where ``f_i = -inf``: OTT's ``apply_lse_kernel``
    reducing over y. ``h + eps log|W vec|`` with ``h`` = :func:`softmin` and W its weights."""
    eps, s = _as32(eps, s)
    X, Y = prepare(x, y)
    h = softmin(x, y, jnp.asarray(g, F32), eps, s, X, Y, precision)
    if vec is None:
        val, sign = h, jnp.ones((1,), F32)
    else:
        q = plan_product(x, y, -h, g, eps, s, jnp.reshape(vec, (-1, 1)), (X, Y), precision)[:, 0]
        val, sign = h + eps * jnp.log(jnp.abs(q)), jnp.sign(q)
    f = jnp.asarray(f, F32)
    return val + jnp.where(jnp.isfinite(f), 0.0, f), sign


def transport(x: jax.Array, y: jax.Array, f: jax.Array, g: jax.Array, eps, s, v: jax.Array,
              precision: str = "float32") -> jax.Array:
    """``P v`` for v (m,) or (m, k), ``P_ij = exp((f_i + g_j - C_ij) / eps)`` (one pass)."""
    eps, s = _as32(eps, s)
    v2 = jnp.reshape(v, (v.shape[0], -1))
    out = plan_product(x, y, f, g, eps, s, v2, prepare(x, y), precision)
    return out.reshape((x.shape[0],) + tuple(v.shape[1:]))


def marginal(x: jax.Array, y: jax.Array, f: jax.Array, g: jax.Array, eps, s,
             precision: str = "float32") -> jax.Array:
    """``P 1`` (n,): the marginal of the plan on the x side (one pass)."""
    return transport(x, y, f, g, eps, s, jnp.ones((y.shape[0],), F32), precision)


def kernel_apply(x: jax.Array, y: jax.Array, eps, s, v: jax.Array, precision: str = "float32") -> jax.Array:
    """``K v`` for v (m,) or (m, k), ``K_ij = exp(-C_ij / eps)`` (one pass)."""
    zx, zy = jnp.zeros((x.shape[0],), F32), jnp.zeros((y.shape[0],), F32)
    return transport(x, y, zx, zy, eps, s, v, precision)


def mean_cost(x: jax.Array, y: jax.Array) -> jax.Array:
    """The mean over (i, j) of ``|x_i - y_j|^2``, exactly: ``var(x) + var(y) + |mean x - mean y|^2``
    (population variances summed over coordinates). O((n + m) d)."""
    mx, my = jnp.mean(x, 0), jnp.mean(y, 0)
    return (jnp.mean(jnp.sum((x - mx) ** 2, 1)) + jnp.mean(jnp.sum((y - my) ** 2, 1))
            + jnp.sum((mx - my) ** 2))


def std_cost(x: jax.Array, y: jax.Array) -> jax.Array:
    """The standard deviation over (i, j) of ``c_ij = |x_i - y_j|^2`` (population), in closed form.

    With ``u = x - mean x``, ``v = y - mean y``, ``delta = mean x - mean y``:
    ``c_ij = A_i + B_j + |delta|^2 - 2 <u_i, v_j>``, ``A_i = |u_i|^2 + 2 <u_i, delta>``,
    ``B_j = |v_j|^2 - 2 <v_j, delta>``. The three random terms are uncorrelated over independent
    uniform (i, j) (u and v have mean zero), so::

        var(c) = var(A) + var(B) + 4 <S_u, S_v>_F,  S_u = mean u u^T, S_v = mean v v^T.

    O((n + m) d^2), no cancellation against the mean.
    """
    mx, my = jnp.mean(x, 0), jnp.mean(y, 0)
    u, v, delta = x - mx, y - my, mx - my
    A = jnp.sum(u * u, 1) + 2 * u @ delta
    B = jnp.sum(v * v, 1) - 2 * v @ delta
    su, sv = u.T @ u / x.shape[0], v.T @ v / y.shape[0]
    return jnp.sqrt(jnp.var(A) + jnp.var(B) + 4 * jnp.sum(su * sv))
