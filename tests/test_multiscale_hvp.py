"""The HVP of the multiscale SamplesLoss (torch_api.multiscale.hvp; CPU: Triton interpreter, real
block-sparse kernels) against float64 dense Hessians (tests/implicit_reference.py) of the same
truncated plans at the same potentials, and against the dense backend's HVP."""

import pytest
import torch

from implicit_reference import Problem
from ot_triton_jax.core import multiscale_plans, runtime
from torch_api import SamplesLoss
from torch_api.multiscale import clusters as mc
from torch_api.multiscale.hvp import multiscale_hvp
from torch_api.multiscale.solve import anneal
from test_multiscale_solve import _dense_mask as _pairs  # (n, m) bool: the pairs ranges stream


def _problem(seed, n, m, d, span=3.0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.rand(n, d, generator=g) * span, torch.rand(m, d, generator=g) * span * 0.9 + 0.5
    a, b = torch.rand(n, generator=g) + 0.2, torch.rand(m, generator=g) + 0.2
    return x, y, a / a.sum(), b / b.sum(), g


def _diameter(x, y):
    both = torch.cat([x, y])
    return float((both.max(0).values - both.min(0).values).norm())


def rel(u, ref):
    return float((u.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("block_m,chunk", [(4, 4096), (16, 4096), (4, 3)])
def test_block_pair_ranges_are_one_pair_set_covering_the_kept_clusters(block_m, chunk):
    g = torch.Generator().manual_seed(3)
    x, y = torch.rand(70, 2, generator=g), torch.rand(45, 2, generator=g)
    cx, cy = mc.cluster_pair(x, torch.ones(70), y, torch.ones(45), 0.1)
    keep = torch.cdist(cx.centroid, cy.centroid) < 0.2  # a band, as truncation keeps
    rows, cols = mc.block_pair_ranges(keep, cx.label, cy.label, block_m, chunk=chunk)
    s_xy, s_yx = _pairs(rows, 70, 45, block_m), _pairs(cols, 45, 70, block_m)
    assert torch.equal(s_xy, s_yx.t())  # P^T is the transpose of P
    kept = keep[cx.label][:, cy.label]
    assert bool(s_xy[kept].all()) and not bool(s_xy.all())
    # whole (x-block, y-block) rectangles, each touching a kept cluster pair
    bx, by = torch.arange(70) // block_m, torch.arange(45) // block_m
    hit = torch.zeros(int(bx.max()) + 1, int(by.max()) + 1, dtype=torch.bool)
    hit[bx[:, None].expand(70, 45)[kept], by[None, :].expand(70, 45)[kept]] = True
    assert torch.equal(s_xy, hit[bx][:, by])


@pytest.mark.parametrize("d,truncate,scale,span,n,m", [(1, 3.0, 0.25, 3.0, 64, 48), (2, 2.0, 0.5, 5.0, 96, 80),
                                                      (3, 2.0, 0.7, 4.0, 64, 56)])
def test_hvp_is_the_float64_hessian_of_the_truncated_plans(d, truncate, scale, span, n, m):
    """Real truncation (blocks dropped): the debiased Hessian of the three plans restricted to the
    HVP's pair sets, at the solve's last potentials, in float64."""
    x, y, a, b, g = _problem(30 + d, n, m, d, span)
    blur = 0.3
    eps = blur ** 2
    res = anneal(x, y, a, b, blur, 0.5, _diameter(x, y), cluster_scale=scale, truncate=truncate, tol=1e-2)
    vx, vy = torch.randn(x.shape, generator=g), torch.randn(y.shape, generator=g)
    tx, ty = multiscale_hvp(res, vx, vy, True, "float32")
    _, _, _, perms, extra = res.state
    block_m = multiscale_plans.blocksparse_block_m(d, "float32", runtime.on_gpu())
    inv = [torch.argsort(p) for p in perms]
    lx, ly = extra["labels"]

    def support(keep, la, lb, ia, ib):  # the pair set in the original order
        rows, _ = mc.block_pair_ranges(keep, la, lb, block_m)
        return _pairs(rows, la.shape[0], lb.shape[0], block_m)[ia][:, ib]

    m_xy = support(extra["keep"][0], lx, ly, inv[0], inv[1])
    m_xx = support(extra["keep"][1], lx, lx, inv[0], inv[0])
    m_yy = support(extra["keep"][2], ly, ly, inv[1], inv[1])
    assert not bool(m_xy.all())
    f_ba, g_ab, f_aa, g_bb = (p.double() for p in res.new)
    la, lb = a.double().log(), b.double().log()
    pxy = Problem(x, y, a, b, eps, 2.0, potentials=(f_ba + eps * la, g_ab + eps * lb), mask=m_xy)
    hxy = pxy.hvp(vx, vy)
    pxx = Problem(x, x, a, a, eps, 2.0, potentials=(f_aa + eps * la, f_aa + eps * la), mask=m_xx)
    hxx = pxx.hvp(vx, vx)
    pyy = Problem(y, y, b, b, eps, 2.0, potentials=(g_bb + eps * lb, g_bb + eps * lb), mask=m_yy)
    hyy = pyy.hvp(vy, vy)
    ref_x = hxy[0] - 0.5 * (hxx[0] + hxx[1])
    ref_y = hxy[1] - 0.5 * (hyy[0] + hyy[1])
    assert rel(tx, ref_x) < 1e-3 and rel(ty, ref_y) < 1e-3, (rel(tx, ref_x), rel(ty, ref_y))
    # the same potentials without truncation: the dropped blocks move the Hessian by little
    full = (Problem(x, y, a, b, eps, 2.0, potentials=(f_ba + eps * la, g_ab + eps * lb)).hvp(vx, vy)[0]
            - 0.5 * sum(Problem(x, x, a, a, eps, 2.0, potentials=(f_aa + eps * la,) * 2).hvp(vx, vx)[:2]))
    assert rel(tx, full) < 0.1, rel(tx, full)


def test_double_backward_is_the_hvp_and_keep_all_is_the_dense_backends():
    """create_graph=True through SamplesLoss(backend="multiscale") gives multiscale_hvp; with one
    point per cluster and nothing truncated it is the dense backend's HVP; third order raises."""
    x, y, a, b, g = _problem(5, 40, 32, 2)
    v = torch.randn(x.shape, generator=g)
    kw = dict(blur=0.3, scaling=0.5)
    ms = SamplesLoss("sinkhorn", backend="multiscale", cluster_scale=0.4, truncate=2.0, tol=1e-2, **kw)
    xg = x.clone().requires_grad_(True)
    (gx,) = torch.autograd.grad(ms(a, xg, b, y), xg, create_graph=True)
    (h,) = torch.autograd.grad((gx * v).sum(), xg, create_graph=True)
    assert ms.last_multiscale.kept < 1.0
    tx, _ = multiscale_hvp(ms.last_multiscale, v, None, True, "float32")
    assert rel(h, tx) < 1e-5
    with pytest.raises(NotImplementedError, match="third derivatives"):  # an error, never a silent zero
        torch.autograd.grad(h.sum(), xg)
    # linear in the direction: the derivative of <w, H v> in v is H w (H symmetric)
    w = torch.randn(x.shape, generator=g)
    vg = v.clone().requires_grad_(True)
    (gx,) = torch.autograd.grad(ms(a, xg, b, y), xg, create_graph=True)
    (hv,) = torch.autograd.grad((gx * vg).sum(), xg, create_graph=True)
    (dv,) = torch.autograd.grad((hv * w).sum(), vg)
    assert rel(dv, multiscale_hvp(ms.last_multiscale, w, None, True, "float32")[0]) < 1e-5

    dense = SamplesLoss("sinkhorn", backend="online", **kw)
    _, h_dense = torch.autograd.functional.hvp(lambda z: dense(a, z, b, y), x, v)
    one = SamplesLoss("sinkhorn", backend="multiscale", cluster_scale=5e-3, truncate=None, tol=None, **kw)
    _, h_one = torch.autograd.functional.hvp(lambda z: one(a, z, b, y), x, v)
    assert one.last_multiscale.clusters == (40, 32)
    assert rel(h_one, h_dense) < 1e-4
