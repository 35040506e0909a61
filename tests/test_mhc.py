"""mHC batched Sinkhorn-Knopp (torch_api.mhc_sinkhorn / FusedMHC, ot_triton_jax.mhc_sinkhorn).

CPU: every kernel runs under the Triton interpreter with the interpreter
launch plan (segmented replay: SEG = 8, so T = 20 is a partial segment of 4
plus two of 8). References are float64 loops of the documented semantics;
gradients are autograd through the float64 loop. Errors are relative
Frobenius norms over the batch, NaN never passes.
"""

from __future__ import annotations

import math

import pytest
import torch

from mhc_reference import ref_grad, ref_mhc, rel_err

from ot_triton_jax.core import mhc_plans as launch_plans_mhc
from torch_api import FusedMHC, mhc_sinkhorn

NS = [2, 3, 4, 5, 8, 16]


# ----------------------------------------------------------------------------- references


def make_logits(kind: str, shape, gen) -> torch.Tensor:
    n = shape[-1]
    if kind == "n01":
        return torch.randn(shape, generator=gen)
    if kind == "n09":
        return 3.0 * torch.randn(shape, generator=gen)
    if kind == "identity":
        return 5.0 * torch.eye(n) + 0.1 * torch.randn(shape, generator=gen)
    raise ValueError(kind)


@pytest.fixture
def gen():
    g = torch.Generator()
    g.manual_seed(torch.seed() % (2**31))
    return g


def fused_grad(logits, weight, iters, **kw):
    m = logits.detach().clone().requires_grad_(True)
    out = mhc_sinkhorn(m, iters, **kw)
    (g,) = torch.autograd.grad(out, m, weight.to(out.dtype))
    return out, g


# ----------------------------------------------------------------------------- forward


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("start,eps", [("cols", 0.0), ("rows", 1e-6), ("cols", 0.1)])
def test_forward_matches_float64_loop(n, start, eps, gen):
    logits = make_logits("n09", (2, 5, n, n), gen)
    out = mhc_sinkhorn(logits, 20, start=start, eps=eps)
    assert out.shape == logits.shape and out.dtype == torch.float32
    ref = ref_mhc(logits, 20, eps, start)
    assert rel_err(out, ref) <= 1e-6
    # the last normalization is exact: its sums are 1/(1 + eps/sum), i.e. 1 up to eps
    last = -1 if start == "cols" else -2
    assert (out.double().sum(last) - 1).abs().max() <= 2e-6 + 2 * eps


def test_forward_converges_to_doubly_stochastic(gen):
    logits = make_logits("n01", (16, 4, 4), gen)
    out = mhc_sinkhorn(logits, 100)
    assert (out.sum(-1) - 1).abs().max() <= 1e-5
    assert (out.sum(-2) - 1).abs().max() <= 1e-5


def test_forward_large_logits_do_not_overflow(gen):
    # exp(100) overflows float32; the stable first step must not care (eps > 0 too)
    logits = 100.0 + make_logits("n01", (8, 4, 4), gen)
    for eps in (0.0, 1e-6):
        out = mhc_sinkhorn(logits, 20, eps=eps)
        assert rel_err(out, ref_mhc(logits, 20, eps)) <= 1e-6


def test_forward_non_contiguous_and_batch_shapes(gen):
    logits = make_logits("n01", (3, 4, 5, 5), gen)
    view = logits.transpose(0, 1)  # non-contiguous leading dims
    out = mhc_sinkhorn(view, 20)
    assert out.shape == view.shape
    assert rel_err(out, ref_mhc(view, 20)) <= 1e-6
    single = mhc_sinkhorn(logits[0, 0], 20)  # no batch dims
    assert single.shape == (5, 5)
    assert rel_err(single, ref_mhc(logits[0, 0], 20)) <= 1e-6


# ----------------------------------------------------------------------------- unrolled backward


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("kind", ["n01", "n09", "identity"])
def test_unrolled_grad_matches_autograd(n, kind, gen):
    logits = make_logits(kind, (24, n, n), gen)
    weight = torch.randn(logits.shape, generator=gen)
    out, g = fused_grad(logits, weight, 20)
    assert rel_err(out, ref_mhc(logits, 20)) <= 1e-6
    assert rel_err(g, ref_grad(logits, weight, 20)) <= 1e-5


@pytest.mark.parametrize("n", [3, 4, 8])
@pytest.mark.parametrize("start,eps", [("rows", 0.0), ("cols", 1e-6), ("rows", 0.05)])
def test_unrolled_grad_start_and_eps(n, start, eps, gen):
    logits = make_logits("n09", (16, n, n), gen)
    weight = torch.randn(logits.shape, generator=gen)
    _, g = fused_grad(logits, weight, 20, start=start, eps=eps)
    assert rel_err(g, ref_grad(logits, weight, 20, eps, start)) <= 1e-5


