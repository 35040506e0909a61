"""Static checks of the package layout (CPU, no imports of the packages): no import cycles among
the modules of ``ot_triton_jax`` and ``torch_api`` (module-level and function-level imports both
count), and no ``.py`` file in them over the line limit."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("ot_triton_jax", "torch_api")
MAX_LINES = 400


def _modules() -> dict[str, str]:
    """Module name -> file path for every .py file under the packages."""
    out = {}
    for pkg in PACKAGES:
        for root, dirs, files in os.walk(os.path.join(ROOT, pkg)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(root, f)
                    parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
                    if parts[-1] == "__init__":
                        parts = parts[:-1]
                    out[".".join(parts)] = path
    return out


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute module a ``from ... import`` (or ``import``) statement names."""
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _known(name: str, modules) -> str | None:
    """The longest prefix of ``name`` that is one of ``modules`` (an import of a package's
    attribute or of a submodule's name reaches the module that defines it)."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        cand = ".".join(parts[:k])
        if cand in modules:
            return cand
    return None


def import_graph(modules: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the modules of ``modules`` it imports anywhere in its file (module level, inside
    functions, under TYPE_CHECKING). ``from pkg import name`` is an edge to ``pkg.name`` when that
    is a module, else to ``pkg``. Importing a submodule also imports its parent packages, but a
    package's ``__init__`` is not counted as importing its submodules unless it does so itself."""
    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        is_package = os.path.basename(path) == "__init__.py"
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), filename=path)
        edges: set[str] = set()
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_package, node.level, node.module)
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            for t in targets:
                hit = _known(t, modules)
                if hit is not None and hit != mod:
                    edges.add(hit)
        graph[mod] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a list of modules (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_cycle_finder_finds_a_cycle_and_accepts_a_dag():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_import_graph_sees_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "toy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "one.py").write_text("from . import two\n")
    (pkg / "two.py").write_text("def f():\n    from .one import g\n")
    mods = {"toy": str(pkg / "__init__.py"), "toy.one": str(pkg / "one.py"), "toy.two": str(pkg / "two.py")}
    graph = import_graph(mods)
    assert graph["toy.one"] >= {"toy.two"} and graph["toy.two"] >= {"toy.one"}
    assert find_cycle(graph) == ["toy.one", "toy.two", "toy.one"]


def test_packages_have_no_import_cycles():
    graph = import_graph(_modules())
    assert len(graph) > 50
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_file_over_the_line_limit():
    too_long = {}
    for path in _modules().values():
        with open(path, encoding="utf-8") as fh:
            lines = sum(1 for _ in fh)
        if lines > MAX_LINES:
            too_long[os.path.relpath(path, ROOT)] = lines
    assert not too_long, f"files over {MAX_LINES} lines: {too_long}"
