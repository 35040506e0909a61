"""The label-augmented cost's rules (OTDD; flash-sinkhorn's ``label_cost_matrix``), written once.

Every point carries an integer class label, ``label_x`` (n,) and ``label_y`` (m,), and a small
class-to-class table ``label_cost`` W (K_x, K_y) is added to the squared distance:

    C_ij = s (|x_i - y_j|^2 + W[label_x_i, label_y_j]),   s the kernels' cost scale (PARAMS[1]:
                                                          OTT's 1 / scale_cost, GeomLoss's 1/2).

The kernels form W[label_x_i, label_y_j] inside the tile (kernels/label_tiles.py: one-hot rows
times table rows on the tensor cores): nothing n x m is stored. Each kernel cloud carries its
labels (int32) and the table ORIENTED so that its labels index the rows: the x cloud W (K_x, K_y),
the y cloud W^T (K_y, K_x), both contiguous float32 (the frontends' ``clouds(..., labels=,
label_cost=)``); a call reads the tgt cloud's. A self problem (x against x: the debiasing terms)
reads W[label_x_i, label_x_j]: its table must be square; a cloud built alone holds W^T for it, a
cloud built for a two-cloud problem reads its own table there (W^T[l_i, l_j] for x, W[l_i, l_j]
for y: the same when W is symmetric, as OTDD's class distances are).

Rules (the frontends call these at their entry points; errors name the argument and the fix):

* :func:`check_shapes`: integer labels of shapes (n,), (m,), a floating table of shape (K_x, K_y)
  with K_x, K_y >= 1, square for a self problem. Structural: valid under ``jax.jit``.
* :func:`check_values`: labels in [0, K_x) / [0, K_y), a finite table. Reads the values, so only
  where they are readable (torch tensors; JAX arrays outside ``jax.jit``). Under ``jax.jit`` the
  values cannot be read: an out-of-range label then gives NaN in every output it touches (the
  kernels clamp the index for the load, never read out of bounds, and poison the row or column
  with NaN); a non-finite table entry gives NaN or zero plan entries.

Functions take the frontend's array module as ``xp`` where they compute (numpy, jax.numpy, torch).
"""

from __future__ import annotations

_INT_NAMES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
_FLOAT_NAMES = ("float16", "bfloat16", "float32", "float64")


def _dtype_name(a) -> str:
    return str(a.dtype).replace("torch.", "")


def _shape(a) -> tuple[int, ...]:
    return tuple(int(k) for k in a.shape)


def check_label_array(labels, size: int, name: str, other: str) -> None:
    """``labels`` is an integer array of shape (size,): one class per point of ``other``."""
    if not hasattr(labels, "shape") or not hasattr(labels, "dtype"):
        raise TypeError(f"{name} must be an integer array of shape ({size},), one class per point of {other}; "
                        f"got {type(labels).__name__}")
    if _shape(labels) != (size,):
        raise ValueError(f"{name} must have shape ({size},), one class per point of {other}; "
                         f"got {_shape(labels)}")
    if _dtype_name(labels) not in _INT_NAMES:
        raise TypeError(f"{name} must hold integer class indices (e.g. int32), got {_dtype_name(labels)}; "
                        "convert it with .astype(int32) / .to(torch.int32)")


def check_table(label_cost, *, square: bool = False) -> tuple[int, int]:
    """The shape (K_x, K_y) of a floating 2-D ``label_cost`` with K_x, K_y >= 1 (square when a
    self problem reads it)."""
    if not hasattr(label_cost, "shape") or not hasattr(label_cost, "dtype"):
        raise TypeError(f"label_cost must be a float array of shape (K_x, K_y), got {type(label_cost).__name__}")
    shape = _shape(label_cost)
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"label_cost must be a 2-D table (K_x, K_y) of class-to-class costs with K_x, K_y >= 1, "
                         f"got shape {shape}")
    if _dtype_name(label_cost) not in _FLOAT_NAMES:
        raise TypeError(f"label_cost must be a floating table (float32 or float64), got {_dtype_name(label_cost)}")
    if square and shape[0] != shape[1]:
        raise ValueError(f"label_cost must be square for a self problem (x against x: label_x indexes both "
                         f"its rows and columns), got shape {shape}")
    return shape[0], shape[1]


def check_shapes(label_x, label_y, label_cost, n: int, m: int, *, self_problem: bool = False) -> tuple[int, int]:
    """Structural checks of a labelled problem (x: n points, y: m points; ``label_y`` ignored for a
    self problem): all three given or none, shapes and dtypes. Returns (K_x, K_y), or (0, 0) when
    no label cost is asked for."""
    given = {"label_x": label_x is not None, "label_cost": label_cost is not None}
    if not self_problem:
        given["label_y"] = label_y is not None
    if not any(given.values()):
        return 0, 0
    if not all(given.values()):
        missing = ", ".join(k for k, v in given.items() if not v)
        raise ValueError(f"the label cost needs {', '.join(given)} together; {missing} missing "
                         "(pass them all, or none for the plain squared distance)")
    check_label_array(label_x, n, "label_x", "x")
    if not self_problem:
        check_label_array(label_y, m, "label_y", "y")
    return check_table(label_cost, square=self_problem)


