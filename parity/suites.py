"""The suites: ``small`` (CPU, Triton interpreter, < 5 min on 2 cores) and ``full`` (GPU).

The small suite covers every group of quantities and every kind of problem on tiny sizes
(n, m <= 24, d <= 5): uniform / random / partly-zero weights, n != m, eps_rel from 1e-2 to 10,
duplicate points, clustered, far-apart and far-from-origin clouds, the full Hessian at n = 6,
the stopping-rule check, HVPs at the library's default CG options, and KL-relaxed marginals
(OTT's tau on both sides and on one, with second derivatives and the divergence; GeomLoss's reach) with unequal masses, and a label cost. The full suite replaces them by the GPU sizes (up to n = m = 8192, where
OTT-JAX's dense float64 mode still fits), d in {1, 2, 3, 16, 64}, ``precision="tf32"`` rows and
the far-from-origin line (points on [0, 10], eps = 0.01), whose 50 000-iteration solves
only a GPU runs in time.
"""

from __future__ import annotations

from .cases import Case

FIRST = ("solve", "grad")
SECOND = ("solve", "grad", "hvp", "pot_vjp")

SMALL: tuple[Case, ...] = (
    Case("tiny-d1", 5, 4, 1, 1.0, "uniform", groups=FIRST),
    Case("uniform-d2", 12, 9, 2, 0.5, "uniform", groups=SECOND + ("samples_loss",)),
    Case("random-w-d3", 10, 14, 3, 0.2, "random", groups=SECOND + ("samples_loss",)),
    Case("zero-w-d2", 12, 10, 2, 0.3, "partly-zero", groups=SECOND),
    Case("hessian-d1", 6, 7, 1, 1.0, "random", groups=("solve", "hess")),
    Case("eps10-d3", 8, 8, 3, 10.0, "uniform", groups=("solve", "grad", "hvp", "div")),
    Case("eps0.01-clustered-d2", 12, 12, 2, 0.01, "uniform", "clustered", groups=FIRST),
    Case("duplicates-d2", 12, 10, 2, 0.3, "random", "duplicates", groups=("solve", "grad", "hvp")),
    Case("far-apart-d2", 10, 8, 2, 0.1, "uniform", "far-apart", groups=FIRST + ("samples_loss",)),
    Case("far-origin-d2", 12, 10, 2, 0.1, "uniform", "far-origin", groups=FIRST + ("div",)),
    Case("stop-check-d2", 24, 20, 2, 0.05, "uniform", groups=("stop",)),
    # HVPs with the default CG options (converged forward): n != m, zero weights, eps = 0.05 of the
    # mean cost at d = 5 (eps ~ 0.5 for unit Gaussians) and 0.017 at d = 3 (eps ~ 0.1); the side solved
    # by CG is y (n > m). A CG stopping test on the Euclidean residual leaves 2e-4 to 3e-4 on that side
    # at the second size (tests/test_hvp_default_accuracy.py)
    Case("default-cg-zero-w-d5", 24, 17, 5, 0.05, "partly-zero", groups=("solve", "hvp_default")),
    Case("default-cg-zero-w-d3", 40, 27, 3, 0.017, "partly-zero", groups=("hvp_default",)),
    # the shifted-box stopping case: unit box shifted by 5, eps = 1e-2 (mean cost 1/3: eps_rel 0.03)
    Case("stop-check-shifted-box-d2", 48, 40, 2, 0.03, "uniform", "shifted-box", groups=("stop",)),
    # KL-relaxed marginals, unequal masses: both sides (OTT's tau), one side with zero weights,
    # GeomLoss's reach
    Case("unbalanced-d2", 12, 9, 2, 0.5, "random", tau_a=0.7, tau_b=0.7, mass_b=1.4, groups=SECOND + ("div",)),
    Case("semi-unbalanced-zero-w-d3", 10, 14, 3, 0.3, "partly-zero", tau_a=1.0, tau_b=0.5, mass_b=0.8,
         groups=SECOND),
    Case("reach-d2", 12, 9, 2, 0.5, "random", reach=1.0, mass_b=1.3, groups=("samples_loss",)),
    # a label cost (three classes, symmetric table of the cost's scale), zero weights on both sides
    Case("labels-zero-w-d3", 13, 10, 3, 0.3, "partly-zero", groups=FIRST, label_classes=3),
)

# On the GPU the tiny cases are replaced by larger ones of the same kinds; two have no larger twin.
_SMALL_KEPT = ("far-apart-d2", "stop-check-shifted-box-d2")

FULL: tuple[Case, ...] = tuple(c for c in SMALL if c.name in _SMALL_KEPT) + (
    Case("n256-d16-uniform", 256, 256, 16, 0.1, "uniform", groups=SECOND + ("div", "samples_loss")),
    Case("n1024-d64-random", 1024, 768, 64, 0.5, "random", groups=SECOND + ("samples_loss",)),
    Case("n1024-d3-zero", 1024, 1000, 3, 0.2, "partly-zero", groups=SECOND),
    Case("n8192-d3-uniform", 8192, 8192, 3, 0.1, "uniform", groups=("solve", "grad", "hvp", "div", "samples_loss")),
    Case("n8192-d64-random", 8192, 6144, 64, 1.0, "random", groups=SECOND),
    Case("n4096-d16-far-origin", 4096, 4096, 16, 0.1, "uniform", "far-origin", groups=FIRST + ("div",)),
    Case("n2048-d2-clustered-eps0.01", 2048, 2048, 2, 0.01, "uniform", "clustered", groups=FIRST,
         max_iterations=10000),
    Case("n512-d1-eps0.01", 512, 512, 1, 0.01, "uniform", groups=FIRST + ("div",), max_iterations=10000),
    # points on [0, 10], eps = 0.01 absolute (mean cost ~16.7: eps_rel 6e-4)
    Case("n512-d1-line-eps6e-4", 512, 512, 1, 6e-4, "uniform", "line", groups=FIRST + ("div",),
         max_iterations=50000),
    Case("n2048-d16-eps10-duplicates", 2048, 1536, 16, 10.0, "random", "duplicates", groups=SECOND),
    Case("n32-d3-hessian", 32, 24, 3, 0.3, "random", groups=("solve", "hess")),
    Case("n4096-d3-stop-check", 4096, 4096, 3, 0.05, "uniform", groups=("stop",)),
    Case("n8192-d64-tf32", 8192, 8192, 64, 0.5, "uniform", precision="tf32", groups=("solve", "grad", "hvp")),
    Case("n1024-d16-tf32", 1024, 1024, 16, 1.0, "random", precision="tf32", groups=FIRST + ("samples_loss",)),
    Case("n1024-d3-unbalanced", 1024, 768, 3, 0.1, "partly-zero", tau_a=0.9, tau_b=0.8, mass_b=1.5, groups=FIRST),
    Case("n4096-d16-reach", 4096, 3000, 16, 0.5, "random", reach=1.0, mass_b=0.7, groups=("samples_loss",)),
    Case("n1024-d3-labels", 1024, 900, 3, 0.1, "partly-zero", groups=FIRST, label_classes=10),
)

SUITES: dict[str, tuple[Case, ...]] = {"small": SMALL, "full": FULL}