@pytest.mark.parametrize("iters", [1, 2, 8, 9, 17, 33])
def test_unrolled_grad_segment_boundaries(iters, gen):
    # interpreter plan: SEG = 8; these cover a single short segment, exactly one,
    # one + a partial one, and several + a partial one
    logits = make_logits("n09", (8, 4, 4), gen)
    weight = torch.randn(logits.shape, generator=gen)
    _, g = fused_grad(logits, weight, iters)
    assert rel_err(g, ref_grad(logits, weight, iters)) <= 1e-5
    # and the same through the tile layout (n = 16)
    logits = make_logits("n09", (4, 16, 16), gen)
    weight = torch.randn(logits.shape, generator=gen)
    _, g = fused_grad(logits, weight, iters, eps=1e-3)
    assert rel_err(g, ref_grad(logits, weight, iters, 1e-3)) <= 1e-5


def test_unrolled_grad_keeps_only_the_input(gen):
    logits = make_logits("n01", (4, 4, 4), gen).requires_grad_(True)
    out = mhc_sinkhorn(logits, 20)
    saved = [t for t in out.grad_fn.saved_tensors] if hasattr(out.grad_fn, "saved_tensors") else []
    assert len(saved) == 1 and saved[0].data_ptr() == logits.data_ptr()


# ----------------------------------------------------------------------------- implicit backward


@pytest.fixture
def single_segment(monkeypatch):
    """Interpreter plan with SEG = 64: one replay instead of many (interpreter time only)."""
    monkeypatch.setattr(launch_plans_mhc, "_INTERP_SEG", 64)
    launch_plans_mhc.mhc_plan.cache_clear()
    yield
    launch_plans_mhc.mhc_plan.cache_clear()


@pytest.mark.parametrize("n", [2, 3, 4, 8, 16])
def test_implicit_matches_unrolled_when_converged(n, gen, single_segment):
    # N(0, 1) logits: converged far below float32 resolution after 60 iterations
    # (n = 2 is slower: a few 2x2 matrices in 10^4 are still 1e-5 away at 60, 1e-7 at 300)
    iters = 300 if n == 2 else 60
    logits = make_logits("n01", (16, n, n), gen)
    weight = torch.randn(logits.shape, generator=gen)
    ref = ref_grad(logits, weight, iters)
    _, g_imp = fused_grad(logits, weight, iters, backward="implicit")
    _, g_unr = fused_grad(logits, weight, iters, backward="unrolled")
    assert rel_err(g_unr, ref) <= 1e-5
    assert rel_err(g_imp, ref) <= 1e-5
    assert rel_err(g_imp, g_unr.double()) <= 1e-5


@pytest.mark.parametrize("eps", [1e-6, 0.05])
def test_implicit_exact_at_convergence_with_eps(eps, gen):
    # with eps > 0 the fixed point has marginals 1 - eps; the corrected system covers it
    logits = make_logits("n01", (16, 4, 4), gen)
    weight = torch.randn(logits.shape, generator=gen)
    _, g = fused_grad(logits, weight, 60, backward="implicit", eps=eps)
    assert rel_err(g, ref_grad(logits, weight, 60, eps)) <= 1e-5


def test_implicit_gap_at_20_iterations_on_identity_like_logits(gen):
    """Documents when "implicit" is not the gradient of the 20-step map.

    On nearly-diagonal logits (5 I + N(0, 0.01)) 20 iterations are far from the
    fixed point for the backward: the implicit gradient differs from the exact
    (unrolled) one by ~10% at n = 8 (~30-45% at n = 2..4, measured in float64),
    and is close to the gradient of the converged map instead. Converging takes
    ~200 iterations at n = 8 (~400 at n = 4).
    """
    n = 8
    logits = make_logits("identity", (16, n, n), gen)
    weight = torch.randn(logits.shape, generator=gen)
    exact20 = ref_grad(logits, weight, 20)
    _, g_imp = fused_grad(logits, weight, 20, backward="implicit")
    _, g_unr = fused_grad(logits, weight, 20, backward="unrolled")
    assert rel_err(g_unr, exact20) <= 1e-5
    gap = rel_err(g_imp, exact20)
    assert 0.03 <= gap <= 0.5, gap
    converged = ref_grad(logits, weight, 300)
    assert rel_err(g_imp, converged) <= 0.5 * gap  # nearer the converged map's gradient
    _, g_imp_conv = fused_grad(logits, weight, 300, backward="implicit")
    assert rel_err(g_imp_conv, converged) <= 1e-5


