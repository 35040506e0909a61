"""Torch execution of the kernel calls described in ``ot_triton_jax.core.kernel_calls``.

:func:`run` launches a :class:`~ot_triton_jax.core.kernel_calls.CallSequence` on torch
tensors (outputs allocated here, 1-element scratch outputs shared per device since no
kernel writes them); the functions below only name the arrays of each call. The JAX
frontend runs the very same descriptions (``ot_triton_jax.jax_frontend.kernel_ops``).
"""

from __future__ import annotations

import operator

import torch

from ot_triton_jax.core import kernel_calls, labels as label_rules, launch_plans, multiscale_calls, multiscale_plans, runtime

from .host_copy import to_device
from .launch import launch, prewarm as launch_prewarm

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "int8": torch.int8, "int32": torch.int32,
           "int64": torch.int64}
_SCRATCH: dict = {}
_STEPS: dict = {}


def _scratch(device) -> torch.Tensor:
    t = _SCRATCH.get(device)
    if t is None:
        t = _SCRATCH[device] = torch.empty(1, dtype=torch.float32, device=device)
    return t


def _steps(seq: kernel_calls.CallSequence) -> tuple:
    """Per call of ``seq``: (kernel, grid, argument getter, integer arguments, output specs,
    constexprs, warps, stages), kept per description (the builders are cached, so the same
    object comes back). Host time per launch matters at n <= 8192 (docs/performance.md)."""
    hit = _STEPS.get(id(seq))
    if hit is None or hit[0] is not seq:
        steps = []
        for c in seq.calls:
            keys = tuple(a if isinstance(a, str) else f"#{k}" for k, a in enumerate(c.args))
            ints = {f"#{k}": a for k, a in enumerate(c.args) if not isinstance(a, str)}
            # scratch -> None (one shared buffer); a 1-D shape as an int (torch.empty is faster with one)
            outs = tuple((o.name, None if o.scratch else (o.shape[0] if len(o.shape) == 1 else o.shape),
                          _DTYPES[o.dtype]) for o in c.outputs)
            steps.append((c.kernel, tuple(c.plan.grid), operator.itemgetter(*keys), ints, outs, c.constexprs,
                          c.plan.num_warps, c.plan.num_stages))
        hit = _STEPS[id(seq)] = (seq, tuple(steps))
    return hit[1]


def run(seq: kernel_calls.CallSequence, arrays: dict, device) -> tuple[torch.Tensor, ...]:
    """Launch every call of ``seq`` with the named ``arrays`` (updated in place with the
    outputs); return its results."""
    scratch = None
    for kernel, grid, getter, ints, outs, constexprs, warps, stages in _steps(seq):
        arrays.update(ints)
        bufs = []
        for name, shape, dtype in outs:
            if shape is None:
                buf = scratch = scratch if scratch is not None else _scratch(device)
            else:
                buf = torch.empty(shape, dtype=dtype, device=device)
            arrays[name] = buf
            bufs.append(buf)
        launch(kernel, grid, getter(arrays) + tuple(bufs), constexprs, num_warps=warps, num_stages=stages)
    if seq.row_partials is not None:
        name, split, n = seq.row_partials
        arrays[name] = arrays[name].view(split, n).sum(0)
    return tuple(arrays[r] for r in seq.results)


_INPUT_DTYPES = {"ranges": torch.int32, "keep": torch.int8, "span": torch.int32, "col_start": torch.int32}  # every other named input is float32


def input_dtype(call: kernel_calls.KernelCall, name: str) -> torch.dtype:
    """The torch dtype of the named input ``name`` of ``call`` (kernel_calls: float32 unless
    the call's ``dtypes`` or the int inputs say otherwise)."""
    return _DTYPES[call.dtypes[name]] if name in call.dtypes else _INPUT_DTYPES.get(name, torch.float32)


def prewarm(seqs, device) -> int:
    """Compile the kernels of the descriptions ``seqs`` (kernel_calls.CallSequence) in parallel
    before their first :func:`run` (launch.prewarm); stand-in one-element tensors take the
    arrays' places, the integer sizes are the descriptions' own. Returns the compiles run."""
    stand_in: dict = {}

    def tensor(dtype):
        if dtype not in stand_in:
            stand_in[dtype] = torch.empty(1, dtype=dtype, device=device)
        return stand_in[dtype]

    items = []
    for seq in seqs:
        for c in seq.calls:
            args = tuple(tensor(input_dtype(c, a)) if isinstance(a, str) else a for a in c.args)
            args += tuple(tensor(_DTYPES[o.dtype]) for o in c.outputs)
            items.append((c.kernel, args, c.constexprs, c.plan.num_warps, c.plan.num_stages))
    return launch_prewarm(items)


