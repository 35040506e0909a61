"""mHC in compiled and batched code: torch.compile, host syncs, float64, jax.vmap.

CPU, every kernel under the Triton interpreter, tiny sizes (B <= 12, n <= 5,
3-5 iterations). The GPU counterparts (inductor, CUDA graphs) are in
tests/test_mhc_gpu.py.

* ``torch.compile(FusedMHC(...), fullgraph=True, backend="aot_eager")``: the
  custom ops (``ot_triton::mhc_forward`` / ``ot_triton::mhc_backward``) trace
  without graph breaks, forward and backward give the eager numbers, and new
  data of the same shape does not recompile.
* The default call (forward and backward) reads nothing on the host: every
  way a tensor's value reaches Python is made to raise during the call.
* float64 logits in both frontends against the float64 reference.
* ``jax.vmap`` of mhc_sinkhorn and of jax.grad through it against a loop of
  single calls.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from mhc_reference import ref_grad, ref_mhc, rel_err

from torch_api import FusedMHC, mhc_sinkhorn


@pytest.fixture
def gen():
    g = torch.Generator()
    g.manual_seed(torch.seed() % (2**31))
    return g


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def eager_fwd_bwd(fn, logits, weight):
    m = logits.detach().clone().requires_grad_(True)
    out = fn(m)
    (g,) = torch.autograd.grad(out, m, weight.to(out.dtype))
    return out.detach(), g


# ----------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("n,kw", [
    (4, {}),                                                  # defaults (SoA layout)
    (5, dict(backward="implicit", start="rows", eps=1e-3)),   # tile layout, other options
])
def test_compile_fullgraph_matches_eager_no_recompile(n, kw, gen, fresh_dynamo):
    from torch._dynamo.testing import CompileCounterWithBackend

    layer = FusedMHC(iters=3, **kw)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    for call in range(2):
        logits = 2.0 * torch.randn(6, n, n, generator=gen)
        weight = torch.randn(6, n, n, generator=gen)
        if call == 0:
            out_c, g_c = eager_fwd_bwd(compiled, logits, weight)
        else:
            # new data, same shape: no recompile
            with torch._dynamo.config.patch(error_on_recompile=True):
                out_c, g_c = eager_fwd_bwd(compiled, logits, weight)
        out_e, g_e = eager_fwd_bwd(layer, logits, weight)
        # the same kernels on the same inputs: the same numbers
        assert torch.equal(out_c, out_e) and torch.equal(g_c, g_e)
        assert rel_err(out_c, ref_mhc(logits, 3, kw.get("eps", 0.0), kw.get("start", "cols"))) <= 1e-6
    assert counter.frame_count == 1
    ops = [str(node.target) for gm in counter.graphs for node in gm.graph.nodes]
    assert any("mhc_forward" in t for t in ops)


def test_compile_new_batch_size_recompiles_once(gen, fresh_dynamo):
    # a second batch size makes the batch dynamic (one recompile); later sizes reuse that graph
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(FusedMHC(iters=2), fullgraph=True, backend=counter)
    for batch, frames in ((3, 1), (5, 2), (7, 2)):
        logits = torch.randn(batch, 4, 4, generator=gen)
        weight = torch.randn(batch, 4, 4, generator=gen)
        out, g = eager_fwd_bwd(compiled, logits, weight)
        assert counter.frame_count == frames
        assert rel_err(out, ref_mhc(logits, 2)) <= 1e-6
        assert rel_err(g, ref_grad(logits, weight, 2)) <= 1e-5


def test_compile_function_float64_and_bf16(gen, fresh_dynamo):
    f = torch.compile(lambda x: mhc_sinkhorn(x, 3), fullgraph=True, backend="aot_eager")
    logits = torch.randn(4, 3, 3, generator=gen)
    weight = torch.randn(4, 3, 3, generator=gen)
    for dtype in (torch.float64, torch.bfloat16):
        x = logits.to(dtype)
        out_c, g_c = eager_fwd_bwd(f, x, weight)
        out_e, g_e = eager_fwd_bwd(lambda v: mhc_sinkhorn(v, 3), x, weight)
        assert out_c.dtype == dtype and g_c.dtype == dtype
        assert torch.equal(out_c, out_e) and torch.equal(g_c, g_e)


# ----------------------------------------------------------------------------- no host sync


class HostRead(AssertionError):
    pass


_HOST_READS = ("__bool__", "item", "__float__", "__int__", "tolist")


@contextlib.contextmanager
def host_reads_raise():
    """Make every way a tensor's value reaches Python raise inside the block.

    ``bool(t)`` (``if t:``, ``bool(torch.isfinite(x).all())``), ``t.item()``,
    ``float(t)``, ``int(t)``, ``t.tolist()`` and ``torch.cuda.synchronize()``: on a
    GPU each of them waits for the device.
    """
    def raiser(*args, **kwargs):
        raise HostRead("host read of a tensor value during an mHC call")

    with pytest.MonkeyPatch.context() as mp:
        for name in _HOST_READS:
            mp.setattr(torch.Tensor, name, raiser)
        mp.setattr(torch.cuda, "synchronize", raiser)
        yield


def test_default_call_does_not_sync(gen):
    logits = torch.randn(5, 4, 4, generator=gen)
    weight = torch.randn(5, 4, 4, generator=gen)
    layer = FusedMHC(iters=3)
    m = logits.clone().requires_grad_(True)
    m2 = logits.clone().requires_grad_(True)
    with host_reads_raise():
        out = mhc_sinkhorn(m, 3)          # the default call, forward ...
        out.backward(weight)              # ... and backward
        out2 = layer(m2)                  # the default module
        out2.backward(weight)
        # the guard is real: the on-request check reads a value on the host
        with pytest.raises(HostRead):
            mhc_sinkhorn(logits, 3, check_finite=True)
        with pytest.raises(HostRead):
            bool(torch.isfinite(logits).all())
    assert rel_err(out.detach(), ref_mhc(logits, 3)) <= 1e-6
    assert rel_err(m.grad, ref_grad(logits, weight, 3)) <= 1e-5
    assert torch.equal(out2.detach(), out.detach()) and torch.equal(m2.grad, m.grad)


# ----------------------------------------------------------------------------- float64


@pytest.mark.parametrize("backward", ["unrolled", "implicit"])
def test_torch_float64(backward, gen):
    logits = torch.randn(6, 4, 4, generator=gen, dtype=torch.float64)
    weight = torch.randn(6, 4, 4, generator=gen, dtype=torch.float64)
    iters = 5 if backward == "unrolled" else 60  # implicit: exact once converged
    out, g = eager_fwd_bwd(lambda v: mhc_sinkhorn(v, iters, backward=backward), logits, weight)
    assert out.dtype == torch.float64 and g.dtype == torch.float64
    # float32 arithmetic: float32 accuracy against the float64 loop
    assert rel_err(out, ref_mhc(logits, iters)) <= 1e-6
    assert rel_err(g, ref_grad(logits, weight, iters)) <= 1e-5


def test_jax_float64(gen):
    import jax
    import jax.numpy as jnp

    from ot_triton_jax import mhc_sinkhorn as jmhc

    logits = torch.randn(6, 4, 4, generator=gen, dtype=torch.float64)
    weight = torch.randn(6, 4, 4, generator=gen, dtype=torch.float64)
    with jax.enable_x64(True):
        m, w = jnp.asarray(logits.numpy()), jnp.asarray(weight.numpy())
        assert m.dtype == jnp.float64
        out = jmhc(m, 5)
        g = jax.jit(jax.grad(lambda x: jnp.sum(jmhc(x, 5) * w)))(m)
        assert out.dtype == jnp.float64 and g.dtype == jnp.float64
        out_t = torch.from_numpy(jax.device_get(out).copy())
        g_t = torch.from_numpy(jax.device_get(g).copy())
    assert rel_err(out_t, ref_mhc(logits, 5)) <= 1e-6
    assert rel_err(g_t, ref_grad(logits, weight, 5)) <= 1e-5
    # the same kernels as torch on the same float32-rounded logits
    out_torch, g_torch = eager_fwd_bwd(lambda v: mhc_sinkhorn(v, 5), logits, weight)
    assert torch.equal(out_t, out_torch) and torch.equal(g_t, g_torch)


# ----------------------------------------------------------------------------- jax.vmap


def test_jax_vmap_matches_loop_of_single_calls(gen):
    import jax
    import jax.numpy as jnp

    from ot_triton_jax import mhc_sinkhorn as jmhc

    logits = 2.0 * torch.randn(3, 2, 4, 4, generator=gen)
    weight = torch.randn(3, 2, 4, 4, generator=gen)
    m, w = jnp.asarray(logits.numpy()), jnp.asarray(weight.numpy())

    def loss(x, wt):
        return jnp.sum(jmhc(x, 4, eps=1e-3) * wt)

    def to_t(a):
        return torch.from_numpy(jax.device_get(a).copy())

    outs = jax.jit(jax.vmap(lambda x: jmhc(x, 4, eps=1e-3)))(m)
    grads = jax.jit(jax.vmap(jax.grad(loss)))(m, w)
    loop_out = jnp.stack([jmhc(m[i], 4, eps=1e-3) for i in range(3)])
    loop_g = jnp.stack([jax.grad(loss)(m[i], w[i]) for i in range(3)])
    assert outs.shape == m.shape and grads.shape == m.shape
    assert rel_err(to_t(outs), to_t(loop_out).double()) <= 1e-6
    assert rel_err(to_t(grads), to_t(loop_g).double()) <= 1e-6
    assert rel_err(to_t(grads), ref_grad(logits, weight, 4, 1e-3)) <= 1e-5
