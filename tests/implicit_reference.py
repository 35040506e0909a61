"""Dense float64 implicit-function-theorem references (tests only; small n, m).

Independent of the library's algebra: the derivatives come from torch.func on dense
formulas and one pseudo-inverse of the Jacobian of the optimality conditions.

    F(f, g; x, y, a, b) = eps (P 1 - a, P^T 1 - b),  P_ij = exp((f_i + g_j - C_ij)/eps)
    (df, dg) = -pinv(dF/d(f, g)) dF/dtheta . t          (the minimum-norm solution)

With KL-relaxed marginals (``taus`` = (tau_a, tau_b), rho = eps tau / (1 - tau)) the conditions
are GeomLoss's relaxed fixed point written with OTT-form potentials (f = f_geomloss + eps log a):
P 1 = a exp(-(f - eps log a)/rho_a) and likewise for b (a strict side keeps its balanced row),
the problem whose entropy is relative to a x b (``SamplesLoss(reach=...)``). OTT's
``LinearProblem(tau_a, tau_b)`` has P 1 = a exp(-f/rho_a) instead; the two agree only where
a = 1, so its potentials are not this mode's (OTT's relaxed problem is checked against OTT itself).
Only the x, y tangents are then used.

The gradient map G = (gx, gy, ga, gb) is the envelope gradient of OTT's reg_ot_cost;
its directional derivative along t is jvp(G, (t, df, dg)). Weight quantities depend on
the gauge; compare them after :func:`center_weights`.
"""

from __future__ import annotations

import torch
from torch.func import jacrev, jvp

from reference import sinkhorn_ott


def _cost(x, y, s):
    return s * ((x[:, None, :] - y[None, :, :]) ** 2).sum(-1)


_MASK: list = [None]  # the plan's support (set by Problem(mask=...)), None: every pair


def _plan(f, g, x, y, eps, s):
    P = torch.exp((f[:, None] + g[None, :] - _cost(x, y, s)) / eps)
    return P if _MASK[0] is None else torch.where(_MASK[0], P, 0.0)


_TAUS: list = [(1.0, 1.0)]  # (tau_a, tau_b) of the running Problem


def _target(pot, w, eps, tau):
    if tau == 1.0:
        return w
    lw = torch.log(torch.where(w > 0, w, 1.0))
    return torch.where(w > 0, w * torch.exp(-(pot - eps * lw) * (1.0 - tau) / (eps * tau)), 0.0)


def _foc(f, g, x, y, a, b, eps, s):
    P = _plan(f, g, x, y, eps, s)
    ta, tb = _TAUS[0]
    return torch.cat([eps * (P.sum(1) - _target(f, a, eps, ta)), eps * (P.sum(0) - _target(g, b, eps, tb))])


def _grad_map(f, g, x, y, a, b, eps, s):
    P = _plan(f, g, x, y, eps, s)
    r, c = P.sum(1), P.sum(0)
    gx = 2 * s * (r[:, None] * x - P @ y)
    gy = 2 * s * (c[:, None] * y - P.T @ x)
    ga = torch.where(a > 0, f - eps * torch.log(torch.where(a > 0, a, 1.0)) - eps + eps * b.sum(), eps * b.sum())
    gb = torch.where(b > 0, g - eps * torch.log(torch.where(b > 0, b, 1.0)) - eps + eps * a.sum(), eps * a.sum())
    return gx, gy, ga, gb


