"""The compared quantities: their groups, kinds (which bound applies) and gauge normalisation.

Groups (a case lists the groups it computes; one solve per group and frontend is reused for
all of the group's quantities):

* ``solve``: ``f``, ``g`` (potentials), ``reg_ot_cost``, ``converged`` (the solver's flag; the
  iteration counts of ours and of OTT-JAX are reported in the row's note).
* ``grad``: ``grad_x``, ``grad_y``, ``grad_a``, ``grad_b`` of ``reg_ot_cost``.
* ``hvp``: ``hvp_x`` (autodiff: double backward / ``jax.jvp(jax.grad)``) and ``hvp_y`` (the
  library's ``hvp(..., wrt="y")``) of ``reg_ot_cost`` along the case's directions vx, vy.
* ``pot_vjp``: gradients in x, y, a, b of <wf, f> + <wg, g> (sum wf == sum wg, both zero off the
  support: gauge invariant), i.e. the implicit VJP of the potentials.
* ``hess``: ``hess_xx``, the full (n, d, n, d) Hessian of ``reg_ot_cost`` in x.
* ``div``: ``sinkhorn_divergence`` value, gradients in x and y, ``div_hvp_x`` (library ``hvp``
  with ``loss="sinkhorn_divergence"``) and ``div_hvp_y`` (autodiff).
* ``samples_loss``: ``SamplesLoss`` / ``samples_loss`` against GeomLoss: value, potentials F, G,
  gradient in x.
* ``stop``: a separate solve at ``thresholds.STOP_THRESHOLD``; its last reported marginal error
  against the float64 error of the potentials it returned.

Gauge normalisations (:func:`parity.compare.normalise`):

* ``gauge_fg`` (f, g): (f + t, g - t) solve the same problem. Both are compared on the support
  (a > 0, b > 0; f = -inf where a = 0, which must hold in ours too) after
  f <- f - t*, g <- g + t*, t* = (mean_{a>0} f - mean_{b>0} g) / 2, which is invariant under the
  gauge (it gives f and g the same mean).
* ``center_a`` / ``center_b`` (weight derivatives): on the balanced problem only mass-preserving
  weight directions exist, so a weight gradient is defined up to a constant: compared on the
  support after removing its mean there.
* ``none``: compared as is (x- / y-indexed derivatives are 0 at zero-weight points in both).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Quantity:
    name: str
    group: str
    kind: str  # "potential" | "cost" | "gradient" | "second" | "second_default" | "converged" | "stop"
    normalisation: str = "none"  # "none" | "gauge_fg" | "center_a" | "center_b"
    reference: str = "ott"  # "ott" (dense float64 fallback) | "geomloss" | "float64-marginal" | "self"


QUANTITIES: tuple[Quantity, ...] = (
    Quantity("f", "solve", "potential", "gauge_fg"),
    Quantity("g", "solve", "potential", "gauge_fg"),
    Quantity("reg_ot_cost", "solve", "cost"),
    Quantity("converged", "solve", "converged", reference="self"),
    Quantity("grad_x", "grad", "gradient"),
    Quantity("grad_y", "grad", "gradient"),
    Quantity("grad_a", "grad", "gradient", "center_a"),
    Quantity("grad_b", "grad", "gradient", "center_b"),
    Quantity("hvp_x", "hvp", "second"),
    Quantity("hvp_y", "hvp", "second"),
    Quantity("hvp_default_x", "hvp_default", "second_default", reference="dense"),
    Quantity("hvp_default_y", "hvp_default", "second_default", reference="dense"),
    Quantity("pot_vjp_x", "pot_vjp", "second"),
    Quantity("pot_vjp_y", "pot_vjp", "second"),
    Quantity("pot_vjp_a", "pot_vjp", "second", "center_a"),
    Quantity("pot_vjp_b", "pot_vjp", "second", "center_b"),
    Quantity("hess_xx", "hess", "second"),
    Quantity("div", "div", "cost"),
    Quantity("div_grad_x", "div", "gradient"),
    Quantity("div_grad_y", "div", "gradient"),
    Quantity("div_hvp_x", "div", "second"),
    Quantity("div_hvp_y", "div", "second"),
    Quantity("sl_value", "samples_loss", "cost", reference="geomloss"),
    Quantity("sl_f", "samples_loss", "potential", reference="geomloss"),
    Quantity("sl_g", "samples_loss", "potential", reference="geomloss"),
    Quantity("sl_grad_x", "samples_loss", "gradient", reference="geomloss"),
    Quantity("stop_error", "stop", "stop", reference="float64-marginal"),
)
BY_NAME: dict[str, Quantity] = {q.name: q for q in QUANTITIES}
GROUPS: dict[str, tuple[str, ...]] = {}
for _q in QUANTITIES:
    GROUPS.setdefault(_q.group, ())
    GROUPS[_q.group] += (_q.name,)

# OTT-JAX quantity names (tests/ott_reference.py) needed by each group
OTT_KEYS: dict[str, tuple[str, ...]] = {
    "solve": ("cost", "f", "g"),
    "grad": ("grad_x", "grad_y", "grad_a", "grad_b"),
    "hvp": ("hvp_x", "hvp_y"),
    "pot_vjp": ("pot_vjp",),
    "hess": ("hess_xx",),
    "div": ("div", "div_grad_x", "div_grad_y", "div_hvp_x", "div_hvp_y"),
}
# OTT result key -> our quantity name, where they differ
OTT_NAME: dict[str, str] = {"cost": "reg_ot_cost"}
