"""Problems of the harness: a seeded generator of point clouds, weights and directions.

A :class:`Case` names its problem (sizes, cloud layout, weights kind, relative eps, precision)
and the groups of quantities computed on it (:data:`parity.quantities.GROUPS`). ``inputs``
draws the float32 arrays every frontend and reference receives, from a seed derived from the
case name (the same case gives the same arrays in every run).
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np

CLOUDS = ("gaussian", "clustered", "far-apart", "duplicates", "far-origin", "line", "shifted-box")
WEIGHTS = ("uniform", "random", "partly-zero")
PRECISIONS = ("float32", "tf32")


@dataclasses.dataclass(frozen=True)
class Case:
    """One problem. ``eps_rel`` is relative to the data's scale, the mean of |x_i - y_j|^2."""

    name: str
    n: int
    m: int
    d: int
    eps_rel: float
    weights: str = "uniform"
    cloud: str = "gaussian"
    precision: str = "float32"
    groups: tuple[str, ...] = ("solve", "grad")
    max_iterations: int = 2000
    # KL-relaxed marginals (core/unbalanced.py): OTT's tau of each side for the OTT-convention
    # groups, GeomLoss's reach (both sides) for ``samples_loss``; b then sums to ``mass_b`` (a to 1)
    tau_a: float = 1.0
    tau_b: float = 1.0
    reach: float | None = None
    mass_b: float = 1.0
    frontends: tuple[str, ...] = ("torch", "jax")  # the frontends that offer every group of the case
    # label cost (core/labels.py): K classes drawn per point, a symmetric table of the cost's scale
    label_classes: int = 0

    @property
    def balanced(self) -> bool:
        return self.tau_a == 1.0 and self.tau_b == 1.0 and self.reach is None

    def __post_init__(self) -> None:
        if min(self.n, self.m, self.d) < 1:
            raise ValueError(f"case {self.name}: n, m, d must be >= 1")
        if not self.eps_rel > 0:
            raise ValueError(f"case {self.name}: eps_rel must be > 0")
        if self.weights not in WEIGHTS or self.cloud not in CLOUDS or self.precision not in PRECISIONS:
            raise ValueError(f"case {self.name}: unknown weights / cloud / precision")
        if not (0.0 < self.tau_a <= 1.0 and 0.0 < self.tau_b <= 1.0) or not (self.reach is None or self.reach > 0):
            raise ValueError(f"case {self.name}: tau_a, tau_b must lie in (0, 1], reach must be None or > 0")
        if self.label_classes < 0 or (self.label_classes and not set(self.groups) <= {"solve", "grad"}):
            raise ValueError(f"case {self.name}: label_classes >= 0; a label cost takes the groups solve, grad")
        if self.mass_b != 1.0 and self.balanced:
            raise ValueError(f"case {self.name}: unequal masses need a relaxed marginal (tau < 1 or a reach)")


@dataclasses.dataclass(frozen=True)
class Inputs:
    """float32 arrays of a case (numpy) and its absolute eps / cost scale (float64 numbers)."""

    x: np.ndarray
    y: np.ndarray
    a: np.ndarray
    b: np.ndarray
    vx: np.ndarray  # HVP direction in x
    vy: np.ndarray  # HVP direction in y
    wf: np.ndarray  # weights of <wf, f> + <wg, g>: zero off the support, sum wf == sum wg
    wg: np.ndarray
    eps: float
    max_cost: float  # max_ij |x_i - y_j|^2 (float64): the conditioning scale (parity.thresholds)
    mass_b: float = 1.0  # sum(b) (sum(a) = 1)
    balanced: bool = True  # both marginals strict: potentials have a gauge, weight gradients a constant
    label_x: np.ndarray | None = None  # label cost: int32 classes of x (n,), y (m,) and the table (K, K)
    label_y: np.ndarray | None = None
    label_cost: np.ndarray | None = None

    def labels(self) -> dict[str, np.ndarray]:
        """The label-cost keyword arrays of the solves (none without a label cost)."""
        if self.label_cost is None:
            return {}
        return dict(label_x=self.label_x, label_y=self.label_y, label_cost=self.label_cost)

    def as_float64(self) -> dict[str, np.ndarray]:
        """The arrays in float64 with weights renormalised in float64 (masses 1 and mass_b exactly)."""
        out = {k: getattr(self, k).astype(np.float64) for k in ("x", "y", "a", "b", "vx", "vy", "wf", "wg")}
        out["a"], out["b"] = out["a"] / out["a"].sum(), self.mass_b * out["b"] / out["b"].sum()
        return out


