"""The JAX side of the label-augmented cost in the public operations (rules:
:mod:`ot_triton_jax.core.labels`).

A labelled problem carries ``labels`` = (label_x, label_y, label_cost), a pytree passed next to
the points (None without a label cost): integer classes of the rows and columns and the table
W, so that every kernel call adds s W[label_row_i, label_col_j] to s |x_i - y_j|^2. A self
problem (x against x) carries (label_x, label_x, W) with W square: cost
s (|x_i - x_j|^2 + W[label_x_i, label_x_j]). Shapes and dtypes are checked at trace time;
values (labels in range, W finite) eagerly where concrete, and under ``jax.jit`` through
:func:`values_ok` (the solve then returns NaN with ``converged=False``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..core import labels as rules
from .checks import is_traced
from .kernel_ops import Cloud, clouds


def _concrete(*arrays) -> bool:
    return not any(is_traced(v) for v in arrays)


def checked(label_x, label_y, label_cost, n: int, m: int, *, self_problem: bool = False,
            square: bool = False) -> tuple | None:
    """(label_x, label_y, label_cost) as arrays after the checks of core.labels (values only where
    concrete), or None when no label cost is asked for. For a self problem ``label_y`` is
    ignored and label_x is returned in its place; ``square``: the table must be square (a
    problem with self terms, ``labels.check_symmetric``; :func:`values_ok` with ``symmetric``
    under jit)."""
    # concrete values are read with numpy (jnp would trace them under jax.jit)
    readable = _concrete(label_x, label_y, label_cost)
    read = (lambda v: None if v is None else np.asarray(v)) if readable else (lambda v: v)
    lab = rules.entry_checks(read(label_x), read(label_y), read(label_cost), n, m, np, self_problem=self_problem,
                             square=square, readable=readable)
    if lab is None:
        return None
    label_y = label_x if self_problem else label_y
    return (jnp.asarray(label_x).astype(jnp.int32), jnp.asarray(label_y).astype(jnp.int32),
            jax.lax.stop_gradient(jnp.asarray(label_cost)).astype(jnp.float32))


def values_ok(labels, symmetric: bool = False) -> jax.Array:
    """Run-time validity of ``labels`` (True without): labels in range, a finite table (and a
    symmetric one with ``symmetric``)."""
    if labels is None:
        return jnp.array(True)
    lx, ly, w = labels
    k_x, k_y = w.shape
    ok = jnp.all((lx >= 0) & (lx < k_x)) & jnp.all((ly >= 0) & (ly < k_y)) & jnp.all(jnp.isfinite(w))
    return ok & rules.symmetric_ok(w, jnp) if symmetric else ok


def by_label(labels) -> tuple[jax.Array, jax.Array]:
    """(perm, inverse): the stable order that groups the points by label, and its inverse. The
    LSE kernels run a row block of one label at the unlabelled speed (kernels/label_tiles.py), so
    the solve loops run on the grouped clouds and return the potentials in the caller's order."""
    perm = jnp.argsort(labels, stable=True)
    return perm, jnp.argsort(perm)


def pair_clouds(x, y, labels, backend) -> tuple[Cloud, Cloud]:
    """``kernel_ops.clouds(x, y)``, labelled (cost s W[lx_i, ly_j]) when ``labels`` is given."""
    if labels is None:
        return clouds(x, y, backend=backend)
    lx, ly, w = labels
    return clouds(x, y, backend=backend, labels=(lx, ly), label_cost=w)


def self_cloud(x, lx, w, backend) -> Cloud:
    """``kernel_ops.clouds(x)`` of a self problem, labelled (cost s W[lx_i, lx_j], W square)."""
    if w is None:
        return clouds(x, backend=backend)[0]
    return clouds(x, backend=backend, labels=(lx,), label_cost=w)[0]


def swapped(labels):
    """The labels of the transposed problem (y against x): (ly, lx, W^T); None without."""
    if labels is None:
        return None
    lx, ly, w = labels
    return ly, lx, w.T


def message(what: str) -> str:
    return rules.not_implemented_message(what)


def check_unlabelled(labels, what: str) -> None:
    """NotImplementedError naming ``what`` for a labelled problem."""
    if labels is not None:
        raise NotImplementedError(message(what))
