"""Block-sparse LSE update and plan application (kernels/lse_blocksparse.py, apply_blocksparse.py).

The tgt cloud is laid out by cluster (col_start), each src row block of
multiscale_plans.blocksparse_block_m rows keeps a subset of the clusters (keep), handed to the
kernels as runs of kept columns (multiscale.clusters.column_ranges). With every cluster kept
the kernels must agree with the dense ones; with a random mask, with a float64 reference
that drops the (row block, cluster) pairs not kept.
"""

import pytest
import torch

from ot_triton_jax.core import multiscale_calls, multiscale_plans, runtime
from torch_api.kernel_ops import (apply_plan, apply_plan_blocksparse, clouds, lse_blocksparse, lse_update,
                                  params)
from torch_api.multiscale.clusters import column_ranges

EPS = 0.2


def block_m(d: int, precision: str = "float32") -> int:
    return multiscale_plans.blocksparse_block_m(d, precision, runtime.on_gpu())


def logw(w: torch.Tensor) -> torch.Tensor:
    return torch.where(w > 0, w.clamp_min(1e-38).log(), -torch.inf)


def problem(n: int, m: int, d: int, gen: torch.Generator, zero_weights: bool = True):
    x = torch.rand(n, d, generator=gen) * 2.0
    y = torch.rand(m, d, generator=gen) * 2.0 + 0.2
    a, b = torch.rand(n, generator=gen) + 0.1, torch.rand(m, generator=gen) + 0.1
    if zero_weights:  # -inf log-weights must drop out without NaN
        a[3], b[5] = 0.0, 0.0
    return x, y, a / a.sum(), b / b.sum(), 0.1 * torch.randn(m, generator=gen)


