"""Sphinx configuration of the ot_triton_jax documentation.

Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html`` from the
repository root. sphinx-gallery runs every script of ``examples/`` with ``--small``
(tiny sizes: on a machine without a GPU every kernel runs under the Triton interpreter).
"""

from __future__ import annotations

import inspect
import re
import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

# The Triton interpreter evaluates log2(0) for zero-weight lanes on purpose.
warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")

import ot_triton_jax  # noqa: E402

project = "ot_triton_jax"
author = "ot_triton_jax contributors"
copyright = "ot_triton_jax contributors"
release = version = ot_triton_jax.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "myst_parser",
    "sphinx_gallery.gen_gallery",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "auto_examples/*.ipynb",
                    "auto_examples/*.py", "auto_examples/*.zip", "auto_examples/*.json"]
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = "ot_triton_jax"

# autodoc: documented under their public names (torch_api.X, ot_triton_jax.X).
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# The performance page (performance.md) is maintained with the benchmarks. In a checkout
# without it the build writes a stub for its toctree entry and removes it when the build ends.
_PERFORMANCE = os.path.join(HERE, "performance.md")
_STUB_TEXT = "# Performance\n\nThe performance notes are not part of this checkout.\n"
_PERFORMANCE_STUB = not os.path.exists(_PERFORMANCE) or open(_PERFORMANCE).read() == _STUB_TEXT
if _PERFORMANCE_STUB:
    with open(_PERFORMANCE, "w") as fh:
        fh.write(_STUB_TEXT)


def _remove_performance_stub(app, exception):
    if _PERFORMANCE_STUB and os.path.exists(_PERFORMANCE):
        os.remove(_PERFORMANCE)


sphinx_gallery_conf = {
    "examples_dirs": os.path.join(ROOT, "examples"),
    "gallery_dirs": "auto_examples",
    "filename_pattern": r"/plot_",
    "reset_argv": "gallery_args.small_run",
    "download_all_examples": False,
    "remove_config_comments": True,
    "matplotlib_animations": False,
    "image_scrapers": ("matplotlib",),
    "abort_on_example_error": True,
    "show_memory": False,
    "min_reported_time": 1,
}

# ---------------------------------------------------------------------------------------
# The public functions state their full conventions in the docstring of the module that
# defines them ("see the module docstring"). Those notes are appended to the entry of the
# public name, under "Details", so the reference is complete without naming internal modules.

DETAILED = {
    "torch_api.sinkhorn", "torch_api.sinkhorn_divergence", "torch_api.SamplesLoss",
    "torch_api.hvp", "torch_api.mhc_sinkhorn",
    "ot_triton_jax.sinkhorn", "ot_triton_jax.sinkhorn_divergence", "ot_triton_jax.samples_loss",
    "ot_triton_jax.hvp", "ot_triton_jax.mhc_sinkhorn",
}


def _append_module_notes(app, what, name, obj, options, lines):
    if name not in DETAILED:
        return
    module = sys.modules.get(getattr(obj, "__module__", ""), None)
    doc = inspect.getdoc(module) if module is not None else None
    if not doc:
        return
    lines.extend(["", ".. rubric:: Details", ""])
    lines.extend(_plain_to_rst(doc.splitlines()))
    lines.append("")


_LITERAL = re.compile(r"(``.*?``|:\w+:`[^`]*`)")


def _escape(text):
    """Escape the characters that plain-text formulas use and reStructuredText reads as markup."""
    parts = _LITERAL.split(text)
    for k in range(0, len(parts), 2):
        parts[k] = re.sub(r"([|*_`])", r"\\\1", parts[k])
    return "".join(parts)


def _plain_to_rst(lines):
    """Module notes are written as plain text: formulas inline, indented displays after a colon.

    Inline markup characters are escaped (except inside literals and roles), bullets ("* ")
    are kept, and an indented block that follows a non-indented line becomes a literal block.
    """
    out, literal_indent = [], None
    for k, line in enumerate(lines):
        indent = len(line) - len(line.lstrip())
        if literal_indent is not None:
            if line.strip() and indent < literal_indent:
                literal_indent = None
                out.append("")
            else:
                out.append(line)
                continue
        nxt = lines[k + 1] if k + 1 < len(lines) else ""
        nxt_indent = len(nxt) - len(nxt.lstrip())
        bullet = line.lstrip().startswith("* ")
        body_indent = indent + (2 if bullet else 0)
        text = line.lstrip()
        text = ("* " + _escape(text[2:])) if bullet else _escape(text)
        starts_block = nxt.strip() and nxt_indent > body_indent and not line.rstrip().endswith("::")
        if starts_block:
            if text.strip():
                out.extend([" " * indent + text.rstrip() + " ::", ""])
            else:
                out.extend(["", "::", ""])
            literal_indent = nxt_indent
            continue
        out.append(" " * indent + text)
    return out


def setup(app):
    app.connect("autodoc-process-docstring", _append_module_notes)
    app.connect("build-finished", _remove_performance_stub)
