"""The torch loops of :func:`torch_api.sinkhorn_batch`: B packed problems, one launch per half-step.

Two loops share one driver: OTT's alternating loop (:func:`batched_loop`) and OTT's symmetric
solve of self problems (x, x, a, a) (:func:`batched_symmetric`, the self terms of a batched
``sinkhorn_divergence``: h <- 0.5 h + 0.5 T(h), error 2 ||P 1 - a||_1, as
``sinkhorn_loops.symmetric_loop``). The driver runs in *segments*, the iterations between two
measurements of the marginal error (``core.options.LoopOptions.measured``): a segment of L
iterations is L updates and a measuring one, followed by the per-problem bookkeeping on the
device (each problem's error as a segment sum, its stop, its state at the stop, its record of
errors per block as OTT keeps it: +inf for a block run but not measured, -1 for one not run).
A stopped problem's row blocks stream no column in the segments after its stop
(``batch_layout.active_ranges``): the batch costs the work of the problems still running.
One host read per segment: whether every problem has stopped. The launches of a segment
depend only on its length, so on the GPU each length is captured once in a CUDA graph per
batch shape and replayed (``torch_api.cuda_graphs``: from a batch shape's second call; the
packed inputs are copied into the set's static buffers, and the centring of the packed clouds
is a graph of its own). Elsewhere, and on a shape's first call, the same function launches
eagerly; both give the same numbers.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ot_triton_jax.core.batch_layout import active_ranges
from ot_triton_jax.core.options import LoopOptions

from . import cuda_graphs
from .kernel_ops import Cloud, clouds, lse_blocksparse

__all__ = ["batched_loop", "batched_symmetric", "segment_sum"]


def segment_sum(values: Tensor, segment: Tensor, count: int) -> Tensor:
    """(count,) sums of ``values`` per problem (``segment``: the problem of each packed row, -1 on padding)."""
    valid = segment >= 0
    return torch.zeros(count, dtype=values.dtype, device=values.device).index_add_(
        0, torch.where(valid, segment, 0), torch.where(valid, values, 0.0))


def _state(B: int, rows: dict[str, int], n_blocks: int, device) -> dict[str, Tensor]:
    """The loop's state buffers (written in place by every segment): ``rows`` the potentials' names
    and lengths, and the bookkeeping."""
    f32 = dict(dtype=torch.float32, device=device)
    state = {name: torch.empty(k, **f32) for name, k in rows.items()}
    state.update({"done": torch.empty(B, dtype=torch.bool, device=device),
                  "n_iters": torch.empty(B, dtype=torch.int32, device=device), "errors": torch.empty(B, **f32),
                  "history": torch.empty(B, n_blocks, **f32), "count": torch.empty((), dtype=torch.int32, device=device)})
    return state


def _reset(s: dict) -> None:
    s["done"].copy_(s["done0"])
    s["n_iters"].zero_()
    s["count"].zero_()
    s["errors"].fill_(float("inf"))
    s["history"].fill_(-1.0)


def _measured(s: dict, err: Tensor, length: int, max_it: int, inner: int, kept: dict) -> Tensor:
    """The bookkeeping after a segment of ``length`` iterations whose last one measured the errors
    ``err`` (B,): stops, iterations, error records, and ``kept`` (state name -> (value, the problem
    of each of its rows)): the value each problem had at its stop. Writes the state in place and
    returns whether every problem has stopped (a 0-d tensor)."""
    done, start = s["done"], s["count"]
    count = start + length
    stop = ~done & ((err < s["thr"]) | ~torch.isfinite(err) | (count >= max_it))
    cols, last = s["cols"], (count - 1) // inner
    skipped = (cols >= start // inner) & (cols < last)
    hist = torch.where(cols == last, err[:, None], torch.where(skipped, float("inf"), s["history"]))
    new = {"errors": torch.where(done, s["errors"], err), "n_iters": torch.where(stop, count, s["n_iters"]),
           "history": torch.where(done[:, None], s["history"], hist), "done": done | stop, "count": count}
    for name, (value, rows) in kept.items():
        new[name] = torch.where(stop[rows], value, s[name])
    for name, value in new.items():
        s[name].copy_(value)
    return new["done"].all()


def _start(s: dict, X: Cloud, Y: Cloud, precision: str, relax: tuple = (0, 0)) -> tuple:
    """The alternating loop's initial state: f0, the pending g-update from f0, nobody stopped (but ``done0``)."""
    g = lse_blocksparse(Y, X, s["f0"], s["prm"], s["ry"], precision, logw_out=s["lb"], relax_at=relax[1])[0]
    s["pending"].copy_(g)
    for name, value in (("f", s["f0"]), ("f_stop", s["f0"]), ("g_stop", s["g0"])):
        s[name].copy_(value)
    _reset(s)
    return ()


