"""The multiscale solve on a GPU (compiled block-sparse kernels, the GPU's BLOCK_M): the same
checks as the CPU tests at larger sizes, against the float64 re-implementation run on the CPU
with the same clusters and masks (tests/test_multiscale_solve.py)."""

import pytest
import torch

import torch_api
from ot_triton_jax.core import launch_plans
from test_multiscale_solve import _grad_x_reference, _reference
from torch_api import kernel_ops
from torch_api.multiscale_solve import anneal, direction

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
    bm = launch_plans.blocksparse_block_m(3, precision, True)
    keep = torch.ones(-(-3000 // bm), 4, dtype=torch.int8, device="cuda")
    col_start = torch.tensor([0, 700, 700, 1900, 2500], dtype=torch.int32, device="cuda")  # one empty cluster
    dense = kernel_ops.lse_update(X, Y, g, prm, precision, logw_in=lb)[0]
    sparse = kernel_ops.lse_blocksparse(X, Y, g, prm, keep, col_start, precision, logw_in=lb)[0]
    assert torch.isfinite(sparse).all()
    assert float((sparse - dense).norm() / dense.norm()) < 1e-6


@pytest.mark.parametrize("d,truncate,scale", [(3, 5.0, 0.5), (2, None, 0.3), (1, 5.0, 0.2)])
def test_anneal_and_gradient_match_the_float64_algorithm(d, truncate, scale):
    x, y, a, b = _problem(1500, 1300, d, seed=d)
    both = torch.cat([x, y])
    blur, scaling, diam = 0.05, 0.5, float((both.max(0).values - both.min(0).values).norm())
    out = anneal(x.cuda(), y.cuda(), a.cuda(), b.cuda(), blur, scaling, diam, cluster_scale=scale, truncate=truncate)
    bm = launch_plans.blocksparse_block_m(d, "float32", True)
    ref, jump, masks, last = _reference(x, y, a, b, blur, scaling, diam, scale, truncate, bm)
    assert out.jump == jump
    for mine, theirs in zip(out.new, ref):
        assert torch.isfinite(mine).all()
        # float32 conditioning: max C / eps ~ 1e4 here, 2^-24 * 1e4 = 6e-4; the H100 measured 3.0e-5
        # (d = 3, 3xTF32 cross term) where the CPU interpreter's exact products gave < 2e-5
        assert float((mine.cpu().double() - theirs).norm() / theirs.norm()) < 1e-4
    gx = (a.cuda()[:, None] * direction(out, 0)).cpu().double()
    ref_gx = _grad_x_reference(last, a)
    assert float((gx - ref_gx).norm() / ref_gx.norm()) < 1e-4
    if truncate is not None:
        assert out.kept < 1.0 and out.dropped_mass_bound >= 0.0


@pytest.mark.xfail(strict=True, reason="issue 15 open: at n = 2^16 the multiscale value was 3.8e-3 from the dense "
                   "solve on the H100 (session 10; flash-sinkhorn's multiscale 8e-3 on the same kind of data); "
                   "the issue's target is 1e-4")
def test_samples_loss_multiscale_runs_and_drops_blocks_at_scale():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(1 << 16, 3, generator=g).cuda(), (torch.randn(1 << 16, 3, generator=g) + 0.5).cuda()
    x.requires_grad_(True)
    loss = torch_api.SamplesLoss("sinkhorn", blur=0.05, scaling=0.5, backend="multiscale")
    value = loss(x, y)
    (gx,) = torch.autograd.grad(value, x)
    dense = torch_api.SamplesLoss("sinkhorn", blur=0.05, scaling=0.5)(x.detach(), y)
    assert torch.isfinite(gx).all()
    assert abs(float(value.detach()) - float(dense)) < 1e-4 * abs(float(dense))
    assert loss.last_multiscale.kept < 0.5
