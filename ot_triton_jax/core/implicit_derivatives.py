"""Second-order and implicit derivatives of OTT's balanced problem, written once for both frontends.

Conventions (OTT-JAX): C_ij = s |x_i - y_j|^2 (s = 1/scale_cost), P_ij =
exp((f_i + g_j - C_ij)/eps), r = P 1, c = P^T 1, and the envelope gradient of
reg_ot_cost (the map the frontends differentiate a second time)

    gx_i = 2s (r_i x_i - (P y)_i),   gy_j = 2s (c_j y_j - (P^T x)_j),
    ga_i = f_i - eps log a_i - eps + eps sum b,   gb_j = g_j - eps log b_j - eps + eps sum a.

:func:`hessian_apply` is its directional derivative in a direction (vx, vy, da, db) with
the potentials moving as the solution does: (df, dg) solve H [df; dg] = rhs
(:mod:`.implicit_solve`), where rhs is the linearized marginal constraint,

    rhs_f = e + eps da,   e_i = sum_j P_ij dC_ij,   dC_ij = 2s <x_i - y_j, vx_i - vy_j>,
    rhs_g = h + eps db,   h_j = sum_i P_ij dC_ij,

and then, with z_ij = x_i - y_j and dP_ij = P_ij (df_i + dg_j - dC_ij)/eps,

    d gx_i = 2s sum_j [dP_ij z_ij + P_ij (vx_i - vy_j)].

The part sum_j P_ij z_ij <z_ij, vx_i - vy_j> holds the per-row second moment
sum_j P_ij (<vx_i, y_j> + <x_i, vy_j>) y_j, taken by one weighted pass
(kernels/apply_weighted.py); everything else is ordinary plan products. d gy is the same
with the two sides swapped. The Hessian is symmetric, so this one function is both the
JVP of the gradient (JAX's ``custom_jvp``) and its VJP (torch's double backward).

The weights. The balanced problem is defined only for sum a = sum b, and f, g are
defined up to the gauge (f + t, g - t), which shifts (ga, gb) by (t, -t). Derivatives in
the weights are therefore taken on the mass-preserving directions: a direction (da, db)
is first projected orthogonally onto sum_{a>0} da = sum_{b>0} db (entries at zero
weights are dropped), and the resulting (d ga, d gb) is projected the same way (the
gauge component removed). The operator is then symmetric and exact on every
mass-preserving direction; OTT's own tests compare weight Hessians after the same
centring. Entries at zero weights keep d ga_i = eps sum db (their gradient is eps sum b).

:func:`potentials_vjp` is the implicit VJP of (f, g) themselves (OTT's ImplicitDiff):
for a cotangent (uf, ug), first projected off the gauge direction, it solves
H [zf; zg] = [uf; ug] and pulls back through the constraint:

    x_i: 2s [zf_i (r_i x_i - (P y)_i) + x_i (P zg)_i - (P (zg * y))_i],  y: the same swapped,
    a: eps zf,  b: eps zg   (then projected as above).

So it is the derivative of the potentials normalized so that sum_{a>0} f - sum_{b>0} g
is held at its solved value; for functions invariant under the gauge (f + t, g - t) it is
the derivative, whatever the normalization. :func:`apply_vjp` differentiates the matrix-free
product P v in x, y, f, g and v at fixed potentials (the frontends chain f, g into
:func:`potentials_vjp`).

KL-relaxed marginals (``taus`` = OTT's (tau_a, tau_b) with a tau < 1; :mod:`.unbalanced`).
The gradient of reg_ot_cost in x, y is the same envelope formula in P (OTT's default gives
it; it is the gradient of the dual value V = -rho_a <a, e^{-f/rho_a}> - rho_b <b, e^{-g/rho_b}>
- eps sum P, stationary at the fixed point r = a e^{-f/rho_a}, c = b e^{-g/rho_b}), so
:func:`hessian_apply` in (vx, vy) is the Hessian of V: the same formulas with (df, dg) from
the relaxed H of :mod:`.implicit_solve` (diagonal blocks diag(r/tau_a), diag(c/tau_b)). The
weights enter the relaxed constraint as eps d log a: rhs_f += eps (r/a) da, rhs_g += eps
(c/b) db; no gauge, so nothing is projected and :func:`potentials_vjp` is the derivative of
the potentials themselves, with a: eps (r/a) zf, b: eps (c/b) zg. The a, b gradients of
OTT's relaxed reg_ot_cost are partials at fixed potentials (not a gradient of V): ga_i =
d div_a/d a_i + eps sum b with div_a of :func:`.unbalanced.ott_marginal_term`, so along x, y
tangents d ga_i = (1/tau_a) exp(-(f_i - eps log a_i)/rho_a) df_i (df_i when tau_a = 1), which
:func:`hessian_apply` returns (the JVP; the map is no longer symmetric there, so a VJP must not
use it); tangents in a, b raise :func:`relaxed_weight_message`.

Second derivatives involving epsilon or scale_cost are not implemented: the frontends
raise (``checks.second_order_message``) rather than return a partial number.
"""

