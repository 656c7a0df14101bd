"""The package's layers, read from the import statements of every module (lazy ones included).

The rules (docs/DESIGN.md, "Layers"):

* ``lantern.decoding`` (the loop, acceptance, trees, caches, sampling) imports nothing but itself
  and the base utilities: no model family, no stack, no CLI;
* ``lantern.models`` (the nn.Modules) imports nothing above the decoding cache and the base
  utilities (errors, file reading, images);
* no library module imports ``lantern.cli`` (the CLI is a thin layer on top);
* ``lantern.eval`` never imports ``lantern.train``;
* no import circles: no module imports, at any depth and lazily or not, a module that imports it
  back. Imports under ``if TYPE_CHECKING:`` never run and are left out.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The base utilities every layer may use: one-line errors, safe file reading, PNG helpers.
BASE = ("lantern.errors", "lantern.io", "lantern.images")


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, except those under ``if TYPE_CHECKING:``."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph(root: Path, package: str = "lantern") -> dict[str, set[str]]:
    """module -> the package modules it imports (``from a import b`` is module ``a.b`` when it is one)."""
    files = {_module_name(p, root): p for p in (root / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges: set[str] = set()
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name.split(".")[0] == package)
            elif node.level == 0 and node.module and node.module.split(".")[0] == package:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    edges.add(sub if sub in files else node.module)
        graph[name] = {e for e in edges if e != name}
    return graph


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for mod, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if _inside(mod, "lantern.decoding") and not (_inside(dep, "lantern.decoding") or dep in BASE):
                out.append(f"{mod} (decoding) imports {dep}")
            if _inside(mod, "lantern.models") and not (
                _inside(dep, "lantern.models") or dep in BASE or dep == "lantern.decoding.cache"
            ):
                out.append(f"{mod} (models) imports {dep}")
            if _inside(dep, "lantern.cli") and not _inside(mod, "lantern.cli"):
                out.append(f"{mod} (library) imports {dep}")
            if _inside(mod, "lantern.eval") and _inside(dep, "lantern.train"):
                out.append(f"{mod} (eval) imports {dep}")
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_keeps_its_layers() -> None:
    graph = import_graph(ROOT)
    assert "lantern.decoding.loop" in graph and len(graph) > 40  # the walk saw the package
    assert violations(graph) == []


def test_the_package_has_no_import_circles() -> None:
    assert cycles(import_graph(ROOT)) == []


def _fake_package(root: Path, modules: dict[str, str]) -> None:
    for name, body in modules.items():
        path = root / (name.replace(".", "/") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)


@pytest.mark.parametrize(
    ("modules", "expected"),
    [
        ({"lantern/decoding/loop": "from lantern.models.llamagen import LlamaGen\n", "lantern/models/llamagen": ""},
         ["lantern.decoding.loop (decoding) imports lantern.models.llamagen"]),
        ({"lantern/bench": "def f():\n    from lantern.cli import main\n", "lantern/cli/__init__": ""},
         ["lantern.bench (library) imports lantern.cli"]),
        ({"lantern/eval/bench": "import lantern.train.loop\n", "lantern/train/loop": ""},
         ["lantern.eval.bench (eval) imports lantern.train.loop"]),
        ({"lantern/decoding/loop": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                   "    from lantern.models.llamagen import LlamaGen\n",
          "lantern/models/llamagen": ""}, []),
    ],
)
def test_the_checker_sees_a_broken_layer(tmp_path: Path, modules: dict[str, str], expected: list[str]) -> None:
    """Power check: each rule fires on a package that breaks it (lazy imports included), and only then."""
    _fake_package(tmp_path, {k.replace("/", "."): v for k, v in modules.items()})
    assert violations(import_graph(tmp_path)) == expected


def test_the_checker_sees_a_lazy_circle(tmp_path: Path) -> None:
    _fake_package(tmp_path, {
        "lantern.a": "from lantern.b import x\n",
        "lantern.b": "x = 1\ndef f():\n    from lantern.c import y\n",
        "lantern.c": "import lantern.a\ny = 2\n",
        "lantern.d": "from lantern.a import x\n",
    })
    assert cycles(import_graph(tmp_path)) == [["lantern.a", "lantern.b", "lantern.c"]]
