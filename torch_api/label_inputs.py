"""The torch side of the label-augmented cost in the public operations (rules:
:mod:`ot_triton_jax.core.labels`).

A labelled problem carries ``labels`` = (label_x, label_y, label_cost): integer classes of the
rows and columns and the table W, so that every kernel call adds s W[label_row_i, label_col_j]
to s |x_i - y_j|^2. A self problem (x against x) carries (label_x, label_x, W) with W square:
its cost is s (|x_i - x_j|^2 + W[label_x_i, label_x_j]). The label term does not depend on the
points: first derivatives in x, y are the envelope formula with the labelled plan, those in a,
b and epsilon the partials at fixed potentials (sum P W enters d/d eps and d/d scale_cost).
Derivatives in ``label_cost`` are not computed (None); derivatives through the potentials and
second derivatives raise ``NotImplementedError`` (:func:`check_labelled_derivative`).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from ot_triton_jax.core import labels as rules

from .kernel_ops import Cloud, clouds


def checked(label_x, label_y, label_cost, n: int, m: int, *, self_problem: bool = False, square: bool = False
            ) -> tuple[Tensor, Tensor, Tensor] | None:
    """(label_x, label_y, label_cost) after the shape and value checks of core.labels (eager:
    the values are read, one device sync), or None when no label cost is asked for. For a
    self problem ``label_y`` is ignored and label_x is returned in its place; ``square``: the
    table must be square and symmetric (a problem with self terms, ``labels.check_symmetric``)."""
    lab = rules.entry_checks(label_x, label_y, None if label_cost is None else label_cost.detach(), n, m, torch,
                             self_problem=self_problem, square=square)
    return None if lab is None else (*lab, label_cost.detach())


def by_label(labels: Tensor) -> tuple[Tensor, Tensor]:
    """(perm, inverse): the stable order that groups the points by label, and its inverse. The
    LSE kernels run a row block of one label at the unlabelled speed (kernels/label_tiles.py), so
    the solve loops run on the grouped clouds and return the potentials in the caller's order."""
    perm = torch.argsort(labels, stable=True)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return perm, inv


def pair_clouds(x: Tensor, y: Tensor, lx: Optional[Tensor], ly: Optional[Tensor], w: Optional[Tensor]
                ) -> tuple[Cloud, Cloud]:
    """``kernel_ops.clouds(x, y)``, labelled (cost s W[lx_i, ly_j]) when ``w`` is given."""
    if w is None:
        return clouds(x, y)
    return clouds(x, y, labels=(lx, ly), label_cost=w)


def self_cloud(x: Tensor, lx: Optional[Tensor], w: Optional[Tensor]) -> Cloud:
    """``kernel_ops.clouds(x)`` for a self problem, labelled (cost s W[lx_i, lx_j], W square)."""
    if w is None:
        return clouds(x)[0]
    return clouds(x, labels=(lx,), label_cost=w)[0]


def swapped(labels: tuple | None) -> tuple:
    """The labels of the transposed problem (y against x): (ly, lx, W^T); (None,) * 3 without."""
    if labels is None:
        return (None, None, None)
    lx, ly, w = labels
    return ly, lx, w.t()


def message(what: str) -> str:
    return rules.not_implemented_message(what)


def check_labelled_derivative(backward: Callable, setup: Callable, label_at: int, what: str
                              ) -> tuple[Callable, Callable]:
    """(backward, setup_context) raising NotImplementedError naming ``what`` when the op's input
    at ``label_at + 2`` (its label_cost) is given and a cotangent arrives; else ``backward``."""

    def setup_context(ctx, inputs, output):
        inputs = tuple(inputs)
        setup(ctx, inputs, output)
        ctx.labelled = len(inputs) > label_at + 2 and inputs[label_at + 2] is not None

    def labelled_backward(ctx, *cotangents):
        if ctx.labelled and any(c is not None for c in cotangents):
            raise NotImplementedError(message(what))
        return backward(ctx, *cotangents)

    return labelled_backward, setup_context