def _segment(s: dict, X: Cloud, Y: Cloud, length: int, opts: LoopOptions, relax: tuple = (0, 0)) -> tuple:
    """``length`` alternating iterations and a measurement from the state in ``s``, written back in
    place; returns (all problems stopped,). ``relax``: the kernels' RELAX_AT of the a and b sides
    (``core.unbalanced.relax_at``; (0, 0) balanced). The g kept at a stop is the one f was updated
    from (the pending update is the next iteration's)."""
    f, g_next = s["f"], s["pending"]
    prm, la, lb, precision = s["prm"], s["la"], s["lb"], opts.precision
    rx, ry = (active_ranges(torch, s[r], s[k], s["done"]) for r, k in (("rx", "bx"), ("ry", "by")))
    ra, rb = relax
    g = g_next
    for t in range(length):
        g = g_next if t == 0 else lse_blocksparse(Y, X, f, prm, ry, precision, logw_out=lb, relax_at=rb)[0]
        f = lse_blocksparse(X, Y, g, prm, rx, precision, logw_out=la, relax_at=ra)[0]
    pending, err_rows = lse_blocksparse(Y, X, f, prm, ry, precision, logw_out=lb, pold=g, compute_err=True,
                                        relax_at=rb)
    err = segment_sum(err_rows, s["seg_y"], s["done"].shape[0])
    stopped = _measured(s, err, length, opts.max_iterations, opts.inner_iterations,
                        {"f_stop": (f, s["rows_x"]), "g_stop": (g, s["rows_y"])})
    s["f"].copy_(f)
    s["pending"].copy_(pending)
    return (stopped,)


def _start_symmetric(s: dict, X: Cloud, precision: str, relax: int = 0) -> tuple:
    """The symmetric loop's initial state: h0 and its update, nobody stopped (but ``done0``)."""
    u = lse_blocksparse(X, X, s["f0"], s["prm"], s["rx"], precision, logw_out=s["la"], relax_at=relax)[0]
    s["u"].copy_(u)
    for name in ("h", "h_stop"):
        s[name].copy_(s["f0"])
    _reset(s)
    return ()


def _segment_symmetric(s: dict, X: Cloud, length: int, opts: LoopOptions, relax: int = 0) -> tuple:
    """``length`` symmetric iterations h <- 0.5 h + 0.5 u (non-finite h read as 0), u the update
    of h, the last one measuring 2 ||P 1 - a||_1 per problem; the state written back in place."""
    h, u = s["h"], s["u"]
    rx = active_ranges(torch, s["rx"], s["bx"], s["done"])
    for t in range(length):
        h = 0.5 * torch.where(torch.isfinite(h), h, 0.0) + 0.5 * u
        u, err_rows = lse_blocksparse(X, X, h, s["prm"], rx, opts.precision, logw_out=s["la"], pold=h,
                                      compute_err=t == length - 1, relax_at=relax)
    err = 2.0 * segment_sum(err_rows, s["seg_x"], s["done"].shape[0])
    stopped = _measured(s, err, length, opts.max_iterations, opts.inner_iterations, {"h_stop": (h, s["rows_x"])})
    s["h"].copy_(h)
    s["u"].copy_(u)
    return (stopped,)


# inputs made by the library and never written (cached per batch shape, or fresh per call):
# a static buffer already holding the very tensor is not copied again
_OURS = ("la", "lb", "f0", "g0", "prm", "rx", "ry", "bx", "by", "seg_x", "seg_y", "rows_x", "rows_y", "cols")


def _columns(n_blocks: int, device) -> Tensor:
    return _cached_columns(n_blocks, torch.device(device))


@functools.lru_cache(maxsize=8)
def _cached_columns(n_blocks: int, device: torch.device) -> Tensor:
    """(n_blocks,) int32 block indices, made once per size and device (nobody writes them)."""
    return torch.arange(n_blocks, dtype=torch.int32, device=device)


