"""torch_api.distributed.sinkhorn on CPU processes (Gloo, Triton interpreter) against torch_api.sinkhorn.

Each world size spawns its processes once; every worker solves the cases below on its shards,
runs the bad-input checks that need several ranks, and saves what it saw. The parent solves the
gathered problems on one device and compares f, g (gathered), reg_ot_cost, n_iters, converged,
errors and the gradients in x, y and (when given) a, b (gathered) to float32 rounding.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.distributed as dist

import torch_api
from gloo_world import Worlds, shard, sizes
from ot_triton_jax.core.sharding import ShardLayout, check_agreement, split_sizes
from torch_api import distributed


def _problem(seed: int, n: int, m: int, d: int, zeros: bool) -> dict:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64).float()
    y = (0.8 * torch.randn(m, d, generator=gen, dtype=torch.float64) + 0.4).float()
    if not zeros:
        return dict(x=x, y=y, a=None, b=None)
    a = torch.rand(n, generator=gen, dtype=torch.float64) + 0.2
    b = torch.rand(m, generator=gen, dtype=torch.float64) + 0.2
    a[[0, 5, n - 1]] = 0.0
    b[[2, m // 2]] = 0.0
    return dict(x=x, y=y, a=(a / a.sum()).float(), b=(b / b.sum()).float())


# (name, problem, options, x shard sizes per world size, y shard sizes per world size); None: array_split
CASES = [
    ("uniform", _problem(0, 37, 29, 3, False), dict(epsilon=0.5), None, None),
    ("weighted", _problem(1, 37, 29, 3, True),
     dict(epsilon=0.5, scale_cost=2.0, inner_iterations=3, min_iterations=5, exchange="ring"),
     {2: (1, 36), 4: (1, 15, 12, 9)}, {2: (25, 4), 4: (20, 3, 1, 5)}),
    ("capped", _problem(2, 22, 30, 2, True),
     dict(epsilon=0.3, threshold=1e-9, inner_iterations=4, max_iterations=7), None, None),
]

# sinkhorn_divergence: (name, problem, options, world sizes); array_split shards
DIV_CASES = [
    ("symmetric", _problem(4, 26, 21, 2, True), dict(epsilon=0.5, inner_iterations=5, exchange="ring"), (2, 4)),
    ("alternating_static_b", _problem(5, 19, 23, 3, True),
     dict(epsilon=0.7, symmetric_sinkhorn=False, static_b=True, offset_static_b=0.25), (2,)),
]


def _single(opts: dict) -> dict:
    """The single-device call's options (``exchange`` is the sharded solve's alone)."""
    return {k: v for k, v in opts.items() if k != "exchange"}


def _grad_leaves(*ts):
    """Copies of ``ts`` that require grad (None stays None)."""
    return [None if t is None else t.clone().requires_grad_() for t in ts]


def _with_scalar_leaves(opts: dict) -> tuple[dict, list]:
    """``opts`` with epsilon and scale_cost as float64 tensors that require grad, and those tensors."""
    leaves = [torch.tensor(float(opts.get(k, 1.0)), dtype=torch.float64, requires_grad=True)
              for k in ("epsilon", "scale_cost")]
    return dict(opts, epsilon=leaves[0], scale_cost=leaves[1]), leaves


def _grads(ts) -> list:
    return [None if t is None else t.grad for t in ts]


def _error(fn) -> str:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 (the message is what is checked)
        return f"{type(err).__name__}: {err}"
    return "no error"


def _bad_inputs(rank: int, world: int) -> dict:
    """Checks that need several ranks; each returns this rank's error."""
    p = _problem(3, 10, 8, 3, False)
    xs = split_sizes(10, world)
    x, y = shard(p["x"], xs, rank), shard(p["y"], split_sizes(8, world), rank)
    opts = dict(epsilon=0.5, max_iterations=3)
    out = {}
    d = 2 if rank == world - 1 else 3
    out["dimension"] = _error(lambda: distributed.sinkhorn(x[:, :d], y[:, :d], **opts))
    eps = 0.6 if rank == world - 1 else 0.5
    out["epsilon"] = _error(lambda: distributed.sinkhorn(x, y, epsilon=eps, max_iterations=3))
    a = torch.full((x.shape[0] + (rank == world - 1),), 0.1)
    out["local_shape"] = _error(lambda: distributed.sinkhorn(x, y, a, None, **opts))
    b = torch.full((y.shape[0],), 2.0 / 8)
    out["masses"] = _error(lambda: distributed.sinkhorn(x, y, torch.full((x.shape[0],), 0.1), b, **opts))
    aw = torch.full((x.shape[0],), 0.1, requires_grad=True)
    cost = distributed.sinkhorn(x, y, aw, torch.full((y.shape[0],), 1.0 / 8), **opts).reg_ot_cost
    (ga,) = torch.autograd.grad(cost, aw, create_graph=True)
    out["weights_second"] = _error(lambda: ga.sum().backward())
    eps_t = torch.tensor(0.5, requires_grad=True)
    cost = distributed.sinkhorn(x, y, epsilon=eps_t, max_iterations=3).reg_ot_cost
    (geps,) = torch.autograd.grad(cost, eps_t, create_graph=True)
    out["epsilon_second"] = _error(lambda: geps.backward())
    out["tau"] = _error(lambda: distributed.sinkhorn(x, y, tau_a=0.5, **opts))
    out["exchange"] = _error(lambda: distributed.sinkhorn(x, y, exchange="broadcast", **opts))
    ex = "ring" if rank == world - 1 else "gather"
    out["exchange_agreement"] = _error(lambda: distributed.sinkhorn(x, y, exchange=ex, **opts))
    xn = x.clone()
    xn[0, 0] = float("nan") if rank == 0 else xn[0, 0]
    out["ring_nan"] = _error(lambda: distributed.sinkhorn(xn, y, exchange="ring", **opts))
    xg = x.clone().requires_grad_()
    res = distributed.sinkhorn(xg, y, **opts)
    out["potential_grad"] = _error(lambda: res.f.sum().backward())
    out["one_default"] = float(distributed.sinkhorn(x, y, torch.full((x.shape[0],), 0.1), None, **opts).reg_ot_cost)
    out["after_errors"] = float(distributed.sinkhorn(x, y, **opts).reg_ot_cost)  # the group still works
    return out


