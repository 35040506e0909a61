"""torch_api.launch: the launch signature separates what Triton specializes on,
the constexpr tail follows the kernel signature, and (GPU) kept kernels give
bitwise the results of Triton's own launch, misaligned views included."""

import pytest
import torch

from ot_triton_jax.core.kernels import center_kernel, lse_combine_kernel, split_centered_kernel
from torch_api import launch as fast_launch


def test_arg_key_separates_triton_specializations():
    k = fast_launch._arg_key
    base = torch.zeros(8)
    assert k(base) != k(base[1:])                       # 16-byte alignment of the pointer
    assert k(base) != k(base.to(torch.float16))         # dtype
    assert k(base) == k(torch.ones(8))                  # same dtype and alignment class
    assert k(1) != k(17) and k(16) != k(17) and k(16) == k(32)
    assert k(2 ** 31 - 16) != k(2 ** 31)               # int32 vs int64 range
    assert k(2 ** 40)[3] is False and k(2 ** 40)[4] is True
    assert k(0.5) == k(2.0)
    with pytest.raises(TypeError, match="unsupported kernel argument"):
        k("a")


def test_constexpr_tail_follows_signature_and_defaults():
    tail = fast_launch._constexpr_tail(center_kernel, 5, {"SAMPLE": 256, "D": 3, "BLOCK_D": 16})
    assert tail == (3, 256, 16)
    tail = fast_launch._constexpr_tail(
        lse_combine_kernel, 8, {"BLOCK_M": 32, "SPLIT": 2, "COMPUTE_ERR": True, "HAS_LOGW_OUT": False})
    assert tail == (False, True, 2, 32, False, 0, 0)  # signature order, then the defaults N16, RELAX_AT, LABELS
    with pytest.raises(TypeError, match="not given"):
        fast_launch._constexpr_tail(center_kernel, 5, {"D": 3, "SAMPLE": 256})
    with pytest.raises(TypeError, match="no constexpr"):
        fast_launch._constexpr_tail(center_kernel, 5, {"D": 3, "SAMPLE": 256, "BLOCK_D": 16, "OTHER": 1})
    with pytest.raises(TypeError, match="positionally"):
        fast_launch._constexpr_tail(center_kernel, 4, {"D": 3, "SAMPLE": 256, "BLOCK_D": 16})


def _split_args(x, center):
    n = x.shape[0]
    outs = (torch.full_like(x, float("nan")), torch.full_like(x, float("nan")), torch.full_like(x, float("nan")),
            torch.full((n,), float("nan"), device=x.device))
    return (x, center, n) + outs, outs


def test_launch_runs_the_kernel():
    """Under the interpreter launch() is Triton's launch; on the GPU the kept path."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x, center = torch.randn(50, 3, device=dev), torch.randn(3, device=dev)
    for _ in range(2):
        args, (xc, hi, lo, sq) = _split_args(x, center)
        fast_launch.launch(split_centered_kernel, (4,), args, {"D": 3, "BLOCK_R": 16, "BLOCK_D": 16},
                           num_warps=4, num_stages=1)
    torch.testing.assert_close(xc, x - center, rtol=0, atol=0)
    torch.testing.assert_close(hi + lo, xc, rtol=2 ** -20, atol=0)
    torch.testing.assert_close(sq, (xc * xc).sum(1), rtol=1e-6, atol=0)
    assert bool((hi.view(torch.int32) & 8191).eq(0).all()) and bool((lo.view(torch.int32) & 8191).eq(0).all())


@pytest.mark.gpu
def test_kept_kernels_match_triton_launch_bitwise():
    torch.manual_seed(0)
    storage, center = torch.randn(4097, device="cuda"), torch.randn(4, device="cuda")
    flags = {"D": 4, "BLOCK_R": 64, "BLOCK_D": 16}
    for x in (storage[:4096].view(1024, 4), storage[1:].view(1024, 4)):   # aligned, then a misaligned view
        args, ref = _split_args(x, center)
        split_centered_kernel[(16,)](*args, **flags, num_warps=4)
        kept_before = len(fast_launch._kept)
        for _ in range(3):                               # first call compiles, then the kept path
            args, outs = _split_args(x, center)
            fast_launch.launch(split_centered_kernel, (16,), args, flags, num_warps=4, num_stages=3)
            assert all(torch.equal(u, v) for u, v in zip(outs, ref))
        assert len(fast_launch._kept) == kept_before + 1


@pytest.mark.gpu
def test_solver_on_fast_launch_matches_triton_launch():
    """A whole solve through kept kernels equals the same solve with every launch through Triton."""
    import torch_api
    from torch_api import kernel_ops as kernel_calls

    torch.manual_seed(1)
    x, y = torch.randn(3000, 3, device="cuda"), torch.randn(2500, 3, device="cuda")
    out = torch_api.sinkhorn(x, y, epsilon=0.1, min_iterations=20, max_iterations=20)

    def triton_launch(kernel, grid, args, constexprs, *, num_warps, num_stages):
        kernel[grid](*args, num_warps=num_warps, num_stages=num_stages, **constexprs)

    orig = kernel_calls.launch
    kernel_calls.launch = triton_launch
    try:
        ref = torch_api.sinkhorn(x, y, epsilon=0.1, min_iterations=20, max_iterations=20)
    finally:
        kernel_calls.launch = orig
    assert torch.equal(out.f, ref.f) and torch.equal(out.g, ref.g)
