"""The relaxed-marginal pieces of ``samples_loss_ops``: the loss's per-point terms and the rows of
the backward direction (``torch_api.samples_loss`` states the definitions; ``core.unbalanced``
holds the formulas shared with the JAX frontend).

With rho_x != rho_y the self problems are split (``unbalanced.self_problems_split``) and their
potentials come packed: f_aa = [p_a, q_a] (2N entries), g_bb = [p_b, q_b] (2M entries), p damped
with rho_x (first marginal), q with rho_y (second marginal).
"""

from __future__ import annotations

import torch

from ot_triton_jax.core.unbalanced import geomloss_weight, geomloss_weight_slope, self_problems_split


def outputs(new, debias: bool, rho_x, rho_y, eps: float, terms: bool):
    """(F, G): the loss's per-point dual terms (``terms``) or the potentials (module docstring)."""
    w = (lambda p, r: geomloss_weight(torch, p, r, eps)) if terms else (lambda p, r: p)
    f_ba, g_ab, f_aa, g_bb = new
    if not debias:
        return w(f_ba, rho_x).clone(), w(g_ab, rho_y).clone()
    out = []
    for cross, own, rho_ in ((f_ba, f_aa, rho_x), (g_ab, g_bb, rho_y)):
        if self_problems_split(rho_x, rho_y):  # own = [p, q]: 1/2 (w_x(p) + w_y(q))
            n = cross.shape[0]
            out.append(w(cross, rho_) - 0.5 * (w(own[:n], rho_x) + w(own[n:], rho_y)))
        else:
            out.append(w(cross, rho_) - w(own, rho_))
    return out


def mean(pv_p1):
    return pv_p1[0] / pv_p1[1][:, None]


def relaxed_row(Sc, mean_t, mean_s, f_st, f_ss, old_ss, rho_, rho_x, rho_y, eps, debias: bool, terms: bool):
    """damp w'(f_st) (s - P t) minus the self problem's terms (module docstring): damp w'(f_ss) (s - Q s),
    or 1/2 [damp_x w_x'(p) (s - Q_q s) + damp_y w_y'(q) (s - Q_p s)] when split; w' = 1 for the
    potentials (``terms`` False). ``mean_s(row, col_old)``: the row-normalised self plan's mean."""
    def term(pot, r, mean):
        d = 1.0 if r is None else r / (r + eps)
        slope = geomloss_weight_slope(torch, pot, r, eps)[:, None] if terms else 1.0
        return d * slope * (Sc.x - mean)

    row = term(f_st, rho_, mean_t)
    if not debias:
        return row
    if not self_problems_split(rho_x, rho_y):
        return row - term(f_ss, rho_, mean_s(f_ss, old_ss))
    n = Sc.n
    p, q, op, oq = f_ss[:n], f_ss[n:], old_ss[:n], old_ss[n:]
    return row - 0.5 * (term(p, rho_x, mean_s(p, oq)) + term(q, rho_y, mean_s(q, op)))