def _body(rank: int, world: int) -> dict:
    results = {}
    for name, p, opts, xsz, ysz in CASES:
        sx, sy = sizes(xsz, p["x"].shape[0], world), sizes(ysz, p["y"].shape[0], world)
        leaves = _grad_leaves(shard(p["x"], sx, rank), shard(p["y"], sy, rank), shard(p["a"], sx, rank),
                              shard(p["b"], sy, rank))
        kw, scalars = _with_scalar_leaves(opts)
        out = distributed.sinkhorn(*leaves, **kw)
        out.reg_ot_cost.backward()
        results[name] = dict(f=out.f.detach(), g=out.g.detach(), cost=out.reg_ot_cost.detach(),
                             n_iters=int(out.n_iters), converged=bool(out.converged), errors=out.errors,
                             rows=(out.x_rows, out.y_rows), **dict(zip(_GRADS + _SCALARS, _grads(leaves + scalars))))
    for name, p, opts, worlds in DIV_CASES:
        if world not in worlds:
            continue
        sx, sy = split_sizes(p["x"].shape[0], world), split_sizes(p["y"].shape[0], world)
        leaves = _grad_leaves(shard(p["x"], sx, rank), shard(p["y"], sy, rank), shard(p["a"], sx, rank),
                              shard(p["b"], sy, rank))
        kw, scalars = _with_scalar_leaves(opts)
        div, out = distributed.sinkhorn_divergence(*leaves, **kw)
        div.backward()
        results["div_" + name] = dict(
            div=div.detach(), costs=[float(c) for c in out.costs],
            **dict(zip(_GRADS + _SCALARS, _grads(leaves + scalars))),
            n_iters=[None if v is None else int(v) for v in out.n_iters],
            converged=[None if v is None else bool(v) for v in out.converged],
            potentials=[None if p is None else tuple(t.detach() for t in p) for p in out.potentials])
    if world == 2:
        results["bad"] = _bad_inputs(rank, world)
    return results


_run = Worlds(_body)
_GRADS = ("gx", "gy", "ga", "gb")
_SCALARS = ("geps", "gscale")  # derivatives in epsilon and scale_cost: global, equal on every rank


_REFS: dict = {}


