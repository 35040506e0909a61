"""The kernel calls of ``ot_triton_jax.core.kernel_calls`` on JAX arrays, and the envelope gradient.

:func:`run` executes a call description (the same descriptions ``torch_api.kernel_ops``
runs) through :func:`.launch.launch`; the functions below only name the arrays of each
call. Everything here is a plain function of JAX arrays (jit-able, no custom
derivative rules): the solvers and the derivative rules (:mod:`.derivatives`) call it.
In particular :func:`cost_grads` is the gradient of the OTT regularized cost as a
*plain* function of the potentials; a later HVP can wrap it in ``jax.custom_jvp``.

Clouds are float32, contiguous, with their squared norms precomputed once per
solve (:class:`Cloud`). Run-time floats travel in ``params = [eps, s]``
(float32, shape (2,)) so a new epsilon never recompiles.

The kernels themselves are not differentiable (XLA sees opaque calls); pass
``jax.lax.stop_gradient`` values, as the solvers do.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .launch import kernels_on_gpu, launch

kernels_on_gpu()  # before the kernels are imported (by kernel_calls): GPU or interpreter

from ..core import kernel_calls, launch_plans, multiscale_calls  # noqa: E402
from ..core import labels as label_rules  # noqa: E402

F32 = jnp.float32


def run(seq: kernel_calls.CallSequence, arrays: dict, backend: str | None) -> tuple[jax.Array, ...]:
    """Launch every call of ``seq`` with the named ``arrays``; return its results."""
    env = dict(arrays)
    for call in seq.calls:
        outs = launch(call.kernel, call.plan, [env[a] if isinstance(a, str) else a for a in call.args],
                      [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in call.outputs],
                      backend=backend, constexprs=call.flags)
        env.update(zip((o.name for o in call.outputs), outs))
    if seq.row_partials is not None:
        name, split, n = seq.row_partials
        env[name] = env[name].reshape(split, n).sum(0)
    return tuple(env[r] for r in seq.results)


class Cloud(NamedTuple):
    """A point cloud as the kernels want it (built by :func:`clouds`): (n, d) float32
    centred on its problem's common centre, its squared norms (n,), and its head and tail
    that the kernels read: float16 parts of the cloud scaled by S, ``scale`` = 1 / S
    (kernels/split.py; TF32 parts and no scale where launch_plans.fp16_operands says no).
    With a label cost (core/labels.py): its int32 ``labels`` (n,) and the class table oriented so
    that they index its rows, ``label_table`` (K_self, K_other) float32 (x: W, y: W^T; the kernels
    read the tgt cloud's, kernels/label_tiles.py); both None otherwise."""

    x: jax.Array
    sqnorm: jax.Array
    hi: jax.Array
    lo: jax.Array
    scale: jax.Array | None = None
    labels: jax.Array | None = None
    label_table: jax.Array | None = None

    @property
    def n(self) -> int:
        return self.x.shape[0]

    @property
    def d(self) -> int:
        return self.x.shape[1]


def clouds(*pts: jax.Array, backend: str | None = None, labels: tuple[jax.Array, ...] | None = None,
           label_cost: jax.Array | None = None) -> tuple[Cloud, ...]:
    """The clouds of one problem (one or two (n, d) arrays, not differentiated through:
    pass ``stop_gradient`` values), shifted by one common centre
    (``kernel_calls.center``): the cost |x - y|^2, the plan and the potentials are
    unchanged, float32 rounding is not (kernels/split.py says why).

    Label cost (core/labels.py): ``labels`` one integer array per cloud and ``label_cost`` W
    (K_x, K_y); every kernel call on these clouds then adds s W[label_src_i, label_tgt_j] to the
    cost (x holds W, y holds W^T). One cloud (a self problem): W square, the cost W[label_i, label_j]
    (the cloud holds W^T: the kernels read the tgt cloud's table, Cloud). Shapes and
    dtypes are checked here; the values (labels in range, W finite) by ``labels.check_values``
    where readable (under ``jax.jit`` an out-of-range label gives NaN outputs)."""
    pts = tuple(jnp.asarray(p).astype(F32) for p in pts)
    on_gpu = kernels_on_gpu()
    d = pts[0].shape[1]
    (c,) = run(kernel_calls.center(pts[0].shape[0], pts[-1].shape[0], d, on_gpu), {"x": pts[0], "y": pts[-1]},
               backend)
    arrays = {"center": c, "amax": None}
    if launch_plans.fp16_operands(d):  # the FP16 parts' scale: the largest |x - c| of every cloud
        arrays["amax"] = jnp.concatenate([run(kernel_calls.absmax(pts[i].shape[0], pts[j].shape[0], d, on_gpu),
                                              {"x": pts[i], "y": pts[j], "center": c}, backend)[0]
                                          for i, j in kernel_calls.absmax_pairs(len(pts))])
    n_amax = 0 if arrays["amax"] is None else arrays["amax"].shape[0]
    out = []
    for p in pts:
        xc, hi, lo, sq, *sc = run(kernel_calls.split_centered(p.shape[0], d, on_gpu, n_amax), dict(arrays, x=p),
                                  backend)
        out.append(Cloud(xc, sq, hi, lo, sc[0] if sc else None))
    return tuple(out) if labels is None and label_cost is None else _labelled(tuple(out), labels, label_cost)


def _labelled(cl: tuple[Cloud, ...], labels, label_cost) -> tuple[Cloud, ...]:
    """The clouds ``cl`` given their int32 labels and oriented tables (:func:`clouds`)."""
    if len(cl) > 2 or labels is None or len(labels) != len(cl):
        raise ValueError(f"clouds: labels must be a tuple of one label array per cloud ({len(cl)} here, at most 2) "
                         "given with label_cost")
    label_rules.check_shapes(labels[0], labels[-1], label_cost, cl[0].n, cl[-1].n, self_problem=len(cl) == 1)
    w = jax.lax.stop_gradient(jnp.asarray(label_cost)).astype(F32)
    return tuple(c._replace(labels=jnp.asarray(lab).astype(jnp.int32), label_table=table)
                 for c, lab, table in zip(cl, labels, (w.T,) if len(cl) == 1 else (w, w.T)))  # a self cloud: T^T


def make_params(eps, s) -> jax.Array:
    """The PARAMS array [eps, s] read by every kernel (float32, traced)."""
    return jnp.stack([jnp.asarray(eps, F32), jnp.asarray(s, F32)])


def masked_log(w: jax.Array) -> jax.Array:
    """log w where w > 0, -inf elsewhere (no NaN, no warning)."""
    return jnp.where(w > 0, jnp.log(jnp.where(w > 0, w, 1.0)), -jnp.inf)


def _pair(src: Cloud, tgt: Cloud, params: jax.Array) -> dict:
    return {"x_hi": src.hi, "x_lo": src.lo, "y_hi": tgt.hi, "y_lo": tgt.lo, "x_sq": src.sqnorm,
            "y_sq": tgt.sqnorm, "params": params, "x_scale": src.scale, "y_scale": tgt.scale,
            "x_lab": src.labels, "y_lab": tgt.labels, "x_ltab": src.label_table, "y_ltab": tgt.label_table}


def _labels(src: Cloud, tgt: Cloud) -> tuple[int, int] | None:
    """The kernel_calls ``labels`` of a call on (src, tgt): None, or the src table's shape."""
    return label_rules.call_labels(src.labels, src.label_table, tgt.labels, tgt.label_table, src is tgt)


def _f32(v):
    return None if v is None else v.astype(F32)


def lse_update(src: Cloud, tgt: Cloud, pot_tgt: jax.Array, params: jax.Array, *,
               precision: str, backend: str | None = None,
               logw_in: jax.Array | None = None, logw_out: jax.Array | None = None,
               pold: jax.Array | None = None, compute_err: bool | None = None,
               fold: bool = False, relax_at: int = 0) -> tuple[jax.Array, jax.Array | None]:
    """One half-step on the ``src`` side (kernels/lse.py; ``kernel_calls.lse_update``).

    out_i = eps logw_out_i - eps LSE_j((pot_tgt_j - C_ij)/eps + logw_in_j). ``pold``:
    the previous potential of the ``src`` side; with it, err_i = |exp(pold_i/eps + L_i)
    - w_out_i|, the per-point marginal error on this side of the plan built from
    ``pold`` (``compute_err``, default: whenever ``pold`` is given), and with ``fold``
    the fixed-shift loop predicted from ``pold`` (verified in the kernel). ``relax_at``:
    a KL-relaxed side's (tau, 1/rho) index in ``params`` (``core.unbalanced``; 0:
    balanced): out is damped by tau and the error's target is w_out exp(-pold / rho).
    """
    compute_err = pold is not None if compute_err is None else bool(compute_err)
    seq = kernel_calls.lse_update(src.n, tgt.n, src.d, precision, kernels_on_gpu(), logw_in is not None,
                                  logw_out is not None, pold is not None, compute_err, fold, relax_at, _labels(src, tgt))
    arrays = _pair(src, tgt, params)
    arrays.update(pot=pot_tgt.astype(F32), logw_in=_f32(logw_in), logw_out=_f32(logw_out), pold=_f32(pold))
    out, err = run(seq, arrays, backend)
    return out, (err if compute_err else None)


def lse_pair(X: Cloud, Y: Cloud, f: jax.Array, g: jax.Array, logw_x: jax.Array, logw_y: jax.Array,
             params: jax.Array, *, precision: str, backend: str | None = None) -> tuple[jax.Array, jax.Array]:
    """Both sides of a symmetric update from (f, g) (``kernel_calls.lse_pair``): the softmins
    -eps LSE_j((g_j - C_ij)/eps + logw_y_j) of the X points and -eps LSE_i((f_i - C_ij)/eps +
    logw_x_i) of the Y points."""
    seq = kernel_calls.lse_pair(X.n, Y.n, X.d, precision, kernels_on_gpu(), _labels(X, Y))
    arrays = _pair(X, Y, params)
    arrays.update(f=f.astype(F32), g=g.astype(F32), logw_x=logw_x.astype(F32), logw_y=logw_y.astype(F32))
    return run(seq, arrays, backend)


def lse_self(X: Cloud, f: jax.Array, logw_x: jax.Array, params: jax.Array, *, precision: str,
             backend: str | None = None) -> jax.Array:
    """The symmetric update -eps LSE_j((f_j - C_ij)/eps + logw_x_j) of X against itself
    (``kernel_calls.lse_self``)."""
    seq = kernel_calls.lse_self(X.n, X.d, precision, kernels_on_gpu(), _labels(X, X))
    arrays = _pair(X, X, params)
    arrays.update(f=f.astype(F32), logw_x=logw_x.astype(F32))
    return run(seq, arrays, backend)[0]


def apply_plan(src: Cloud, tgt: Cloud, f: jax.Array, g: jax.Array, params: jax.Array, *,
               precision: str, backend: str | None = None,
               v: jax.Array | None = None) -> tuple[jax.Array | None, jax.Array]:
    """(P v, P 1) with P_ij = exp((f_i + g_j - C_ij)/eps), never forming P.

    ``v`` is (m, p) or None (row sums only). Rows of P are the ``src`` points.
    """
    p = 0 if v is None else v.shape[1]
    seq = kernel_calls.apply_plan(src.n, tgt.n, src.d, p, precision, kernels_on_gpu(), _labels(src, tgt))
    arrays = _pair(src, tgt, params)
    arrays.update(f=f.astype(F32), g=g.astype(F32), v=_f32(v))
    pv, rowsum = run(seq, arrays, backend)
    return (pv if p else None), rowsum


def lse_blocksparse(src: Cloud, tgt: Cloud, pot_tgt: jax.Array, params: jax.Array, ranges: jax.Array, *,
                    precision: str, backend: str | None = None, logw_out: jax.Array | None = None,
                    pold: jax.Array | None = None, compute_err: bool = False,
                    relax_at: int = 0) -> tuple[jax.Array, jax.Array | None]:
    """:func:`lse_update` with row block b of ``src`` streaming only the ``tgt`` columns
    [ranges[b, q, 0], ranges[b, q, 1]) (kernels/lse_blocksparse.py; ``multiscale_calls.lse_blocksparse``):
    ``ranges`` int32 (cdiv(n, BLOCK_M), r, 2), BLOCK_M = ``multiscale_plans.blocksparse_block_m``.
    ``compute_err`` needs ``pold``; unlabelled clouds only."""
    if src.labels is not None or tgt.labels is not None:
        raise NotImplementedError("lse_blocksparse has no label cost")
    if compute_err and pold is None:
        raise ValueError("lse_blocksparse: compute_err needs pold (the previous potential)")
    seq = multiscale_calls.lse_blocksparse(src.n, tgt.n, src.d, ranges.shape[1], precision, kernels_on_gpu(), False,
                                           logw_out is not None, compute_err, False, relax_at)
    arrays = _pair(src, tgt, params)
    arrays.update(pot=pot_tgt.astype(F32), logw_out=_f32(logw_out), pold=_f32(pold), ranges=ranges)
    out, err = run(seq, arrays, backend)
    return out, (err if compute_err else None)


def apply_plan_blocksparse(src: Cloud, tgt: Cloud, f: jax.Array, g: jax.Array, params: jax.Array,
                           ranges: jax.Array, *, precision: str, backend: str | None = None,
                           v: jax.Array | None = None) -> tuple[jax.Array | None, jax.Array]:
    """:func:`apply_plan` with P_ij kept only where column j is in a range of row i's block
    (``ranges`` as in :func:`lse_blocksparse`): (P v, P 1), v (m, p) or None."""
    if src.labels is not None or tgt.labels is not None:
        raise NotImplementedError("apply_plan_blocksparse has no label cost")
    p = 0 if v is None else v.shape[1]
    seq = multiscale_calls.apply_plan_blocksparse(src.n, tgt.n, src.d, ranges.shape[1], p, precision,
                                                  kernels_on_gpu())
    arrays = _pair(src, tgt, params)
    arrays.update(f=f.astype(F32), g=g.astype(F32), v=_f32(v), ranges=ranges)
    pv, rowsum = run(seq, arrays, backend)
    return (pv if p else None), rowsum


def apply_weighted(src: Cloud, tgt: Cloud, f: jax.Array, g: jax.Array, params: jax.Array, w: jax.Array,
                   wa: jax.Array, wb: jax.Array, *, precision: str, backend: str | None = None) -> jax.Array:
    """sum_j P_ij <w_i, wa_j> wb_j (n, p) for w (n, k), wa (m, k), wb (m, p) (rows of P: ``src``)."""
    seq = kernel_calls.apply_weighted(src.n, tgt.n, src.d, w.shape[1], wb.shape[1], precision, kernels_on_gpu(),
                                      _labels(src, tgt))
    arrays = _pair(src, tgt, params)
    arrays.update(f=f.astype(F32), g=g.astype(F32), w=w.astype(F32), wa=wa.astype(F32), wb=wb.astype(F32))
    return run(seq, arrays, backend)[0]


def fixed_split(x: jax.Array, *, backend: str | None = None) -> tuple[jax.Array, jax.Array]:
    """Fixed-point heads and TF32 tails of an (n, d) float32 array (split_fixed_kernel)."""
    return run(kernel_calls.split_fixed(x.shape[0], x.shape[1], kernels_on_gpu()), {"x": x}, backend)


def exact_row_mass(src: Cloud, tgt: Cloud, f: jax.Array, g: jax.Array, params: jax.Array, *,
                   backend: str | None = None) -> jax.Array:
    """P 1 with the unbiased "fixed4" cross term (the mass term of reg_ot_cost;
    ``kernel_calls.exact_row_mass`` says why)."""
    xh, xl = fixed_split(src.x, backend=backend)
    yh, yl = (xh, xl) if tgt is src else fixed_split(tgt.x, backend=backend)
    arrays = {**_pair(src, tgt, params), "x_hi": xh, "x_lo": xl, "y_hi": yh, "y_lo": yl,
              "f": f.astype(F32), "g": g.astype(F32)}
    (rows,) = run(kernel_calls.exact_row_mass(src.n, tgt.n, src.d, kernels_on_gpu(), _labels(src, tgt)), arrays,
                  backend)
    return rows


def transport(src: Cloud, tgt: Cloud, f_src: jax.Array, g_tgt: jax.Array, params: jax.Array,
              vec: jax.Array, *, precision: str, backend: str | None = None) -> jax.Array:
    """P vec for vec of shape (m,) or (m, k) (rows of P are ``src``); returns (n,) or (n, k)."""
    v2 = vec.reshape(vec.shape[0], -1)
    out, _ = apply_plan(src, tgt, f_src, g_tgt, params, precision=precision, backend=backend, v=v2)
    return out.reshape((src.n,) + tuple(vec.shape[1:]))


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
