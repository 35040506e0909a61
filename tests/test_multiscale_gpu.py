"""The multiscale solve on a GPU (compiled block-sparse kernels, the GPU's BLOCK_M): the same
checks as the CPU tests at larger sizes, against the float64 re-implementation run on the CPU
with the same clusters and masks (tests/test_multiscale_solve.py)."""

import pytest
import torch

import torch_api
from ot_triton_jax.core import multiscale_plans
from test_multiscale_solve import _grad_x_reference, _reference
from torch_api import kernel_ops
from torch_api.multiscale.clusters import column_ranges
from torch_api.multiscale.gradient import direction
from torch_api.multiscale.solve import anneal

pytestmark = pytest.mark.gpu


def _problem(n, m, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.rand(n, d, generator=g) * 4.0, torch.rand(m, d, generator=g) * 3.2 + 0.6
    a, b = torch.rand(n, generator=g) + 0.2, torch.rand(m, generator=g) + 0.2
    return x, y, a / a.sum(), b / b.sum()


@pytest.mark.parametrize("precision", ["float32", "tf32"])
def test_keep_all_equals_the_dense_update(precision):
    x, y, _, b = _problem(3000, 2500, 3)
    X, Y = kernel_ops.clouds(x.cuda(), y.cuda())
    g = torch.randn(2500, device="cuda") * 0.1
    prm = kernel_ops.params(0.05, 0.5, "cuda")
    lb = b.cuda().log()
    bm = multiscale_plans.blocksparse_block_m(3, precision, True)
    keep = torch.ones(-(-3000 // bm), 4, dtype=torch.int8, device="cuda")
    col_start = torch.tensor([0, 700, 700, 1900, 2500], dtype=torch.int32, device="cuda")  # one empty cluster
    dense = kernel_ops.lse_update(X, Y, g, prm, precision, logw_in=lb)[0]
    sparse = kernel_ops.lse_blocksparse(X, Y, g, prm, column_ranges(keep, col_start), precision, logw_in=lb)[0]
    assert torch.isfinite(sparse).all()
    assert float((sparse - dense).norm() / dense.norm()) < 1e-6


@pytest.mark.parametrize("d,truncate,scale,tol", [(3, 5.0, 0.5, None), (2, None, 0.3, None), (1, 5.0, 0.2, 1e-2)])
def test_anneal_and_gradient_match_the_float64_algorithm(d, truncate, scale, tol):
    x, y, a, b = _problem(1500, 1300, d, seed=d)
    both = torch.cat([x, y])
    blur, scaling, diam = 0.05 if tol is None else 0.3, 0.5, float((both.max(0).values - both.min(0).values).norm())
    trace = []
    out = anneal(x.cuda(), y.cuda(), a.cuda(), b.cuda(), blur, scaling, diam, cluster_scale=scale, truncate=truncate,
                 tol=tol, trace=trace)
    bm = multiscale_plans.blocksparse_block_m(d, "float32", True)
    trace = [(e, None if rng is None else tuple(None if r is None else r.cpu() for r in rng), kind, *mix)
             for e, rng, kind, *mix in trace]
    ref, jump, masks, last = _reference(x, y, a, b, blur, scaling, diam, scale, trace, bm,
                                        None if tol is None else out.coarse_finish_sweeps)
    assert out.jump == jump
    for mine, theirs in zip(out.new, ref):
        assert torch.isfinite(mine).all()
        # float32 conditioning: max C / eps ~ 1e4 here, 2^-24 * 1e4 = 6e-4; the H100 measured 3.0e-5
        # (d = 3, 3xTF32 cross term) where the CPU interpreter's exact products gave < 2e-5
        assert float((mine.cpu().double() - theirs).norm() / theirs.norm()) < 1e-4
    gx = (a.cuda()[:, None] * direction(out, 0)).cpu().double()
    ref_gx = _grad_x_reference(last, a)
    assert float((gx - ref_gx).norm() / ref_gx.norm()) < 1e-4
    if truncate is not None:  # the bound is rigorous but vacuous for unconverged potentials (tol=None)
        assert out.kept < 1.0 and out.dropped_mass_bound > 0.0
    if tol is not None:
        assert out.converged and out.marginal_error <= tol
        assert truncate is None or out.dropped_mass_bound < 1e-2


def test_samples_loss_multiscale_at_scale_against_the_converged_exact_solve():
    """n = m = 2^16 uniform in the unit cube, blur 0.05 (the multiscale benchmark's workload, bench/areas/multiscale.py): the default
    solve meets its tolerance with a small dropped-mass bound; with tol=1e-4 the value is within
    1e-4 of the untruncated solve converged to 1e-5."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.rand(1 << 16, 3, generator=g).cuda(), torch.rand(1 << 16, 3, generator=g).cuda()
    x.requires_grad_(True)
    loss = torch_api.SamplesLoss("sinkhorn", blur=0.05, scaling=0.5, backend="multiscale")
    value = loss(x, y)
    (gx,) = torch.autograd.grad(value, x)
    res = loss.last_multiscale
    assert torch.isfinite(gx).all() and res.converged and res.marginal_error <= 5e-3
    assert res.kept < 0.5 and res.dropped_mass_bound < 1e-3
    exact = torch_api.SamplesLoss("sinkhorn", blur=0.05, scaling=0.5, backend="multiscale", truncate=None, tol=1e-5)
    ref = float(exact(x.detach(), y))
    assert exact.last_multiscale.converged
    tight = float(torch_api.SamplesLoss("sinkhorn", blur=0.05, scaling=0.5, backend="multiscale", tol=1e-4)(
        x.detach(), y))
    assert abs(tight - ref) < 1e-4 * abs(ref), (tight, ref, float(value))


def test_hvp_matches_the_float64_hessian_of_the_truncated_plans():
    """The block-sparse HVP (compiled kernels, the GPU's blocks) against the float64 Hessian of
    the same truncated plans at the same potentials (tests/test_multiscale_hvp.py's reference)."""
    from implicit_reference import Problem
    from test_multiscale_solve import _dense_mask as _pairs
    from torch_api.multiscale import clusters as mc
    from torch_api.multiscale.hvp import multiscale_hvp
    n, m, d, blur = 1500, 1200, 3, 0.25
    g = torch.Generator().manual_seed(7)
    x, y = torch.rand(n, d, generator=g) * 5.0, torch.rand(m, d, generator=g) * 4.5 + 0.5
    a, b = torch.full((n,), 1.0 / n), torch.full((m,), 1.0 / m)
    both = torch.cat([x, y])
    diam = float((both.max(0).values - both.min(0).values).norm())
    res = anneal(x.cuda(), y.cuda(), a.cuda(), b.cuda(), blur, 0.5, diam, cluster_scale=0.5, truncate=3.0, tol=1e-3)
    vx, vy = torch.randn(n, d, generator=g), torch.randn(m, d, generator=g)
    tx, ty = multiscale_hvp(res, vx.cuda(), vy.cuda(), True, "float32")
    _, _, _, perms, extra = res.state
    bm = multiscale_plans.blocksparse_block_m(d, "float32", True)
    inv = [torch.argsort(p).cpu() for p in perms]
    lx, ly = (lab.cpu() for lab in extra["labels"])

    def support(keep, la, lb, ia, ib):
        rows, _ = mc.block_pair_ranges(keep.cpu(), la, lb, bm)
        return _pairs(rows, la.shape[0], lb.shape[0], bm)[ia][:, ib]

    eps = blur ** 2
    f_ba, g_ab, f_aa, g_bb = (p.double().cpu() for p in res.new)
    la, lb = a.double().log(), b.double().log()
    m_xy = support(extra["keep"][0], lx, ly, inv[0], inv[1])
    assert float(m_xy.float().mean()) < 0.9  # blocks of 64 rows: coarse rectangles, still truncated
    hxy = Problem(x, y, a, b, eps, 2.0, potentials=(f_ba + eps * la, g_ab + eps * lb), mask=m_xy).hvp(vx, vy)
    hxx = Problem(x, x, a, a, eps, 2.0, potentials=(f_aa + eps * la,) * 2,
                  mask=support(extra["keep"][1], lx, lx, inv[0], inv[0])).hvp(vx, vx)
    hyy = Problem(y, y, b, b, eps, 2.0, potentials=(g_bb + eps * lb,) * 2,
                  mask=support(extra["keep"][2], ly, ly, inv[1], inv[1])).hvp(vy, vy)
    ref_x, ref_y = hxy[0] - 0.5 * (hxx[0] + hxx[1]), hxy[1] - 0.5 * (hyy[0] + hyy[1])
    for t, r in ((tx, ref_x), (ty, ref_y)):
        assert torch.isfinite(t).all()
        assert float((t.double().cpu() - r).norm() / r.norm()) < 2e-3


def test_jax_twin_on_the_gpu_is_torch_apis():
    """ot_triton_jax.samples_loss(backend="multiscale") on GPU arrays (zero-copy into torch_api's
    solve on the same device): value, gradient and HVP equal torch_api's."""
    import jax
    import numpy as np
    import ot_triton_jax as otj
    n, m, d = 20000, 18000, 3
    x, y, a, b = _problem(n, m, d, seed=3)
    v = torch.randn(n, d, generator=torch.Generator().manual_seed(4))
    kw = dict(blur=0.1, scaling=0.5, backend="multiscale")
    xj, yj, aj, bj, vj = (jax.device_put(t.numpy()) for t in (x, y, a, b, v))
    assert xj.devices().pop().platform == "gpu"
    loss = lambda z: otj.samples_loss(z, yj, aj, bj, **kw)  # noqa: E731
    value, gx = jax.value_and_grad(loss)(xj)
    _, hx = jax.jvp(jax.grad(loss), (xj,), (vj,))
    tl = torch_api.SamplesLoss("sinkhorn", **kw)
    xt = x.cuda().requires_grad_(True)
    vt = tl(a.cuda(), xt, b.cuda(), y.cuda())
    (gxt,) = torch.autograd.grad(vt, xt, create_graph=True)
    (hxt,) = torch.autograd.grad((gxt * v.cuda()).sum(), xt)
    rel = lambda u, r: float(np.linalg.norm(np.asarray(u, np.float64) - r.double().cpu().numpy())  # noqa: E731
                             / r.double().norm())
    # two GPU solves differ by the order of atomic float64 sums (cluster centroids, fits): float32
    # noise in the potentials, and a borderline block may flip in a mask
    assert abs(float(value) - float(vt)) <= 1e-5 * abs(float(vt))
    assert rel(gx, gxt.detach()) < 1e-4 and rel(hx, hxt) < 1e-3
    assert np.isfinite(np.asarray(hx)).all()


_FIRST_CALL = r"""
import json, sys, torch
from triton.runtime.jit import JITFunction
import torch_api
from torch_api import kernel_ops
compiles, inside = [], [False]
do_compile, prewarm = JITFunction._do_compile, kernel_ops.launch_prewarm
def counted(self, *a, **k):
    compiles.append([self.fn.__name__, inside[0]])
    return do_compile(self, *a, **k)
def flagged(items, workers=None):
    inside[0] = True
    try:
        return prewarm(items, workers)
    finally:
        inside[0] = False
JITFunction._do_compile, kernel_ops.launch_prewarm = counted, flagged
g = torch.Generator().manual_seed(0)
x, y = torch.rand(20000, 3, generator=g).cuda(), torch.rand(18000, 3, generator=g).cuda()
loss = torch_api.SamplesLoss("sinkhorn", blur=0.05, backend="multiscale")
values = []
for _ in range(2):
    xg = x.clone().requires_grad_(True)
    value = loss(xg, y)
    (gx,) = torch.autograd.grad(value, xg)
    values.append([float(value), float(gx.norm())])
print(json.dumps({"compiles": compiles, "values": values}))
"""


def test_first_call_compiles_every_kernel_in_the_parallel_prewarm(tmp_path):
    """A fresh process with an empty Triton cache: every compile of the first loss + gradient
    happens inside kernel_ops.prewarm (none one by one at a first launch), and the second call
    gives the same numbers."""
    import json
    import os
    import subprocess
    import sys
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    out = subprocess.run([sys.executable, "-c", _FIRST_CALL], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["compiles"], "a cold cache must compile"
    late = [name for name, inside in res["compiles"] if not inside]
    assert not late, f"compiled at first launch, not in the prewarm: {late}"
    (v1, g1), (v2, g2) = res["values"]
    assert abs(v1 - v2) <= 1e-6 * abs(v1) and abs(g1 - g2) <= 1e-6 * abs(g1)


def test_ott_convention_option_against_the_dense_solver():
    """sinkhorn(..., multiscale=MultiscaleOptions()) at 20000 x 18000 points, d = 3, on the GPU:
    converged, its cost within 1e-3 of the dense solver's converged cost (truncation and the
    finishing tolerance), its gradient in x within 1e-2, and its reports finite."""
    g = torch.Generator().manual_seed(4)
    x, y = torch.rand(20000, 3, generator=g).cuda(), (torch.rand(18000, 3, generator=g) * 0.9 + 0.05).cuda()
    kw = dict(epsilon=0.0025, scale_cost=2.0, threshold=1e-4)
    xm, xd = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ms = torch_api.sinkhorn(xm, y, **kw, multiscale=torch_api.MultiscaleOptions())
    dense = torch_api.sinkhorn(xd, y, **kw, max_iterations=20000)
    assert bool(ms.converged) and bool(dense.converged) and ms.report.kept < 1.0
    assert abs(float(ms.reg_ot_cost) - float(dense.reg_ot_cost)) <= 1e-3 * abs(float(dense.reg_ot_cost))
    (gm,) = torch.autograd.grad(ms.reg_ot_cost, xm)
    (gd,) = torch.autograd.grad(dense.reg_ot_cost, xd)
    assert float((gm - gd).norm() / gd.norm()) < 1e-2
    assert torch.isfinite(ms.f).all() and torch.isfinite(ms.g).all() and ms.dropped_mass_bound >= 0.0


def test_taylor_pass_on_the_gpu_against_the_direct_pass(monkeypatch):
    """The default ("auto") takes the Taylor pass where clusters hold >= 48 points (150 000 points,
    blur 0.1: ~1950 clusters, ~77 points each): all four plans, the x side's with the gradient's
    means, at order 5 (multiscale_rules.taylor_order at the default tol), reported; against MODE
    "never" the value within the truncation's reach and the gradient within the two kept sets'
    difference (the Taylor pass keeps the mask's cluster pairs, the direct pass a row block's
    union), marginal errors within tol, the kernels in the prewarm list. With
    TAYLOR_MEAN_MIN_POINTS above the cluster size the x side's fused passes stay direct: the
    gradient equals "never"'s. Then the pass itself (update and mean) at both orders against
    float64 on 64 rows over the same kept cluster pairs, within its bounds."""
    import math

    from ot_triton_jax.core import kernels, multiscale_rules as rules
    from test_multiscale_taylor import solve_in_modes
    from torch_api.multiscale import prewarm as ms, taylor
    g = torch.Generator().manual_seed(6)
    x, y = torch.rand(150000, 3, generator=g).cuda(), (torch.rand(150000, 3, generator=g) * 0.9 + 0.05).cuda()
    out = solve_in_modes(monkeypatch, x, y, 0.1, ("never", "auto"))
    (v0, g0, r0, _), (v1, g1, r1, ran) = out["never"], out["auto"]
    # the plans' smaller mean cluster size decides (multiscale_rules.taylor_worthwhile)
    assert max(rules.TAYLOR_MIN_POINTS, rules.TAYLOR_MEAN_MIN_POINTS) <= 150000 / max(r1.clusters) < 200
    assert r0.taylor_passes == 0 and r1.taylor_passes == 4 * r1.sweeps
    assert r1.converged and r1.marginal_error <= 5e-3
    assert abs(v1 - v0) <= 0.01 * (r0.dropped_mass_bound + r1.dropped_mass_bound) + 1e-6 * abs(v0)
    assert float((g1 - g0).norm()) <= 1e-3 * float(g0.norm())
    kx, ky = r1.clusters
    listed = {(s.calls[0].kernel, tuple(sorted(s.calls[0].constexprs.items())))
              for s in ms.kernel_descriptions(150000, 150000, kx, ky, 3, "float32", True, True, (True, False), True,
                                              ((5,), (5,)))}
    tk = (kernels.taylor_monomials_kernel, kernels.taylor_moments_kernel, kernels.taylor_evaluate_kernel)
    launched = {(s.calls[0].kernel, tuple(sorted(s.calls[0].constexprs.items()))) for s in ran if s.calls[0].kernel in tk}
    assert len(launched) == 5 and launched <= listed and all(dict(c).get("R") == 64 for _, c in launched)
    monkeypatch.setattr(rules, "TAYLOR_MEAN_MIN_POINTS", 200.0)
    v2, g2, r2, _ = solve_in_modes(monkeypatch, x, y, 0.1, ("auto",))["auto"]
    assert r2.taylor_passes == 2 * r2.sweeps and r2.converged and r2.marginal_error <= 5e-3
    assert abs(v2 - v0) <= 0.01 * (r0.dropped_mass_bound + r2.dropped_mass_bound) + 1e-6 * abs(v0)
    assert float((g2 - g0).norm()) <= 1e-5 * float(g0.norm())
    # the pass alone on the solve's y -> x plan, against float64 on sampled rows
    new, plans, prm, perms, extra = r1.state
    Y, X, f_old, la, _ = plans["yx"]
    keep_xy = extra["keep"][0]
    lab_x, lab_y = extra["labels"]
    sx = torch.zeros(kx + 1, dtype=torch.int32, device="cuda")
    sx[1:] = torch.cumsum(torch.bincount(lab_x, minlength=kx), 0)
    sy = torch.zeros(ky + 1, dtype=torch.int32, device="cuda")
    sy[1:] = torch.cumsum(torch.bincount(lab_y, minlength=ky), 0)
    src, tgt = taylor.TaylorSide(Y.x, lab_y, sy), taylor.TaylorSide(X.x, lab_x, sx)
    g_old = plans["xy"][2]
    eps = float(prm[0])
    t = src.max_radius * tgt.max_radius / eps
    rows = torch.randint(0, Y.n, (64,), generator=torch.Generator().manual_seed(0)).cuda()
    for p in rules.TAYLOR_ORDERS:
        res = taylor.lse(src, tgt, f_old, la, g_old, prm, taylor.pair_orders(keep_xy, keep_xy.T.contiguous())[1], True,
                         mean=True, p=p)
        assert res is not None
        worst = worst_mean = 0.0
        for i in rows.tolist():
            ls = keep_xy[:, lab_y[i]].nonzero()[:, 0]
            cols = torch.cat([torch.arange(int(sx[l]), int(sx[l + 1]), device="cuda") for l in ls])
            z = (g_old[i].double() + f_old[cols].double() + eps * la[cols].double()
                 - 0.5 * ((Y.x[i].double() - X.x[cols].double()) ** 2).sum(1)) / eps
            ref = g_old[i].double() - eps * torch.logsumexp(z, 0)
            worst = max(worst, abs(float(res[0][i]) - float(ref)) / eps)
            ref_mean = torch.softmax(z, 0) @ X.x[cols].double()
            worst_mean = max(worst_mean, float((res[2][i].double() - ref_mean).abs().max()))
        # per pair weight a relative error <= taylor_bound (the mean's: one degree lower), plus float32
        # rounding; the points span [0, 1]
        assert worst <= rules.taylor_bound(t, p) + 1e-5 and math.isfinite(worst), (p, worst)
        assert worst_mean <= tgt.max_radius * rules.taylor_bound(t, p - 1) + 2e-6 and math.isfinite(worst_mean), (p, worst_mean)
        print(f"order {p}: t {t:.3f}, update {worst:.2e} eps, mean {worst_mean:.2e}")


def test_coarse_phase_replays_its_graphs_bitwise(monkeypatch):
    """The coarse annealing and the finishing loop's checked sweeps replay CUDA graphs from a shape's
    second solve on (multiscale.coarse.CoarsePhase): the same potentials, finishing steps and result,
    bitwise, as the eager first solve; with OT_TRITON_CUDA_GRAPHS=0 nothing is captured."""
    from torch_api import cuda_graphs
    g = torch.Generator().manual_seed(11)
    n = 30000
    x, y = torch.rand(n, 3, generator=g).cuda(), torch.rand(n, 3, generator=g).cuda()
    a = torch.full((n,), 1.0 / n, device="cuda")

    def solve():
        return anneal(x, y, a, a, 0.05, 0.5, 1.8, means=(True, False))
    cuda_graphs.clear()
    monkeypatch.setenv("OT_TRITON_CUDA_GRAPHS", "0")
    solve(), solve()
    assert not any(k[0] == "multiscale_coarse" for k in cuda_graphs._sets)
    monkeypatch.delenv("OT_TRITON_CUDA_GRAPHS")
    runs = [solve() for _ in range(3)]  # eager (the shape's first), then captured, then replayed
    sets = [v for k, v in cuda_graphs._sets.items() if k[0] == "multiscale_coarse"]
    assert len(sets) == 1 and set(sets[0]._graphs) == {"anneal", "check"}
    assert runs[0].coarse_finish_sweeps > 1
    for r in runs[1:]:
        assert (r.coarse_finish_sweeps, r.sweeps, r.marginal_error) == (runs[0].coarse_finish_sweeps, runs[0].sweeps,
                                                                       runs[0].marginal_error)
        for p, q in zip(r.new + r.old, runs[0].new + runs[0].old):
            assert torch.equal(p, q)
