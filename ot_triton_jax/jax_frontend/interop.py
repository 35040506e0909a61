"""Zero-copy exchange of arrays between JAX and PyTorch (DLPack), CPU and GPU.

``to_torch(array)`` returns a ``torch.Tensor`` that *aliases* the JAX array's
buffer; ``from_torch(tensor)`` returns a ``jax.Array`` that aliases the
tensor's storage. Nothing is copied; the tests check data pointers.

Lifetime: each side keeps the other's buffer alive (the DLPack capsule holds
a reference), so either object may be dropped first.

Mutation: JAX arrays are immutable and XLA assumes nobody writes to them.
Never write to the tensor returned by ``to_torch``, nor to a tensor after
handing it to ``from_torch`` while the JAX array is in use: results would be
undefined (XLA may have cached, fused or reused the value). Clone first if
you need to write (``to_torch(a).clone()``).

Streams and synchronization (GPU), following the DLPack stream handshake;
neither direction blocks the host:

* ``to_torch``: torch's *current* CUDA stream is made to wait (device-side)
  until the JAX computation producing the array has finished; later torch
  work on that stream sees the final values. Work on other torch streams
  must synchronize with the current stream itself.
* ``from_torch``: JAX's stream is made to wait for the work already queued on
  torch's current stream (the producer of the tensor), so JAX computations
  launched afterwards see the final values. Torch work queued *after* the
  call is not ordered with JAX: do not free-and-reuse or modify the tensor
  while JAX may still read it.

On the CPU both directions are plain pointer handovers (JAX's CPU client
finishes pending work before exporting a buffer).
"""

from __future__ import annotations

import jax

__all__ = ["to_torch", "from_torch"]

try:
    _Tracer = jax.core.Tracer
except AttributeError:  # moved in some JAX versions
    from jax._src.core import Tracer as _Tracer


def is_tracer(v) -> bool:
    """True for abstract values met while tracing (jit, grad, ...)."""
    return isinstance(v, _Tracer)


def concrete_value(v):
    """``v`` itself, or the concrete value under a differentiation tracer (eager
    ``jax.grad``), or None when there is none (inside ``jax.jit``)."""
    if not is_tracer(v):
        return v
    primal = jax.lax.stop_gradient(v)
    return None if is_tracer(primal) else primal


def to_torch(array: jax.Array):
    """The JAX array as a ``torch.Tensor`` sharing its memory (no copy).

    Raises TypeError for tracers (inside ``jax.jit`` use a callback instead)
    and non-arrays; ValueError for arrays sharded over several devices.
    """
    import torch

    if is_tracer(array):
        raise TypeError("to_torch got a traced value: it needs a concrete jax.Array, so call it "
                        "outside jax.jit (or use jax.experimental.buffer_callback inside)")
    if not isinstance(array, jax.Array):
        raise TypeError(f"to_torch expects a jax.Array; got {type(array).__name__}. "
                        "Wrap it with jnp.asarray first")
    if len(array.devices()) != 1:
        raise ValueError(f"to_torch needs an array on a single device; this one is sharded over "
                         f"{len(array.devices())} devices. Gather it first (jax.device_put(x, device))")
    return torch.from_dlpack(array)


def from_torch(tensor, *, copy: bool = False) -> jax.Array:
    """The tensor as a ``jax.Array`` sharing its memory (no copy unless ``copy=True``).

    Errors (each says the fix): not a tensor; ``requires_grad`` (JAX cannot see
    torch's autograd graph: pass ``tensor.detach()``); non-contiguous (pass
    ``tensor.contiguous()``, which copies); a 64-bit dtype while JAX runs in
    32-bit mode (JAX would convert); a buffer JAX cannot adopt without copying
    (on the CPU JAX needs 64-byte alignment: torch's allocator gives it, but
    ``torch.from_numpy`` arrays and offset views may not; pass ``copy=True``).
    """
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"from_torch expects a torch.Tensor; got {type(tensor).__name__}")
    if tensor.requires_grad:
        raise ValueError("from_torch got a tensor with requires_grad=True: JAX cannot follow torch's "
                         "autograd graph, so gradients would be silently lost. Pass tensor.detach() "
                         "(and differentiate on the JAX side)")
    if not tensor.is_contiguous():
        raise ValueError(f"from_torch needs a contiguous tensor for a zero-copy view; got strides "
                         f"{tuple(tensor.stride())} for shape {tuple(tensor.shape)}. Pass "
                         "tensor.contiguous() (this copies)")
    if tensor.is_conj() or tensor.is_neg():
        raise ValueError("from_torch got a lazily conjugated/negated tensor; call tensor.resolve_conj() "
                         "/ tensor.resolve_neg() first")
    x64 = jax.dtypes.canonicalize_dtype(jax.numpy.int64) == jax.numpy.int64
    if tensor.element_size() == 8 and not x64:
        raise ValueError(f"from_torch got a {tensor.dtype} tensor but JAX runs without 64-bit types "
                         "(it would silently convert, i.e. copy). Cast it first (e.g. tensor.float() / "
                         "tensor.int()) or enable jax.config.update('jax_enable_x64', True)")
    if copy:
        return jax.dlpack.from_dlpack(tensor, copy=True)
    try:
        return jax.dlpack.from_dlpack(tensor, copy=False)
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"from_torch could not adopt this tensor's memory without a copy ({e}). "
                         "Pass copy=True to allow one") from e