from __future__ import annotations

from .implicit_solve import ImplicitOptions, PlanPasses, col, schur_solve, symmetric_solve
from .unbalanced import is_balanced


def relaxed_weight_message(what: str) -> str:
    return (f"{what} is not implemented with a KL-relaxed marginal (tau_a or tau_b < 1): the gradient of "
            "reg_ot_cost in a, b is OTT's partial derivative at fixed potentials, whose own derivative is not "
            "provided. Second derivatives in x, y (HVPs) and the derivatives of the potentials are; detach a "
            "and b (or use tau_a = tau_b = 1) for second derivatives involving the weights")


def _balanced(taus) -> bool:
    return is_balanced(*taus)


def _active_shift(xp, ua, ub, mask_a, mask_b):
    """The orthogonal projection removing the component along (1_{a>0}, -1_{b>0})."""
    t = col((xp.where(mask_a, ua, 0.0).sum(-1) - xp.where(mask_b, ub, 0.0).sum(-1))
            / (mask_a.sum(-1) + mask_b.sum(-1)))
    return xp.where(mask_a, ua - t, ua), xp.where(mask_b, ub + t, ub)


def weight_direction(xp, da, db, like_a, like_b, mask_a, mask_b):
    """A weight direction projected on the mass-preserving ones (zero at zero weights)."""
    da = xp.zeros_like(like_a) if da is None else xp.where(mask_a, da, 0.0)
    db = xp.zeros_like(like_b) if db is None else xp.where(mask_b, db, 0.0)
    return _active_shift(xp, da, db, mask_a, mask_b)


def _row_tangent(ops: PlanPasses, vx, vy, df, dg, r, py, pvy, pdel, delta):
    """d gx (rows of ``ops``) given the solved (df, dg); see the module docstring.

    py = P y, pvy = P vy, pdel = P <y, vy> (None without vy), delta = <y_j, vy_j>."""
    xp = ops.xp
    x, y, eps, s = ops.x, ops.y, ops.eps, ops.s
    d = x.shape[-1]
    cols = [col(dg), col(dg) * y]
    if vy is not None:
        cols.append(col(delta) * y)
    pv, _ = ops.apply(xp.concatenate(cols, axis=-1))
    pdg, pdgy = pv[..., 0], pv[..., 1:1 + d]
    mean_dir = col(r) * x - py  # sum_j P_ij z_ij
    # W_i = sum_j P_ij z_ij <z_ij, vx_i - vy_j>
    w_rows, w_cols = [], []
    W = xp.zeros_like(x)
    if vx is not None:
        alpha = (x * vx).sum(-1)
        W = W + col(alpha) * mean_dir - x * col((py * vx).sum(-1))
        w_rows.append(vx)
        w_cols.append(y)
    if vy is not None:
        W = W - x * col((x * pvy).sum(-1) - pdel) - pv[..., 1 + d:1 + 2 * d]
        w_rows.append(x)
        w_cols.append(vy)
    if w_rows:
        W = W + ops.weighted(xp.concatenate(w_rows, axis=-1), xp.concatenate(w_cols, axis=-1), y)
    out = col(df) * mean_dir + x * col(pdg) - pdgy - 2.0 * s * W
    out = out * (2.0 * s / eps)
    if vx is not None:
        out = out + 2.0 * s * col(r) * vx
    if vy is not None:
        out = out - 2.0 * s * pvy
    return out