def _seed(name: str, seed: int) -> int:
    return zlib.crc32(name.encode()) + 7919 * seed


def _cloud(rng: np.random.Generator, case: Case) -> tuple[np.ndarray, np.ndarray]:
    n, m, d = case.n, case.m, case.d
    if case.cloud == "clustered":  # three tight clusters shared by both clouds, points dealt in turn
        centres = rng.normal(size=(3, d)) * 2.0
        x = centres[np.arange(n) % 3] + 0.1 * rng.normal(size=(n, d))
        y = centres[np.arange(m) % 3] + 0.1 * rng.normal(size=(m, d))
    elif case.cloud == "far-apart":  # two clouds of spread 1 at distance 10
        x = rng.normal(size=(n, d))
        y = rng.normal(size=(m, d)) + 10.0 / np.sqrt(d)
    elif case.cloud == "duplicates":  # every point of x twice, y has repeated points too
        x = rng.normal(size=((n + 1) // 2, d)).repeat(2, axis=0)[:n]
        y = rng.normal(size=(m, d)) * 0.8 + 0.5
        y[m // 2:] = y[: m - m // 2]
    elif case.cloud == "shifted-box":  # uniform on [0, 1]^d, both shifted by 5 (centring: docs/performance.md)
        x, y = rng.uniform(0.0, 1.0, (n, d)) + 5.0, rng.uniform(0.0, 1.0, (m, d)) + 5.0
    elif case.cloud == "line":  # both clouds uniform on the segment [0, 10] of the first axis
        x, y = np.zeros((n, d)), np.zeros((m, d))
        x[:, 0], y[:, 0] = rng.uniform(0.0, 10.0, n), rng.uniform(0.0, 10.0, m)
    else:
        x = rng.normal(size=(n, d))
        y = rng.normal(size=(m, d)) * 0.8 + 0.5
    if case.cloud == "far-origin":  # both clouds shifted by one common offset: |x - y|^2 unchanged
        offset = 200.0 / np.sqrt(d)  # |x|^2 ~ 4e4: |x|^2 + |y|^2 - 2<x, y> without centring loses ~2e-3
        x, y = x + offset, y + offset
    return x.astype(np.float32), y.astype(np.float32)


def _weights(rng: np.random.Generator, kind: str, n: int) -> np.ndarray:
    if kind == "uniform":
        w = np.ones(n)
    else:
        w = rng.uniform(0.2, 1.2, n)
        if kind == "partly-zero":
            zero = rng.permutation(n)[: max(1, n // 4)]
            w[zero[zero != 0]] = 0.0  # entry 0 stays positive
    return (w / w.sum()).astype(np.float32)


def inputs(case: Case, seed: int = 0) -> Inputs:
    """Draw the case's arrays (deterministic in (case.name, seed))."""
    rng = np.random.default_rng(_seed(case.name, seed))
    x, y = _cloud(rng, case)
    a, b = _weights(rng, case.weights, case.n), _weights(rng, case.weights, case.m) * np.float32(case.mass_b)
    vx = rng.normal(size=x.shape).astype(np.float32)
    vy = rng.normal(size=y.shape).astype(np.float32)
    wf = np.where(a > 0, rng.normal(size=case.n), 0.0)
    wg = np.where(b > 0, rng.normal(size=case.m), 0.0)
    wg = np.where(b > 0, wg + (wf.sum() - wg.sum()) / np.count_nonzero(b), 0.0)  # sum wf == sum wg
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    cost = (x64 * x64).sum(1)[:, None] + (y64 * y64).sum(1)[None] - 2 * x64 @ y64.T
    cost = np.maximum(cost, 0.0)
    labels = {}
    if case.label_classes:  # drawn last: the other cases' arrays do not move
        k = case.label_classes
        w = rng.uniform(0.0, cost.mean(), (k, k))
        labels = dict(label_x=rng.integers(0, k, case.n).astype(np.int32),
                      label_y=rng.integers(0, k, case.m).astype(np.int32),
                      label_cost=(0.5 * (w + w.T)).astype(np.float32))
        cost = cost + labels["label_cost"].astype(np.float64)[labels["label_x"]][:, labels["label_y"]]
    return Inputs(x=x, y=y, a=a, b=b, vx=vx, vy=vy, wf=wf.astype(np.float32), wg=wg.astype(np.float32),
                  eps=float(case.eps_rel * cost.mean()), max_cost=float(cost.max()), mass_b=case.mass_b,
                  balanced=case.balanced, **labels)