def _reference(name: str) -> dict:
    if name not in _REFS:
        _, p, opts, _, _ = next(c for c in CASES if c[0] == name)
        leaves = _grad_leaves(p["x"], p["y"], p["a"], p["b"])
        kw, scalars = _with_scalar_leaves(_single(opts))
        out = torch_api.sinkhorn(*leaves, **kw)
        cost = out.reg_ot_cost
        cost.backward()
        _REFS[name] = dict(f=out.f.detach(), g=out.g.detach(), cost=cost.detach(), n_iters=int(out.n_iters),
                           converged=bool(out.converged), errors=out.errors,
                           **dict(zip(_GRADS + _SCALARS, _grads(leaves + scalars))))
    return _REFS[name]


_DIV_REFS: dict = {}


def _div_reference(name: str) -> dict:
    if name not in _DIV_REFS:
        _, p, opts, _ = next(c for c in DIV_CASES if c[0] == name)
        leaves = _grad_leaves(p["x"], p["y"], p["a"], p["b"])
        kw, scalars = _with_scalar_leaves(_single(opts))
        div, out = torch_api.sinkhorn_divergence(*leaves, **kw)
        div.backward()
        _DIV_REFS[name] = dict(div=div.detach(), costs=[float(c) for c in out.costs],
                               **dict(zip(_GRADS + _SCALARS, _grads(leaves + scalars))),
                               n_iters=[None if v is None else int(v) for v in out.n_iters],
                               converged=[None if v is None else bool(v) for v in out.converged],
                               potentials=out.potentials)
    return _DIV_REFS[name]


def _close(got: torch.Tensor, want: torch.Tensor, what: str, rtol: float = 1e-5) -> None:
    got, want = got.double(), want.double()
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)), f"{what}: non-finite entries differ"
    assert torch.equal(got[~finite], want[~finite]), f"{what}: infinite entries differ"
    g, w = got[finite], want[finite]
    scale = float(w.abs().max()) if w.numel() else 1.0
    err = float((g - w).abs().max()) if w.numel() else 0.0
    assert err <= rtol * max(scale, 1e-30) + 1e-7 * scale, f"{what}: max error {err:.3g} at scale {scale:.3g}"


def _same_scalars(r: dict, ref: dict) -> None:
    """One rank's derivatives in epsilon and scale_cost (global) against the single device's: float64
    leaves, nonzero, to float32 rounding of the partial sums (their terms cancel to ~1/10 of
    their size, hence 1e-4)."""
    for key in _SCALARS:
        assert r[key].dtype == torch.float64 and float(ref[key]) != 0.0, key
        _close(r[key], ref[key], key, rtol=1e-4)


def _same_grads(ranks, ref, key) -> None:
    """The ranks' pieces of ``key`` (a potential or a gradient) gathered against the single
    device's; None (no weights given) on every rank where the reference has None."""
    if ref[key] is None:
        assert all(r[key] is None for r in ranks), key
        return
    got = torch.cat([r[key] for r in ranks])
    assert got.dtype == ref[key].dtype and got.shape == ref[key].shape, key
    _close(got, ref[key], key)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_sharded_solve_matches_single_device(world, name, tmp_path_factory):
    runs = _run(world, tmp_path_factory)
    ref = _reference(name)
    ranks = [r[name] for r in runs]
    _, p, _, xsz, ysz = next(c for c in CASES if c[0] == name)
    lx = ShardLayout(sizes(xsz, p["x"].shape[0], world))
    ly = ShardLayout(sizes(ysz, p["y"].shape[0], world))
    assert [r["rows"] for r in ranks] == [(lx.rows(k), ly.rows(k)) for k in range(world)]
    for r in ranks:  # global results, equal on every rank and to the single solve's
        assert r["n_iters"] == ref["n_iters"] and r["converged"] == ref["converged"]
        got, want = r["errors"].double(), ref["errors"].double()
        assert torch.equal(got == -1, want == -1) and torch.equal(torch.isinf(got), torch.isinf(want))
        measured = torch.isfinite(want) & (want != -1)
        assert measured.any()
        # float32 sums of the marginals (unit mass): ~1e-7 absolute apart whatever the error's size
        assert torch.allclose(got[measured], want[measured], rtol=1e-4, atol=1e-6), (got, want)
        _close(r["cost"], ref["cost"], "reg_ot_cost")
        _same_scalars(r, ref)
    for key in ("f", "g") + _GRADS:
        _same_grads(ranks, ref, key)
    if name == "capped":
        assert ref["n_iters"] == 7 and not ref["converged"]
    else:
        assert ref["converged"] and ref["n_iters"] < 2000
    if name == "weighted":  # a rank whose x shard is one point of weight zero
        assert ranks[0]["f"].shape == (1,) and torch.isinf(ranks[0]["f"]).all()


