"""Rows: one quantity of one frontend on one case, its error against the reference and verdict.

``normalise`` applies the gauge normalisation named by the quantity (see
:mod:`parity.quantities`); ``rel_error`` is the metric of :mod:`parity.thresholds`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .cases import Case, Inputs
from .quantities import Quantity
from .thresholds import bound


@dataclasses.dataclass
class Row:
    frontend: str
    quantity: str
    case: str
    error: float
    threshold: float
    passed: bool
    reference: str
    note: str
    n: int
    m: int
    d: int
    eps: float
    eps_rel: float
    weights: str
    cloud: str
    precision: str
    cancel: float = 1.0
    stop_gap: float = 0.0

    @property
    def id(self) -> str:
        return row_id(self.case, self.frontend, self.quantity)


def row_id(case: str, frontend: str, quantity: str) -> str:
    """The name ``--only`` patterns are matched against: ``case:frontend:quantity``."""
    return f"{case}:{frontend}:{quantity}"


def make_row(case: Case, inp: Inputs, frontend: str, q: Quantity, error: float, reference: str,
             note: str = "", passed: bool | None = None, cancel: float = 1.0, stop_gap: float = 0.0) -> Row:
    """A row whose verdict is ``error <= bound + stop_gap`` (NaN fails) unless ``passed`` is given."""
    thr = bound(q.kind, case.precision, inp.max_cost, inp.eps, cancel) + stop_gap
    ok = bool(error <= thr) if passed is None else passed
    return Row(frontend=frontend, quantity=q.name, case=case.name, error=float(error), threshold=float(thr),
               passed=ok, reference=reference, note=note, n=case.n, m=case.m, d=case.d, eps=inp.eps,
               eps_rel=case.eps_rel, weights=case.weights, cloud=case.cloud, precision=case.precision,
               cancel=float(cancel), stop_gap=float(stop_gap))


def rel_error(ours: np.ndarray, ref: np.ndarray) -> float:
    """||ours - ref|| / ||ref|| (|.| for scalars); NaN in ours, or a shape or infinity-pattern
    mismatch, is an infinite error; entries that are -inf in both are left out."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    if ours.shape != ref.shape or np.isnan(ours).any() or np.isnan(ref).any():
        return math.inf
    fin = np.isfinite(ref)
    if not np.array_equal(fin, np.isfinite(ours)) or not np.array_equal(ours[~fin], ref[~fin]):
        return math.inf
    num, den = np.linalg.norm(ours[fin] - ref[fin]), np.linalg.norm(ref[fin])
    return float(num / den) if den > 0 else float(num)


def normalise(q: Quantity, vals: dict[str, np.ndarray], inp: Inputs) -> np.ndarray:
    """The quantity's gauge-invariant form (see :mod:`parity.quantities`). A relaxed problem has no
    gauge and its weight gradients no free constant: compared as they are, the weight gradients on
    the support (the reference's convention leaves zero-weight entries undefined)."""
    v = np.asarray(vals[q.name], np.float64)
    if not inp.balanced:
        if q.normalisation in ("center_a", "center_b"):
            return v[inp.a > 0] if q.normalisation == "center_a" else v[inp.b > 0]
        return v
    if q.normalisation == "gauge_fg":
        sa, sb = inp.a > 0, inp.b > 0
        f, g = np.asarray(vals["f"], np.float64), np.asarray(vals["g"], np.float64)
        if not (np.all(np.isfinite(f[sa])) and np.all(np.isfinite(g[sb]))):
            return v  # non-finite on the support: rel_error reports the mismatch
        t = 0.5 * (f[sa].mean() - g[sb].mean())
        shifted = f - t if q.name == "f" else g + t
        return np.where(sa if q.name == "f" else sb, shifted, v)  # off the support: as returned
    if q.normalisation in ("center_a", "center_b"):
        s = inp.a > 0 if q.normalisation == "center_a" else inp.b > 0
        return v[s] - v[s].mean()
    return v


def cancellation(q: Quantity, vals: dict[str, np.ndarray], refvals: dict[str, np.ndarray], inp: Inputs) -> float:
    """The cancellation factor of :mod:`parity.thresholds` (>= 1): the size of the float32 terms a
    compared quantity is a small difference of, over the size of the quantity, on the reference
    (the divergence's terms: the frontend's own three costs in ``vals["div_terms"]``)."""
    ref = np.asarray(refvals[q.name], np.float64)
    if q.normalisation != "none" and inp.balanced:
        sel = (inp.a > 0) if q.normalisation in ("gauge_fg", "center_a") and q.name != "g" else (inp.b > 0)
        raw = ref[sel] if ref.shape == sel.shape else ref
        norm = normalise(q, refvals, inp)
        norm = norm[sel] if norm.shape == sel.shape else norm
        size, result = np.linalg.norm(raw[np.isfinite(raw)]), np.linalg.norm(norm[np.isfinite(norm)])
    elif q.name == "div" and "div_terms" in vals:
        size, result = float(vals["div_terms"]), abs(float(ref))
    elif q.name in ("sl_f", "sl_g"):
        size, result = 0.5 * inp.max_cost, float(np.sqrt(np.mean(ref[np.isfinite(ref)] ** 2)))
    else:
        return 1.0
    if not (np.isfinite(size) and np.isfinite(result)) or result <= 0:
        return 1.0
    return max(1.0, float(size / result))


ENVELOPE_OF = {"grad_a": "f", "grad_b": "g"}


def stop_gap(q: Quantity, refvals: dict[str, np.ndarray], inp: Inputs) -> float:
    """The stop gap of :mod:`parity.thresholds` for a weight gradient compared with a reference
    stopped at a raised threshold: the distance, on the reference itself, between its envelope
    gradient (its own potential f or g, centred) and its implicit gradient ``grad_a`` / ``grad_b``.
    Zero for every other quantity."""
    pot = ENVELOPE_OF.get(q.name)
    if pot is None or pot not in refvals or not inp.balanced:  # relaxed: the weight gradient is not f
        return 0.0
    envelope = dict(refvals, **{q.name: refvals[pot]})
    gap = rel_error(normalise(q, envelope, inp), normalise(q, refvals, inp))
    return gap if math.isfinite(gap) else 0.0