def hessian_apply(ops: PlanPasses, f, g, a, b, tangents, want, opts: ImplicitOptions,
                  taus: tuple[float, float] = (1.0, 1.0), symmetric: bool = False):
    """Directional derivative of (gx, gy, ga, gb) (module docstring).

    ``tangents`` = (vx, vy, da, db), None for zero; ``want`` = 4 bools for the outputs; ``taus``:
    OTT's (tau_a, tau_b) (a relaxed problem takes x, y tangents and outputs only).
    ``symmetric``: a self problem (x against itself, a = b, f = g up to the solve's accuracy,
    tau_a = tau_b) moved as one cloud (vx = vy): the right-hand sides are equal, so
    df = dg solves the symmetric system of :func:`.implicit_solve.symmetric_solve` (one pass
    per CG iteration, well conditioned at any eps) and tx = ty.
    Returns ((tx, ty, ta, tb) with None where not wanted, (iterations, rel. residual, converged))."""
    if symmetric:
        return _symmetric_hessian_apply(ops, f, a, tangents, want, opts, taus)
    xp = ops.xp
    x, y, eps, s = ops.x, ops.y, ops.eps, ops.s
    vx, vy, da, db = tangents
    if not _balanced(taus) and (da is not None or db is not None):
        raise NotImplementedError(relaxed_weight_message("A second derivative of reg_ot_cost in a or b"))
    d = x.shape[-1]
    mask_a, mask_b = a > 0, b > 0
    has_w = da is not None or db is not None
    if has_w:
        da, db = weight_direction(xp, da, db, a, b, mask_a, mask_b)

    cols = [y] + ([vy, col((y * vy).sum(-1))] if vy is not None else [])
    pv, r = ops.apply(xp.concatenate(cols, axis=-1))
    py = pv[..., :d]
    pvy, pdel = (pv[..., d:2 * d], pv[..., 2 * d]) if vy is not None else (None, None)
    cols = [x] + ([vx, col((x * vx).sum(-1))] if vx is not None else [])
    pt, c = ops.apply_t(xp.concatenate(cols, axis=-1))
    ptx = pt[..., :d]
    ptvx, ptal = (pt[..., d:2 * d], pt[..., 2 * d]) if vx is not None else (None, None)

    e, h = xp.zeros_like(r), xp.zeros_like(c)
    alpha = delta = None
    if vx is not None:
        alpha = (x * vx).sum(-1)
        e = e + r * alpha - (py * vx).sum(-1)
        h = h + ptal - (y * ptvx).sum(-1)
    if vy is not None:
        delta = (y * vy).sum(-1)
        e = e - (x * pvy).sum(-1) + pdel
        h = h - (ptx * vy).sum(-1) + c * delta
    rhs_f, rhs_g = 2.0 * s * e, 2.0 * s * h
    if has_w:
        rhs_f, rhs_g = rhs_f + eps * da, rhs_g + eps * db
    df, dg, info = schur_solve(ops, rhs_f, rhs_g, r, c, mask_a, mask_b, opts, taus)

    tx = ty = ta = tb = None
    if want[0]:
        tx = _row_tangent(ops, vx, vy, df, dg, r, py, pvy, pdel, delta)
    if want[1]:
        ty = _row_tangent(ops.transposed(), vy, vx, dg, df, c, ptx, ptvx, ptal, alpha)
    if (want[2] or want[3]) and not _balanced(taus):
        ta = _relaxed_weight_tangent(xp, df, f, a, eps, taus[0]) if want[2] else None
        tb = _relaxed_weight_tangent(xp, dg, g, b, eps, taus[1]) if want[3] else None
    elif want[2] or want[3]:
        sda = col(da.sum(-1)) if has_w else 0.0
        sdb = col(db.sum(-1)) if has_w else 0.0
        ta, tb = df, dg
        if has_w:
            ta = ta - eps * da / xp.where(mask_a, a, 1.0)
            tb = tb - eps * db / xp.where(mask_b, b, 1.0)
        ta = xp.where(mask_a, ta, 0.0) + eps * sdb
        tb = xp.where(mask_b, tb, 0.0) + eps * sda
        ta, tb = _active_shift(xp, ta, tb, mask_a, mask_b)
        ta, tb = (ta if want[2] else None), (tb if want[3] else None)
    return (tx, ty, ta, tb), info


