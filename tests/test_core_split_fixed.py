"""kernels/split.py split_fixed_kernel (Triton interpreter): the fixed-point heads of the
unbiased "fixed4" cross term, against the properties that make their products exact."""

import numpy as np
import pytest
import torch

from ot_triton_jax.core import cloud_plans
from torch_api.kernel_ops import fixed_split


def f32_bits(v: torch.Tensor) -> torch.Tensor:
    return v.contiguous().view(torch.int32)


@pytest.mark.parametrize("n,d", [(37, 3), (20, 64), (9, 70), (3, 300)])
def test_heads_on_the_row_grid_tails_tf32_and_head_products_exact(n, d):
    g = torch.Generator().manual_seed(n * d)
    # rows of very different magnitudes, a zero row, a row with one large entry
    x = torch.randn(n, d, generator=g) * torch.logspace(-6, 6, n)[:, None]
    x[1] = 0.0
    x[2, 0] = 1e3 * x[2].abs().max()
    hi, lo = fixed_split(x)
    p = cloud_plans.fixed_point_bits(d)
    amax = x.abs().amax(1, keepdim=True).double()
    e = torch.floor(torch.log2(torch.where(amax > 0, amax, 1.0)))
    q = torch.exp2(e + 1 - p)
    k = hi.double() / q
    assert torch.equal(k, torch.round(k)) and k.abs().max() <= 2 ** p  # integers, at most P + 1 bits
    assert (f32_bits(lo) & 8191).eq(0).all() and (f32_bits(hi) & 8191).eq(0).all()  # TF32 values
    r = x.double() - hi.double()
    assert (r.abs() <= q / 2).all()  # round to nearest on the grid
    assert ((r - lo.double()).abs() <= r.abs() * 2.0 ** -11).all()
    # float32 partial sums of head products, in any order, are exact (integers < 2^24 units)
    for i, j in ((0, n - 1), (2, min(3, n - 1)), (n - 1, n - 1)):
        prods = (hi[i] * hi[j]).numpy()  # exact products: 2 * 11 bits
        run = np.float32(0.0)
        for v in prods[np.random.default_rng(i + j).permutation(d)]:
            run = np.float32(run + v)
        assert float(run) == float((hi[i].double() * hi[j].double()).sum())


def test_bits_keep_head_sums_below_2_24_units():
    for d in (1, 3, 16, 17, 64, 65, 128, 4096):
        p = cloud_plans.fixed_point_bits(d)
        assert p <= 10 and d * 2 ** (2 * p) <= 2 ** 24
