"""Dense float64 reference of the Sinkhorn Hessian-vector product, for GPU sizes (n, m ~ 8192).

Used by ``tests/test_hvp_gpu.py`` and ``bench/areas/hvp.py``. Torch only, on the inputs'
device; memory a few dense float64 n x m matrices (8192^2 x 8 B = 512 MiB each).

Problem (OTT conventions): C_ij = s |x_i - y_j|^2 with s = 1/scale_cost, epsilon absolute,
P_ij = exp((f_i + g_j - C_ij)/eps), marginals P 1 = a, P^T 1 = b (uniform by default),
L = OTT's reg_ot_cost, whose envelope gradient is gx_i = 2 s sum_j P_ij (x_i - y_j).

Potentials (:func:`solve_potentials`): plain Sinkhorn is hopeless here (at eps = 0.1 on
randn clouds in d = 64, n = m = 512 or 1024, float64 alternating iterations need ~950 to
reach an L1 marginal error of 1e-3, ~3000 for 1.5e-4, and do not reach 1e-6 within 20000:
the plan is close to a permutation), so log-domain Sinkhorn iterations warm-start a damped
Newton method on the dual

    D(f, g) = <f, a> + <g, b> - eps sum_ij P_ij,   grad D = (a - P 1, b - P^T 1),
    -eps Hess D = H = [[diag(r), P], [P^T, diag(c)]],  r = P 1, c = P^T 1,

each Newton system solved by the Schur complement on g (below), until the L1 marginal
error max(|P 1 - a|_1, |P^T 1 - b|_1) is below ``threshold`` (1e-10 by default). At
n = 512, d = 64: 200 warm iterations (error 2.5e-2), then ~20 Newton steps to 1e-10 (the
rate is linear, ~1/3 per step, near the float64 floor of this ill-conditioned system).
:func:`at_potentials` builds the same object at given potentials (e.g. a library's float32
ones) without solving, to separate the error of a forward solve from that of its HVP.

HVP (:func:`hvp_reference`), by the implicit function theorem: along a tangent (vx, vy),
dC_ij = 2 s <x_i - y_j, vx_i - vy_j>; keeping both marginals fixed gives

    H [df; dg] = [e; h],  e_i = sum_j P_ij dC_ij,  h_j = sum_i P_ij dC_ij,

solved through S = diag(c) - P^T diag(1/r) P (symmetric PSD, null vector 1, the gauge
(f + k, g - k)): (S + alpha 1 1^T + tau I) dg = h - P^T (e / r) (the right side sums to
zero, so 1^T dg = 0: the minimum-norm solution in g; tau = TAU max(c) below), then
df = (e - P dg) / r; one Cholesky factorisation per set of potentials. Then, with dP_ij = P_ij (df_i + dg_j - dC_ij) / eps,

    HVP_x_i = 2 s (r_i vx_i - (P vy)_i) + 2 s sum_j dP_ij (x_i - y_j)
    HVP_y_j = 2 s (c_j vy_j - (P^T vx)_j) + 2 s sum_i dP_ij (y_j - x_i).

(With vy = 0 and s = 1: HVP_x_i = 2 r_i v_i + (2/eps) sum_j P_ij (df_i + dg_j - dC_ij)(x_i - y_j).)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Reference", "solve_potentials", "at_potentials", "hvp_reference", "rel_err"]


def rel_err(u, ref) -> float:
    """||u - ref|| / ||ref|| in float64 (inf when u has a NaN / inf)."""
    u = torch.as_tensor(u).detach().to(ref.device, torch.float64)
    if not torch.isfinite(u).all():
        return float("inf")
    return float((u - ref.double()).norm() / ref.double().norm())


def _cost(X, Y, s):
    """s |x_i - y_j|^2 in float64 (norm expansion: no n x m x d intermediate)."""
    C = (X * X).sum(1)[:, None] + (Y * Y).sum(1)[None, :] - 2.0 * (X @ Y.T)
    return (s * C).clamp_min_(0.0)


@dataclass
class Reference:
    """A solved problem in float64: clouds, weights, cost, potentials, plan and marginals."""

    x: torch.Tensor
    y: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    eps: float
    s: float
    C: torch.Tensor
    f: torch.Tensor
    g: torch.Tensor
    P: torch.Tensor
    marginal_error: float
    sinkhorn_iterations: int
    newton_iterations: int
    _chol: tuple | None = None

    def factor(self):
        """Factor of S + alpha 1 1^T + tau I (computed once): Cholesky, LU where that fails."""
        if self._chol is None:
            self._chol = _factor(_schur(self.P))
        return self._chol

    def solve(self, e: torch.Tensor, h: torch.Tensor):
        """Minimum-norm-in-g solution of H [df; dg] = [e; h] (requires sum e == sum h)."""
        r = self.P.sum(1)
        rhs = h - self.P.T @ (e / r)
        rhs = rhs - rhs.mean()  # exact zero sum (rounding)
        dg = _solve(self.factor(), rhs)
        df = (e - self.P @ dg) / r
        return df, dg

    def reg_ot_cost(self) -> float:
        a, b, eps = self.a, self.b, self.eps
        return float((a * (self.f - eps * a.log())).sum() + (b * (self.g - eps * b.log())).sum()
                     + eps * (a.sum() * b.sum() - self.P.sum()))

    def grads(self):
        r, c = self.P.sum(1), self.P.sum(0)
        gx = 2 * self.s * (r[:, None] * self.x - self.P @ self.y)
        gy = 2 * self.s * (c[:, None] * self.y - self.P.T @ self.x)
        return gx, gy


def _plan(f, g, C, eps):
    return torch.exp((f[:, None] + g[None, :] - C) / eps)


# Relative Tikhonov shift of the Schur complement. S spans some twenty decades here: at
# eps = 0.1 the plan of randn clouds in d = 64 is close to a permutation (about 1.3
# effective entries per row at n = 512), so S = diag(c) - P^T diag(1/r) P has many
# eigenvalues at the float64 rounding floor (-1e-16 relative) besides its null vector 1,
# and an unshifted LU or Cholesky fails as singular. Directions with eigenvalue lambda
# contribute O(lambda) to the HVP (the right side and the read-out both carry the plan's
# weak couplings), so the shift costs ~TAU relative: at n = 512, d = 64 the HVP with
# TAU = 1e-13 agrees with an eigendecomposition pseudo-inverse (cutoffs 1e-12 .. 1e-16)
# to 1e-11.
TAU = 1e-13


def _schur(P):
    """S + alpha 1 1^T + tau I, S = diag(c) - P^T diag(1/r) P (symmetrised), float64."""
    r, c = P.sum(1), P.sum(0)
    S = P.T @ (P / r[:, None])
    S.neg_()
    S.diagonal().add_(c)
    S = 0.5 * (S + S.T)
    m = c.shape[0]
    S += float(c.mean()) / m  # eigenvalue mean(c) along 1 / sqrt(m)
    S.diagonal().add_(TAU * float(c.max()))
    return S


def _factor(S):
    L, info = torch.linalg.cholesky_ex(S)
    if int(info) == 0:
        return ("chol", L)
    return ("lu", torch.linalg.lu_factor(S))


def _solve(fac, rhs):
    kind, F = fac
    if kind == "chol":
        return torch.cholesky_solve(rhs[:, None], F)[:, 0]
    return torch.linalg.lu_solve(F[0], F[1], rhs[:, None])[:, 0]


def solve_potentials(x, y, eps, a=None, b=None, scale_cost=1.0, threshold=1e-10, warm_iterations=200,
                     max_newton=100, verbose=False, strict=True) -> Reference:
    """Float64 potentials to an L1 marginal error below ``threshold`` (module docstring).

    ``strict=False``: return what Newton reached instead of raising (``marginal_error`` says it)."""
    X, Y = x.detach().double(), y.detach().double()
    n, m = X.shape[0], Y.shape[0]
    dev = X.device
    a = torch.full((n,), 1.0 / n, dtype=torch.float64, device=dev) if a is None else a.detach().double()
    b = torch.full((m,), 1.0 / m, dtype=torch.float64, device=dev) if b is None else b.detach().double()
    if not (bool((a > 0).all()) and bool((b > 0).all())):
        raise ValueError("hvp_reference_gpu: positive weights only")
    eps, s = float(eps), 1.0 / float(scale_cost)
    C = _cost(X, Y, s)
    la, lb = a.log(), b.log()
    f = torch.zeros(n, dtype=torch.float64, device=dev)
    g = torch.zeros(m, dtype=torch.float64, device=dev)
    # OTT's alternating iterations (g first) as the warm start
    for _ in range(warm_iterations):
        g = eps * lb - eps * torch.logsumexp((f[:, None] - C) / eps, 0)
        f = eps * la - eps * torch.logsumexp((g[None, :] - C) / eps, 1)

    def state(f, g):
        P = _plan(f, g, C, eps)
        r, c = P.sum(1), P.sum(0)
        err = max(float((r - a).abs().sum()), float((c - b).abs().sum()))
        res = float((r - a).square().sum() + (c - b).square().sum())
        return P, r, c, err, res

    P, r, c, err, res = state(f, g)
    k = 0
    while err > threshold and k < max_newton:
        k += 1
        # Newton: H [df; dg] = eps (a - r, b - c), Schur complement on g
        ra, rb = eps * (a - r), eps * (b - c)
        rhs = rb - P.T @ (ra / r)
        rhs = rhs - rhs.mean()
        dg = _solve(_factor(_schur(P)), rhs)
        df = (ra - P @ dg) / r
        # backtracking on the squared Euclidean marginal residual, which the Newton direction
        # of F(f, g) = (P 1 - a, P^T 1 - b) decreases for small enough steps
        t, accepted = 1.0, False
        while t > 1e-6:
            P2, r2, c2, err2, res2 = state(f + t * df, g + t * dg)
            if res2 < res:
                f, g, P, r, c, err, res, accepted = f + t * df, g + t * dg, P2, r2, c2, err2, res2, True
                break
            del P2
            t *= 0.5
        if verbose:
            print(f"  newton {k}: step {t:g} marginal error {err:.3e}", flush=True)
        if not accepted:  # float64 floor
            break
    if err > threshold and strict:
        raise RuntimeError(f"hvp_reference_gpu: Newton stopped at marginal error {err:.3e} > {threshold:g}")
    return Reference(X, Y, a, b, eps, s, C, f, g, P, err, warm_iterations, k)


def at_potentials(x, y, f, g, eps, a=None, b=None, scale_cost=1.0, C=None) -> Reference:
    """The float64 problem at given potentials (no solve): the HVP of :func:`hvp_reference` is then
    the implicit-function HVP at those potentials, with H built from their plan (r = P 1, c = P^T 1,
    as the streaming implementations do). ``C`` may be passed to reuse a float64 cost matrix."""
    X, Y = x.detach().double(), y.detach().double()
    n, m = X.shape[0], Y.shape[0]
    dev = X.device
    a = torch.full((n,), 1.0 / n, dtype=torch.float64, device=dev) if a is None else a.detach().double()
    b = torch.full((m,), 1.0 / m, dtype=torch.float64, device=dev) if b is None else b.detach().double()
    eps, s = float(eps), 1.0 / float(scale_cost)
    C = _cost(X, Y, s) if C is None else C
    f, g = f.detach().to(dev, torch.float64), g.detach().to(dev, torch.float64)
    P = _plan(f, g, C, eps)
    err = max(float((P.sum(1) - a).abs().sum()), float((P.sum(0) - b).abs().sum()))
    return Reference(X, Y, a, b, eps, s, C, f, g, P, err, 0, 0)


def hvp_reference(ref: Reference, vx=None, vy=None):
    """(HVP in x, HVP in y) of reg_ot_cost along the joint tangent (vx, vy) (float64)."""
    X, Y, P, s, eps = ref.x, ref.y, ref.P, ref.s, ref.eps
    VX = torch.zeros_like(X) if vx is None else vx.detach().double()
    VY = torch.zeros_like(Y) if vy is None else vy.detach().double()
    r, c = P.sum(1), P.sum(0)
    # dC_ij = 2 s (<x_i, vx_i> - <x_i, vy_j> - <y_j, vx_i> + <y_j, vy_j>)
    xv, yw = (X * VX).sum(1), (Y * VY).sum(1)
    dC = 2 * s * (xv[:, None] + yw[None, :] - X @ VY.T - VX @ Y.T)
    W = P * dC
    e, h = W.sum(1), W.sum(0)
    df, dg = ref.solve(e, h)
    dP = (P * (df[:, None] + dg[None, :]) - W) / eps
    del W, dC
    hx = 2 * s * (r[:, None] * VX - P @ VY) + 2 * s * (dP.sum(1)[:, None] * X - dP @ Y)
    hy = 2 * s * (c[:, None] * VY - P.T @ VX) + 2 * s * (dP.sum(0)[:, None] * Y - dP.T @ X)
    return hx, hy


if __name__ == "__main__":  # quick self-check on small sizes: python tests/hvp_reference_gpu.py
    import sys
    import time

    n, d = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (256, 64)
    torch.manual_seed(0)
    x, y, v = torch.randn(n, d), torch.randn(n, d), torch.randn(n, d)
    t0 = time.perf_counter()
    ref = solve_potentials(x, y, 0.1, verbose=True)
    hx, _ = hvp_reference(ref, vx=v)
    print(f"n={n} d={d}: marginal error {ref.marginal_error:.2e} after {ref.newton_iterations} Newton steps, "
          f"|hvp| {float(hx.norm()):.4e}, {time.perf_counter() - t0:.1f} s")
