"""Launching the Triton kernels from JAX: one entry point, two backends.

:func:`launch` runs one ``@triton.jit`` kernel of :mod:`ot_triton_jax.core.kernels`
on JAX arrays, inside or outside ``jax.jit``, with the launch plan that
:mod:`ot_triton_jax.core.launch_plans` also gives to ``torch_api`` (so both
frontends run identical kernels). Backends:

``"triton_call"`` (GPU only)
    ``jax_triton.triton_call``: the kernel is compiled by jax-triton and
    embedded in the XLA program as a native custom call (no Python per
    launch). Works with jax-triton 0.3.1 (``out_shape=``, triton 3.6) and
    the 0.4.x API (``out_type=``). Importing ``jax_triton`` clears
    ``TRITON_CACHE_DIR`` (0.3.1 sets it to ``""``, which breaks every later
    PyTorch-side Triton compile; 0.4.x deletes it); the variable is put
    back exactly as it was right after the import.

``"callback"`` (CPU and GPU)
    ``jax.experimental.buffer_callback``: XLA hands the callback its device
    buffers, which are wrapped zero-copy with ``torch.from_dlpack`` and given
    to the very same ``kernel[grid](...)`` call ``torch_api`` makes. On a GPU
    the launch happens on XLA's own stream
    (``torch.cuda.ExternalStream(ctx.stream)``), so it is ordered with the
    surrounding XLA work without any synchronization; without a GPU the
    kernels run under the Triton interpreter (see :mod:`ot_triton_jax.core.runtime`).
    One Python call per launch: meant for CPU runs, tests and as a fallback.

Choice of backend, first match wins: the ``backend=`` argument, the
environment variable ``OT_TRITON_JAX_BACKEND`` (``triton_call``,
``callback`` or ``auto``), otherwise automatic: ``triton_call`` when JAX's
default backend is a GPU and jax-triton imports, else ``callback``.

Kernel contract (same as ``kernels/__init__.py``): positional arguments are
input pointers and integer sizes, then one pointer per output, then
compile-time constants as keywords. Run-time floats travel in small float32
arrays (``PARAMS``), never as Python floats (those would become compile-time
constants, and a new value would recompile).

Outputs are **write-only fresh buffers**: they are allocated by XLA for this
call, are *not* zero-initialized, and alias no input. A kernel must store
every element of every output it declares (or the caller must ignore the
elements it does not write); a kernel must never read an output pointer.

Batching: every launch (both backends) carries a ``jax.custom_batching.custom_vmap``
rule (:func:`ot_triton_jax.jax_frontend.batching.loop_over_batch`): under ``jax.vmap``
the kernel runs once per batch element in a ``jax.lax.map`` loop, the unbatched
operands closed over (not broadcast). So every streaming operation (``sinkhorn``
and its outputs, its gradients, ``sinkhorn_divergence``, ``samples_loss``) works
under ``vmap``, nested ``vmap`` and ``vmap`` of ``grad``, as a loop over the batch:
one launch per problem and half-step (its cost: :mod:`ot_triton_jax.jax_frontend.batching`),
unless a whole solve folds the batch first (the OTT loop, :mod:`.batched_loop`; GeomLoss's
strict annealed loop, :mod:`.geomloss_packed`; the plan passes of ``kernel_ops``).
mHC folds a vmapped batch into one launch with rules of its own
(:mod:`ot_triton_jax.jax_frontend.mhc`), applied before this one.

Derivatives: the launched call has none (a kernel is opaque to JAX); launch only
on ``stop_gradient``-ed values and attach ``jax.custom_vjp``/``jax.custom_jvp``
rules around the calls, as the solvers do.
Pure: no side effects, so XLA removes calls whose outputs are unused.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ..core import runtime
from ..core.launch_plans import LaunchPlan
from .batching import loop_over_batch

BACKENDS = ("triton_call", "callback")
ENV_VAR = "OT_TRITON_JAX_BACKEND"

__all__ = ["launch", "resolve_backend", "has_gpu", "kernels_on_gpu", "BACKENDS", "ENV_VAR"]


@functools.cache
def has_gpu() -> bool:
    """True when JAX's default backend is a GPU."""
    return jax.default_backend() == "gpu"


