"""The package's layers, read from the import statements of every module (lazy ones included).

The rules (docs/layout.md, docs/DESIGN.md "Layers"):

* ``LAYERS`` lists the package bottom-up, as docs/layout.md does; a module may import
  from its own layer and the layers before it, never from a later one;
* the engine stays model-free: ``lantern.models`` (the nn.Modules) uses only the KV cache of
  ``lantern.decoding``;
* no module imports a private name (``_x``) of another top-level package or module: what a layer
  offers the layers above it is public;
* no import circles: no module imports, at any depth and lazily or not, a module that imports it
  back. Imports under ``if TYPE_CHECKING:`` never run and are left out.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Bottom-up, as in docs/layout.md: (name, the modules and packages of that layer).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("utilities", ("lantern.errors", "lantern.io", "lantern.images", "lantern.outputs", "lantern.validate",
                   "lantern.hub", "lantern.distributed", "lantern.version",
                   "lantern.machine")),
    ("engine", ("lantern.decoding",)),
    ("models", ("lantern.models",)),
    ("drafters", ("lantern.drafters",)),
    ("targets", ("lantern.targets",)),
    ("methods", ("lantern.methods", "lantern.calibration")),
    ("run", ("lantern.parts", "lantern.run", "lantern.jobs")),
    ("autotree", ("lantern.autotree",)),
    ("api", ("lantern.api",)),
    ("data", ("lantern.data",)),
    ("eval", ("lantern.eval",)),
    ("train", ("lantern.train",)),
    ("testing", ("lantern.testing",)),
    ("serve", ("lantern.serve",)),
    ("cli", ("lantern.cli", "lantern.__main__")),
    ("package", ("lantern",)),  # __init__: the public API, re-exported lazily
)


def layer_of(module: str) -> int:
    """Index in LAYERS of the most specific entry holding ``module``."""
    best = max(((len(prefix), i) for i, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
                if _inside(module, prefix)), default=None)
    assert best is not None, f"{module} is in no layer: add it to LAYERS (and to docs/layout.md)"
    return best[1]


def unit_of(module: str) -> str:
    """The top-level package or module ``module`` belongs to (``lantern.decoding.loop`` -> ``lantern.decoding``)."""
    return ".".join(module.split(".")[:2])


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
    return _scan(root, package)[0]


def private_imports(root: Path, package: str = "lantern") -> list[str]:
    """``from lantern.x import _name`` where the importer is outside ``lantern.x``'s top-level unit."""
    return _scan(root, package)[1]


