"""Multiscale building blocks (CPU): voxel clusters, GeomLoss's jump rule, the row-block masks
and column ranges handed to the block-sparse kernels (the ranges kernel under the interpreter);
each against a brute-force loop or the torch route."""

import math

import numpy as np
import pytest
import torch

from ot_triton_jax.core import multiscale_rules as rules
from torch_api.multiscale import clusters as mc


def _clouds(seed, n, m, d):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.rand(n, d, generator=g) * 3.0, torch.rand(m, d, generator=g) * 2.0 + 0.5
    a, b = torch.rand(n, generator=g), torch.rand(m, generator=g)
    a[: n // 5] = 0.0  # a few zero weights: centroids must stay finite
    return x, a / a.sum(), y, b / b.sum()


@pytest.mark.parametrize("d", [1, 2, 3])
def test_clusters_match_a_brute_force_grid(d):
    x, a, y, b = _clouds(d, 90, 70, d)
    scale = 0.45
    cx, cy = mc.cluster_pair(x, a, y, b, scale)
    lower = torch.cat([x, y]).min(0).values.double()
    for pts, w, c in ((x, a, cx), (y, b, cy)):
        cells = [tuple(int(math.floor(v)) for v in ((p.double() - lower) / scale)) for p in pts]
        groups = {}
        for i, cell in enumerate(cells):
            groups.setdefault(cell, []).append(i)
        assert c.k == len(groups)
        assert c.start[0] == 0 and c.start[-1] == len(pts)
        for k in range(c.k):
            members = c.perm[int(c.start[k]):int(c.start[k + 1])].tolist()
            assert {cells[i] for i in members} == {cells[members[0]]}  # one voxel per cluster
            assert sorted(members) == sorted(groups[cells[members[0]]])  # and all of it
            assert torch.all(c.label[int(c.start[k]):int(c.start[k + 1])] == k)
            wk, pk = w[members].double(), pts[members].double()
            assert float(c.weight[k]) == pytest.approx(float(wk.sum()), rel=1e-6, abs=1e-12)
            cen = (wk[:, None] * pk).sum(0) / wk.sum() if wk.sum() > 0 else pk.mean(0)
            torch.testing.assert_close(c.centroid[k].double(), cen, rtol=1e-6, atol=1e-6)
            rad = (pk - c.centroid[k].double()).norm(dim=1).max()
            assert float(c.radius[k]) == pytest.approx(float(rad), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("block_m", [4, 16, 64])
def test_row_block_mask_is_the_union_over_each_blocks_clusters(block_m):
    x, a, y, b = _clouds(7, 97, 40, 2)
    cx, cy = mc.cluster_pair(x, a, y, b, 0.5)
    keep = torch.rand(cx.k, cy.k, generator=torch.Generator().manual_seed(3)) < 0.3
    mask = mc.row_block_mask(keep, cx.label, block_m)
    nb = -(-x.shape[0] // block_m)
    assert mask.shape == (nb, cy.k) and mask.dtype == torch.int8
    for blk in range(nb):
        labels = set(cx.label[blk * block_m:(blk + 1) * block_m].tolist())
        expect = np.zeros(cy.k, bool)
        for k in labels:
            expect |= keep[k].numpy()
        assert np.array_equal(mask[blk].numpy().astype(bool), expect)


@pytest.mark.parametrize("block_m,density", [(4, 0.3), (16, 0.05), (64, 0.6), (16, 1.0), (4, 0.0)])
def test_kept_ranges_kernel_gives_the_runs_of_the_row_block_mask(block_m, density):
    """kernels/block_ranges.py (interpreter) against the torch route through the (row blocks,
    K_y) mask: the same runs in the same order, the same padding."""
    x, a, y, b = _clouds(11, 97, 60, 2)
    cx, cy = mc.cluster_pair(x, a, y, b, 0.3)
    keep = torch.rand(cx.k, cy.k, generator=torch.Generator().manual_seed(5)) < density
    if density == 0.0:
        keep[:, 0] = True  # a run of one cluster at the left edge
    got = mc.kept_ranges(keep, cx.label, block_m, cy.start)
    expect = mc.column_ranges(mc.row_block_mask(keep, cx.label, block_m), cy.start)
    assert got.dtype == torch.int32 and torch.equal(got, expect)
    assert int(got[..., 1].max()) <= y.shape[0]


def test_rules_defaults_jump_and_errors():
    assert rules.cluster_scale_value(None, 2.0, 3) == pytest.approx(2.0 / (math.sqrt(3) * 2000 ** (1 / 3)))
    assert rules.cluster_scale_value(0.1, 2.0, 3) == 0.1
    # with a tolerance (blur given): CELL_BLURS blurs, between the cap's scale and GeomLoss's
    geomloss = 2.0 / (math.sqrt(3) * 2000 ** (1 / 3))
    cap = 2.0 / (math.sqrt(3) * rules.MAX_DEFAULT_CLUSTERS ** (1 / 3))
    assert rules.cluster_scale_value(None, 2.0, 3, blur=0.1) == pytest.approx(rules.CELL_BLURS * 0.1)
    assert rules.cluster_scale_value(None, 2.0, 3, blur=1.0) == pytest.approx(geomloss)
    assert rules.cluster_scale_value(None, 2.0, 3, blur=1e-3) == pytest.approx(cap)
    assert rules.cluster_scale_value(0.3, 2.0, 3, blur=1e-3) == 0.3
    eps_list = [4.0, 4.0, 1.0, 0.25, 0.0625, 0.01]
    assert rules.jump_index(eps_list, 0.6) == 2  # 0.36 > 0.25 (eps_list[3]): solve clusters up to index 2
    assert rules.jump_index(eps_list, 0.05) == len(eps_list) - 1  # grid finer than the blur
    with pytest.raises(ValueError, match="d <= 3"):
        rules.check_dim(4)
    with pytest.raises(ValueError, match="cluster_scale"):
        rules.cluster_scale_value(-1.0, 2.0, 2)
    with pytest.raises(ValueError, match="truncate"):
        rules.truncate_value(0.0)
    assert rules.truncate_value(None) is None
    with pytest.raises(ValueError, match="tol"):
        rules.tol_value(-1e-3)
    assert rules.tol_value(None) is None and rules.tol_value(1e-3) == 1e-3
    with pytest.raises(ValueError, match="larger cluster_scale"):
        rules.grid_shape([10.0, 10.0, 10.0], 1e-3)
    assert rules.grid_shape([1.0, 0.0], 0.3) == (4, 1)


def test_finer_cluster_scale_halves_while_the_occupied_cells_fit():
    from ot_triton_jax.core import multiscale_rules as rules
    cap = rules.MAX_DEFAULT_CLUSTERS
    surface = lambda s: 4.0 / s ** 2  # noqa: E731  (occupied cells of a surface of area 4)
    s = rules.finer_cluster_scale(0.5, 0.001, surface)
    assert surface(s) <= cap < surface(s / 2) and s in (0.5 / 2 ** k for k in range(12))
    assert rules.finer_cluster_scale(0.5, 0.2, surface) == 0.25  # the floor, CELL_BLURS * blur = 0.16 > 0.25 / 2
    assert rules.finer_cluster_scale(0.5, 0.001, lambda s: 10 * cap) == 0.5  # full already: unchanged
    assert rules.finer_cluster_scale(0.5, 0.001, lambda s: float("inf")) == 0.5  # grid too fine to build


def test_occupied_cells_of_a_sphere_and_of_a_filled_cube():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(3000, 3, generator=g)
    sphere = v / v.norm(dim=1, keepdim=True)
    cube = torch.rand(3000, 3, generator=g) * 2 - 1
    from torch_api.multiscale.clusters import occupied_cells
    # a side of 0.25 cuts the box [-1, 1]^3 into 8^3 = 512 cells (and a thin last layer): the cube fills
    # nearly all, the sphere's surface ~ 4 pi / 0.25^2 ~ 200 of them
    assert 450 < occupied_cells(cube, cube[:10], 0.25) <= 729
    assert occupied_cells(sphere, sphere[:10], 0.25) < 400
    assert occupied_cells(sphere[:10], sphere, 0.25) == occupied_cells(sphere, sphere[:10], 0.25)  # the larger cloud's
