"""Float64 dense references of the label-augmented cost (numpy; the full n x m matrix).

C_ij = s (|x_i - y_j|^2 + W[label_x_i, label_y_j]). :func:`ott_sinkhorn` is OTT's alternating
log-domain loop (g then f, P = exp((f + g - C)/eps), reg_ot_cost as OTT defines it, its
gradients by the envelope formula); :func:`geomloss_loss` is GeomLoss's symmetric
eps-scaling loop at a fixed schedule with its last extrapolation (loss, potentials, gradients).
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
    """f, g, reg_ot_cost, its gradients (x, y, a, b, eps, s) and the plan of OTT's balanced solve."""
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
    return dict(f=f, g=g, cost=reg, gx=gx, gy=gy, ga=ga, gb=gb, geps=geps, gs=pc / s, plan=p)


def geomloss_loss(x, y, a, b, lx, ly, w, schedule, debias=True):
    """GeomLoss's SamplesLoss("sinkhorn", p=2) with C = (|x - y|^2 + W[lx, ly]) / 2 at a fixed
    eps ``schedule``: (loss, F, G, grad_x, grad_y), the gradients by GeomLoss's rule (the last
    extrapolation differentiated with detached inputs: a_i ((Q x)_i - (P y)_i))."""
    x, y, a, b, w = (np.asarray(v, np.float64) for v in (x, y, a, b, w))
    la, lb = _log(a), _log(b)
    c = {k: cost(u, v, lu, lv, w, 0.5) for k, (u, v, lu, lv) in
         dict(xy=(x, y, lx, ly), yx=(y, x, ly, lx), xx=(x, x, lx, lx), yy=(y, y, ly, ly)).items()}

    def logits(e, cm, h):  # h_j - C_ij / eps, h = log w + pot / eps
        return h[None, :] - cm / e

    def softmin(e, cm, h):
        return -e * logsumexp(logits(e, cm, h), axis=1)

    e = schedule[0]
    f_ba, g_ab = softmin(e, c["xy"], lb), softmin(e, c["yx"], la)
    f_aa, g_bb = softmin(e, c["xx"], la), softmin(e, c["yy"], lb)
    for e in schedule:
        ft, gt = softmin(e, c["xy"], lb + g_ab / e), softmin(e, c["yx"], la + f_ba / e)
        fa, gb = softmin(e, c["xx"], la + f_aa / e), softmin(e, c["yy"], lb + g_bb / e)
        f_ba, g_ab, f_aa, g_bb = 0.5 * (f_ba + ft), 0.5 * (g_ab + gt), 0.5 * (f_aa + fa), 0.5 * (g_bb + gb)
    e = schedule[-1]
    hs = dict(xy=lb + g_ab / e, yx=la + f_ba / e, xx=la + f_aa / e, yy=lb + g_bb / e)
    new = {k: softmin(e, c[k], h) for k, h in hs.items()}

    def mean(k, pts):  # row-normalised plan of the last extrapolation times pts
        lg = logits(e, c[k], hs[k])
        p = np.exp(lg - logsumexp(lg, axis=1, keepdims=True))
        return p @ pts

    if debias:
        F, G = new["xy"] - new["xx"], new["yx"] - new["yy"]
        gx = a[:, None] * (mean("xx", x) - mean("xy", y))
        gy = b[:, None] * (mean("yy", y) - mean("yx", x))
    else:
        F, G = new["xy"], new["yx"]
        gx = a[:, None] * (x - mean("xy", y))
        gy = b[:, None] * (y - mean("yx", x))
    return (a * F).sum() + (b * G).sum(), F, G, gx, gy