class Problem:
    """A solved problem in float64 (inputs: torch tensors of any float dtype)."""

    def __init__(self, x, y, a, b, eps, scale_cost=1.0, iters=20000, potentials=None, mask=None,
                 taus=(1.0, 1.0)):
        """``potentials`` = (f, g): evaluate the derivatives at these (OTT convention)
        instead of solving (the formulas then use the plan they define). ``mask`` (n, m) bool:
        the plan restricted to these pairs (a truncated plan; with ``potentials``); the mask is
        active while this object's methods run. ``taus``: relaxed marginals (module docstring;
        with ``potentials`` only)."""
        if taus != (1.0, 1.0) and potentials is None:
            raise ValueError("a relaxed Problem is evaluated at given potentials")
        self.mask = None if mask is None else torch.as_tensor(mask, dtype=torch.bool)
        self.taus = taus
        _MASK[0], _TAUS[0] = self.mask, taus
        d64 = lambda t: torch.as_tensor(t).detach().double()
        self.x, self.y, self.a, self.b = d64(x), d64(y), d64(a), d64(b)
        self.eps, self.s = float(eps), 1.0 / float(scale_cost)
        if potentials is None:
            self.f, self.g, self.cost = sinkhorn_ott(self.x, self.y, self.a, self.b, self.eps, scale_cost,
                                                     iters=iters, tol=1e-13)
        else:
            self.f, self.g = (d64(p) for p in potentials)
        n, m = self.x.shape[0], self.y.shape[0]
        act = torch.cat([self.a > 0, self.b > 0])
        fz = torch.where(self.a > 0, self.f, -torch.inf)  # zero weight: no mass (rows of P vanish)
        gz = torch.where(self.b > 0, self.g, -torch.inf)
        self.fz, self.gz = fz, gz
        H = jacrev(lambda fg: _foc(fg[:n], fg[n:], self.x, self.y, self.a, self.b, self.eps, self.s))(
            torch.cat([fz, gz]))
        H = torch.where(act[:, None] & act[None, :], H, 0.0)
        self.H_pinv = torch.linalg.pinv(H, hermitian=True, rtol=1e-12)
        self.act = act
        ev = torch.linalg.eigvalsh(H).abs()
        ev = ev[ev > 1e-10 * ev.max()]  # drop the gauge direction and the inactive rows
        self.condition = float(ev.max() / ev.min())

    def float32_tolerance(self, threshold: float, base: float = 1e-4) -> float:
        """The relative error a float32 solve stopped at marginal error ``threshold`` can promise
        on implicit derivatives of this problem: ``base`` or ``1e-2 * threshold * condition**2``,
        the larger. The forward's potentials carry an error of about ``threshold * condition``;
        the implicit system (the same operator) multiplies it by ``condition`` again. The factor
        1e-2 leaves a margin of 4 over the largest ratio measured on random draws (0.8e-3 to
        2.4e-3 * threshold * condition**2 for conditions 75 to 1900)."""
        return max(base, 1e-2 * threshold * self.condition**2)

    def _dfg(self, vx, vy, da, db):
        _MASK[0], _TAUS[0] = self.mask, self.taus
        n = self.x.shape[0]
        _, dF = jvp(lambda x, y, a, b: _foc(self.fz, self.gz, x, y, a, b, self.eps, self.s),
                    (self.x, self.y, self.a, self.b), (vx, vy, da, db))
        dF = torch.where(self.act, dF, 0.0)
        dfg = -self.H_pinv @ dF
        return dfg[:n], dfg[n:]

    def tangents(self, vx=None, vy=None, da=None, db=None):
        z = torch.zeros_like
        vx = z(self.x) if vx is None else vx.double()
        vy = z(self.y) if vy is None else vy.double()
        da = z(self.a) if da is None else da.double()
        db = z(self.b) if db is None else db.double()
        return vx, vy, da, db

    def hvp(self, vx=None, vy=None, da=None, db=None):
        """(d gx, d gy, d ga, d gb) along (vx, vy, da, db); give mass-preserving (da, db)."""
        _MASK[0], _TAUS[0] = self.mask, self.taus
        vx, vy, da, db = self.tangents(vx, vy, da, db)
        df, dg = self._dfg(vx, vy, da, db)
        _, out = jvp(lambda f, g, x, y, a, b: _grad_map(f, g, x, y, a, b, self.eps, self.s),
                     (self.fz, self.gz, self.x, self.y, self.a, self.b), (df, dg, vx, vy, da, db))
        return out

    def grads(self):
        _MASK[0], _TAUS[0] = self.mask, self.taus
        return _grad_map(self.fz, self.gz, self.x, self.y, self.a, self.b, self.eps, self.s)

    def potentials_vjp(self, uf, ug):
        """Gradients in (x, y, a, b) of <uf, f> + <ug, g> (give sum uf = sum ug)."""
        _MASK[0], _TAUS[0] = self.mask, self.taus
        n = self.x.shape[0]
        u = torch.cat([uf.double(), ug.double()])
        u = torch.where(self.act, u, 0.0)
        z = self.H_pinv @ u  # H symmetric
        _, pull = torch.func.vjp(lambda x, y, a, b: _foc(self.fz, self.gz, x, y, a, b, self.eps, self.s),
                                 self.x, self.y, self.a, self.b)
        return tuple(-t for t in pull(torch.where(self.act, z, 0.0)))

    def apply_vjp(self, v, u, axis=1):
        """Gradients in (x, y, a, b) of <u, apply(v, axis)> with implicit potentials
        (axis=1: P v, v indexed by y; axis=0: P^T v, v indexed by x)."""
        _MASK[0], _TAUS[0] = self.mask, self.taus
        v, u = v.double(), u.double()
        n = self.x.shape[0]

        def val(f, g, x, y):
            P = _plan(f, g, x, y, self.eps, self.s)
            out = P @ v if axis == 1 else P.T @ v
            return (out * u).sum()

        gf, gg, gx, gy = torch.func.grad(val, argnums=(0, 1, 2, 3))(self.fz, self.gz, self.x, self.y)
        gf = torch.where(self.a > 0, gf, 0.0)
        gg = torch.where(self.b > 0, gg, 0.0)
        px, py, pa, pb = self.potentials_vjp(gf, gg)  # P v is gauge invariant: sum gf = sum gg
        return gx + px, gy + py, pa, pb


def center_weights(t: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Remove the mean over the active entries (the gauge / mass direction)."""
    t = t.double()
    if mask is None:
        return t - t.mean()
    return torch.where(mask, t - t[mask].mean(), 0.0)