# ----------------------------------------------------------------------------- dtypes, module


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("backward", ["unrolled", "implicit"])
def test_low_precision_inputs(dtype, tol, backward, gen):
    logits = make_logits("n01", (16, 4, 4), gen).to(dtype)
    weight = torch.randn(logits.shape, generator=gen)
    out, g = fused_grad(logits, weight, 20, backward=backward)
    assert out.dtype == dtype and g.dtype == dtype
    # float32 arithmetic on the rounded inputs: only the output rounding remains
    assert rel_err(out, ref_mhc(logits, 20)) <= tol
    if backward == "unrolled":
        ref = ref_grad(logits, weight.to(dtype), 20)
        assert rel_err(g, ref) <= tol


def test_fused_module_autocast(gen):
    layer = FusedMHC(iters=20)
    assert "iters=20" in repr(layer)
    logits = make_logits("n01", (2, 3, 4, 4), gen).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(logits)
    assert out.dtype == torch.float32
    assert rel_err(out, ref_mhc(logits.detach(), 20)) <= 1e-6
    out.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    bf = logits.detach().bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(bf).dtype == torch.bfloat16


def test_empty_batch():
    logits = torch.zeros(0, 4, 4, requires_grad=True)
    out = mhc_sinkhorn(logits, 20)
    assert out.shape == (0, 4, 4)
    out.sum().backward()
    assert logits.grad.shape == (0, 4, 4)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "logits,kwargs,exc,match",
    [
        (torch.zeros(3, 4, 5), {}, ValueError, r"logits must have shape \(\.\.\., n, n\)"),
        (torch.zeros(4), {}, ValueError, r"logits must have shape"),
        (torch.zeros(2, 1, 1), {}, ValueError, r"n in \[2, 64\]"),
        (torch.zeros(2, 65, 65), {}, ValueError, r"n in \[2, 64\]"),
        (torch.zeros(2, 4, 4, dtype=torch.int32), {}, TypeError, r"float32, bfloat16, float16 or float64"),
        (torch.zeros(2, 4, 4, dtype=torch.complex64), {}, TypeError, r"float32, bfloat16, float16 or float64"),
        ([[0.0, 1.0], [1.0, 0.0]], {}, TypeError, r"logits must be a torch.Tensor"),
        (torch.zeros(2, 4, 4), {"iters": 0}, ValueError, r"iters must be an int >= 1"),
        (torch.zeros(2, 4, 4), {"iters": 2.5}, ValueError, r"iters must be an int >= 1"),
        (torch.zeros(2, 4, 4), {"backward": "exact"}, ValueError, r"backward must be one of"),
        (torch.zeros(2, 4, 4), {"start": "row"}, ValueError, r"start must be one of"),
        (torch.zeros(2, 4, 4), {"eps": -1e-6}, ValueError, r"eps must be a finite float >= 0"),
        (torch.zeros(2, 4, 4), {"eps": math.nan}, ValueError, r"eps must be a finite float >= 0"),
    ],
)
def test_bad_input_errors(logits, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        mhc_sinkhorn(logits, **kwargs)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_logits(bad, gen):
    logits = make_logits("n01", (3, 4, 4), gen)
    logits[1, 2, 0] = bad
    # checked only on request
    with pytest.raises(ValueError, match="logits contain NaN or inf"):
        mhc_sinkhorn(logits, 20, check_finite=True)
    with pytest.raises(ValueError, match="logits contain NaN or inf"):
        FusedMHC(20, check_finite=True)(logits)
    # default: unchecked
    m = logits.clone().requires_grad_(True)
    out = mhc_sinkhorn(m, 20)
    weight = torch.randn(logits.shape, generator=gen)
    out.backward(weight)
    keep = [0, 2]
    assert rel_err(out[keep], ref_mhc(logits[keep], 20)) <= 1e-6
    assert rel_err(m.grad[keep], ref_grad(logits[keep], weight[keep], 20)) <= 1e-5
    if bad == -math.inf:
        # documented: a -inf logit is an exact zero entry (exp(-inf) = 0)
        assert out[1, 2, 0] == 0
        assert rel_err(out[1], ref_mhc(logits[1], 20)) <= 1e-6
        assert torch.isfinite(m.grad[1]).all()
    else:
        # documented: NaN / +inf make their own matrix NaN (output and gradient), nothing else
        assert torch.isnan(out[1]).all() and torch.isnan(m.grad[1]).all()


def test_module_rejects_bad_options():
    with pytest.raises(ValueError, match="backward must be one of"):
        FusedMHC(backward="implicitly")
    with pytest.raises(ValueError, match="iters must be an int >= 1"):
        FusedMHC(iters=0)


# ----------------------------------------------------------------------------- JAX frontend


@pytest.fixture(scope="module")
def jmhc():
    from ot_triton_jax import mhc_sinkhorn as f

    return f


@pytest.mark.parametrize("n,backward,start,eps", [(4, "unrolled", "cols", 0.0), (5, "implicit", "rows", 1e-6),
                                                  (16, "unrolled", "rows", 0.0)])
def test_jax_agrees_with_torch(jmhc, n, backward, start, eps, gen):
    import jax
    import jax.numpy as jnp

    logits = make_logits("n09", (2, 3, n, n), gen)
    weight = torch.randn(logits.shape, generator=gen)
    out_t, g_t = fused_grad(logits, weight, 20, backward=backward, start=start, eps=eps)
    kw = dict(backward=backward, start=start, eps=eps)
    m, w = jnp.asarray(logits.numpy()), jnp.asarray(weight.numpy())
    out_j = jmhc(m, 20, **kw)
    g_j = jax.jit(jax.grad(lambda x: jnp.sum(jmhc(x, 20, **kw) * w)))(m)
    assert out_j.shape == logits.shape and out_j.dtype == jnp.float32
    # same kernels, same plans: identical numbers
    assert torch.equal(torch.from_numpy(jax.device_get(out_j).copy()), out_t)
    assert torch.equal(torch.from_numpy(jax.device_get(g_j).copy()), g_t)
    assert rel_err(torch.from_numpy(jax.device_get(g_j).copy()), ref_grad(logits, weight, 20, eps, start)) <= (
        1e-5 if backward == "unrolled" else 1.0)


def test_jax_vmap_folds_into_the_batch(jmhc, gen):
    import jax
    import jax.numpy as jnp

    logits = make_logits("n01", (3, 5, 4, 4), gen)
    weight = torch.randn(logits.shape, generator=gen)
    m, w = jnp.asarray(logits.numpy()), jnp.asarray(weight.numpy())

    def loss(x, wt):
        return jnp.sum(jmhc(x, 20) * wt)

    direct = jax.grad(loss)(m, w)
    assert jnp.array_equal(jax.vmap(lambda x: jmhc(x, 20))(m), jmhc(m, 20))
    assert jnp.array_equal(jax.jit(jax.vmap(jax.grad(loss)))(m, w), direct)
    assert jnp.array_equal(jax.grad(lambda x: jnp.sum(jax.vmap(lambda y: jmhc(y, 20))(x) * w))(m), direct)
    # only the cotangent batched (logits broadcast by the rule)
    per_w = jax.vmap(lambda wt: jax.grad(loss)(m[0], wt))(w[:, 0])
    assert jnp.array_equal(per_w[1], jax.grad(loss)(m[0], w[1, 0]))
    ref = ref_grad(logits, weight, 20)
    assert rel_err(torch.from_numpy(jax.device_get(direct).copy()), ref) <= 1e-5


def test_jax_bf16_and_errors(jmhc, gen):
    import jax
    import jax.numpy as jnp

    logits = make_logits("n01", (4, 4, 4), gen)
    m = jnp.asarray(logits.numpy(), jnp.bfloat16)
    out = jmhc(m, 20)
    g = jax.grad(lambda x: jnp.sum(jmhc(x, 20).astype(jnp.float32)))(m)
    assert out.dtype == jnp.bfloat16 and g.dtype == jnp.bfloat16
    ref = ref_mhc(torch.from_numpy(jax.device_get(m.astype(jnp.float32)).copy()), 20)
    assert rel_err(torch.from_numpy(jax.device_get(out.astype(jnp.float32)).copy()), ref) <= 1e-2
    with pytest.raises(ValueError, match=r"square last two dims"):
        jmhc(jnp.zeros((2, 3, 4)))
    with pytest.raises(ValueError, match=r"n in \[2, 64\]"):
        jmhc(jnp.zeros((2, 80, 80)))
    with pytest.raises(ValueError, match="backward must be one of"):
        jmhc(jnp.zeros((2, 4, 4)), backward="nope")
    with pytest.raises(TypeError, match=r"float32, bfloat16, float16 or float64"):
        jmhc(jnp.zeros((2, 4, 4), jnp.int32))
    bad = jnp.asarray(logits.numpy()).at[1, 0, 0].set(jnp.nan)
    with pytest.raises(ValueError, match="logits contain NaN or inf"):
        jmhc(bad, check_finite=True)
    eager = jmhc(bad, 20)  # default: unchecked, NaN confined to matrix 1
    assert bool(jnp.isnan(eager[1]).all()) and bool(jnp.isfinite(eager[jnp.array([0, 2, 3])]).all())
    traced = jax.jit(lambda x: jmhc(x, 20, check_finite=True))(bad)  # traced: not checked
    assert bool(jnp.isnan(traced[1]).any()) and bool(jnp.isfinite(traced[jnp.array([0, 2, 3])]).all())