def _symmetric_hessian_apply(ops: PlanPasses, f, a, tangents, want, opts: ImplicitOptions, taus):
    """:func:`hessian_apply` of a self problem moved as one cloud (its ``symmetric`` case): the
    row quantities serve both sides (P^T = P, c = r), and ta = tb (the general case's outputs
    with df = dg = u, whose gauge component is zero)."""
    xp = ops.xp
    x, s = ops.x, ops.s
    v, vy, da, db = tangents
    if v is None or vy is not v or da is not None or db is not None:
        raise ValueError("hessian_apply(symmetric=True) takes one x tangent for both sides (vx is vy) and no weight "
                         "tangents")
    d = x.shape[-1]
    delta = (x * v).sum(-1)
    pv, r = ops.apply(xp.concatenate([x, v, col(delta)], axis=-1))
    py, pvy, pdel = pv[..., :d], pv[..., d:2 * d], pv[..., 2 * d]
    e = r * delta - (py * v).sum(-1) - (x * pvy).sum(-1) + pdel
    mask = a > 0
    u, info = symmetric_solve(ops, 2.0 * s * e, r, mask, opts, taus[0])
    t = _row_tangent(ops, v, v, u, u, r, py, pvy, pdel, delta) if want[0] or want[1] else None
    w = None
    if want[2] or want[3]:
        w = (xp.where(mask, u, 0.0) if _balanced(taus) else _relaxed_weight_tangent(xp, u, f, a, ops.eps, taus[0]))
    return tuple(o if k else None for o, k in zip((t, t, w, w), want)), info


def _relaxed_weight_tangent(xp, dpot, pot, w, eps, tau: float):
    """d ga = (1/tau) exp(-(f - eps log a)/rho) df on a > 0, 0 elsewhere (module docstring)."""
    pos = w > 0
    if tau == 1.0:
        return xp.where(pos, dpot, 0.0)
    u = xp.where(pos, pot, 0.0) - eps * xp.log(xp.where(pos, w, 1.0))
    return xp.where(pos, xp.exp(-u * ((1.0 - tau) / tau) / eps) * dpot / tau, 0.0)


def _pullback_row(ops: PlanPasses, zf, zg, r, py):
    """2s [zf_i (r_i x_i - (P y)_i) + x_i (P zg)_i - (P (zg * y))_i] (rows of ``ops``)."""
    xp = ops.xp
    x, y, s = ops.x, ops.y, ops.s
    pv, _ = ops.apply(xp.concatenate([col(zg), col(zg) * y], axis=-1))
    return 2.0 * s * (col(zf) * (col(r) * x - py) + x * pv[..., :1] - pv[..., 1:])


def potentials_vjp(ops: PlanPasses, f, g, a, b, uf, ug, want, opts: ImplicitOptions,
                   taus: tuple[float, float] = (1.0, 1.0)):
    """Implicit VJP of (f, g) for cotangents (uf, ug) (module docstring): ((tx, ty, ta, tb), info).
    ``taus``: OTT's (tau_a, tau_b); with a tau < 1 nothing is projected (no gauge)."""
    xp = ops.xp
    eps = ops.eps
    mask_a, mask_b = a > 0, b > 0
    balanced = _balanced(taus)
    uf = xp.zeros_like(f) if uf is None else xp.where(mask_a, uf, 0.0)
    ug = xp.zeros_like(g) if ug is None else xp.where(mask_b, ug, 0.0)
    if balanced:
        uf, ug = _active_shift(xp, uf, ug, mask_a, mask_b)
    py, r = ops.apply(ops.y)
    ptx, c = ops.apply_t(ops.x)
    zf, zg, info = schur_solve(ops, uf, ug, r, c, mask_a, mask_b, opts, taus)
    tx = _pullback_row(ops, zf, zg, r, py) if want[0] else None
    ty = _pullback_row(ops.transposed(), zg, zf, c, ptx) if want[1] else None
    ta = tb = None
    if (want[2] or want[3]) and not balanced:  # rhs eps (r/a) da, eps (c/b) db
        ta = xp.where(mask_a, eps * zf * r / xp.where(mask_a, a, 1.0), 0.0)
        tb = xp.where(mask_b, eps * zg * c / xp.where(mask_b, b, 1.0), 0.0)
    elif want[2] or want[3]:
        ta, tb = _active_shift(xp, xp.where(mask_a, eps * zf, 0.0), xp.where(mask_b, eps * zg, 0.0), mask_a, mask_b)
    return (tx, ty, ta if want[2] else None, tb if want[3] else None), info


