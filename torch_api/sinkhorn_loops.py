"""The torch Sinkhorn loops of the OTT-convention solves (``sinkhorn_ops``' solve ops).

The alternating loop runs in *segments*: the iterations between two host reads of the
marginal error (:func:`segments`). A segment's launches are fixed by the shapes and the
loop options, so on the GPU each kind of segment is captured once in a CUDA graph and
replayed (``torch_api.cuda_graphs``); elsewhere, and on a shape's first solve, the same
function launches them eagerly. Both give the same numbers.
"""

from __future__ import annotations

import functools
import math
from typing import Iterator

import numpy as np
import torch
from torch import Tensor

from ot_triton_jax.core import unbalanced
from ot_triton_jax.core.options import LoopOptions

from . import checks as check
from . import cuda_graphs, dense_prewarm
from .host_copy import to_device
from .kernel_ops import Cloud, clouds, lse_update


def masked_log(w: Tensor) -> Tensor:
    """log w where w > 0, -inf elsewhere (no NaN); the library's default weights' log is kept."""
    lw = check.uniform_log(w)
    if lw is not None:
        return lw
    return torch.where(w > 0, w.clamp_min(torch.finfo(w.dtype).tiny).log(), -torch.inf)


def f32(v: float) -> float:
    return float(np.float32(v))


def segments(opts: LoopOptions) -> Iterator[tuple[int, int, str]]:
    """The alternating loop as runs of iterations between host reads: (start, stop, end)
    covers iterations [start, stop). ``end == "meas"``: iteration stop - 1's g-update also
    measures the marginal error of the state after iteration stop - 2 (which
    ``opts.measured``); the host reads it and stops there or goes on. ``end == "final"``:
    stop is ``max_iterations`` and one more g-update measures the final state. Iteration 0's
    g-update has no previous shift to fold (kernels/lse.py)."""
    start, max_it = 0, opts.max_iterations
    while True:
        j = max(start - 1, 0)
        while not opts.measured(j):
            j += 1
        if j == max_it - 1:
            yield start, max_it, "final"
            return
        yield start, j + 2, "meas"
        start = j + 2


def run_segment(X: Cloud, Y: Cloud, la: Tensor, lb: Tensor, prm: Tensor, f: Tensor, g: Tensor, start: int,
                stop: int, end: str, precision: str, relax: tuple[int, int] = (0, 0), cold: bool = False) -> tuple:
    """Iterations [start, stop) of OTT's alternating loop (g then f) and the segment's
    measurement. Returns (f, g, f_prev, g_prev, err): the state after stop - 1; for
    ``end == "meas"`` the state after stop - 2 (the measured one; None for "final") and
    its marginal error sum as a 0-d float64 tensor (for "final": the error of the returned
    state). ``relax``: the kernels' RELAX_AT of the a and b sides (``core.unbalanced.relax_at``;
    (0, 0): balanced): the updates are then damped by tau and the g-update's error is the
    relaxed one, ||P^T 1 - b exp(-g / rho_b)||_1 (the a side's is 0 after the f-update). ``cold``:
    f and g are the zero start (no fixed shift predicted from them: ``unbalanced.folds``)."""
    ra, rb = relax
    grouped = X.labels is not None  # labelled clouds arrive sorted by label (sinkhorn_ops.by_label)
    fp = gp = err_sum = f_prev = g_prev = None
    for it in range(start, stop):
        meas = end == "meas" and it == stop - 1
        if meas:
            fp, gp = f, g
        # the previous potential predicts the LSE shift (kernels/lse.py, FOLD); not for the
        # very first g-update, as in the JAX solver. With a relaxed side both sides extrapolate it
        # where no error is measured on it (unbalanced.shift_hint)
        g_hint = g if meas or g_prev is None else unbalanced.shift_hint(g, g_prev)
        f_hint = f if f_prev is None else unbalanced.shift_hint(f, f_prev)
        if ra or rb:
            f_prev, g_prev = f, g
        fold_g, fold_f = unbalanced.folds(it, cold, bool(ra or rb))
        g, err = lse_update(Y, X, f, prm, precision, logw_out=lb, pold=g_hint, compute_err=meas, fold=fold_g,
                            relax_at=rb, grouped=grouped)
        f, _ = lse_update(X, Y, g, prm, precision, logw_out=la, pold=f_hint, compute_err=False, fold=fold_f,
                          relax_at=ra, grouped=grouped)
        if meas:
            err_sum = err.double().sum()
    if end == "final":
        _, err = lse_update(Y, X, f, prm, precision, logw_out=lb, pold=g, fold=True, relax_at=rb, grouped=grouped)
        err_sum = err.double().sum()
    return f, g, fp, gp, err_sum