def kernels_on_gpu() -> bool:
    """Configure the Triton runtime from JAX's view of the device (first caller wins).

    Must run before ``ot_triton_jax.core.kernels`` is imported; every JAX module
    that imports the kernels calls this first.
    """
    return runtime.configure(has_gpu())


# ----------------------------------------------------------------------------- backends


_JT = None  # the jax_triton module, imported on first use
_JT_OUT_KW = None  # "out_type" (0.4.x) or "out_shape" (0.3.x)


def _jax_triton():
    """Import jax_triton once, undoing its TRITON_CACHE_DIR side effect."""
    global _JT, _JT_OUT_KW
    if _JT is None:
        missing = object()
        before = os.environ.get("TRITON_CACHE_DIR", missing)
        try:
            import jax_triton as jt
        finally:
            if before is missing:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = before
        params = inspect.signature(jt.triton_call).parameters
        _JT_OUT_KW = "out_type" if "out_type" in params else "out_shape"
        _JT = jt
    return _JT


@functools.cache
def _jax_triton_available() -> bool:
    try:
        _jax_triton()
    except ImportError:
        return False
    return True


def resolve_backend(backend: str | None = None) -> str:
    """The backend :func:`launch` will use for ``backend`` (see module docstring)."""
    source = "backend="
    if backend is None or backend == "auto":
        env = os.environ.get(ENV_VAR, "").strip()
        if env and env != "auto":
            backend, source = env, f"environment variable {ENV_VAR}"
        else:
            backend = None
    if backend is None:
        return "triton_call" if has_gpu() and _jax_triton_available() else "callback"
    if backend not in BACKENDS:
        raise ValueError(
            f"{source} must be one of {BACKENDS} or 'auto', got {backend!r}"
        )
    if backend == "triton_call":
        if not has_gpu():
            raise ValueError(
                f"{source}'triton_call' needs a GPU (JAX default backend is "
                f"{jax.default_backend()!r}); use backend='callback' or leave it on 'auto'"
            )
        if not _jax_triton_available():
            raise ImportError(
                f"{source}'triton_call' needs jax-triton (pip install jax-triton==0.3.1 for "
                "triton 3.6); or use backend='callback'"
            )
    return backend


def _check_inputs(inputs: Sequence[Any]) -> None:
    for i, v in enumerate(inputs):
        if isinstance(v, bool) or isinstance(v, (float, np.floating)):
            raise TypeError(
                f"inputs[{i}] is a Python {type(v).__name__}: pass run-time floats in a float32 "
                "array (PARAMS) and flags as constexprs"
            )
        if isinstance(v, (int, np.integer)):
            continue
        if not hasattr(v, "shape") or not hasattr(v, "dtype"):
            raise TypeError(f"inputs[{i}] must be a jax.Array or an int, got {type(v).__name__}")


def constexpr_defaults(kernel) -> dict[str, Any]:
    """The default values of ``kernel``'s compile-time parameters (``FLAG: tl.constexpr = False``).
    jax_triton's ``triton_call`` does not apply them: a constexpr it is not given compiles as
    None, so a flag defaulting to True would silently read as false. Every launch passes them."""
    fn = getattr(kernel, "fn", kernel)  # the Python function of a JITFunction / InterpretedFunction
    return {name: p.default for name, p in inspect.signature(fn).parameters.items()
            if "constexpr" in str(p.annotation) and p.default is not inspect.Parameter.empty}


