"""Float64 dense references of the label-augmented cost (numpy; the full n x m matrix).

C_ij = s (|x_i - y_j|^2 + W[label_x_i, label_y_j]). :func:`ott_sinkhorn` is OTT's alternating
log-domain loop (g then f, P = exp((f + g - C)/eps), reg_ot_cost as OTT defines it, its
gradients by the envelope formula); :func:`geomloss_sinkhorn` is GeomLoss's symmetric
eps-scaling loop at a fixed schedule with its last extrapolation (potentials and loss).
"""

from __future__ import annotations

import numpy as np
from scipy.special import logsumexp


def cost(x, y, lx, ly, w, s):
    d = ((x[:, None, :] - y[None, :, :]) ** 2).sum(-1)
    return s * (d + w[np.ix_(lx, ly)])


def _log(w):
    with np.errstate(divide="ignore"):
        return np.log(w)


def ott_sinkhorn(x, y, a, b, lx, ly, w, eps, s=1.0, iters=3000):
    """(f, g, reg_ot_cost, grad_x, grad_y, grad_a, grad_b, grad_eps, plan) of OTT's balanced solve."""
    x, y, a, b, w = (np.asarray(v, np.float64) for v in (x, y, a, b, w))
    c = cost(x, y, lx, ly, w, s)
    la, lb = _log(a), _log(b)
    f, g = np.zeros(len(a)), np.zeros(len(b))
    for _ in range(iters):
        g = eps * lb - eps * logsumexp((f[:, None] - c) / eps, axis=0)
        f = eps * la - eps * logsumexp((g[None, :] - c) / eps, axis=1)
    p = np.exp((f[:, None] + g[None, :] - c) / eps)
    pa, pb = a > 0, b > 0
    reg = (a[pa] * (f[pa] - eps * la[pa])).sum() + (b[pb] * (g[pb] - eps * lb[pb])).sum() + eps * (
        a.sum() * b.sum() - p.sum())
    r, col = p.sum(1), p.sum(0)
    gx = 2 * s * (r[:, None] * x - p @ y)
    gy = 2 * s * (col[:, None] * y - p.T @ x)
    ga = np.where(pa, f - eps * np.where(pa, la, 0) - eps + eps * b.sum(), eps * b.sum())
    gb = np.where(pb, g - eps * np.where(pb, lb, 0) - eps + eps * a.sum(), eps * a.sum())
    ent = (a[pa] * la[pa]).sum() + (b[pb] * lb[pb]).sum()
    pc = (p * c).sum()
    rf = (r[pa] * f[pa]).sum() + (col[pb] * g[pb]).sum()
    geps = -ent + a.sum() * b.sum() - p.sum() + (rf - pc) / eps
    return dict(f=f, g=g, cost=reg, gx=gx, gy=gy, ga=ga, gb=gb, geps=geps, plan=p)


def geomloss_ot(x, y, a, b, cxy, cyx, cxx, cyy, schedule):
    """GeomLoss's sinkhorn_loop (symmetric updates, last extrapolation) on dense cost matrices:
    (f_ba, g_ab, f_aa, g_bb) with f_aa, g_bb None when cxx is None."""
    la, lb = _log(a), _log(b)

    def softmin(e, c, h):
        return -e * logsumexp(h[None, :] / e - c / e, axis=1)

    e = schedule[0]
    g_ab, f_ba = softmin(e, cyx, la), softmin(e, cxy, lb)
    deb = cxx is not None
    if deb:
        f_aa, g_bb = softmin(e, cxx, la), softmin(e, cyy, lb)
    for e in schedule:
        ft, gt = softmin(e, cxy, lb + g_ab / e), softmin(e, cyx, la + f_ba / e)
        g_ab, f_ba = 0.5 * (g_ab + gt), 0.5 * (f_ba + ft)
        if deb:
            fa, gb = softmin(e, cxx, la + f_aa / e), softmin(e, cyy, lb + g_bb / e)
            f_aa, g_bb = 0.5 * (f_aa + fa), 0.5 * (g_bb + gb)
    e = schedule[-1]
    f_ba, g_ab = softmin(e, cxy, lb + g_ab / e), softmin(e, cyx, la + f_ba / e)
    if deb:
        f_aa, g_bb = softmin(e, cxx, la + f_aa / e), softmin(e, cyy, lb + g_bb / e)
        return f_ba, g_ab, f_aa, g_bb
    return f_ba, g_ab, None, None
