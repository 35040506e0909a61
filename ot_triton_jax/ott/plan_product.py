"""The plan product P V as a JAX primitive: one streaming pass, differentiable to any order.

With C_ij = s |x_i - y_j|^2 and

    P_ij = exp((f_i + g_j - C_ij) / eps),

``plan_product(x, y, f, g, eps, s, v, clouds)`` returns P v for v of shape (m, p), never forming
P (``kernel_ops.apply_plan``: tiles of y streamed past tiles of x). It is linear in v, and that is
what makes it a primitive rather than a ``custom_jvp``: reverse mode transposes the tangent map of
every operation built on it, and the transpose of v -> P v is u -> P^T u, the same pass with the
two clouds (and f, g) exchanged. Its rules:

* JVP in every operand (x, y, f, g, eps, s, v), written with P applied to other vectors (so its
  own JVP follows, to any order). With c_ij = |x_i - y_j|^2 and A = P v:

      d(P v)_ik = sum_j P_ij v_jk [(df_i + dg_j - ds c_ij - s dc_ij) / eps
                                   - deps (f_i + g_j - s c_ij) / eps^2] + (P dv)_ik,
      dc_ij = 2 <x_i - y_j, dx_i - dy_j>,
      sum_j P_ij v_jk c_ij = |x_i|^2 A_ik + (P(|y|^2 v))_ik - 2 sum_l x_il (P(y_l v))_ik,

  so one pass of P on the primal columns (|y|^2 v, y_l v, g v) and one on the tangent columns
  (dg v, dy_l v, <y, dy> v, dv) give it (x, y taken relative to a common centre: the cost is
  translation invariant, float32 rounding is not).
* transpose in v (the only linear operand): u -> P^T u.
* ``jax.vmap``: when only v is batched the batch becomes extra columns of v (one pass); otherwise
  one pass per batch element (``jax.lax.map``).

``clouds`` = (X, Y) are ``kernel_ops.clouds(x, y)``: the kernels' copies of x and y, prepared
once per geometry operation and shared by all its passes. They carry no derivative (the rules
differentiate through x and y); they must be the clouds of these x and y.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from ..jax_frontend import kernel_ops
from ..jax_frontend.kernel_ops import Cloud

F32 = jnp.float32
sg = jax.lax.stop_gradient

plan_product_p = Primitive("ot_triton_plan_product")


def plan_product(x: jax.Array, y: jax.Array, f: jax.Array, g: jax.Array, eps: jax.Array, s: jax.Array,
                 v: jax.Array, clouds: tuple[Cloud, Cloud], precision: str = "float32") -> jax.Array:
    """``P v`` (n, p) for v (m, p), ``P_ij = exp((f_i + g_j - s |x_i - y_j|^2) / eps)``, a primitive:
    linear in v (its transpose is the same pass with the clouds exchanged), with a JVP in every
    operand written with further plan products (so derivatives of any order exist) and a
    ``jax.vmap`` rule (a batch of v alone becomes extra columns: one pass).

    Args:
      x, y: the points (n, d) and (m, d); rows of P are x.
      f, g: potentials (n,) and (m,); -inf entries give zero rows / columns of P.
      eps, s: scalars: the temperature and the cost scale.
      v: (m, p).
      clouds: ``kernel_ops.clouds(x, y)`` (not differentiated).
      precision: the kernels' cross-term precision, "float32" or "tf32".
    """
    X, Y = clouds
    leaves, tree = jax.tree_util.tree_flatten((X, Y))
    return plan_product_p.bind(x, y, jnp.asarray(f, F32), jnp.asarray(g, F32), jnp.asarray(eps, F32),
                               jnp.asarray(s, F32), jnp.asarray(v, F32), *leaves, precision=precision,
                               cloud_tree=tree)


def _split(args, cloud_tree):
    x, y, f, g, eps, s, v, *leaves = args
    return (x, y, f, g, eps, s, v), jax.tree_util.tree_unflatten(cloud_tree, leaves)


def _impl(*args, precision, cloud_tree):
    (_, _, f, g, eps, s, v), (X, Y) = _split(args, cloud_tree)
    if v.shape[1] == 0:
        return jnp.zeros((X.n, 0), F32)
    pv, _ = kernel_ops.apply_plan(X, Y, f, g, kernel_ops.make_params(eps, s), precision=precision, v=v)
    return pv


def _abstract(*args, precision, cloud_tree):
    (x, y, f, g, eps, s, v), _ = _split(args, cloud_tree)
    n, m = x.shape[0], y.shape[0]
    if f.shape != (n,) or g.shape != (m,) or v.ndim != 2 or v.shape[0] != m or eps.shape or s.shape:
        raise ValueError(f"plan_product: shapes x {x.shape}, y {y.shape}, f {f.shape}, g {g.shape}, "
                         f"eps {eps.shape}, s {s.shape}, v {v.shape}; want f (n,), g (m,), scalars, v (m, p)")
    return jax.core.ShapedArray((n, v.shape[1]), F32)


plan_product_p.def_impl(_impl)
plan_product_p.def_abstract_eval(_abstract)
mlir.register_lowering(plan_product_p, mlir.lower_fun(_impl, multiple_results=False))


def _rebind(args, v, cloud_tree, precision):
    (x, y, f, g, eps, s, _), clouds = _split(args, cloud_tree)
    return plan_product(x, y, f, g, eps, s, v, clouds, precision)


def _is_zero(t) -> bool:
    return type(t) is ad.Zero


def centred(x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x - c, y - c with c the (non-differentiated) mean of the two clouds' means."""
    c = sg((jnp.mean(x.astype(F32), 0) + jnp.mean(y.astype(F32), 0)) / 2)
    return x.astype(F32) - c, y.astype(F32) - c


