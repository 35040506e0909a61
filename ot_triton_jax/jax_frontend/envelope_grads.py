"""The envelope gradient of OTT's reg_ot_cost at fixed potentials, on the streaming plan passes."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .kernel_ops import F32, Cloud, apply_plan, make_params, masked_log

__all__ = ["CostGrads", "cost_grads"]


class CostGrads(NamedTuple):
    """Envelope gradients of OTT's reg_ot_cost with the potentials held fixed."""

    x: jax.Array
    y: jax.Array
    a: jax.Array
    b: jax.Array
    eps: jax.Array
    s: jax.Array


def cost_grads(X: Cloud, Y: Cloud, a: jax.Array, b: jax.Array, eps: jax.Array, s: jax.Array,
               f: jax.Array, g: jax.Array, *, precision: str,
               backend: str | None = None) -> CostGrads:
    """Gradient of R = sum_{a>0} a(f - eps log a) + sum_{b>0} b(g - eps log b)
    + eps (sum a sum b - sum P) at fixed (f, g), C = s|x - y|^2 (Danskin / OTT ``use_danskin``):

      dR/dx_i = 2s (r_i x_i - (P y)_i),   r = P 1
      dR/dy_j = 2s (c_j y_j - (P^T x)_j), c = P^T 1
      dR/da_i = f_i - eps log a_i - eps + eps sum b   (eps sum b where a_i = 0)
      dR/db_j = g_j - eps log b_j - eps + eps sum a   (eps sum a where b_j = 0)
      dR/deps = -sum a log a - sum b log b + sum a sum b - sum P
                + (sum_i r_i f_i + sum_j c_j g_j - <P, C>) / eps
      dR/ds   = <P, C> / s,  <P, C> = s (sum r|x|^2 + sum c|y|^2 - 2 sum <x_i, (P y)_i>)

    Two streaming passes (P y with r, P^T x with c); under jit the unused ones are
    removed by XLA. A plain function: no custom derivative rule on this path. Labelled clouds
    (C = s (|x - y|^2 + W[lx_i, ly_j]), core/labels.py): the same x, y formulas with the labelled
    plan, and <P, C> adds s sum_ij P_ij W[lx_i, ly_j], read off the P y pass widened by the
    one-hot columns of ly (X.label_table = W).
    """
    params = make_params(eps, s)
    pw = 0.0
    if X.labels is not None:
        onehot = jax.nn.one_hot(Y.labels, X.label_table.shape[1], dtype=F32)
        pyw, r = apply_plan(X, Y, f, g, params, precision=precision, backend=backend,
                            v=jnp.concatenate([Y.x, onehot], axis=1))
        py, pk = pyw[:, :Y.x.shape[1]], pyw[:, Y.x.shape[1]:]  # pk[i, l] = sum_{j: ly_j = l} P_ij
        pw = jnp.sum(pk * X.label_table[jnp.clip(X.labels, 0, X.label_table.shape[0] - 1)])
    else:
        py, r = apply_plan(X, Y, f, g, params, precision=precision, backend=backend, v=Y.x)
    px, c = apply_plan(Y, X, g, f, params, precision=precision, backend=backend, v=X.x)
    gx = 2.0 * s * (r[:, None] * X.x - py)
    gy = 2.0 * s * (c[:, None] * Y.x - px)
    la, lb = masked_log(a), masked_log(b)
    sa, sb = jnp.sum(a), jnp.sum(b)
    ga = jnp.where(a > 0, f - eps * la - eps + eps * sb, eps * sb)
    gb = jnp.where(b > 0, g - eps * lb - eps + eps * sa, eps * sa)
    pc = s * (jnp.sum(r * X.sqnorm) + jnp.sum(c * Y.sqnorm) - 2.0 * jnp.sum(X.x * py) + pw)
    rf = jnp.sum(jnp.where(r > 0, r * f, 0.0))
    cg = jnp.sum(jnp.where(c > 0, c * g, 0.0))
    ent = jnp.sum(jnp.where(a > 0, a * la, 0.0)) + jnp.sum(jnp.where(b > 0, b * lb, 0.0))
    geps = -ent + sa * sb - jnp.sum(r) + (rf + cg - pc) / eps
    gs = pc / s
    return CostGrads(gx, gy, ga, gb, geps, gs)
