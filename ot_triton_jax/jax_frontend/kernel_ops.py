"""The kernel calls of ``ot_triton_jax.core.kernel_calls`` on JAX arrays, and the envelope gradient.

:func:`run` executes a call description (the same descriptions ``torch_api.kernel_ops``
runs) through :func:`.launch.launch`; the functions below only name the arrays of each
call. Everything here is a plain function of JAX arrays (jit-able, no custom
derivative rules): the solvers and the derivative rules (:mod:`.derivatives`) call it.

Batching: under ``jax.vmap`` the cloud preparation (:func:`clouds`) and the plan passes
(:func:`apply_plan`, :func:`exact_row_mass`) of unlabelled clouds run once for the whole batch
(the problems packed, the block-sparse kernels: :func:`_packed_plan`); every other call runs
once per problem (:func:`.batching.loop_over_batch`) unless its whole solve folds the batch
(:mod:`.batched_loop`, :mod:`.geomloss_packed`: :func:`lse_blocksparse` on the packed clouds).

Clouds are float32, contiguous, with their squared norms precomputed once per
solve (:class:`Cloud`). Run-time floats travel in ``params = [eps, s]``
(float32, shape (2,)) so a new epsilon never recompiles.

The kernels themselves are not differentiable (XLA sees opaque calls); pass
``jax.lax.stop_gradient`` values, as the solvers do.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .launch import kernels_on_gpu, launch

kernels_on_gpu()  # before the kernels are imported (by kernel_calls): GPU or interpreter

from ..core import batch_layout, kernel_calls, launch_plans, multiscale_calls  # noqa: E402
from . import packing  # noqa: E402
from .batching import loop_over_batch  # noqa: E402
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
    out = tuple(Cloud(xc, sq, hi, lo, sc) for xc, hi, lo, sq, sc in _prepare_op(len(pts), backend)(*pts))
    return out if labels is None and label_cost is None else _labelled(out, labels, label_cost)


def _prepare(pts: tuple[jax.Array, ...], backend, center: jax.Array | None = None) -> tuple:
    """(xc, hi, lo, sq, sc or None) of each cloud: centred on ``center`` (default: the centre
    kernel's common centre), split for the cross term (kernels/split.py)."""
    on_gpu = kernels_on_gpu()
    d = pts[0].shape[1]
    if center is None:
        (center,) = run(kernel_calls.center(pts[0].shape[0], pts[-1].shape[0], d, on_gpu),
                        {"x": pts[0], "y": pts[-1]}, backend)
    arrays = {"center": center, "amax": None}
    if launch_plans.fp16_operands(d):  # the FP16 parts' scale: the largest |x - c| of every cloud
        arrays["amax"] = jnp.concatenate([run(kernel_calls.absmax(pts[i].shape[0], pts[j].shape[0], d, on_gpu),
                                              {"x": pts[i], "y": pts[j], "center": center}, backend)[0]
                                          for i, j in kernel_calls.absmax_pairs(len(pts))])
    n_amax = 0 if arrays["amax"] is None else arrays["amax"].shape[0]
    out = []
    for p in pts:
        xc, hi, lo, sq, *sc = run(kernel_calls.split_centered(p.shape[0], d, on_gpu, n_amax), dict(arrays, x=p),
                                  backend)
        out.append((xc, hi, lo, sq, sc[0] if sc else None))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _prepare_op(count: int, backend):
    """:func:`_prepare` of ``count`` clouds, whose ``jax.vmap`` prepares the whole batch at once:
    each problem centred on the mean of its clouds' means (XLA), then one absmax and one split
    launch per cloud for all problems together (one float16 scale for the batch)."""

    def fold(B, flags, *pts):
        full = [p if b else jnp.broadcast_to(p, (B,) + p.shape) for p, b in zip(pts, flags)]
        c = sum(jnp.mean(p, axis=1) for p in full) / len(full)
        d = full[0].shape[-1]
        parts = _prepare(tuple((p - c[:, None, :]).reshape(-1, d) for p in full), backend, jnp.zeros((d,), F32))
        out = tuple((xc.reshape(B, -1, d), hi.reshape(B, -1, hi.shape[-1]), lo.reshape(B, -1, lo.shape[-1]),
                     sq.reshape(B, -1), None if sc is None else jnp.broadcast_to(sc, (B,) + sc.shape))
                    for xc, hi, lo, sq, sc in parts)
        return out, jax.tree_util.tree_map(lambda _: True, out)

    return loop_over_batch(lambda *pts: _prepare(pts, backend), fold=fold)


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
               fold: bool = False, relax_at: int = 0, grouped: bool = False) -> tuple[jax.Array, jax.Array | None]:
    """One half-step on the ``src`` side (kernels/lse.py; ``kernel_calls.lse_update``).

    out_i = eps logw_out_i - eps LSE_j((pot_tgt_j - C_ij)/eps + logw_in_j). ``pold``:
    the previous potential of the ``src`` side; with it, err_i = |exp(pold_i/eps + L_i)
    - w_out_i|, the per-point marginal error on this side of the plan built from
    ``pold`` (``compute_err``, default: whenever ``pold`` is given), and with ``fold``
    the fixed-shift loop predicted from ``pold`` (verified in the kernel). ``relax_at``:
    a KL-relaxed side's (tau, 1/rho) index in ``params`` (``core.unbalanced``; 0:
    balanced): out is damped by tau and the error's target is w_out exp(-pold / rho). ``grouped``:
    src's labels are sorted (kernels/lse_update.py, GROUPED).
    """
    compute_err = pold is not None if compute_err is None else bool(compute_err)
    seq = kernel_calls.lse_update(src.n, tgt.n, src.d, precision, kernels_on_gpu(), logw_in is not None,
                                  logw_out is not None, pold is not None, compute_err, fold, relax_at, _labels(src, tgt),
                                  grouped)
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

    ``v`` is (m, p) or None (row sums only). Rows of P are the ``src`` points. Under ``jax.vmap``
    (unlabelled clouds, shared ``params``) one block-sparse pass serves the batch (:func:`_packed_plan`).
    """
    if src.labels is None and tgt.labels is None:
        return _apply_op(precision, backend)(src, tgt, f, g, params, v)
    return _apply_plan(src, tgt, f, g, params, precision, backend, v)


def _apply_plan(src: Cloud, tgt: Cloud, f, g, params, precision: str, backend, v):
    p = 0 if v is None else v.shape[1]
    seq = kernel_calls.apply_plan(src.n, tgt.n, src.d, p, precision, kernels_on_gpu(), _labels(src, tgt))
    arrays = _pair(src, tgt, params)
    arrays.update(f=f.astype(F32), g=g.astype(F32), v=_f32(v))
    pv, rowsum = run(seq, arrays, backend)
    return (pv if p else None), rowsum


@functools.lru_cache(maxsize=None)
def _apply_op(precision: str, backend):
    return loop_over_batch(lambda *args: _apply_plan(*args[:5], precision, backend, args[5]),
                           fold=lambda B, flags, *args: _packed_plan(B, flags, *args, precision, backend))


def _packed_plan(B: int, flags, src: Cloud, tgt: Cloud, f, g, params, v, precision: str, backend):
    """The batched (P v, P 1) of B problems in one block-sparse pass: the problems' clouds (each
    centred on its own centre) packed on row-block boundaries and split once (packing.py,
    :func:`apply_plan_blocksparse`); None (one pass per problem) when ``params`` is batched."""
    b_src, b_tgt, b_f, b_g, b_prm, b_v = flags
    if b_prm:
        return None
    n, m, d = src.x.shape[-2], tgt.x.shape[-2], src.x.shape[-1]

    def packed(val, batched, layout, fill=0.0):
        return packing.pack(packing.batch_rows(val, batched, B), layout, fill)

    lx, ly = packing.layouts(B, n, m, d, precision)
    S, T = clouds(packed(src.x, b_src.x, lx), packed(tgt.x, b_tgt.x, ly), backend=backend)
    pv, rows = apply_plan_blocksparse(
        S, T, packed(f, b_f, lx, -jnp.inf), packed(g, b_g, ly, -jnp.inf), params,
        jnp.asarray(batch_layout.column_ranges(lx, ly)), precision=precision, backend=backend,
        v=None if v is None else packed(v, b_v, ly))
    outs = (None if v is None else packing.unpack(pv, lx).reshape(B, n, -1), packing.unpack(rows, lx).reshape(B, n))
    return outs, jax.tree_util.tree_map(lambda _: True, outs)


def lse_blocksparse(src: Cloud, tgt: Cloud, pot_tgt: jax.Array, params: jax.Array, ranges: jax.Array, *,
                    precision: str, backend: str | None = None, logw_in: jax.Array | None = None,
                    logw_out: jax.Array | None = None, pold: jax.Array | None = None, compute_err: bool = False,
                    relax_at: int = 0) -> tuple[jax.Array, jax.Array | None]:
    """:func:`lse_update` with row block b of ``src`` streaming only the ``tgt`` columns
    [ranges[b, q, 0], ranges[b, q, 1]) (kernels/lse_blocksparse.py; ``multiscale_calls.lse_blocksparse``):
    ``ranges`` int32 (cdiv(n, BLOCK_M), r, 2), BLOCK_M = ``multiscale_plans.blocksparse_block_m``.
    ``logw_in``: the tgt log weights inside the LSE (GeomLoss's softmin). ``compute_err`` needs
    ``pold``; unlabelled clouds only."""
    if src.labels is not None or tgt.labels is not None:
        raise NotImplementedError("lse_blocksparse has no label cost")
    if compute_err and pold is None:
        raise ValueError("lse_blocksparse: compute_err needs pold (the previous potential)")
    seq = multiscale_calls.lse_blocksparse(src.n, tgt.n, src.d, ranges.shape[1], precision, kernels_on_gpu(),
                                           logw_in is not None, logw_out is not None, compute_err, False, relax_at)
    arrays = _pair(src, tgt, params)
    arrays.update(pot=pot_tgt.astype(F32), logw_in=_f32(logw_in), logw_out=_f32(logw_out), pold=_f32(pold),
                  ranges=ranges)
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
    """sum_j P_ij <w_i, wa_j> wb_j (n, p) for w (n, k), wa (m, k), wb (m, p) (rows of P: ``src``).
    Under ``jax.vmap`` (unlabelled clouds, shared ``params``, k p <= ``OUTER_MAX``) one packed plan
    pass of the k p columns wa_jq wb_j serves the batch, contracted with w_i after it
    (:func:`_packed_weighted`)."""
    if src.labels is None and tgt.labels is None:
        return _weighted_op(precision, backend)(src, tgt, f, g, params, w, wa, wb)
    return _apply_weighted(src, tgt, f, g, params, w, wa, wb, precision, backend)


OUTER_MAX = 64  # columns of the outer-product form of a batched weighted pass


@functools.lru_cache(maxsize=None)
def _weighted_op(precision: str, backend):
    return loop_over_batch(lambda *args: _apply_weighted(*args, precision, backend),
                           fold=lambda B, flags, *args: _packed_weighted(B, flags, *args, precision, backend))


def _packed_weighted(B: int, flags, src: Cloud, tgt: Cloud, f, g, params, w, wa, wb, precision: str, backend):
    """The batched weighted pass as sum_q w_iq (P (wa_q * wb))_i: one packed plan pass
    (:func:`_packed_plan`) of the k p columns wa_jq wb_jr; None (one weighted pass per problem)
    with batched ``params`` or more than ``OUTER_MAX`` columns."""
    b_src, b_tgt, b_f, b_g, b_prm, b_w, b_wa, b_wb = flags
    k, p, m = w.shape[-1], wb.shape[-1], tgt.x.shape[-2]
    if b_prm or k * p > OUTER_MAX:
        return None
    full = lambda v, b: (v if b else jnp.broadcast_to(v, (B,) + v.shape)).astype(F32)  # noqa: E731
    outer = (full(wa, b_wa)[..., :, None] * full(wb, b_wb)[..., None, :]).reshape(B, m, k * p)
    (pv, _), _ = _packed_plan(B, (b_src, b_tgt, b_f, b_g, b_prm, True), src, tgt, f, g, params, outer, precision,
                              backend)
    out = (full(w, b_w)[..., :, None] * pv.reshape(B, -1, k, p)).sum(-2)
    return out, True


def _apply_weighted(src: Cloud, tgt: Cloud, f, g, params, w, wa, wb, precision: str, backend) -> jax.Array:
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
    ``kernel_calls.exact_row_mass`` says why). Under ``jax.vmap`` (unlabelled clouds, shared
    ``params``) the batch's rows come from one block-sparse pass with the solver's own float32
    cross term instead (:func:`_packed_plan`: its truncation bias, ~1e-7 relative of <x, y>, enters
    reg_ot_cost only through eps sum P, far under float32 rounding of the cost)."""
    if src.labels is None and tgt.labels is None:
        return _row_mass_op(backend)(src, tgt, f, g, params)
    return _exact_row_mass(src, tgt, f, g, params, backend)


def _exact_row_mass(src: Cloud, tgt: Cloud, f, g, params, backend) -> jax.Array:
    xh, xl = fixed_split(src.x, backend=backend)
    yh, yl = (xh, xl) if tgt is src else fixed_split(tgt.x, backend=backend)
    arrays = {**_pair(src, tgt, params), "x_hi": xh, "x_lo": xl, "y_hi": yh, "y_lo": yl,
              "f": f.astype(F32), "g": g.astype(F32)}
    (rows,) = run(kernel_calls.exact_row_mass(src.n, tgt.n, src.d, kernels_on_gpu(), _labels(src, tgt)), arrays,
                  backend)
    return rows


@functools.lru_cache(maxsize=None)
def _row_mass_op(backend):
    def fold(B, flags, *args):
        out = _packed_plan(B, (*flags, False), *args, None, "float32", backend)
        return None if out is None else (out[0][1], True)

    return loop_over_batch(lambda *args: _exact_row_mass(*args, backend), fold=fold)


def transport(src: Cloud, tgt: Cloud, f_src: jax.Array, g_tgt: jax.Array, params: jax.Array,
              vec: jax.Array, *, precision: str, backend: str | None = None) -> jax.Array:
    """P vec for vec of shape (m,) or (m, k) (rows of P are ``src``); returns (n,) or (n, k)."""
    v2 = vec.reshape(vec.shape[0], -1)
    out, _ = apply_plan(src, tgt, f_src, g_tgt, params, precision=precision, backend=backend, v=v2)
    return out.reshape((src.n,) + tuple(vec.shape[1:]))