class Cloud:
    """A point cloud as the kernels want it (built by :func:`clouds`): float32 ``x``
    centred on its problem's common centre, its head and tail ``hi``, ``lo`` (float16 parts of
    the cloud scaled by S, ``scale`` = 1 / S; kernels/split.py; TF32 parts and no scale where
    launch_plans.fp16_operands says no) and its squared norms. With a label cost (core/labels.py):
    its int32 ``labels`` (n,) and the class table oriented so that they index its rows,
    ``label_table`` (K_self, K_other) float32 contiguous (x: W, y: W^T; the kernels read the tgt
    cloud's, kernels/label_tiles.py); both None otherwise."""

    __slots__ = ("x", "hi", "lo", "sqnorm", "scale", "labels", "label_table")

    def __init__(self, x: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, sqnorm: torch.Tensor,
                 scale: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                 label_table: torch.Tensor | None = None):
        self.x, self.hi, self.lo, self.sqnorm, self.scale = x, hi, lo, sqnorm, scale
        self.labels, self.label_table = labels, label_table

    @property
    def n(self) -> int:
        return self.x.shape[0]

    @property
    def d(self) -> int:
        return self.x.shape[1]


def clouds(*pts: torch.Tensor, labels: tuple[torch.Tensor, ...] | None = None,
           label_cost: torch.Tensor | None = None) -> tuple[Cloud, ...]:
    """The clouds of one problem (one or two (n, d) tensors, detached, in float32), shifted
    by one common centre (``kernel_calls.center``): the cost |x - y|^2, the plan and the
    potentials are unchanged, float32 rounding is not (kernels/split.py says why).

    Label cost (core/labels.py): ``labels`` one integer tensor per cloud and ``label_cost`` W
    (K_x, K_y); every kernel call on these clouds then adds s W[label_src_i, label_tgt_j] to the
    cost (x holds W, y holds W^T). One cloud (a self problem): W square, the cost W[label_i, label_j]
    (the cloud holds W^T: the kernels read the tgt cloud's table, Cloud). Shapes and
    dtypes are checked here; the values (labels in range, W finite) by ``labels.check_values``."""
    pts = tuple(p.detach().to(torch.float32).contiguous() for p in pts)
    dev, on_gpu = pts[0].device, runtime.on_gpu()
    d = pts[0].shape[1]
    (c,) = run(kernel_calls.center(pts[0].shape[0], pts[-1].shape[0], d, on_gpu), {"x": pts[0], "y": pts[-1]}, dev)
    arrays = {"center": c, "amax": None}
    if launch_plans.fp16_operands(d):  # the FP16 parts' scale: the largest |x - c| of every cloud
        arrays["amax"] = torch.cat([run(kernel_calls.absmax(pts[i].shape[0], pts[j].shape[0], d, on_gpu),
                                        {"x": pts[i], "y": pts[j], "center": c}, dev)[0]
                                    for i, j in kernel_calls.absmax_pairs(len(pts))])
    n_amax = 0 if arrays["amax"] is None else arrays["amax"].shape[0]
    out = tuple(Cloud(*run(kernel_calls.split_centered(p.shape[0], d, on_gpu, n_amax), dict(arrays, x=p), dev))
                for p in pts)
    return out if labels is None and label_cost is None else _labelled(out, labels, label_cost)


def _labelled(cl: tuple[Cloud, ...], labels, label_cost) -> tuple[Cloud, ...]:
    """The clouds ``cl`` given their int32 labels and oriented tables (:func:`clouds`)."""
    if len(cl) > 2 or labels is None or len(labels) != len(cl):
        raise ValueError(f"clouds: labels must be a tuple of one label tensor per cloud ({len(cl)} here, at most 2) "
                         "given with label_cost")
    label_rules.check_shapes(labels[0], labels[-1], label_cost, cl[0].n, cl[-1].n, self_problem=len(cl) == 1)
    w = label_cost.detach().to(device=cl[0].x.device, dtype=torch.float32).contiguous()
    tables = (w.t().contiguous(),) if len(cl) == 1 else (w, w.t().contiguous())  # a self cloud: T^T
    for c, lab, table in zip(cl, labels, tables):
        c.labels = lab.detach().to(device=c.x.device, dtype=torch.int32).contiguous()
        c.label_table = table
    return cl


