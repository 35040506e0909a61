"""The torch loop of :func:`torch_api.sinkhorn_batch`: B packed problems, one launch per half-step.

The loop runs in *segments*, the iterations between two measurements of the marginal error
(``core.options.LoopOptions.measured``): a segment of L iterations is L pairs of half-steps
(g from the pending g-update or from f, then f) and one measuring g-update, followed by the
per-problem bookkeeping on the device (each problem's error as a segment sum, its stop, its
state at the stop). One host read per segment: whether every problem has stopped. The launches
of a segment depend only on its length, so on the GPU each length is captured once in a CUDA
graph per batch shape and replayed (``torch_api.cuda_graphs``: from a batch shape's second call;
the packed inputs are copied into the set's static buffers, and the centring of the packed
clouds is a graph of its own). Elsewhere, and on a shape's first call, the same function
launches eagerly; both give the same numbers.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ot_triton_jax.core.options import LoopOptions

from . import cuda_graphs
from .kernel_ops import Cloud, clouds, lse_blocksparse

__all__ = ["batched_loop", "segment_sum"]


def segment_sum(values: Tensor, segment: Tensor, count: int) -> Tensor:
    """(count,) sums of ``values`` per problem (``segment``: the problem of each packed row, -1 on padding)."""
    valid = segment >= 0
    return torch.zeros(count, dtype=values.dtype, device=values.device).index_add_(
        0, torch.where(valid, segment, 0), torch.where(valid, values, 0.0))


def _state(B: int, rows_x: int, rows_y: int, device) -> dict[str, Tensor]:
    """The loop's state buffers (written in place by every segment)."""
    f32 = dict(dtype=torch.float32, device=device)
    return {"f": torch.empty(rows_x, **f32), "pending": torch.empty(rows_y, **f32),
            "done": torch.empty(B, dtype=torch.bool, device=device),
            "n_iters": torch.empty(B, dtype=torch.int32, device=device), "errors": torch.empty(B, **f32),
            "f_stop": torch.empty(rows_x, **f32), "g_stop": torch.empty(rows_y, **f32),
            "count": torch.empty((), dtype=torch.int32, device=device)}


def _start(s: dict, X: Cloud, Y: Cloud, precision: str, relax: tuple = (0, 0)) -> tuple:
    """The initial state: f0, the pending g-update from f0, nobody stopped (but ``done0``)."""
    g = lse_blocksparse(Y, X, s["f0"], s["prm"], s["ry"], precision, logw_out=s["lb"], relax_at=relax[1])[0]
    s["pending"].copy_(g)
    for name, value in (("f", s["f0"]), ("f_stop", s["f0"]), ("g_stop", s["g0"]), ("done", s["done0"])):
        s[name].copy_(value)
    s["n_iters"].zero_()
    s["count"].zero_()
    s["errors"].fill_(float("inf"))
    return ()


def _segment(s: dict, X: Cloud, Y: Cloud, length: int, max_it: int, precision: str,
             relax: tuple = (0, 0)) -> tuple:
    """``length`` iterations and a measurement from the state in ``s``, written back in place;
    returns (all problems stopped,) (a 0-d tensor). ``relax``: the kernels' RELAX_AT of the a and
    b sides (``core.unbalanced.relax_at``; (0, 0) balanced)."""
    f, g_next = s["f"], s["pending"]
    prm, rx, ry, la, lb = s["prm"], s["rx"], s["ry"], s["la"], s["lb"]
    ra, rb = relax
    g = g_next
    for t in range(length):
        g = g_next if t == 0 else lse_blocksparse(Y, X, f, prm, ry, precision, logw_out=lb, relax_at=rb)[0]
        f = lse_blocksparse(X, Y, g, prm, rx, precision, logw_out=la, relax_at=ra)[0]
    pending, err_rows = lse_blocksparse(Y, X, f, prm, ry, precision, logw_out=lb, pold=g, compute_err=True,
                                        relax_at=rb)
    done = s["done"]
    err = segment_sum(err_rows, s["seg_y"], done.shape[0])
    count = s["count"] + length
    stop = ~done & ((err < s["thr"]) | ~torch.isfinite(err) | (count >= max_it))
    new = {"errors": torch.where(done, s["errors"], err), "n_iters": torch.where(stop, count, s["n_iters"]),
           "f_stop": torch.where(stop[s["rows_x"]], f, s["f_stop"]),
           "g_stop": torch.where(stop[s["rows_y"]], g, s["g_stop"]), "done": done | stop,
           "f": f, "pending": pending, "count": count}
    for name, value in new.items():
        s[name].copy_(value)
    return (new["done"].all(),)


# inputs made by the library and never written (cached per batch shape, or fresh per call):
# a static buffer already holding the very tensor is not copied again
_OURS = ("la", "lb", "f0", "g0", "prm", "rx", "ry", "seg_y", "rows_x", "rows_y")


def batched_loop(inputs: dict[str, Tensor], opts: LoopOptions, key: tuple,
                 relax: tuple = (0, 0), checks=None) -> tuple[Tensor, ...]:
    """OTT's alternating loop of the packed batch ``inputs`` (x, y packed points; la, lb packed log
    weights; f0, g0 packed starting potentials; prm; rx, ry column ranges; seg_y, rows_x, rows_y
    the problem of each packed row; thr; done0 (B,)). ``key``: the batch's shape (the graphs'
    key). Returns each problem's (f, g) at its stop (packed), n_iters, errors (the last measured
    error of each problem). ``relax``: as in :func:`_segment`. ``checks``: the call's deferred value
    rules (``checks.DeferredValues``), finished once the first segment is launched, before its read
    (their reductions queue behind it)."""
    measured = [it for it in range(opts.max_iterations) if opts.measured(it)]
    lengths = [j - i for i, j in zip([-1] + measured[:-1], measured)]
    x, y, B = inputs["x"], inputs["y"], inputs["done0"].shape[0]
    state = _state(B, x.shape[0], y.shape[0], x.device)
    pairs = sum(n * m for n, m in zip(key[0], key[1]))  # the batch's own pairs, not the packed clouds' product
    graphs = cuda_graphs.graph_set(("batched",) + key + tuple(relax), x.device, pairs, {**inputs, **state})
    if graphs is None:
        s = {**inputs, **state}
        X, Y = clouds(x, y)
        _start(s, X, Y, opts.precision, relax)
        for length in lengths:
            stopped = _segment(s, X, Y, length, opts.max_iterations, opts.precision, relax)[0]
            if checks is not None:
                checks.finish()
            if bool(stopped):
                break
    else:
        graphs.load(inputs, immutable=_OURS)
        s = graphs.statics
        X, Y = graphs.run("clouds", lambda st: clouds(st["x"], st["y"]))
        graphs.run("start", lambda st: _start(st, X, Y, opts.precision, relax))
        for length in lengths:
            body = functools.partial(_segment, X=X, Y=Y, length=length, max_it=opts.max_iterations,
                                     precision=opts.precision, relax=relax)
            stopped = graphs.run(("segment", length, opts.max_iterations, opts.precision), body, read=True)[0]
            if checks is not None:
                checks.finish()
            if float(stopped):
                break
    return tuple(s[k].clone() for k in ("f_stop", "g_stop", "n_iters", "errors"))
