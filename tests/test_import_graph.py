"""The import graph of ``k3/``, read from the modules' source: no cycles, imports that run one way through the
layers (``LAYERS``), and no function-level imports of k3 modules except where a dependency is optional.

Edges come from every ``import`` / ``from … import`` statement, at module level and inside functions, resolved to
the ``k3`` module they load (``from k3.ops import kda`` → ``k3.ops.kda``; relative imports too). Imports under
``if TYPE_CHECKING:`` never run and are left out. A package's ``__init__`` is a module like any other: importing
``k3.ops.moe.qb`` does not count as an edge to ``k3.ops.moe``.

A function-level import hides a dependency from the reader and, when it only breaks a cycle, the cycle itself.
The one reason to defer an import is a third-party package that an install may lack: the k3 module imported from
inside a function must import one of ``OPTIONAL`` at its own module level (checked below), so the list cannot
become an escape hatch.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "k3"

# Third-party packages a k3 install may lack, and why. A k3 module that imports one of them at module level may be
# imported from inside a function (the caller then works without the package until that path is taken).
OPTIONAL = {
    "triton": "the GPU kernels, Gluon included; no wheel for macOS, where the PyTorch references run",
    "fastapi": "the `serve` extra: the HTTP server",
    "uvicorn": "the `serve` extra: the HTTP server",
}


# Imports run one way: a module may import modules of its own layer or of lower ones. ``distributed`` wraps the
# single-device model from outside, so the model never imports it; the package root re-exports the entry points.
LAYERS = {
    "k3.utils": 0, "k3.config": 0,
    "k3.ops": 1,
    "k3.state": 2,
    "k3.layers": 3,
    "k3.model": 4,
    "k3.ckpt": 5, "k3.data": 5, "k3.distributed": 5, "k3.memory": 5,
    "k3.train": 6, "k3.infer": 6, "k3.serve": 6, "k3.bench": 6,
    "k3.cli": 7, "k3": 7, "k3.__main__": 7,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.lru_cache(maxsize=1)
def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Imports(ast.NodeVisitor):
    """Collects (target, lineno, in_function) for every import that runs, targets resolved to dotted names."""

    def __init__(self, module: str, is_package: bool, known: set[str]) -> None:
        self.package = module if is_package else module.rpartition(".")[0]
        self.known = known
        self.depth = 0
        self.found: list[tuple[str, int, bool]] = []

    def _add(self, name: str, lineno: int) -> None:
        self.found.append((name, lineno, self.depth > 0))

    def visit_FunctionDef(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")
            base = base[: len(base) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        for alias in node.names:
            sub = f"{module}.{alias.name}"
            self._add(sub if sub in self.known else module, node.lineno)


@functools.lru_cache(maxsize=1)
def _imports() -> dict[str, list[tuple[str, int, bool]]]:
    mods = _modules()
    known = set(mods)
    out = {}
    for name, path in mods.items():
        v = _Imports(name, path.name == "__init__.py", known)
        v.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        out[name] = v.found
    return out


def _k3_target(name: str, known: set[str]) -> str | None:
    """The k3 module an import of ``name`` loads (``import k3.ops.kda`` names a package; the longest known prefix)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _graph() -> dict[str, set[str]]:
    imports = _imports()
    known = set(imports)
    graph: dict[str, set[str]] = {m: set() for m in imports}
    for mod, found in imports.items():
        for name, _, _ in found:
            target = _k3_target(name, known) if name.split(".")[0] == "k3" else None
            if target is not None and target != mod:
                graph[mod].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def _path_in(comp: list[str], graph: dict[str, set[str]]) -> str:
    """One concrete cycle through the component's first module, for the failure message."""
    members = set(comp)
    start = comp[0]
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return " -> ".join(reversed(path)) + f" -> {start}"
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return " ".join(comp)


def test_graph_sees_known_edges() -> None:
    """The parser resolves absolute, ``from package import module`` and function-level imports (guards the test)."""
    graph = _graph()
    assert len(graph) > 40
    assert "k3.config" in graph["k3.model"]
    assert "k3.layers.kda" in graph["k3.model"]
    assert any(t.startswith("k3.ops.kda") for t in graph["k3.layers.kda"])
    v = _Imports("k3.a.b", False, {"k3.a.c", "k3.a.c.d", "k3.x"})
    v.visit(ast.parse("from .c import d\nfrom ..x import y\ndef f():\n    import k3.x\n"
                      "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import k3.z\n"))
    assert v.found == [("k3.a.c.d", 1, False), ("k3.x", 2, False), ("k3.x", 4, True), ("typing", 5, False)]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    graph = _graph()
    cycles = [f"{_path_in(c, graph)}   (all of: {', '.join(c)})" for c in _cycles(graph)]
    assert not cycles, "import cycles in k3/:\n" + "\n".join(cycles)


def _layer(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_imports_run_one_way() -> None:
    graph = _graph()
    unknown = sorted({_layer(m) for m in graph} - set(LAYERS))
    assert not unknown, f"give these parts of k3 a layer in LAYERS: {unknown}"
    upward = [f"{a} -> {b}" for a in sorted(graph) for b in sorted(graph[a])
              if LAYERS[_layer(b)] > LAYERS[_layer(a)]]
    assert not upward, "imports against the layering (ops -> layers -> model -> train/infer/serve -> cli):\n" + \
        "\n".join(upward)


def _optional_needs(target: str | None, imports: dict[str, list[tuple[str, int, bool]]]) -> set[str]:
    """The OPTIONAL packages ``target`` imports at module level, itself or through the modules of its own package
    (``k3.ops.kda.triton.chunk`` through ``k3.ops.kda.triton._common``), never through the rest of k3."""
    if target is None:
        return set()
    known = set(imports)
    home = target if any(m.startswith(f"{target}.") for m in known) else target.rpartition(".")[0]
    needs: set[str] = set()
    seen: set[str] = set()
    todo = [target]
    while todo:
        mod = todo.pop()
        seen.add(mod)
        for name, _, in_fn in imports.get(mod, []):
            if in_fn:
                continue
            top = name.split(".")[0]
            if top in OPTIONAL:
                needs.add(top)
            inner = _k3_target(name, known) if top == "k3" else None
            if inner and inner.startswith(f"{home}.") and inner not in seen:
                todo.append(inner)
    return needs


def test_function_level_imports_only_for_optional_dependencies() -> None:
    imports = _imports()
    known = set(imports)
    paths = _modules()
    bad: dict[str, None] = {}  # ordered set: one line per statement
    for mod, found in sorted(imports.items()):
        for name, line, in_fn in found:
            if in_fn and name.split(".")[0] == "k3":
                target = _k3_target(name, known)
                if not _optional_needs(target, imports):
                    bad[f"{paths[mod].relative_to(ROOT)}:{line}: {target}"] = None
    assert not bad, ("imports of k3 modules inside functions; move them to module level (these modules import "
                     f"none of the optional packages {sorted(OPTIONAL)}):\n" + "\n".join(bad))