def _scan(root: Path, package: str) -> tuple[dict[str, set[str]], list[str]]:
    files = {_module_name(p, root): p for p in (root / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    private: list[str] = []
    for name, path in sorted(files.items()):
        edges: set[str] = set()
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name.split(".")[0] == package)
            elif node.level == 0 and node.module and node.module.split(".")[0] == package:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    edges.add(sub if sub in files else node.module)
                    dunder = a.name.startswith("__") and a.name.endswith("__")  # __version__ is public
                    if a.name.startswith("_") and not dunder and unit_of(node.module) != unit_of(name):
                        private.append(f"{name} imports the private {node.module}.{a.name}")
        graph[name] = {e for e in edges if e != name}
    return graph, private


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for mod, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if layer_of(dep) > layer_of(mod):
                out.append(f"{mod} ({LAYERS[layer_of(mod)][0]}) imports {dep} (the later layer "
                           f"{LAYERS[layer_of(dep)][0]})")
            if _inside(mod, "lantern.models") and _inside(dep, "lantern.decoding") and dep != "lantern.decoding.cache":
                out.append(f"{mod} (models) imports {dep}")
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
    assert private_imports(ROOT) == []


def test_the_package_has_no_import_circles() -> None:
    assert cycles(import_graph(ROOT)) == []


def test_the_layout_page_lists_the_layers_in_order() -> None:
    """docs/layout.md names every top-level folder and module of a layer, in LAYERS' order."""
    page = (ROOT / "docs" / "layout.md").read_text()
    layout = page[page.index("## Layout"):]
    layout = layout[: layout.index("```", layout.index("```") + 3)]
    positions = []
    for _, prefixes in LAYERS[:-1]:
        for prefix in prefixes:
            name = prefix.split(".")[1]
            is_package = (ROOT / "lantern" / name).is_dir()
            token = f"{name}/" if is_package else f"{name}.py"
            assert token in layout, f"docs/layout.md does not mention {token}"
            positions.append(layout.index(token))
    order = [layer_of(f"lantern.{p.split('.')[1]}") for _, ps in LAYERS[:-1] for p in ps]
    assert [o for _, o in sorted(zip(positions, order, strict=True))] == sorted(order)
    on_disk = {p.stem for p in (ROOT / "lantern").iterdir()
               if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").is_file())) and p.stem != "__init__"}
    assert on_disk == {p.split(".")[1] for _, ps in LAYERS[:-1] for p in ps}, "a top-level module is in no layer"


def _fake_package(root: Path, modules: dict[str, str]) -> None:
    for name, body in modules.items():
        path = root / (name.replace(".", "/") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)


@pytest.mark.parametrize(
    ("modules", "expected"),
    [
        ({"lantern/decoding/loop": "from lantern.models.llamagen import LlamaGen\n", "lantern/models/llamagen": ""},
         ["lantern.decoding.loop (engine) imports lantern.models.llamagen (the later layer models)"]),
        ({"lantern/targets/stack": "def f():\n    from lantern.run import run_conditions\n", "lantern/run": ""},
         ["lantern.targets.stack (targets) imports lantern.run (the later layer run)"]),
        ({"lantern/drafters/eagle": "import lantern.targets.checks\n", "lantern/targets/checks": ""},
         ["lantern.drafters.eagle (drafters) imports lantern.targets.checks (the later layer targets)"]),
        ({"lantern/api": "def f():\n    from lantern.cli import main\n", "lantern/cli/__init__": ""},
         ["lantern.api (api) imports lantern.cli (the later layer cli)"]),
        ({"lantern/eval/bench": "import lantern.train.loop\n", "lantern/train/loop": ""},
         ["lantern.eval.bench (eval) imports lantern.train.loop (the later layer train)"]),
        ({"lantern/models/llamagen": "from lantern.decoding.loop import generate\n", "lantern/decoding/loop": ""},
         ["lantern.models.llamagen (models) imports lantern.decoding.loop"]),
        ({"lantern/decoding/loop": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                   "    from lantern.models.llamagen import LlamaGen\n",
          "lantern/models/llamagen": ""}, []),
        ({"lantern/run": "from lantern.targets.base import Stack\n", "lantern/targets/base": ""}, []),
    ],
)
def test_the_checker_sees_a_broken_layer(tmp_path: Path, modules: dict[str, str], expected: list[str]) -> None:
    """Power check: a planted module that breaks a rule (lazy imports included) fails it, and only then."""
    _fake_package(tmp_path, {k.replace("/", "."): v for k, v in modules.items()})
    assert violations(import_graph(tmp_path)) == expected


def test_the_checker_sees_a_private_import(tmp_path: Path) -> None:
    _fake_package(tmp_path, {
        "lantern.drafters.eagle": "from lantern.decoding.drafting import _guided\n",
        "lantern.decoding.drafting": "_guided = 1\n",
        "lantern.decoding.loop": "from lantern.decoding.drafting import _guided\n",  # same package: allowed
    })
    assert private_imports(tmp_path) == ["lantern.drafters.eagle imports the private lantern.decoding.drafting._guided"]


def test_the_checker_sees_a_lazy_circle(tmp_path: Path) -> None:
    _fake_package(tmp_path, {
        "lantern.a": "from lantern.b import x\n",
        "lantern.b": "x = 1\ndef f():\n    from lantern.c import y\n",
        "lantern.c": "import lantern.a\ny = 2\n",
        "lantern.d": "from lantern.a import x\n",
    })
    assert cycles(import_graph(tmp_path)) == [["lantern.a", "lantern.b", "lantern.c"]]