def _finite(t: jax.Array) -> jax.Array:
    return jnp.where(jnp.isfinite(t), t, 0.0)


def _jvp(primals, tangents, *, precision, cloud_tree):
    x, y, f, g, eps, s, v = primals[:7]
    dx, dy, df, dg, deps, ds, dv = tangents[:7]
    out = plan_product_p.bind(*primals, precision=precision, cloud_tree=cloud_tree)
    n, m, d, p = x.shape[0], y.shape[0], x.shape[1], v.shape[1]
    xc, yc = centred(x, y)
    need_c = not (_is_zero(ds) and _is_zero(deps))
    need_y = need_c or not _is_zero(dx)
    # primal columns: [|y|^2 v, y_1 v, ..., y_d v, g v] (those needed)
    prim_cols = []
    if need_c:
        prim_cols.append(jnp.sum(yc * yc, 1)[:, None] * v)
    if need_y:
        prim_cols += [yc[:, l:l + 1] * v for l in range(d)]
    if not _is_zero(deps):
        prim_cols.append(_finite(g)[:, None] * v)
    prim = _rebind(primals, jnp.concatenate(prim_cols, 1), cloud_tree, precision) if prim_cols else None
    # tangent columns (linear in the tangents): [dg v, dy_1 v, ..., dy_d v, <y, dy> v, dv]
    tan_cols, k = [], 0
    if not _is_zero(dg):
        tan_cols.append(dg[:, None] * v / eps)
    if not _is_zero(dy):
        tan_cols += [(2 * s / eps) * dy[:, l:l + 1] * v for l in range(d)]
        tan_cols.append(-(2 * s / eps) * jnp.sum(yc * dy, 1)[:, None] * v)
    if not _is_zero(dv):
        tan_cols.append(dv)
    res = jnp.zeros((n, p), F32)
    if tan_cols:
        t = _rebind(primals, jnp.concatenate(tan_cols, 1), cloud_tree, precision)
        if not _is_zero(dg):
            res = res + t[:, k * p:(k + 1) * p]
            k += 1
        if not _is_zero(dy):
            for l in range(d):
                res = res + xc[:, l:l + 1] * t[:, k * p:(k + 1) * p]
                k += 1
            res = res + t[:, k * p:(k + 1) * p]
            k += 1
        if not _is_zero(dv):
            res = res + t[:, k * p:(k + 1) * p]
    if not _is_zero(df):
        res = res + df[:, None] * out / eps
    j = 0
    sq_y = py = None
    if need_c:
        sq_y, j = prim[:, :p], p
    if need_y:
        py = [prim[:, j + l * p:j + (l + 1) * p] for l in range(d)]
        j += d * p
    if not _is_zero(dx):  # -(s/eps) 2 [<x, dx> A - sum_l dx_l P(y_l v)]
        cross = sum(dx[:, l:l + 1] * py[l] for l in range(d))
        res = res - (2 * s / eps) * (jnp.sum(xc * dx, 1)[:, None] * out - cross)
    if need_c:  # sum_j P_ij v_jk c_ij
        pc = jnp.sum(xc * xc, 1)[:, None] * out + sq_y - 2 * sum(xc[:, l:l + 1] * py[l] for l in range(d))
        if not _is_zero(ds):
            res = res - ds * pc / eps
        if not _is_zero(deps):
            pg = prim[:, j:j + p]
            res = res - deps * (_finite(f)[:, None] * out + pg - s * pc) / (eps * eps)
    return out, res


def _transpose(ct, *args, precision, cloud_tree):
    (x, y, f, g, eps, s, v), (X, Y) = _split(args, cloud_tree)
    if any(ad.is_undefined_primal(a) for a in (x, y, f, g, eps, s)) or not ad.is_undefined_primal(v):
        raise NotImplementedError("plan_product is linear in v only; it cannot be transposed in "
                                  "x, y, f, g, eps or s")
    cts = [None] * len(args)
    if not _is_zero(ct):
        cts[6] = plan_product(y, x, g, f, eps, s, ct, (Y, X), precision)
    return tuple(cts)


def _batch(args, dims, *, precision, cloud_tree):
    batched = [isinstance(dd, int) for dd in dims]  # an unmapped operand's dim is not an int
    size = next(a.shape[dd] for a, dd, b in zip(args, dims, batched) if b)
    args = [jnp.moveaxis(a, dd, 0) if b else a for a, dd, b in zip(args, dims, batched)]
    if not any(batched[:6]) and not any(batched[7:]):  # only v: the batch becomes columns
        v = args[6]  # (B, m, p)
        m, p = v.shape[1], v.shape[2]
        out = _rebind(args, jnp.moveaxis(v, 0, 1).reshape(m, size * p), cloud_tree, precision)
        return jnp.moveaxis(out.reshape(out.shape[0], size, p), 1, 0), 0
    return map_over_batch(plan_product_p, args, batched, precision=precision, cloud_tree=cloud_tree), 0


def map_over_batch(prim: Primitive, args, batched, **params) -> jax.Array:
    """``prim`` bound once per batch element (``jax.lax.map``; batched operands with the batch
    axis first, the others closed over): the batching rule of a kernel pass that depends on more
    than a stack of vectors. Each element binds the primitive again, so its derivative rules apply
    under any outer transformation."""
    mapped = [a for a, b in zip(args, batched) if b]

    def one(sl):
        it = iter(sl)
        return prim.bind(*[next(it) if b else a for a, b in zip(args, batched)], **params)

    return jax.lax.map(one, mapped)


ad.primitive_jvps[plan_product_p] = _jvp
ad.primitive_transposes[plan_product_p] = _transpose
batching.primitive_batchers[plan_product_p] = _batch
