"""The checks of a call that need no values, shared by the single and the batched solves: the
weights' shapes (None: uniform), the scalar options as 0-d tensors, and :func:`prepare`."""

from __future__ import annotations

import torch

from ot_triton_jax.core import checks as rules
from ot_triton_jax.core.options import LoopOptions

from . import checks as check
from .checks import READER


def weights_shape(name: str, w, pts: torch.Tensor, pname: str) -> torch.Tensor:
    """Weights for ``pts`` with their shape, dtype and device checked (values are checked
    inside the solve ops); None means uniform 1/n (float32)."""
    if w is None:
        return check.uniform_weights(pts.shape[0], pts.device)
    rules.weights(READER, name, w, pts, pname)
    return w


def scalar_tensor(name: str, v, device) -> torch.Tensor:
    """``epsilon`` / ``scale_cost`` / ``threshold`` as a 0-d tensor: a number is checked
    now (eagerly) and becomes a float32 CPU tensor (read on the host without a sync; the
    kernels get it through one non-blocking copy); a tensor is reshaped to 0-d (its value
    is checked inside the solve op; it keeps its autograd link, dtype and device). The tensor
    made for a number is kept for the next call with that number (no solve writes it)."""
    if isinstance(v, torch.Tensor):
        rules.scalar_shape(name, READER.shape(v))
        return v.reshape(())
    if torch.compiler.is_compiling():
        # a number that torch.compile made dynamic (after a second value) has no value at
        # trace time: it is checked inside the solve op with the tensors. Made on the points'
        # device: a CPU tensor in the graph would make Inductor build its C++ backend (its
        # vector-ISA probe and a C++ compile took ~50 s of a first compile on the H100 host)
        return torch.as_tensor(v, dtype=torch.float32, device=device)
    key = (name, type(v), v)
    hit = _NUMBERS.get(key)
    if hit is None:
        hit = torch.tensor(check.positive(name, v), dtype=torch.float32)
        if len(_NUMBERS) >= 256:
            _NUMBERS.clear()
        _NUMBERS[key] = hit
    return hit


_NUMBERS: dict = {}  # (name, type, number) -> its checked float32 CPU tensor, never written (host time)


def prepare(x, y, a, b, epsilon, scale_cost, threshold, inner_iterations, min_iterations, max_iterations,
            precision):
    """The checks that need no values: returns (a, b, eps, scale, threshold, LoopOptions)."""
    check.points("x", x)
    check.points("y", y)
    check.pair(x, y)
    a = weights_shape("a", a, x, "x")
    b = weights_shape("b", b, y, "y")
    eps = scalar_tensor("epsilon", epsilon, x.device)
    scale = scalar_tensor("scale_cost", scale_cost, x.device)
    thr = scalar_tensor("threshold", threshold, x.device)
    opts = LoopOptions(check.precision(precision), inner_iterations, min_iterations, max_iterations)
    return a, b, eps, scale, thr, opts