def params(eps: float, s: float, device) -> torch.Tensor:
    """The PARAMS array [eps, s] read by every kernel, filled on the device: a
    ``torch.tensor(list, device=cuda)`` copies from pageable host memory, which blocks the host
    until the stream has drained (a synchronization in the middle of a solve)."""
    out = torch.full((2,), eps, dtype=torch.float32, device=device)
    out[1:].fill_(s)  # not ``out[1] = s``: that copies a host scalar and synchronizes
    return out


_PARAMS: dict = {}  # (eps, scale, device) -> PARAMS, for numbers given on the host


def kernel_params(epsilon: torch.Tensor, scale: torch.Tensor, device) -> torch.Tensor:
    """The PARAMS array [eps, s = 1/scale_cost] read by every kernel (float32, s divided
    in float32 as the JAX frontend does). Numbers given by the user arrive as CPU tensors:
    one non-blocking copy, no host sync, made once per value (read-only afterwards)."""
    key = None
    if epsilon.device.type == "cpu" and scale.device.type == "cpu" and not torch.compiler.is_compiling():
        key = (epsilon.detach().item(), scale.detach().item(), epsilon.dtype, scale.dtype, device)
        hit = _PARAMS.get(key)
        if hit is not None:
            return hit
    eps = epsilon.detach().reshape(()).to(torch.float32)
    sc = scale.detach().reshape(()).to(torch.float32)
    s = 1.0 / sc.to(device=eps.device)
    prm = to_device(torch.stack([eps, s]), device)
    if key is not None:
        if len(_PARAMS) >= 256:
            _PARAMS.clear()
        _PARAMS[key] = prm
    return prm


def _pair(src: Cloud, tgt: Cloud, prm: torch.Tensor) -> dict:
    return {"x_hi": src.hi, "x_lo": src.lo, "y_hi": tgt.hi, "y_lo": tgt.lo, "x_sq": src.sqnorm,
            "y_sq": tgt.sqnorm, "params": prm, "x_scale": src.scale, "y_scale": tgt.scale,
            "x_lab": src.labels, "y_lab": tgt.labels, "x_ltab": src.label_table, "y_ltab": tgt.label_table}


def _labels(src: Cloud, tgt: Cloud) -> tuple[int, int] | None:
    """The kernel_calls ``labels`` of a call on (src, tgt): None, or the src table's shape."""
    return label_rules.call_labels(src.labels, src.label_table, tgt.labels, tgt.label_table, src is tgt)


def _no_labels(src: Cloud, tgt: Cloud, name: str) -> None:
    if src.labels is not None or tgt.labels is not None:
        raise ValueError(f"{name}: the block-sparse (multiscale) kernels have no label cost; use the dense kernels")