def _drive(kind: tuple, inputs: dict[str, Tensor], rows: dict[str, int], opts: LoopOptions, pairs: int,
           make_clouds, start, segment, checks) -> dict[str, Tensor]:
    """Run a loop's segments (module docstring), eagerly or as the replays of the graph set keyed
    by ``kind`` (the loop and the batch shape). ``rows``: the state potentials' names and lengths;
    ``make_clouds(s)`` the clouds from the packed points, ``start(s, *clouds)`` and
    ``segment(s, *clouds, length)`` advance the state. Returns the final state."""
    measured = [it for it in range(opts.max_iterations) if opts.measured(it)]
    lengths = [j - i for i, j in zip([-1] + measured[:-1], measured)]
    B, dev = inputs["done0"].shape[0], inputs["done0"].device
    inputs = {**inputs, "cols": _columns(opts.n_blocks, dev)}
    state = _state(B, rows, opts.n_blocks, dev)
    graphs = cuda_graphs.graph_set(kind, dev, pairs, {**inputs, **state})
    if graphs is None:
        s = {**inputs, **state}
        cl = make_clouds(s)
        start(s, *cl)
        for length in lengths:
            stopped = segment(s, *cl, length=length)[0]
            if checks is not None:
                checks.finish()
            if bool(stopped):
                break
        return s
    graphs.load(inputs, immutable=_OURS)
    cl = graphs.run("clouds", make_clouds)
    graphs.run("start", lambda st: start(st, *cl))
    for length in lengths:
        body = functools.partial(_replayed, segment=segment, cl=cl, length=length)
        stopped = graphs.run(("segment", length, opts.max_iterations, opts.precision), body, read=True)[0]
        if checks is not None:
            checks.finish()
        if float(stopped):
            break
    return graphs.statics


def _replayed(st: dict, segment, cl: tuple, length: int) -> tuple:
    return segment(st, *cl, length=length)


def batched_loop(inputs: dict[str, Tensor], opts: LoopOptions, key: tuple,
                 relax: tuple = (0, 0), checks=None) -> tuple[Tensor, ...]:
    """OTT's alternating loop of the packed batch ``inputs`` (x, y packed points; la, lb packed log
    weights; f0, g0 packed starting potentials; prm; rx, ry column ranges and bx, by the problem of
    each row block (``Layout``); seg_y, rows_x, rows_y
    the problem of each packed row; thr; done0 (B,)). ``key``: the batch's shape (sizes_x, sizes_y,
    d). Returns each problem's (f, g) at its stop (packed), n_iters, errors (the last measured
    error of each problem) and the errors per block (B, n_blocks). ``relax``: as in
    :func:`_segment`. ``checks``: the call's deferred value rules (``checks.DeferredValues``),
    finished once the first segment is launched, before its read (their reductions queue behind it)."""
    rx, ry = inputs["x"].shape[0], inputs["y"].shape[0]
    pairs = sum(n * m for n, m in zip(key[0], key[1]))  # the batch's own pairs, not the packed clouds' product
    s = _drive(("batched",) + key + tuple(relax), inputs, {"f": rx, "pending": ry, "f_stop": rx, "g_stop": ry},
               opts, pairs, lambda st: clouds(st["x"], st["y"]),
               functools.partial(_start, precision=opts.precision, relax=relax),
               functools.partial(_segment, opts=opts, relax=relax), checks)
    return tuple(s[k].clone() for k in ("f_stop", "g_stop", "n_iters", "errors", "history"))


def batched_symmetric(inputs: dict[str, Tensor], opts: LoopOptions, key: tuple, relax: int = 0,
                      checks=None) -> tuple[Tensor, ...]:
    """OTT's symmetric solve of the packed self problems ``inputs`` (x packed points; la packed log
    weights; f0 packed starting potential; prm; rx the column ranges of x's row blocks in x, bx their
    problems; seg_x,
    rows_x the problem of each packed row; thr; done0 (B,)). ``key``: (sizes, d). Returns each
    problem's h at its stop (packed), n_iters, errors (last measured) and the errors per block.
    ``relax``: the kernels' RELAX_AT of the (shared) tau; ``checks`` as in :func:`batched_loop`."""
    rows = inputs["x"].shape[0]
    pairs = sum(n * n for n in key[0])
    s = _drive(("batched-symmetric",) + key + (relax,), inputs, {"h": rows, "u": rows, "h_stop": rows}, opts, pairs,
               lambda st: clouds(st["x"]), functools.partial(_start_symmetric, precision=opts.precision, relax=relax),
               functools.partial(_segment_symmetric, opts=opts, relax=relax), checks)
    return tuple(s[k].clone() for k in ("h_stop", "n_iters", "errors", "history"))