@pytest.mark.parametrize("world, name", [(w, c[0]) for c in DIV_CASES for w in c[3]])
def test_sharded_divergence_matches_single_device(world, name, tmp_path_factory):
    ranks = [r["div_" + name] for r in _run(world, tmp_path_factory)]
    ref = _div_reference(name)
    for r in ranks:
        assert r["n_iters"] == ref["n_iters"] and r["converged"] == ref["converged"]
        _close(r["div"], ref["div"], "divergence")
        _close(torch.tensor(r["costs"]), torch.tensor(ref["costs"]), "costs")
        _same_scalars(r, ref)
    assert all(c for c in ref["converged"] if c is not None) and ref["n_iters"][0] > 0
    for k in _GRADS:
        _same_grads(ranks, ref, k)
    for t, pots in enumerate(ref["potentials"]):
        if pots is None:
            assert all(r["potentials"][t] is None for r in ranks)
            continue
        for s, want in enumerate(pots):
            _close(torch.cat([r["potentials"][t][s] for r in ranks]), want.detach(), f"potentials[{t}][{s}]")
    if name == "alternating_static_b":
        assert ref["costs"][2] == 0.25 and ref["n_iters"][2] is None


def test_bad_inputs_raise_on_every_rank(tmp_path_factory):
    bad = [r["bad"] for r in _run(2, tmp_path_factory)]
    for r in bad:
        assert r["dimension"].startswith("ValueError") and "same x dimension d" in r["dimension"]
        assert r["epsilon"].startswith("ValueError") and "same epsilon" in r["epsilon"]
        assert r["masses"].startswith("ValueError") and "same total mass" in r["masses"]
        assert r["weights_second"].startswith("NotImplementedError") and "second derivatives" in r["weights_second"]
        assert r["epsilon_second"].startswith("NotImplementedError") and "second derivatives" in r["epsilon_second"]
        assert r["tau"].startswith("NotImplementedError") and "tau_a" in r["tau"]
        assert r["exchange_agreement"].startswith("ValueError") and "same exchange" in r["exchange_agreement"]
        assert r["ring_nan"].startswith("ValueError") and "x contains non-finite values" in r["ring_nan"]
        assert r["potential_grad"].startswith("NotImplementedError")
        assert np.isfinite(r["after_errors"])
    assert np.isfinite(bad[0]["one_default"]) and bad[0]["one_default"] == bad[1]["one_default"]
    assert bad[1]["local_shape"].startswith("ValueError") and "a must have shape" in bad[1]["local_shape"]
    assert bad[0]["local_shape"].startswith("ValueError") and "rank(s) [1]" in bad[0]["local_shape"]
    assert bad[0]["exchange"].startswith("ValueError") and "exchange must be one of" in bad[0]["exchange"]


def test_uninitialized_group_names_the_fix():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group.*torchrun"):
        distributed.sinkhorn(torch.zeros(3, 2), torch.zeros(4, 2), epsilon=0.1)


def test_shard_layout_rules():
    for n, parts in ((37, 4), (29, 2), (3, 5), (8, 4)):
        want = [len(s) for s in np.array_split(np.arange(n), parts)]
        assert list(split_sizes(n, parts)) == want
    lay = ShardLayout((1, 15, 12, 9))
    assert lay.total == 37 and lay.width == 15 and lay.offsets == (0, 1, 16, 28)
    assert lay.rows(2) == (16, 28) and lay.pad(0) == 14
    pieces = np.zeros((4, 15, 2))
    rows = np.arange(37 * 2, dtype=float).reshape(37, 2)
    for r in range(4):
        s, e = lay.rows(r)
        pieces[r, :e - s] = rows[s:e]
        pieces[r, e - s:] = np.nan
    assert np.array_equal(lay.unpad(pieces), rows)
    assert np.array_equal(pieces.reshape(60, 2)[lay.gather_index()], rows)
    check_agreement(["d"], [[3.0], [3.0]])
    with pytest.raises(ValueError, match="same d; got rank 0: 3, rank 1: 2"):
        check_agreement(["d"], [[3.0], [2.0]])
    with pytest.raises(ValueError, match="parts must be >= 1"):
        split_sizes(4, 0)