def lse_update(src: Cloud, tgt: Cloud, pot_tgt: torch.Tensor, prm: torch.Tensor, precision: str, *,
               logw_in: torch.Tensor | None = None, logw_out: torch.Tensor | None = None,
               pold: torch.Tensor | None = None, compute_err: bool | None = None,
               fold: bool = False, relax_at: int = 0, grouped: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """New potential on the ``src`` side (kernels/lse.py; ``kernel_calls.lse_update``).
    ``pold``: the previous potential of the ``src`` side; with it, the per-point marginal
    error of the plan built from ``pold`` (``compute_err``, default: whenever ``pold`` is
    given) and, with ``fold``, the fixed-shift loop predicted from ``pold``. ``relax_at``:
    a KL-relaxed side's (tau, 1/rho) index in ``prm`` (``core.unbalanced``; 0: balanced).
    ``grouped``: src's labels are sorted (kernels/lse_update.py, GROUPED)."""
    compute_err = pold is not None if compute_err is None else bool(compute_err)
    seq = kernel_calls.lse_update(src.n, tgt.n, src.d, precision, runtime.on_gpu(), logw_in is not None,
                                  logw_out is not None, pold is not None, compute_err, fold, relax_at, _labels(src, tgt),
                                  grouped)
    arrays = _pair(src, tgt, prm)
    arrays.update(pot=pot_tgt, logw_in=logw_in, logw_out=logw_out, pold=pold)
    out, err = run(seq, arrays, src.x.device)
    return out, (err if compute_err else None)


def lse_pair(X: Cloud, Y: Cloud, f: torch.Tensor, g: torch.Tensor, logw_x: torch.Tensor, logw_y: torch.Tensor,
             prm: torch.Tensor, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Both sides of a symmetric update from (f, g) (``kernel_calls.lse_pair``): the softmins
    -eps LSE_j((g_j - C_ij)/eps + logw_y_j) of the X points and -eps LSE_i((f_i - C_ij)/eps +
    logw_x_i) of the Y points."""
    seq = kernel_calls.lse_pair(X.n, Y.n, X.d, precision, runtime.on_gpu(), _labels(X, Y))
    arrays = _pair(X, Y, prm)
    arrays.update(f=f.contiguous(), g=g.contiguous(), logw_x=logw_x, logw_y=logw_y)
    return run(seq, arrays, X.x.device)


def lse_self(X: Cloud, f: torch.Tensor, logw_x: torch.Tensor, prm: torch.Tensor, precision: str) -> torch.Tensor:
    """The symmetric update -eps LSE_j((f_j - C_ij)/eps + logw_x_j) of X against itself
    (``kernel_calls.lse_self``)."""
    seq = kernel_calls.lse_self(X.n, X.d, precision, runtime.on_gpu(), _labels(X, X))
    arrays = _pair(X, X, prm)
    arrays.update(f=f.contiguous(), logw_x=logw_x)
    return run(seq, arrays, X.x.device)[0]


def apply_plan(src: Cloud, tgt: Cloud, f: torch.Tensor, g: torch.Tensor, prm: torch.Tensor,
               precision: str, v: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(P v, P 1) with P_ij = exp((f_i + g_j - C_ij)/eps); v is (m, p) or None."""
    p = 0 if v is None else v.shape[1]
    seq = kernel_calls.apply_plan(src.n, tgt.n, src.d, p, precision, runtime.on_gpu(), _labels(src, tgt))
    arrays = _pair(src, tgt, prm)
    arrays.update(f=f.contiguous(), g=g.contiguous(), v=v.to(torch.float32).contiguous() if p else None)
    pv, rowsum = run(seq, arrays, src.x.device)
    return (pv if p else None), rowsum


def _blocksparse_ranges(n: int, d: int, precision: str, ranges: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(ranges as contiguous int32, runs per row block); the shape checked against the row
    blocks of ``multiscale_plans.blocksparse_block_m``."""
    rows = -(-n // multiscale_plans.blocksparse_block_m(d, precision, runtime.on_gpu()))
    if ranges.dim() != 3 or ranges.shape[0] != rows or ranges.shape[2] != 2:
        raise ValueError(f"ranges must have shape (row blocks, runs, 2) = ({rows}, r, 2), got {tuple(ranges.shape)}; "
                         "build it with multiscale.clusters.column_ranges")
    if ranges.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ranges must be int32 or int64 column indices, got {ranges.dtype}")
    return ranges.to(torch.int32).contiguous(), ranges.shape[1]


def lse_blocksparse(src: Cloud, tgt: Cloud, pot_tgt: torch.Tensor, prm: torch.Tensor, ranges: torch.Tensor,
                    precision: str, *, logw_in: torch.Tensor | None = None,
                    logw_out: torch.Tensor | None = None, pold: torch.Tensor | None = None,
                    compute_err: bool | None = None, fold: bool = False,
                    relax_at: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`lse_update` over the tgt column ranges of each src row block (kernels/lse_blocksparse.py;
    ``multiscale_calls.lse_blocksparse``): ``ranges`` (cdiv(n, BLOCK_M), r, 2), BLOCK_M from
    ``multiscale_plans.blocksparse_block_m``: row block b streams the columns [ranges[b, q, 0],
    ranges[b, q, 1]). A row block keeping nothing gets eps logw_out (0 without it). Options as
    in :func:`lse_update` (``relax_at`` included)."""
    compute_err = pold is not None if compute_err is None else bool(compute_err)
    if (compute_err or fold) and pold is None:
        raise ValueError("lse_blocksparse: compute_err and fold need pold (the previous potential)")
    _no_labels(src, tgt, "lse_blocksparse")
    ranges, r = _blocksparse_ranges(src.n, src.d, precision, ranges)
    seq = multiscale_calls.lse_blocksparse(src.n, tgt.n, src.d, r, precision, runtime.on_gpu(), logw_in is not None,
                                       logw_out is not None, compute_err, fold, relax_at)
    arrays = _pair(src, tgt, prm)
    arrays.update(pot=pot_tgt, logw_in=logw_in, logw_out=logw_out, pold=pold, ranges=ranges)
    out, err = run(seq, arrays, src.x.device)
    return out, (err if compute_err else None)


def apply_plan_blocksparse(src: Cloud, tgt: Cloud, f: torch.Tensor, g: torch.Tensor, prm: torch.Tensor,
                           ranges: torch.Tensor, precision: str,
                           v: torch.Tensor | None = None,
                           target_mean: bool = False) -> tuple[torch.Tensor | None, torch.Tensor]:
    """:func:`apply_plan` with P_ij kept only where column j is in a range of row i's block
    (``ranges`` as in :func:`lse_blocksparse`): (P v, P 1); v is (m, p) or None.
    ``target_mean`` (v must be None): (P t, P 1) for the target's centred points t = tgt.x, the
    product on the tensor cores (kernels/apply_blocksparse.py, TGT_MEAN: P t / P 1 exact to the
    FP16 rounding of each P_ij; every P_ij must stay below 4, i.e. P 1 < 4)."""
    if target_mean and v is not None:
        raise ValueError("apply_plan_blocksparse: target_mean uses the target's points; pass v=None")
    p = tgt.d if target_mean else (0 if v is None else v.shape[1])
    _no_labels(src, tgt, "apply_plan_blocksparse")
    ranges, r = _blocksparse_ranges(src.n, src.d, precision, ranges)
    seq = multiscale_calls.apply_plan_blocksparse(src.n, tgt.n, src.d, r, p, precision, runtime.on_gpu(), target_mean)
    arrays = _pair(src, tgt, prm)
    arrays.update(f=f.contiguous(), g=g.contiguous(),
                  v=v.to(torch.float32).contiguous() if p and not target_mean else None, ranges=ranges)
    pv, rowsum = run(seq, arrays, src.x.device)
    return (pv if p else None), rowsum


def apply_weighted(src: Cloud, tgt: Cloud, f: torch.Tensor, g: torch.Tensor, prm: torch.Tensor, precision: str,
                   w: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor) -> torch.Tensor:
    """sum_j P_ij <w_i, wa_j> wb_j (n, p) for w (n, k), wa (m, k), wb (m, p) (rows of P: ``src``)."""
    seq = kernel_calls.apply_weighted(src.n, tgt.n, src.d, w.shape[1], wb.shape[1], precision, runtime.on_gpu(),
                                      _labels(src, tgt))
    arrays = _pair(src, tgt, prm)
    arrays.update(f=f.contiguous(), g=g.contiguous(), w=w.to(torch.float32).contiguous(),
                  wa=wa.to(torch.float32).contiguous(), wb=wb.to(torch.float32).contiguous())
    return run(seq, arrays, src.x.device)[0]


def lift_gathered(src: Cloud, start: torch.Tensor, lptr: torch.Tensor, lidx: torch.Tensor, tgt: Cloud,
                  pot_tgt: torch.Tensor, logw_tgt: torch.Tensor, shift: torch.Tensor, prm: torch.Tensor) -> torch.Tensor:
    """-eps LSE_{l kept} ((pot_l - |x_i - c_l|^2 / 2) / eps + logw_l) for the sorted points of ``src``
    (cluster starts ``start``) over the columns ``lidx[lptr[k]:lptr[k + 1]]`` of the cluster of each
    point, ``tgt`` the other cloud's centroids (``multiscale_calls.lift_gathered``; C = |x - y|^2 / 2);
    ``shift`` (n,): a prediction of the result within a few dozen eps (kernels/lift_gathered.py)."""
    seq = multiscale_calls.lift_gathered(src.n, start.numel() - 1, src.d, runtime.on_gpu())
    arrays = {"x": src.x, "start": start.to(torch.int32).contiguous(), "lptr": lptr.to(torch.int32).contiguous(),
              "lidx": lidx.to(torch.int32).contiguous(), "c": tgt.x, "g": pot_tgt.float().contiguous(),
              "logw": logw_tgt.float().contiguous(), "shift": shift.float().contiguous(), "params": prm}
    return run(seq, arrays, src.x.device)[0]


def fixed_split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Heads on a per-row fixed-point grid and TF32 tails of a float32 contiguous (n, d)
    array (kernels/split.py, split_fixed_kernel), for the "fixed4" cross term."""
    return run(kernel_calls.split_fixed(x.shape[0], x.shape[1], runtime.on_gpu()), {"x": x}, x.device)


def exact_row_mass(src: Cloud, tgt: Cloud, f: torch.Tensor, g: torch.Tensor, prm: torch.Tensor) -> torch.Tensor:
    """P 1 (P_ij = exp((f_i + g_j - C_ij)/eps)) with the unbiased "fixed4" cross term
    (``kernel_calls.exact_row_mass`` says why)."""
    xh, xl = fixed_split(src.x)
    yh, yl = (xh, xl) if tgt is src else fixed_split(tgt.x)
    arrays = {**_pair(src, tgt, prm), "x_hi": xh, "x_lo": xl, "y_hi": yh, "y_lo": yl,
              "f": f.contiguous(), "g": g.contiguous()}
    (rows,) = run(kernel_calls.exact_row_mass(src.n, tgt.n, src.d, runtime.on_gpu(), _labels(src, tgt)), arrays,
                  src.x.device)
    return rows