def layout(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """col_start of k clusters over m sorted points, cluster 1 empty (k >= 3), sizes random."""
    cuts = torch.randint(0, m + 1, (k - 1,), generator=gen).sort().values
    cuts[1] = cuts[0]
    return torch.cat([torch.zeros(1, dtype=torch.long), cuts, torch.full((1,), m)]).to(torch.int32)


def random_keep(n: int, d: int, col_start: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A random (row blocks, k) int8 mask; each row block keeps at least one non-empty cluster."""
    rows, k = -(-n // block_m(d)), col_start.shape[0] - 1
    keep = (torch.rand(rows, k, generator=gen) < 0.4).to(torch.int8)
    nonempty = torch.nonzero(col_start[1:] > col_start[:-1]).flatten()
    pick = nonempty[torch.randint(0, nonempty.numel(), (rows,), generator=gen)]
    keep[torch.arange(rows), pick] = 1
    return keep


def allowed(n: int, d: int, keep: torch.Tensor, col_start: torch.Tensor) -> torch.Tensor:
    """(n, m) bool: column j is streamed for row i."""
    sizes = (col_start[1:] - col_start[:-1]).long()
    cluster = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)
    return keep.bool()[torch.arange(n) // block_m(d)][:, cluster]


def cost(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.cdist(x.double(), y.double()) ** 2


def reference_lse(x, y, g, mask, lw_in=None, lw_out=None, pold=None):
    """float64 (out, err) of the masked update (kernels/lse_blocksparse.py)."""
    z = (g.double()[None, :] - cost(x, y)) / EPS
    if lw_in is not None:
        z = z + lw_in.double()[None, :]
    lse = torch.logsumexp(torch.where(mask, z, -torch.inf), dim=1)
    fin = torch.isfinite(lse)
    w_out = torch.zeros(x.shape[0], dtype=torch.float64) if lw_out is None else lw_out.double()
    out = EPS * w_out - EPS * torch.where(fin, lse, 0.0)
    err = None
    if pold is not None:
        marg = torch.where(fin, torch.exp(pold.double() / EPS + torch.where(fin, lse, 0.0)), 0.0)
        err = (marg - w_out.exp()).abs()
    return out, err


def reference_apply(x, y, f, g, mask, v):
    """float64 (P v, P |v|, P 1) of the masked plan."""
    plan = torch.where(mask, torch.exp((f.double()[:, None] + g.double()[None, :] - cost(x, y)) / EPS), 0.0)
    pv = None if v is None else plan @ v.double()
    pav = None if v is None else plan @ v.double().abs()
    return pv, pav, plan.sum(1)


def assert_potentials(got: torch.Tensor, ref: torch.Tensor, rtol: float) -> None:
    assert not torch.isnan(got).any()
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    fin = torch.isfinite(ref)
    err = (got[fin].double() - ref[fin].double()).abs().max()
    assert err <= rtol * ref[fin].double().abs().max(), float(err)


OPTIONS = [  # (logw_in, logw_out, compute_err, fold)
    (False, False, False, False),
    (True, False, False, False),
    (False, True, True, False),
    (True, True, True, False),
    (True, True, True, True),
    (False, True, False, True),
]


@pytest.mark.parametrize("d", [1, 3])
@pytest.mark.parametrize("opts", OPTIONS)
def test_keep_all_lse_matches_dense(d, opts):
    has_in, has_out, compute_err, fold = opts
    gen = torch.Generator().manual_seed(10 * d + OPTIONS.index(opts))
    n, m = 70, 90
    x, y, a, b, g = problem(n, m, d, gen)
    col_start = layout(m, 6, gen)
    keep = torch.ones(-(-n // block_m(d)), 6, dtype=torch.int8)
    X, Y = clouds(x, y)
    prm = params(EPS, 1.0, "cpu")
    kw = dict(logw_in=logw(b) if has_in else None, logw_out=logw(a) if has_out else None)
    ref, _ = reference_lse(x, y, g, torch.ones(n, m, dtype=torch.bool), kw["logw_in"], kw["logw_out"])
    first, _ = lse_update(X, Y, g, prm, "float32", **kw)
    # FOLD: a good prediction and one off by ~500 in log2 units (both kernels fall back to the online max)
    polds = [first + 0.01 * torch.randn(n, generator=gen)] if (compute_err or fold) else [None]
    if fold:
        polds.append(first + 70.0)
    for pold in polds:
        kw.update(pold=pold, compute_err=compute_err, fold=fold)
        dense, dense_err = lse_update(X, Y, g, prm, "float32", **kw)
        sparse, sparse_err = lse_blocksparse(X, Y, g, prm, column_ranges(keep, col_start), "float32", **kw)
        assert_potentials(dense, ref, 1e-5)
        assert_potentials(sparse, dense, 1e-6)
        if compute_err and pold is polds[0]:  # (the marginals of the bad prediction overflow)
            w_max = a.max() if has_out else 1.0
            assert (sparse_err - dense_err).abs().max() <= 1e-6 * w_max
        elif not compute_err:
            assert sparse_err is None


@pytest.mark.parametrize("precision", ["float32", "tf32"])
@pytest.mark.parametrize("p", [0, 2, 16])
def test_keep_all_apply_matches_dense(p, precision):
    gen = torch.Generator().manual_seed(100 + p)
    n, m, d = 45, 90, 2
    x, y, _, _, g = problem(n, m, d, gen, zero_weights=False)
    f = 0.1 * torch.randn(n, generator=gen)
    v = torch.randn(m, p, generator=gen) if p else None
    col_start = layout(m, 5, gen)
    keep = torch.ones(-(-n // block_m(d, precision)), 5, dtype=torch.uint8)
    X, Y = clouds(x, y)
    prm = params(EPS, 1.0, "cpu")
    pv, rows = apply_plan_blocksparse(X, Y, f, g, prm, column_ranges(keep, col_start), precision, v)
    dense_pv, dense_rows = apply_plan(X, Y, f, g, prm, precision, v)
    assert ((rows - dense_rows).abs() <= 1e-6 * dense_rows).all()
    if p:
        bound, _ = apply_plan(X, Y, f, g, prm, precision, v.abs())
        assert ((pv - dense_pv).abs() <= 1e-6 * bound + 1e-30).all()
    else:
        assert pv is None


@pytest.mark.parametrize("d", [1, 2, 3])
@pytest.mark.parametrize("opts", [OPTIONS[0], OPTIONS[3], OPTIONS[4]])
def test_random_mask_lse_matches_float64(d, opts):
    has_in, has_out, compute_err, fold = opts
    gen = torch.Generator().manual_seed(200 + 10 * d + OPTIONS.index(opts))
    n, m = (70, 90) if d != 2 else (45, 37)
    x, y, a, b, g = problem(n, m, d, gen)
    col_start = layout(m, 7, gen)
    keep = random_keep(n, d, col_start, gen)
    mask = allowed(n, d, keep, col_start)
    assert not mask.all() and mask.any(1).all()
    X, Y = clouds(x, y)
    prm = params(EPS, 1.0, "cpu")
    lw_in, lw_out = (logw(b) if has_in else None), (logw(a) if has_out else None)
    ref, _ = reference_lse(x, y, g, mask, lw_in, lw_out)
    # FOLD: a good prediction and one off by ~500 in log2 units (the online fallback)
    polds = [ref.float() + 0.01 * torch.randn(n, generator=gen)] if (compute_err or fold) else [None]
    if fold:
        polds.append(ref.float() + 70.0)
    for pold in polds:
        out, err = lse_blocksparse(X, Y, g, prm, column_ranges(keep, col_start), "float32", logw_in=lw_in,
                                   logw_out=lw_out,
                                   pold=pold, compute_err=compute_err, fold=fold)
        assert_potentials(out, ref, 1e-5)
        if compute_err and pold is polds[0]:  # (the marginals of the bad prediction overflow)
            _, ref_err = reference_lse(x, y, g, mask, lw_in, lw_out, pold)
            scale = a.max() if has_out else 1.0
            assert (err.double() - ref_err).abs().max() <= 1e-5 * scale


@pytest.mark.parametrize("d", [1, 2, 3])
@pytest.mark.parametrize("p", [0, 2, 16])
def test_random_mask_apply_matches_float64(d, p):
    gen = torch.Generator().manual_seed(300 + 10 * d + p)
    n, m = (70, 90) if d != 3 else (45, 37)
    x, y, _, _, g = problem(n, m, d, gen, zero_weights=False)
    f = 0.1 * torch.randn(n, generator=gen)
    v = torch.randn(m, p, generator=gen) if p else None
    col_start = layout(m, 6, gen)
    keep = random_keep(n, d, col_start, gen)
    mask = allowed(n, d, keep, col_start)
    X, Y = clouds(x, y)
    pv, rows = apply_plan_blocksparse(X, Y, f, g, params(EPS, 1.0, "cpu"), column_ranges(keep, col_start),
                                      "float32", v)
    ref_pv, ref_pav, ref_rows = reference_apply(x, y, f, g, mask, v)
    assert ((rows.double() - ref_rows).abs() <= 1e-5 * ref_rows).all()
    if p:
        assert ((pv.double() - ref_pv).abs() <= 1e-5 * ref_pav).all()


@pytest.mark.parametrize("d", [1, 2, 3])
def test_target_mean_on_tensor_cores_matches_float64(d):
    """TGT_MEAN (the multiscale gradient's softmin mean, FP16 plan x packed target parts on the
    tensor cores): P 1 as float32, (P t / P 1) within the FP16 rounding of P (relative 2^-12 per
    entry: at most 2^-11 of the spread of t around the mean), rows keeping nothing give 0."""
    gen = torch.Generator().manual_seed(500 + d)
    n, m = (70, 90) if d != 3 else (45, 37)
    x, y, _, b, g = problem(n, m, d, gen)
    col_start = layout(m, 6, gen)
    keep = random_keep(n, d, col_start, gen)
    keep[1] = 0
    mask = allowed(n, d, keep, col_start)
    X, Y = clouds(x, y)
    # f near the masked update (rows of P summing to ~1, as in the solve's last sweep), weights in g
    gw = g + EPS * logw(b)
    ref_f, _ = reference_lse(x, y, gw.float(), mask)
    f = (ref_f + 0.05 * EPS * torch.randn(n, generator=gen, dtype=torch.float64)).float()
    f = torch.where(torch.isfinite(f), f, 0.0)
    pt, rows = apply_plan_blocksparse(X, Y, f, gw, params(EPS, 1.0, "cpu"), column_ranges(keep, col_start),
                                      "float32", target_mean=True)
    t = Y.x.double()
    ref_pt, _, ref_rows = reference_apply(x, y, f, gw, mask, t)
    live = mask.any(1)
    assert not live.all() and live.any()
    assert (pt[~live] == 0).all() and (rows[~live] == 0).all()
    assert ((rows.double() - ref_rows).abs() <= 1e-5 * ref_rows).all()
    mean, ref_mean = pt[live].double() / rows[live, None].double(), ref_pt[live] / ref_rows[live, None]
    spread = (t[None, :, :] - ref_mean[:, None, :]).abs().amax(1)
    assert torch.isfinite(mean).all()
    assert ((mean - ref_mean).abs() <= 2.0 ** -11 * spread + 1e-7).all(), float((mean - ref_mean).abs().max())
    with pytest.raises(ValueError, match="target_mean"):
        apply_plan_blocksparse(X, Y, f, gw, params(EPS, 1.0, "cpu"), column_ranges(keep, col_start), "float32",
                               torch.randn(m, d), target_mean=True)


def test_row_block_keeping_nothing():
    """L = -inf: out = eps logw_out (0 without), err = w_out, P v = 0, P 1 = 0 on those rows;
    a block keeping only an empty cluster is the same case."""
    gen = torch.Generator().manual_seed(400)
    n, m, d = 50, 40, 2
    bm = block_m(d)
    x, y, a, _, g = problem(n, m, d, gen)
    col_start = layout(m, 4, gen)
    keep = random_keep(n, d, col_start, gen)
    keep[0] = 0
    keep[2] = 0
    keep[2, 1] = 1  # cluster 1 is empty
    X, Y = clouds(x, y)
    prm = params(EPS, 1.0, "cpu")
    rows = torch.cat([torch.arange(0, bm), torch.arange(2 * bm, min(3 * bm, n))])
    out, err = lse_blocksparse(X, Y, g, prm, column_ranges(keep, col_start), "float32", pold=torch.zeros(n))
    assert (out[rows] == 0).all() and (err[rows] == 1).all()
    out, err = lse_blocksparse(X, Y, g, prm, column_ranges(keep, col_start), "float32", logw_out=logw(a),
                               pold=torch.zeros(n),
                               fold=True)
    assert torch.allclose(out[rows], EPS * logw(a)[rows]) and torch.allclose(err[rows], a[rows])
    ref, _ = reference_lse(x, y, g, allowed(n, d, keep, col_start), None, logw(a))
    assert_potentials(out, ref, 1e-5)
    pv, rs = apply_plan_blocksparse(X, Y, torch.zeros(n), g, prm, column_ranges(keep.bool(), col_start),
                                    "float32", torch.randn(m, 3))
    assert (pv[rows] == 0).all() and (rs[rows] == 0).all()
    live = allowed(n, d, keep, col_start).any(1)
    assert live.sum() == n - rows.numel() and (rs[live] > 0).all()


def test_layout_checks():
    gen = torch.Generator().manual_seed(500)
    x, y, _, _, g = problem(20, 20, 2, gen)
    X, Y = clouds(x, y)
    col_start = layout(20, 3, gen)
    prm = params(EPS, 1.0, "cpu")
    with pytest.raises(ValueError, match="shape"):
        lse_blocksparse(X, Y, g, prm, column_ranges(torch.ones(1, 2, dtype=torch.int8), col_start), "float32")
    with pytest.raises(ValueError, match="int32 or int64"):
        lse_blocksparse(X, Y, g, prm, torch.zeros(-(-20 // block_m(2)), 1, 2), "float32")
    with pytest.raises(ValueError, match="pold"):
        keep = torch.ones(-(-20 // block_m(2)), 3, dtype=torch.bool)
        lse_blocksparse(X, Y, g, prm, column_ranges(keep, col_start), "float32", fold=True)


def test_column_ranges_are_the_merged_runs_of_kept_clusters():
    keep = torch.tensor([[1, 1, 0, 1, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1],
                         [0, 1, 0, 0, 0, 0, 0, 1]], dtype=torch.int8)
    col_start = torch.tensor([0, 3, 3, 7, 9, 14, 20, 21, 25], dtype=torch.int32)
    r = column_ranges(keep, col_start)
    assert r.dtype == torch.int32 and tuple(r.shape) == (4, 3, 2)
    assert r[0].tolist() == [[0, 3], [7, 9], [14, 25]]
    assert r[1].tolist() == [[0, 0]] * 3
    assert r[2].tolist() == [[0, 25], [0, 0], [0, 0]]
    assert r[3].tolist() == [[3, 3], [21, 25], [0, 0]]  # cluster 1 is empty: an empty run


@pytest.mark.parametrize("on_gpu", [False, True])
@pytest.mark.parametrize("d", [1, 3, 40, 100])
def test_plans_use_the_queried_block_m(on_gpu, d):
    """The plans' BLOCK_M is blocksparse_block_m's, whatever n; one launch, no column split."""
    for precision in ("float32", "tf32"):
        bm = multiscale_plans.blocksparse_block_m(d, precision, on_gpu)
        for n in (1, 70, 5000):
            lse = multiscale_calls.lse_blocksparse(n, 90, d, 7, precision, on_gpu, True, True, True, True).calls
            app = multiscale_calls.apply_plan_blocksparse(n, 90, d, 7, 16, precision, on_gpu).calls
            assert len(lse) == len(app) == 1
            for call in (lse[0], app[0]):
                assert call.constexprs["BLOCK_M"] == bm and call.plan.grid[0] == -(-n // bm)
            assert lse[0].constexprs["FOLD"] == (d <= 64)
