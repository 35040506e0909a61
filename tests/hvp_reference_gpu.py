"""Dense float64 reference of the Sinkhorn Hessian-vector product, for GPU sizes (n, m ~ 8192).

Used by ``tests/test_hvp_gpu.py`` and ``bench/bench_hvp.py``. Torch only, on the inputs'
device; memory a few dense float64 n x m matrices (8192^2 x 8 B = 512 MiB each).

Problem (OTT conventions): C_ij = s |x_i - y_j|^2 with s = 1/scale_cost, epsilon absolute,
P_ij = exp((f_i + g_j - C_ij)/eps), marginals P 1 = a, P^T 1 = b (uniform by default),
L = OTT's reg_ot_cost, whose envelope gradient is gx_i = 2 s sum_j P_ij (x_i - y_j).

Potentials (:func:`solve_potentials`): plain Sinkhorn is hopeless here (at eps = 0.1 on
randn clouds in d = 64 the alternating iterations need ~1000 iterations to reach a marginal
error of 1e-3 and do not reach 1e-10 within 20000), so a few log-domain Sinkhorn iterations
warm-start a damped Newton method on the dual

    D(f, g) = <f, a> + <g, b> - eps sum_ij P_ij,   grad D = (a - P 1, b - P^T 1),
    -eps Hess D = H = [[diag(r), P], [P^T, diag(c)]],  r = P 1, c = P^T 1,

each Newton system solved by the Schur complement on g (below), until the L1 marginal
error max(|P 1 - a|_1, |P^T 1 - b|_1) is below ``threshold`` (1e-10 by default; the float64
floor is ~1e-15).

HVP (:func:`hvp_reference`), by the implicit function theorem: along a tangent (vx, vy),
dC_ij = 2 s <x_i - y_j, vx_i - vy_j>; keeping both marginals fixed gives

    H [df; dg] = [e; h],  e_i = sum_j P_ij dC_ij,  h_j = sum_i P_ij dC_ij,

solved through S = diag(c) - P^T diag(1/r) P (symmetric PSD, null vector 1, the gauge
(f + k, g - k)): (S + alpha 1 1^T) dg = h - P^T (e / r) (the right side sums to zero, so
1^T dg = 0: the minimum-norm solution in g), df = (e - P dg) / r; one Cholesky
factorisation. Then, with dP_ij = P_ij (df_i + dg_j - dC_ij) / eps,

    HVP_x_i = 2 s (r_i vx_i - (P vy)_i) + 2 s sum_j dP_ij (x_i - y_j)
    HVP_y_j = 2 s (c_j vy_j - (P^T vx)_j) + 2 s sum_i dP_ij (y_j - x_i).

(With vy = 0 and s = 1: HVP_x_i = 2 r_i v_i + (2/eps) sum_j P_ij (df_i + dg_j - dC_ij)(x_i - y_j).)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Reference", "solve_potentials", "hvp_reference", "rel_err"]


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
    _chol: torch.Tensor | None = None
    _alpha: float = 0.0

    def factor(self):
        """Cholesky factor of S + alpha 1 1^T (computed once)."""
        if self._chol is None:
            r, c = self.P.sum(1), self.P.sum(0)
            S = torch.diag(c) - self.P.T @ (self.P / r[:, None])
            S = 0.5 * (S + S.T)
            m = c.shape[0]
            self._alpha = float(c.mean()) / m  # eigenvalue alpha m = mean(c) along 1 / sqrt(m)
            S += self._alpha
            self._chol = torch.linalg.cholesky(S)
            del S
        return self._chol

    def solve(self, e: torch.Tensor, h: torch.Tensor):
        """Minimum-norm-in-g solution of H [df; dg] = [e; h] (requires sum e == sum h)."""
        r = self.P.sum(1)
        rhs = h - self.P.T @ (e / r)
        rhs = rhs - rhs.mean()  # exact zero sum (rounding)
        dg = torch.cholesky_solve(rhs[:, None], self.factor())[:, 0]
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


def solve_potentials(x, y, eps, a=None, b=None, scale_cost=1.0, threshold=1e-10, warm_iterations=200,
                     max_newton=100, verbose=False) -> Reference:
    """Float64 potentials to an L1 marginal error below ``threshold`` (module docstring)."""
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
        return P, r, c, err

    P, r, c, err = state(f, g)
    k = 0
    while err > threshold and k < max_newton:
        k += 1
        # Newton: H [df; dg] = eps (a - r, b - c), Schur complement on g
        S = torch.diag(c) - P.T @ (P / r[:, None])
        S = 0.5 * (S + S.T)
        S += float(c.mean()) / m
        ra, rb = eps * (a - r), eps * (b - c)
        rhs = rb - P.T @ (ra / r)
        rhs = rhs - rhs.mean()
        dg = torch.linalg.solve(S, rhs)
        del S
        df = (ra - P @ dg) / r
        # backtracking on the marginal error (the L1 norm of grad D)
        t, accepted = 1.0, False
        while t > 1e-6:
            P2, r2, c2, err2 = state(f + t * df, g + t * dg)
            if err2 < err:
                f, g, P, r, c, err, accepted = f + t * df, g + t * dg, P2, r2, c2, err2, True
                break
            del P2
            t *= 0.5
        if verbose:
            print(f"  newton {k}: step {t:g} marginal error {err:.3e}", flush=True)
        if not accepted:  # float64 floor
            break
    if err > threshold:
        raise RuntimeError(f"hvp_reference_gpu: Newton stopped at marginal error {err:.3e} > {threshold:g}")
    return Reference(X, Y, a, b, eps, s, C, f, g, P, err, warm_iterations, k)


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