def launch(
    kernel,
    plan: LaunchPlan,
    inputs: Sequence[jax.Array | int],
    out_shapes: Sequence[jax.ShapeDtypeStruct],
    *,
    backend: str | None = None,
    constexprs: Mapping[str, Any] | None = None,
) -> tuple[jax.Array, ...]:
    """Run ``kernel`` on ``plan.grid`` and return its outputs as JAX arrays.

    Args:
      kernel: a ``@triton.jit`` kernel following the argument convention above.
      plan: grid, warps, stages and block constexprs (from ``launch_plans``).
      inputs: the kernel's leading positional arguments, in order: JAX arrays
        (contiguous, any dtype the kernel expects) and Python ints (sizes,
        baked into the launch; a new value means a new trace).
      out_shapes: one ``jax.ShapeDtypeStruct`` per output pointer, in order.
        Outputs are write-only fresh buffers (uninitialized).
      backend: ``"triton_call"``, ``"callback"``, ``"auto"`` or None (see
        :func:`resolve_backend`).
      constexprs: extra compile-time keywords (flags such as ``HAS_V``),
        merged over ``plan.constexprs``.

    Returns:
      A tuple with one array per entry of ``out_shapes``. Under ``jax.vmap`` the
      launch runs once per batch element (``jax.lax.map``) and every output is
      batched.
    """
    kernels_on_gpu()
    _check_inputs(inputs)
    out_shapes = tuple(jax.ShapeDtypeStruct(tuple(s.shape), s.dtype) for s in out_shapes)
    if not out_shapes:
        raise ValueError("out_shapes is empty: a kernel launch must produce at least one output")
    meta = constexpr_defaults(kernel)
    meta.update(plan.constexprs)
    if constexprs:
        meta.update(constexprs)
    which = resolve_backend(backend)
    # Static ints stay in the closure; only the arrays are operands (and can be batched).
    slots = []  # per kernel input: ("int", value) or ("arr", index among arrays)
    arrays = []
    for v in inputs:
        if isinstance(v, (int, np.integer)):
            slots.append(("int", int(v)))
        else:
            slots.append(("arr", len(arrays)))
            arrays.append(v)
    run = _launch_triton_call if which == "triton_call" else _launch_callback

    def launch_arrays(*arrays):
        return run(kernel, plan, slots, list(arrays), out_shapes, meta)

    return tuple(loop_over_batch(launch_arrays)(*arrays))


def _launch_triton_call(kernel, plan, slots, arrays, out_shapes, meta):
    jt = _jax_triton()
    args = [v if kind == "int" else arrays[v] for kind, v in slots]
    outs = jt.triton_call(
        *args,
        kernel=kernel,
        grid=tuple(plan.grid),
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
        **{_JT_OUT_KW: list(out_shapes)},
        **meta,
    )
    return tuple(outs)


# XLA's CPU runtime runs independent custom calls on several threads; the Triton
# interpreter patches triton.language globally while a kernel runs, so two kernels at once
# fail ("Did you forget to add @triton.jit ?"). Interpreted launches take turns.
_INTERPRETER_LOCK = threading.Lock()


def _launch_callback(kernel, plan, slots, arrays, out_shapes, meta):
    from jax.experimental.buffer_callback import buffer_callback

    grid = tuple(plan.grid)
    num_warps, num_stages = plan.num_warps, plan.num_stages

    def run(ctx, outs, *bufs):
        import torch

        device_type, device_id = (bufs[0] if bufs else outs[0]).__dlpack_device__()
        on_cuda = int(device_type) in (2, 10, 13)  # kDLCUDA, kDLROCM, kDLCUDAManaged

        def call():
            ins = [torch.from_dlpack(b) for b in bufs]
            args = [v if kind == "int" else ins[v] for kind, v in slots]
            args += [torch.from_dlpack(o) for o in outs]
            kernel[grid](*args, num_warps=num_warps, num_stages=num_stages, **meta)

        if on_cuda:
            if not runtime.on_gpu():
                raise RuntimeError(
                    "ot_triton_jax kernels were configured for the Triton interpreter but XLA "
                    "passed GPU buffers; configure the runtime before importing the kernels"
                )
            dev = torch.device("cuda", int(device_id))
            stream = torch.cuda.ExternalStream(ctx.stream, device=dev)
            with torch.cuda.device(dev), torch.cuda.stream(stream):
                call()
        else:
            if runtime.on_gpu():
                raise RuntimeError(
                    "ot_triton_jax kernels are compiled for the GPU but XLA passed host buffers; "
                    "put the arrays on the GPU (jax.device_put) or run on a machine without GPU"
                )
            with _INTERPRETER_LOCK:
                call()

    fn = buffer_callback(run, out_shapes)
    return tuple(fn(*arrays))
