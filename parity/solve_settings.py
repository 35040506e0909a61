"""Solver settings shared by both frontends, and the record of one solve.

Ours: marginal-error threshold ``thresholds.solve_threshold`` (``STOP_THRESHOLD`` for the
stopping-rule check), the case's ``max_iterations``, CG at ``CG_RTOL`` (so CG error stays below
the 1e-4 bound of second-order rows). SamplesLoss: blur = sqrt(eps) (GeomLoss's eps = blur^2 for p = 2),
scaling 0.7, debias on: the same options are given to GeomLoss.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import numpy as np

from .cases import Case, Inputs
from .thresholds import CG_RTOL, STOP_THRESHOLD, solve_threshold

GEOMLOSS_SCALING = 0.7


@dataclasses.dataclass(frozen=True)
class SolveRecord:
    """What a frontend reported about one solve (several solves: all must converge)."""

    converged: bool
    n_iters: int | tuple[int, ...]
    last_error: float

    @staticmethod
    def of_divergence(converged: Sequence[Any], n_iters: Sequence[Any], errors: Sequence[Any]) -> "SolveRecord":
        """Record of a divergence's (xy, xx, yy) solves (entries may be None with static_b)."""
        idx = [i for i, c in enumerate(converged) if c is not None]
        last = []
        for i in idx:
            e = np.asarray(errors[i], dtype=np.float64)
            e = e[e >= 0]
            last.append(float(e[-1]) if e.size else float("nan"))
        return SolveRecord(converged=all(bool(np.asarray(converged[i])) for i in idx),
                           n_iters=tuple(int(np.asarray(n_iters[i])) for i in idx),
                           last_error=max(last) if last else float("nan"))


def divergence_terms(costs: Sequence[Any]) -> np.ndarray:
    """|c_xy| + |c_xx| / 2 + |c_yy| / 2 of a divergence's three costs (None: a skipped term): the
    size of what the divergence cancels (``thresholds.bound``'s cancellation)."""
    def num(c: Any) -> float:  # a torch tensor (possibly requiring grad) or a JAX / NumPy value
        return float(c.detach().cpu()) if hasattr(c, "detach") else float(np.asarray(c))

    return np.asarray(sum(w * abs(num(c)) for w, c in zip((1.0, 0.5, 0.5), costs) if c is not None))


def solve_kwargs(case: Case, inp: Inputs, implicit_options: Callable[..., Any]) -> dict[str, Any]:
    """Keyword arguments of ``sinkhorn`` / ``sinkhorn_divergence`` / ``hvp`` in both frontends."""
    kw = dict(epsilon=inp.eps, threshold=solve_threshold(inp.max_cost, inp.eps, case.precision),
              max_iterations=case.max_iterations, precision=case.precision,
              implicit=implicit_options(rtol=CG_RTOL))
    return dict(kw, **relaxation(case))


def relaxation(case: Case) -> dict[str, float]:
    """OTT's ``tau_a`` / ``tau_b`` of a case with a relaxed marginal (nothing when both are strict)."""
    return {} if case.tau_a == case.tau_b == 1.0 else dict(tau_a=case.tau_a, tau_b=case.tau_b)


def stop_kwargs(case: Case, inp: Inputs) -> dict[str, Any]:
    """The stopping-rule check's solve: a threshold where float32 noise is far below it."""
    return dict(epsilon=inp.eps, threshold=STOP_THRESHOLD, max_iterations=case.max_iterations,
                precision=case.precision)


def geomloss_options(case: Case, inp: Inputs) -> dict[str, Any]:
    """``SamplesLoss`` options shared by ours and GeomLoss (p = 2: eps = blur^2), with the case's
    ``reach`` where it has one."""
    opts: dict[str, Any] = dict(p=2, blur=math.sqrt(inp.eps), scaling=GEOMLOSS_SCALING, debias=True)
    return opts if case.reach is None else dict(opts, reach=case.reach)
