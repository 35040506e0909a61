"""Input checks for the PyTorch frontend: the rules of ``ot_triton_jax.core.checks``
read through torch. Every error names the argument and the fix.

Value checks (finite points, weights >= 0, equal masses) read the values, which
synchronizes with the GPU; the operations run them inside their custom ops, so
``torch.compile`` traces the call without a graph break.
"""

from __future__ import annotations

import torch

from ot_triton_jax.core import checks as rules
from ot_triton_jax.core.checks import positive, precision  # noqa: F401 (re-exported)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class _TorchReader:
    array_type = "torch.Tensor"

    @staticmethod
    def is_array(v) -> bool:
        return isinstance(v, torch.Tensor)

    @staticmethod
    def shape(v) -> tuple[int, ...]:
        return tuple(v.shape)

    @staticmethod
    def dtype(v) -> str:
        return str(v.dtype).removeprefix("torch.")

    @staticmethod
    def device(v) -> str:
        return str(v.device)

    @staticmethod
    def _real(v) -> bool:
        return v.device.type != "meta" and not torch.compiler.is_compiling()

    @classmethod
    def all_finite(cls, v) -> bool | None:
        return bool(torch.isfinite(v).all()) if cls._real(v) else None

    @classmethod
    def all_nonneg(cls, v) -> bool | None:
        return bool((v >= 0).all()) if cls._real(v) else None

    @classmethod
    def rows_any_positive(cls, v) -> list[bool] | None:
        return (v > 0).reshape(-1, v.shape[-1]).any(1).tolist() if cls._real(v) else None

    @classmethod
    def rows_sum(cls, v) -> list[float] | None:
        return v.detach().double().sum(-1).reshape(-1).tolist() if cls._real(v) else None


READER = _TorchReader()