def apply_vjp(ops: PlanPasses, v, u):
    """Cotangents of out = P v (rows of ``ops``; v (m, k), u = d out (n, k)) at fixed
    potentials: (d x, d y, d f, d g, d v)."""
    x, y, eps, s = ops.x, ops.y, ops.eps, ops.s
    pv, _ = ops.apply(v)
    ptu, _ = ops.apply_t(u)
    up = (u * pv).sum(-1)
    vp = (v * ptu).sum(-1)
    dx = -(2.0 * s / eps) * (x * col(up) - ops.weighted(u, v, y))
    dy = -(2.0 * s / eps) * (y * col(vp) - ops.weighted_t(v, u, x))
    return dx, dy, up / eps, vp / eps, ptu


def debiased_hessian_apply(ops_xy: PlanPasses, ops_xx: PlanPasses | None, ops_yy: PlanPasses | None, pots, a, b,
                           vx, vy, opts: ImplicitOptions, taus=(1.0, 1.0), scales=(1.0, 1.0),
                           transpose: bool = False):
    """The derivative of the gradient field (G_x, G_y) of a debiased loss applied to (vx, vy) (None: zero),

        G_x = c_x grad_x R(x, y) - 1/2 [c_x grad_1 R_a(x, x) + c_y grad_2 R_a(x, x)],
        G_y = c_y grad_y R(x, y) - 1/2 [c_x grad_1 R_b(y, y) + c_y grad_2 R_b(y, y)],

    R, R_a, R_b the reg_ot_cost of the problems (x, y), (x, x), (y, y), each with OTT's
    ``taus`` = (tau_x, tau_y) on its (first, second) marginal, grad_1 / grad_2 the gradient in a
    self problem's first / second cloud, both moving with the one cloud; ``scales`` = (c_x, c_y).
    With c_x = c_y = 1 and equal taus, (G_x, G_y) is the gradient of S = R(x, y) - 1/2 R(x, x)
    - 1/2 R(y, y) and this is its Hessian. Otherwise the Jacobian J of (G_x, G_y) need not be
    symmetric: ``transpose`` False gives J v (a JVP: the Hessians' outputs scaled by c), True gives
    J^T v (a VJP: the directions scaled by c). ``pots`` = (f, g, h_x, h_y), the solved potentials of
    (x, y), (x, x), (y, y) in OTT's convention; h_x is one potential when the self problem is
    symmetric (equal taus: the one-pass symmetric system of :func:`hessian_apply`) or a pair
    (first, second marginal) otherwise, whose ``ops_xx`` then has rows h_x[0] and columns h_x[1];
    ``ops_xx`` / ``ops_yy`` None drop a self term (no debias). Returns ((tx, ty), [info per CG solve])."""
    f, g, hx, hy = pots
    cx, cy = scales
    scale = lambda v, c: None if v is None else c * v
    din = (scale(vx, cx), scale(vy, cy)) if transpose else (vx, vy)
    (tx, ty, _, _), info = hessian_apply(ops_xy, f, g, a, b, (*din, None, None), (True, True, False, False), opts,
                                         taus)
    if not transpose:
        tx, ty = scale(tx, cx), scale(ty, cy)
    infos = [info]
    for ops, h, w, v, side in ((ops_xx, hx, a, vx, 0), (ops_yy, hy, b, vy, 1)):
        if ops is None or v is None:
            continue
        if isinstance(h, tuple):  # two potentials: the full system, both clouds moved by v
            v1, v2 = (cx * v, cy * v) if transpose else (v, v)
            (s1, s2, _, _), info = hessian_apply(ops, h[0], h[1], w, w, (v1, v2, None, None),
                                                 (True, True, False, False), opts, taus)
            own = s1 + s2 if transpose else cx * s1 + cy * s2
        else:
            (s1, s2, _, _), info = hessian_apply(ops, h, h, w, w, (v, v, None, None), (True, True, False, False),
                                                 opts, taus, symmetric=True)
            own = cx * s1 + cy * s2  # a symmetric problem: J = J^T
        infos.append(info)
        if side == 0:
            tx = tx - 0.5 * own
        else:
            ty = ty - 0.5 * own
    return (tx, ty), infos