def _initial(la: Tensor) -> Tensor:
    """The loop's starting potential: 0 where the weight is positive, -inf elsewhere."""
    return torch.where(la > -torch.inf, 0.0, -torch.inf)


def _points(x: Tensor) -> Tensor:
    return x.detach().to(torch.float32).contiguous()


def alternating_loop(x: Tensor, y: Tensor, a: Tensor, b: Tensor, prm: Tensor, threshold: float,
                     opts: LoopOptions, f0: Tensor | None, g0: Tensor | None, checks=None,
                     relax: tuple[int, int] = (0, 0), labels: tuple | None = None):
    """OTT's alternating Sinkhorn (g then f) with early stopping (sinkhorn_solver docstring),
    on the points x (n, d), y (m, d) (centred here, ``kernel_ops.clouds``). ``relax``: as in
    :func:`run_segment` (``prm`` then carries the relaxation tail, ``unbalanced.params_tail``).

    On the GPU, from a shape's second solve, the centring and each segment are CUDA graph
    replays (``cuda_graphs``; the first segment also sets the starting potentials; a solve
    that is one segment is one replay).
    Returns (f, g) and :func:`loop_record`'s (errors, n_iters, converged) tensors. Only the
    early-stopping decisions read the GPU: a solve whose last segment runs to
    ``max_iterations`` returns without waiting for it (apart from the value checks' read).
    ``labels``: (label_x, label_y, label_cost) of a labelled cost (torch_api.label_inputs; graphed
    as the plain loop, the labels and the table among the static inputs), or None."""
    inner, precision = opts.inner_iterations, opts.precision
    thr = f32(threshold)
    x, y = _points(x), _points(y)
    x_device = x.device
    la, lb = masked_log(a), masked_log(b)
    state = {"x": x, "y": y, "la": la, "lb": lb, "prm": prm}
    lab = _label_state(labels, ("lx", "ly", "lw"))
    state.update(lab)
    if f0 is not None:
        state.update(f=f0, g=g0)
    n, m, d = x.shape[0], y.shape[0], x.shape[1]
    dense_prewarm.alternating(n, m, d, precision, x.device)  # the first solve of a family: compiles in parallel
    graphs = cuda_graphs.graph_set(("alternating", n, m, d, relax) + _label_key(lab), x.device, n * m,
                                   dict(state, f=la, g=lb))

    def pair(s):  # the centred clouds of a state (labelled when the solve is)
        if not lab:
            return clouds(s["x"], s["y"])
        return clouds(s["x"], s["y"], labels=(s["lx"], s["ly"]), label_cost=s["lw"])
    pots = []  # the eager loop's current (f, g), handed to each segment (no other reference:
    # each potential is freed as soon as the next one exists, O(n + m) peak memory)
    given = f0 is not None
    if graphs is None:
        X, Y = pair(state)
        pots += [_initial(la) if f0 is None else f0, _initial(lb) if g0 is None else g0]

        def segment(start, stop, end):
            return run_segment(X, Y, la, lb, prm, pots.pop(0), pots.pop(0), start, stop, end, precision, relax,
                               cold=start == 0 and not given)
    else:
        graphs.load(state, immutable=("la", "lb", "prm"))
        centred = []

        def segment(start, stop, end):
            init = start == 0 and not given
            key = (start == 0, init, stop - start, end, precision)
            body = functools.partial(_segment_body, start=start, stop=stop, end=end, init=init, precision=precision,
                                     relax=relax)
            if start == 0 and end == "final":  # the whole solve in one replay, the centring included
                return graphs.run(("whole",) + key, lambda s: body(s, *pair(s)))
            if not centred:
                centred.extend(graphs.run("clouds", pair))
            return graphs.run(("segment",) + key, functools.partial(body, X=centred[0], Y=centred[1]),
                              read=end == "meas")
    del state, x, y, f0, g0
    errors = [-1.0] * opts.n_blocks
    for start, stop, end in segments(opts):
        f_new, g_new, fp, gp, err_sum = segment(start, stop, end)
        done = stop if end == "final" else stop - 1  # iterations whose state is kept
        for it in range(start, done):
            errors[it // inner] = math.inf
        if end == "final":  # nothing left to decide: the record is finished on the device
            f, g = _kept(f_new, graphs), _kept(g_new, graphs)
            record = loop_record(errors, stop, thr, x_device, last=err_sum)
            if checks is not None:
                checks.finish()
            return (f, g) + record
        if checks is not None:
            checks.finish()
        e = f32(float(err_sum))
        errors[(done - 1) // inner] = e
        if not math.isfinite(e) or e < thr:
            return (_kept(fp, graphs), _kept(gp, graphs)) + loop_record(errors, done, thr, x_device)
        errors[(stop - 1) // inner] = math.inf
        pots[:] = [f_new, g_new]
        f_new = g_new = fp = gp = None
    raise AssertionError("segments() ends with a final segment")


def _segment_body(s: dict, X: Cloud, Y: Cloud, start: int, stop: int, end: str, init: bool, precision: str,
                  relax: tuple[int, int] = (0, 0)) -> tuple:
    """:func:`run_segment` on a :class:`cuda_graphs.GraphSet`'s static potentials s["f"], s["g"]
    (advanced in place; with ``init``, first set to :func:`_initial`)."""
    if init:
        s["f"].copy_(_initial(s["la"]))
        s["g"].copy_(_initial(s["lb"]))
    f, g, fp, gp, err_sum = run_segment(X, Y, s["la"], s["lb"], s["prm"], s["f"], s["g"], start, stop, end, precision,
                                        relax, cold=init)
    if fp is s["f"]:  # a one-iteration segment measures its input, which is overwritten below
        fp, gp = fp.clone(), gp.clone()
    if f is not s["f"]:
        s["f"].copy_(f)
        s["g"].copy_(g)
    return s["f"], s["g"], fp, gp, err_sum


def symmetric_segments(opts: LoopOptions) -> Iterator[tuple[int, int]]:
    """The symmetric loop as runs [start, stop) of iterations, each ending with a measured
    iteration (whose update also measures the error of its state), then a host read."""
    start = 0
    while start < opts.max_iterations:
        stop = start + 1
        while not opts.measured(stop - 1):
            stop += 1
        yield start, stop
        start = stop


def _self_updates(X: Cloud, la: Tensor, prm: Tensor, hs: tuple, precision: str, relax: tuple, meas: bool):
    """The parallel updates of the (x, x, a, a) problem's potentials ``hs``: (h,) when f = g
    (one update, RELAX_AT relax[0]; error 2 sum_i |P 1 - a exp(-h/rho)|_i, both sides being
    equal), or (f, g) (f from g with relax[0], g from f with relax[1]; error the sum of both
    sides' relaxed errors). Returns (updates, error as a 0-d float64 tensor or None)."""
    if len(hs) == 1:
        u, err = lse_update(X, X, hs[0], prm, precision, logw_out=la, pold=hs[0], compute_err=meas,
                            relax_at=relax[0])
        return (u,), (2.0 * err.double().sum() if meas else None)
    f, g = hs
    uf, ef = lse_update(X, X, g, prm, precision, logw_out=la, pold=f, compute_err=meas, relax_at=relax[0])
    ug, eg = lse_update(X, X, f, prm, precision, logw_out=la, pold=g, compute_err=meas, relax_at=relax[1])
    return (uf, ug), (ef.double().sum() + eg.double().sum() if meas else None)


def run_symmetric_segment(X: Cloud, la: Tensor, prm: Tensor, hs: tuple, us: tuple | None, start: int, stop: int,
                          precision: str, relax: tuple = (0,)) -> tuple:
    """Iterations [start, stop) of the symmetric loop from the state ``hs`` and its updates
    ``us`` (None at the start: computed first). Returns (hs, us, err): the state after
    stop - 1, its updates and its marginal error (0-d float64, :func:`_self_updates`)."""
    if us is None:
        us, _ = _self_updates(X, la, prm, hs, precision, relax, False)
    err = None
    for it in range(start, stop):
        hs = tuple(0.5 * torch.where(torch.isfinite(h), h, 0.0) + 0.5 * u for h, u in zip(hs, us))
        us, err = _self_updates(X, la, prm, hs, precision, relax, it == stop - 1)
    return hs, us, err


def symmetric_loop(x: Tensor, a: Tensor, prm: Tensor, threshold: float, opts: LoopOptions, checks=None,
                   relax: tuple = (0,), labels: tuple | None = None):
    """OTT's symmetric solve (``parallel_dual_updates``, momentum 0.5) of (x, x, a, a):
    h <- 0.5 h + 0.5 tau (eps log a - eps LSE_j((h_j - C_ij)/eps)), non-finite old entries
    counted as 0 (tau = 1 when balanced); the error of a state, 2 ||P 1 - a exp(-h/rho)||_1,
    is read off the next update. With ``relax`` = (RELAX_AT of a, of b) and tau_a != tau_b,
    f and g differ: f <- 0.5 f + 0.5 tau_a (...g...), g <- 0.5 g + 0.5 tau_b (...f...), both
    from the old state, error the sum of both sides' relaxed errors. CUDA graphs and host
    reads as in :func:`alternating_loop`. Returns the potentials ((h,) or (f, g)) followed
    by :func:`loop_record`'s (errors, n_iters, converged) tensors. ``labels``: (label_x, label_cost)
    of a labelled cost s W[label_x_i, label_x_j] (W square; graphed as the plain loop), or None."""
    inner, precision = opts.inner_iterations, opts.precision
    thr = f32(threshold)
    x = _points(x)
    la = masked_log(a)
    n, d = x.shape
    k = len(relax)
    pots = {f"{v}{i}": la for i in range(k) for v in "hu"}
    inputs = {"x": x, "la": la, "prm": prm, **_label_state(labels, ("lx", "lw"))}
    lab = "lx" in inputs
    graphs = cuda_graphs.graph_set(("symmetric", n, d, tuple(relax)) + _label_key(inputs), x.device, n * n,
                                   dict(inputs, **pots))

    def cloud(s):  # the centred cloud of a state (labelled when the solve is)
        return clouds(s["x"], labels=(s["lx"],), label_cost=s["lw"]) if lab else clouds(s["x"])
    state = []  # the eager loop's current (hs, us), handed to each segment (as in alternating_loop)
    if graphs is None:
        (X,) = cloud(inputs)
        state += [(_initial(la),) * k, None]

        def segment(start, stop):
            return run_symmetric_segment(X, la, prm, state.pop(0), state.pop(0), start, stop, precision, relax)
    else:
        graphs.load(inputs, immutable=("la", "prm"))
        centred = []

        def segment(start, stop):
            key = (start == 0, stop - start, precision)
            body = functools.partial(_symmetric_body, start=start, stop=stop, precision=precision, relax=relax)
            if start == 0 and stop == opts.max_iterations:  # the whole solve in one replay
                out = graphs.run(("whole",) + key, lambda s: body(s, *cloud(s)))
            else:
                if not centred:
                    centred.extend(graphs.run("clouds", cloud))
                out = graphs.run(("segment",) + key, functools.partial(body, X=centred[0]),
                                 read=stop < opts.max_iterations)
            return out[:k], out[k:2 * k], out[-1]
    x_device = x.device
    del x
    errors = [-1.0] * opts.n_blocks
    for start, stop in symmetric_segments(opts):
        hs, us, err_sum = segment(start, stop)
        state[:] = [hs, us]
        us = None
        for it in range(start, stop - 1):
            errors[it // inner] = math.inf
        if stop == opts.max_iterations:  # the last segment: finished on the device (no read)
            hs = tuple(_kept(h, graphs) for h in hs)
            record = loop_record(errors, stop, thr, x_device, last=err_sum)
            if checks is not None:
                checks.finish()
            return hs + record
        if checks is not None:
            checks.finish()
        e = f32(float(err_sum))
        errors[(stop - 1) // inner] = e
        if not math.isfinite(e) or e < thr:
            return tuple(_kept(h, graphs) for h in hs) + loop_record(errors, stop, thr, x_device)
    raise AssertionError("symmetric_segments() ends at max_iterations")


def _symmetric_body(s: dict, X: Cloud, start: int, stop: int, precision: str, relax: tuple) -> tuple:
    """:func:`run_symmetric_segment` on a :class:`cuda_graphs.GraphSet`'s static state s["h<i>"],
    s["u<i>"] (advanced in place; the first segment starts from :func:`_initial`)."""
    k = len(relax)
    hs0, us0 = (((_initial(s["la"]),) * k, None) if start == 0
                else (tuple(s[f"h{i}"] for i in range(k)), tuple(s[f"u{i}"] for i in range(k))))
    hs, us, err_sum = run_symmetric_segment(X, s["la"], s["prm"], hs0, us0, start, stop, precision, relax)
    for i in range(k):
        s[f"h{i}"].copy_(hs[i])
        s[f"u{i}"].copy_(us[i])
    return tuple(s[f"h{i}"] for i in range(k)) + tuple(s[f"u{i}"] for i in range(k)) + (err_sum,)


def converged(errors: list, thr: float) -> bool:
    """OTT's rule: no NaN in ``errors`` and ``errors[-1] < threshold`` (float32 values)."""
    return not any(math.isnan(e) for e in errors) and errors[-1] < thr


def _label_state(labels: tuple | None, names: tuple[str, ...]) -> dict:
    """A labelled loop's label tensors under the state names ``names`` ({} without labels): static
    inputs of its CUDA graphs like the points, so that a replay reads the call's labels and table."""
    return {} if labels is None else {k: v.detach() for k, v in zip(names, labels)}


def _label_key(state: dict) -> tuple:
    """The part of a graph set's key that a label cost adds: the table's shape and the dtypes the
    static label buffers are made with."""
    if "lw" not in state:
        return ()
    return ("labels", tuple(state["lw"].shape), state["lw"].dtype, state["lx"].dtype, state.get("ly", state["lx"]).dtype)


def _kept(v: Tensor, graphs) -> Tensor:
    """A loop result handed to the caller: graph buffers are rewritten by the next solve."""
    return v if graphs is None else v.clone()


def loop_record(errors: list, n_iters: int, thr: float, device, last: Tensor | None = None
                ) -> tuple[Tensor, Tensor, Tensor]:
    """The solve's (errors float32, n_iters int32, converged bool) tensors on ``device``, from
    one non-blocking copy of the host's record (no synchronization, no allocation of pinned
    memory). ``last``: the 0-d float64 error of the last block, still on the GPU (the loop
    reached ``max_iterations`` without reading it); ``errors[-1]`` is then a placeholder. It
    is rounded to float32 as the host's reads are, and since a loop that goes on has read
    only finite errors, ``converged`` is then ``errors[-1] < thr``."""
    packed = list(errors) + [float(n_iters), float(last is None and converged(errors, thr))]
    rec = to_device(torch.tensor(packed, dtype=torch.float32), device)
    errs = rec[:-2]
    if last is None:
        conv = rec[-1] > 0
    else:
        errs[-1].copy_(last)
        conv = errs[-1] < thr
    return errs, rec[-2].to(torch.int32), conv