class ValuesReader(_TorchReader):
    """The value queries of given point clouds and weights, answered from one device
    reduction and one host read (one synchronization instead of one per rule)."""

    def __init__(self, points=(), weights=()):
        parts, layout = [], []
        for v in points:
            parts.append(torch.isfinite(v).all().reshape(1).double())
            layout.append((v, None))
        for w in weights:
            rows = w.detach().reshape(-1, w.shape[-1])
            parts += [torch.isfinite(rows).all().reshape(1).double(), (rows >= 0).all().reshape(1).double(),
                      (rows > 0).any(1).double(), rows.double().sum(1)]
            layout.append((w, rows.shape[0]))
        self._flags, self._layout = (torch.cat(parts) if parts else None), layout
        self._answers = self._event = None
        if self._flags is not None and self._flags.device.type == "cuda":
            # the flags travel to the host behind the reductions (pinned, non-blocking): read()
            # then waits for this copy only, not for work queued on the stream after it
            self._flags = self._flags.to("cpu", non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def read(self) -> "ValuesReader":
        """The host read (waits for the reductions); the rules can be asked afterwards."""
        if self._answers is not None:
            return self
        if self._event is not None:
            self._event.synchronize()
        vals = self._flags.tolist() if self._flags is not None else []
        layout = self._layout
        self._answers, k = {}, 0
        for v, nrows in layout:
            if nrows is None:
                self._answers[id(v)] = dict(finite=bool(vals[k]))
                k += 1
            else:
                self._answers[id(v)] = dict(finite=bool(vals[k]), nonneg=bool(vals[k + 1]),
                                            positive=[bool(t) for t in vals[k + 2:k + 2 + nrows]],
                                            sums=vals[k + 2 + nrows:k + 2 + 2 * nrows])
                k += 2 + 2 * nrows
        return self

    def all_finite(self, v):
        return self._answers[id(v)]["finite"]

    def all_nonneg(self, v):
        return self._answers[id(v)]["nonneg"]

    def rows_any_positive(self, v):
        return self._answers[id(v)]["positive"]

    def rows_sum(self, v):
        return self._answers[id(v)]["sums"]


def values(points: dict, weights: dict, *, balanced_pair: tuple[str, str] | None = None) -> None:
    """The value rules (finite points; finite, >= 0, not all-zero weights; equal masses of
    ``balanced_pair``) for named tensors, with one synchronization."""
    DeferredValues(points, weights, balanced_pair).finish()


class DeferredValues:
    """:func:`values` in two steps, for the solve loops: nothing is launched or read until
    :meth:`finish`, which the loops call after launching their first block of iterations. The
    reductions then queue behind that block (their host time overlaps the GPU's work) and are read
    with its synchronization; a bad value raises there, after one block."""

    def __init__(self, points: dict, weights: dict, balanced_pair: tuple[str, str] | None = None,
                 numbers: dict | None = None):
        self.points, self.weights, self.balanced_pair, self.done = points, weights, balanced_pair, False
        self.numbers = numbers or {}

    def finish(self) -> None:
        """Check ``numbers`` (> 0; host values or CPU tensors: no sync), then launch the
        reductions, wait for them (and what was queued before them) and apply the rules."""
        if self.done:
            return
        self.done = True
        for name, v in self.numbers.items():
            positive(name, v.detach().item() if isinstance(v, torch.Tensor) else v)
        _rules(self.points, self.weights, self.balanced_pair,
               ValuesReader(self.points.values(), self.weights.values()).read())


def _rules(points: dict, weights: dict, balanced_pair, r: "ValuesReader") -> None:
    for name, v in points.items():
        rules.finite(r, name, v)
    for name, w in weights.items():
        rules.weight_values(r, name, w)
    if balanced_pair is not None:
        rules.balanced(r, weights[balanced_pair[0]], weights[balanced_pair[1]])


def points(name: str, x, *, batched: bool = False) -> torch.Tensor:
    """A (n, d) floating tensor with n, d >= 1 ((B, N, D) allowed when ``batched``)."""
    rules.points(READER, name, x, batched=batched)
    return x


def finite(name: str, x: torch.Tensor) -> torch.Tensor:
    rules.finite(READER, name, x)
    return x


def pair(x: torch.Tensor, y: torch.Tensor, names=("x", "y")) -> None:
    rules.pair(READER, x, y, names)


_UNIFORM: dict = {}  # (n, device) -> (weights 1/n, their log)


def uniform_weights(n: int, device) -> torch.Tensor:
    """The default weights 1/n (float32), one tensor per (n, device), made once (no allocation
    per call) and never written: the solves skip their value rules (:func:`is_uniform_default`)
    and reuse their log (:func:`uniform_log`)."""
    if torch.compiler.is_compiling():  # n may be symbolic; the compiled graph makes it once anyway
        return torch.full((n,), 1.0 / n, device=device, dtype=torch.float32)
    key = (n, torch.device(device))
    hit = _UNIFORM.get(key)
    if hit is None:
        w = torch.full((n,), 1.0 / n, device=device, dtype=torch.float32)
        hit = _UNIFORM[key] = (w, w.log())
    return hit[0]


def is_uniform_default(w: torch.Tensor) -> bool:
    """Whether ``w`` is one of the library's own default weights (by identity)."""
    return uniform_log(w) is not None


def uniform_log(w: torch.Tensor) -> torch.Tensor | None:
    """log w when ``w`` is one of the library's own default weights, else None."""
    hit = _UNIFORM.get((w.shape[0], w.device)) if w.dim() == 1 else None
    return hit[1] if hit is not None and hit[0] is w else None


def weights(name: str, w, n: int, like: torch.Tensor) -> torch.Tensor:
    """Weights of shape (n,) for the points ``like`` (values checked); None means uniform 1/n."""
    if w is None:
        return uniform_weights(n, like.device)
    rules.weights(READER, name, w, like, "x" if name == "a" else "y")
    rules.weight_values(READER, name, w)
    return w


def samples_weights(name: str, w, pts: torch.Tensor, pname: str) -> torch.Tensor:
    """GeomLoss weights: (N,) / (N, 1), or (B, N) / (B, N, 1); returns (N,) or (B, N)."""
    if w is None:
        shape = tuple(pts.shape[:-1])
        return torch.full(shape, 1.0 / shape[-1], dtype=pts.dtype, device=pts.device)
    if rules.weights(READER, name, w, pts, pname, trailing_one=True):
        w = w[..., 0]
    rules.weight_values(READER, name, w)
    return w


def balanced(a: torch.Tensor, b: torch.Tensor) -> None:
    rules.balanced(READER, a, b)


def same_weight_dtype(a: torch.Tensor, b: torch.Tensor) -> None:
    rules.same_weight_dtype(READER, a, b)


def iterations(threshold, inner_iterations, min_iterations, max_iterations) -> tuple[int, int, int]:
    positive("threshold", threshold)
    return rules.iterations(inner_iterations, min_iterations, max_iterations)


def scalar(name: str, v) -> float | torch.Tensor:
    """A positive scalar: a number (checked now) or a 0-d tensor (checked when concrete;
    a tensor that requires grad makes the result differentiable in it)."""
    if isinstance(v, torch.Tensor):
        rules.scalar_shape(name, tuple(v.shape))
        if READER._real(v):
            positive(name, v.detach().reshape(()).item())
        return v.reshape(())
    return positive(name, v)