def check_values(label_x, label_y, label_cost, xp) -> None:
    """Value checks (reads the arrays: call it only where they are concrete): every label_x in
    [0, K_x), every label_y in [0, K_y) (``label_y`` None for a self problem), a finite table."""
    k_x, k_y = _shape(label_cost)
    for name, lab, k in (("label_x", label_x, k_x), ("label_y", label_y, k_y)):
        if lab is None or _shape(lab)[0] == 0:
            continue
        lo, hi = int(xp.min(lab)), int(xp.max(lab))
        if lo < 0 or hi >= k:
            raise ValueError(f"{name} must index the label_cost table: values in [0, {k}), got [{lo}, {hi}]; "
                             f"relabel the classes as 0..{k - 1} or pass a larger label_cost")
    if not bool(xp.all(xp.isfinite(label_cost))):
        raise ValueError("label_cost must be finite (a class pair that must never match: use a large finite cost)")


def table_shape(table) -> tuple[int, int] | None:
    """The shape (K_src, K_tgt) of a cloud's oriented table, None for a cloud without labels."""
    return None if table is None else (int(table.shape[0]), int(table.shape[1]))


def call_labels(src_labels, src_table, tgt_labels, tgt_table, same: bool) -> tuple[int, int] | None:
    """The ``labels`` argument of the kernel_calls builders for a call on the clouds (src, tgt)
    (their labels and oriented tables; ``same``: one cloud against itself): None without labels,
    else the shape (K_src, K_tgt) of the src table. Both clouds carry labels or neither; the tgt
    table is the src table's transpose in shape."""
    if src_labels is None and tgt_labels is None:
        return None
    if src_labels is None or tgt_labels is None:
        raise ValueError("both clouds of a kernel call must carry labels, or neither: build them together "
                         "with clouds(x, y, labels=(label_x, label_y), label_cost=W)")
    ks = table_shape(src_table)
    if same:
        if ks[0] != ks[1]:
            raise ValueError(f"a self problem (a cloud against itself) needs a square label table, got {ks}; "
                             "build the cloud alone with clouds(x, labels=(label_x,), label_cost=W) and W square")
    elif table_shape(tgt_table) != (ks[1], ks[0]):
        raise ValueError(f"the clouds' label tables do not match: {ks} and {table_shape(tgt_table)}; build the "
                         "two clouds together with clouds(x, y, labels=(label_x, label_y), label_cost=W)")
    return ks


# ----------------------------------------------------------------------------- public operations


def check_symmetric(label_cost, xp) -> None:
    """A problem with self terms (debiasing, a divergence's (x, x) and (y, y) problems) solves them
    with symmetric updates, which need a symmetric self cost W[l_i, l_j] = W[l_j, l_i]: ``label_cost``
    square and symmetric to 1e-6 relative (reads the values: only where they are concrete)."""
    w = xp.asarray(label_cost)
    scale = float(xp.max(xp.abs(w)))
    if float(xp.max(xp.abs(w - w.T))) > 1e-6 * max(scale, 1e-30):
        raise ValueError("label_cost must be symmetric (W[k, l] = W[l, k]) for a problem with self terms "
                         "(debias=True, sinkhorn_divergence): symmetrize it, e.g. (W + W.T) / 2")


def symmetric_ok(label_cost, xp):
    """Run-time counterpart of :func:`check_symmetric` (a boolean array, for traced values)."""
    return xp.max(xp.abs(label_cost - label_cost.T)) <= 1e-6 * xp.maximum(xp.max(xp.abs(label_cost)), 1e-30)


def not_implemented_message(what: str) -> str:
    """The NotImplementedError text of a derivative that a labelled problem does not offer."""
    return (f"{what} is not implemented with a label cost (label_x, label_y, label_cost): only the first "
            "derivatives of reg_ot_cost / the loss in x, y, a, b, epsilon and scale_cost are. Detach the "
            "potentials (stop_gradient) or drop label_cost")


def entry_checks(label_x, label_y, label_cost, n: int, m: int, xp, *, self_problem: bool = False,
                 square: bool = False, readable: bool = True):
    """The frontends' entry checks: shapes (:func:`check_shapes`), a square table where self terms
    need one, and, when ``readable``, the values (:func:`check_values`; :func:`check_symmetric`
    with ``square``) through the array module ``xp``. Returns (label_x, label_y) with label_y =
    label_x for a self problem, or None when no label cost is asked for."""
    if check_shapes(label_x, label_y, label_cost, n, m, self_problem=self_problem) == (0, 0):
        return None
    if square:
        check_table(label_cost, square=True)
    if self_problem:
        label_y = label_x
    if readable:
        check_values(label_x, label_y, label_cost, xp)
        if square:
            check_symmetric(label_cost, xp)
    return label_x, label_y
