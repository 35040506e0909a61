"""Static options of the solvers, as frozen (hashable) dataclasses shared by both frontends.

Under ``jax.jit`` they are static arguments (a new value retraces); in torch they
are attributes of the custom ops. Run-time numbers (epsilon, scale_cost, threshold)
are never here: they travel as arrays so that a new value never recompiles.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import checks


@dataclass(frozen=True)
class LoopOptions:
    """OTT's Sinkhorn loop: blocks of ``inner_iterations``; the marginal error is measured
    at the end of a block once ``min_iterations`` are done, and after the last iteration;
    ``max_iterations`` is a hard cap. ``precision``: "float32" or "tf32"."""

    precision: str = "float32"
    inner_iterations: int = 10
    min_iterations: int = 0
    max_iterations: int = 2000

    def __post_init__(self):
        checks.precision(self.precision)
        inner, lo, hi = checks.iterations(self.inner_iterations, self.min_iterations, self.max_iterations)
        object.__setattr__(self, "inner_iterations", inner)
        object.__setattr__(self, "min_iterations", lo)
        object.__setattr__(self, "max_iterations", hi)

    @property
    def n_blocks(self) -> int:
        """Length of ``errors``: one entry per (possibly partial) block."""
        return -(-self.max_iterations // self.inner_iterations)

    def measured(self, it: int) -> bool:
        """Whether the marginal error is measured after iteration ``it`` (0-based)."""
        last_of_block = it % self.inner_iterations == self.inner_iterations - 1
        return it == self.max_iterations - 1 or (last_of_block and it >= self.min_iterations)
