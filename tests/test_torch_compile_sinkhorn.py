"""torch.compile(fullgraph=True) of torch_api.sinkhorn / sinkhorn_divergence (custom ops of
torch_api.sinkhorn_ops): traced without graph breaks, equal to eager, gradients included, no
recompile for a new epsilon tensor; the errors layout equals the JAX frontend's.

CPU: backend "aot_eager" (Dynamo + AOTAutograd, the ops run eagerly: results equal eager
bit for bit); the inductor backend is exercised on the GPU (tests/test_torch_sinkhorn_gpu.py).
"""

import numpy as np
import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

import torch_api

KW = dict(threshold=1e-4, inner_iterations=5, max_iterations=200)


def problem(n, m, d, seed, shift=0.4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = torch.randn(m, d, generator=g) + shift
    a = torch.rand(n, generator=g) + 0.2
    b = torch.rand(m, generator=g) + 0.2
    return x, y, a / a.sum(), b / b.sum()


@pytest.fixture
def counter():
    """A fresh Dynamo state, recompiles turned into errors, and a count of compiled frames."""
    torch._dynamo.reset()
    cnt = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield cnt
    torch._dynamo.reset()


def grad_leaves(*ts):
    return [t.detach().clone().requires_grad_(True) for t in ts]


def test_cost_and_its_gradient_compile_without_breaks_or_recompiles(counter):
    x, y, a, b = problem(12, 10, 2, 1)

    def cost(x, y, a, eps):
        return torch_api.sinkhorn(x, y, a, b, epsilon=eps, **KW).reg_ot_cost

    compiled = torch.compile(cost, fullgraph=True, backend=counter)
    seen = []
    for e in (0.5, 0.7, 0.3):  # a new epsilon tensor each call: one compiled frame
        xc, ac, ec = grad_leaves(x, a, torch.tensor(e))
        xe, ae, ee = grad_leaves(x, a, torch.tensor(e))
        vc = compiled(xc, y, ac, ec)
        ve = cost(xe, y, ae, ee)
        gc = torch.autograd.grad(vc, (xc, ac, ec))
        ge = torch.autograd.grad(ve, (xe, ae, ee))
        assert torch.equal(vc, ve) and vc.dtype == torch.float32
        for u, v in zip(gc, ge):
            assert torch.equal(u, v) and torch.isfinite(u).all()
        seen.append(float(vc.detach()))
    assert counter.frame_count == 1
    assert len(set(seen)) == 3  # the new epsilon values were used


def test_gradient_traced_inside_the_compiled_function(counter):
    # torch.autograd.grad inside the graph (Dynamo's trace_autograd_ops): the registered
    # backward of the reg_ot_cost op and its envelope-gradient op are traced too
    x, y, _, _ = problem(11, 9, 2, 2)
    scale = torch.tensor(1.5)

    def value_and_grads(x, y, eps, scale):
        c = torch_api.sinkhorn(x, y, epsilon=eps, scale_cost=scale, **KW).reg_ot_cost
        return (c.detach(),) + torch.autograd.grad(c, (x, y, eps, scale))

    with torch._dynamo.config.patch(trace_autograd_ops=True):
        compiled = torch.compile(value_and_grads, fullgraph=True, backend=counter)
        for e in (0.6, 0.45):
            args_c = grad_leaves(x, y, torch.tensor(e), scale)
            args_e = grad_leaves(x, y, torch.tensor(e), scale)
            for u, v in zip(compiled(*args_c), value_and_grads(*args_e)):
                assert torch.equal(u, v) and torch.isfinite(u).all()
    assert counter.frame_count == 1


def test_numbers_for_epsilon_scale_and_threshold_compile_too():
    # numbers are constants of the graph; once Dynamo sees a second value it makes them graph
    # inputs (one recompile), which the checks and the ops accept without a graph break
    torch._dynamo.reset()
    x, y, _, _ = problem(8, 7, 2, 8)

    def cost(x, eps, scale, threshold):
        out = torch_api.sinkhorn(x, y, epsilon=eps, scale_cost=scale, threshold=threshold, max_iterations=30)
        return out.reg_ot_cost, out.n_iters

    compiled = torch.compile(cost, fullgraph=True, backend="aot_eager")
    for args in ((0.5, 1.0, 1e-3), (0.4, 2.0, 1e-2), (0.3, 3.0, 1e-1)):
        for u, v in zip(compiled(x, *args), cost(x, *args)):
            assert torch.equal(u, v)
    torch._dynamo.reset()


def test_outputs_compile_and_match_eager(counter):
    x, y, a, b = problem(10, 12, 3, 3)
    v = torch.randn(12, 2, generator=torch.Generator().manual_seed(4))

    def outputs(x, y, a, b, eps, v):
        out = torch_api.sinkhorn(x, y, a, b, epsilon=eps, **KW)
        return (out.f, out.g, out.reg_ot_cost, out.errors, out.converged, out.n_iters, out.apply(v, axis=1),
                out.marginal(0), out.marginal(1), out.transport_mass)

    compiled = torch.compile(outputs, fullgraph=True, backend=counter)
    eps = torch.tensor(0.5)
    got, want = compiled(x, y, a, b, eps, v), outputs(x, y, a, b, eps, v)
    for u, w in zip(got, want):
        assert u.dtype == w.dtype and u.shape == w.shape and u.device == w.device
        assert torch.equal(u, w)
    assert got[3].dtype == torch.float32 and got[4].dtype == torch.bool and got[5].dtype == torch.int32
    assert bool(got[4]) and 0 < int(got[5]) < 200
    assert counter.frame_count == 1


def test_divergence_compiles_with_gradients_and_no_recompile(counter):
    x, y, a, b = problem(9, 8, 2, 5)

    def div(x, y, a, eps):
        return torch_api.sinkhorn_divergence(x, y, a, b, epsilon=eps, **KW)[0]

    compiled = torch.compile(div, fullgraph=True, backend=counter)
    for e in (0.8, 0.6):
        args_c = grad_leaves(x, y, a, torch.tensor(e))
        args_e = grad_leaves(x, y, a, torch.tensor(e))
        vc, ve = compiled(*args_c), div(*args_e)
        assert torch.equal(vc, ve) and float(vc.detach()) > 0
        for u, w in zip(torch.autograd.grad(vc, args_c), torch.autograd.grad(ve, args_e)):
            assert torch.equal(u, w) and torch.isfinite(u).all()
    assert counter.frame_count == 1


def test_bad_values_raise_inside_the_compiled_function(counter):
    # value checks run inside the solve op: compiled once, they still raise at run time
    x, y, _, _ = problem(8, 7, 2, 6)

    def cost(x, y, eps):
        return torch_api.sinkhorn(x, y, epsilon=eps, **KW).reg_ot_cost

    compiled = torch.compile(cost, fullgraph=True, backend=counter)
    assert torch.isfinite(compiled(x, y, torch.tensor(0.5)))
    with pytest.raises(ValueError, match="epsilon must be a finite number > 0"):
        compiled(x, y, torch.tensor(-0.5))
    bad = x.clone()
    bad[2, 1] = float("nan")
    with pytest.raises(ValueError, match="x contains NaN or Inf"):
        compiled(bad, y, torch.tensor(0.5))
    assert counter.frame_count == 1


def test_errors_dtype_and_layout_equal_the_jax_frontend():
    import jax.numpy as jnp

    import ot_triton_jax as otj

    # min_iterations leaves unmeasured blocks (+inf), early stopping leaves unrun ones (-1),
    # and max_iterations = 41 a last partial block of one iteration
    x, y, a, b = problem(10, 9, 2, 7)
    kw = dict(epsilon=0.6, threshold=1e-4, inner_iterations=4, min_iterations=9, max_iterations=41)
    t = torch_api.sinkhorn(x, y, a, b, **kw)
    j = otj.sinkhorn(*(jnp.asarray(v.numpy()) for v in (x, y, a, b)), **kw)
    je = np.asarray(j.errors)
    assert t.errors.dtype == torch.float32 and je.dtype == np.float32
    assert tuple(t.errors.shape) == je.shape == (11,)
    te = t.errors.numpy()
    for kind in (np.isposinf, lambda e: e == -1):
        assert np.array_equal(kind(te), kind(je))
    assert np.isposinf(te[:2]).all() and (te == -1).any()
    measured = np.isfinite(je) & (je >= 0)
    # an error is a sum of |P^T 1 - b|_j over float32 marginals of size ~1/m computed by two loops
    # (XLA fuses the JAX one): agreement to ~1e-7 absolute per term, not relative at 6e-5
    np.testing.assert_allclose(te[measured], je[measured], rtol=1e-4, atol=5e-7)
    assert int(t.n_iters) == int(j.n_iters) and bool(t.converged) == bool(j.converged)
    assert t.n_iters.dtype == torch.int32 and str(j.n_iters.dtype) == "int32"
    assert t.converged.dtype == torch.bool and str(j.converged.dtype) == "bool"
