"""ot_triton_jax.to_torch / from_torch on the CPU: zero-copy (data pointers), errors."""

import numpy as np
import pytest
import torch

import jax
import jax.numpy as jnp

import ot_triton_jax as otj


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_to_torch_is_zero_copy(dtype):
    a = (jnp.arange(24, dtype=jnp.float32).reshape(4, 6) * 0.5).astype(dtype)
    t = otj.to_torch(a)
    assert t.data_ptr() == a.unsafe_buffer_pointer()
    assert tuple(t.shape) == a.shape and not t.requires_grad
    ref = np.asarray(a.astype(jnp.float32))
    np.testing.assert_array_equal(t.float().numpy(), ref)
    del a  # the tensor keeps the buffer alive
    np.testing.assert_array_equal(t.float().numpy(), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32])
def test_from_torch_is_zero_copy(dtype):
    t = (torch.arange(48, dtype=torch.float32).reshape(6, 8) / 4).to(dtype)
    a = otj.from_torch(t)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    np.testing.assert_array_equal(np.asarray(a), t.numpy())
    # the round trip comes back to the same memory
    assert otj.to_torch(a).data_ptr() == t.data_ptr()


def test_from_torch_errors_say_the_fix():
    with pytest.raises(ValueError, match=r"requires_grad=True.*tensor.detach\(\)"):
        otj.from_torch(torch.ones(3, requires_grad=True))
    with pytest.raises(ValueError, match=r"contiguous.*tensor.contiguous\(\)"):
        otj.from_torch(torch.ones(4, 3).T)
    with pytest.raises(ValueError, match="copy=True"):
        otj.from_torch(torch.arange(17, dtype=torch.float32)[1:])  # storage offset: misaligned on CPU
    shifted = otj.from_torch(torch.arange(17, dtype=torch.float32)[1:], copy=True)
    np.testing.assert_array_equal(np.asarray(shifted), np.arange(1, 17, dtype=np.float32))
    with pytest.raises(TypeError, match="expects a torch.Tensor"):
        otj.from_torch(np.ones(3))
    with pytest.raises(ValueError, match="64-bit"):
        otj.from_torch(torch.arange(4))  # int64 while JAX is 32-bit
    # a detached view of a leaf that requires grad is fine (no copy)
    w = torch.ones(5, requires_grad=True)
    assert otj.from_torch(w.detach()).unsafe_buffer_pointer() == w.data_ptr()


def test_to_torch_errors():
    with pytest.raises(TypeError, match="expects a jax.Array"):
        otj.to_torch(np.ones(3))
    with pytest.raises(TypeError, match="traced value"):
        jax.jit(otj.to_torch)(jnp.ones(3))


def test_round_trip_through_the_solver():
    # torch tensors in, solve in JAX, potentials back to torch without copies
    rng = np.random.default_rng(62)
    x = torch.tensor(rng.standard_normal((12, 2)), dtype=torch.float32)  # torch-allocated: aligned
    y = torch.tensor(rng.standard_normal((10, 2)), dtype=torch.float32)
    out = otj.sinkhorn(otj.from_torch(x), otj.from_torch(y), epsilon=0.5)
    f = otj.to_torch(out.f)
    assert f.data_ptr() == out.f.unsafe_buffer_pointer() and torch.isfinite(f).all()
