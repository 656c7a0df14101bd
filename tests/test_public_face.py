"""The public face: every name of ``lantern.__all__`` resolves to the object its module defines,
``from lantern import *`` works in a fresh interpreter, the lazy export table agrees with
``__all__`` and with the type checker's imports, and the README's Python example runs as written."""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import lantern

ROOT = Path(__file__).resolve().parents[1]
EAGER = {"DISTRIBUTION", "__version__"}  # defined in lantern/__init__.py itself, not lazily


def test_every_public_name_resolves_to_its_defining_module() -> None:
    for name in lantern.__all__:
        value = getattr(lantern, name)
        if name in EAGER:
            continue
        module = lantern._EXPORTS[name]
        # the object itself, from the module that defines it (a stale mapping raised AttributeError)
        assert value is getattr(importlib.import_module(module), name), name
        assert getattr(value, "__module__", module) == module, f"{name} is defined in {value.__module__}, not {module}"


def test_exports_and_all_agree() -> None:
    assert len(lantern.__all__) == len(set(lantern.__all__))
    assert set(lantern.__all__) == set(lantern._EXPORTS) | EAGER
    assert set(lantern._EXPORTS) <= set(dir(lantern))


def test_type_checking_imports_agree_with_exports() -> None:
    """What a type checker sees (the ``if TYPE_CHECKING:`` imports) is what ``__getattr__`` hands out."""
    tree = ast.parse((ROOT / "lantern" / "__init__.py").read_text())
    (block,) = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    seen = {alias.name: node.module for node in block.body if isinstance(node, ast.ImportFrom)
            for alias in node.names}
    assert seen == lantern._EXPORTS


def test_unknown_names_still_raise_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'NotAName'"):
        lantern.NotAName  # noqa: B018


def test_star_import_in_a_fresh_interpreter() -> None:
    """A fresh process: nothing this session imported can hide a name that fails to resolve."""
    code = ("from lantern import *\nimport json, lantern\n"
            "print(json.dumps(sorted(n for n in lantern.__all__ if n in globals())))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == sorted(lantern.__all__)


def readme_python_example() -> str:
    """The README's one ```python block, read at test time so the test follows the README."""
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.S | re.M)
    assert len(blocks) == 1, f"README.md has {len(blocks)} python blocks; this test runs exactly one"
    return blocks[0]


def test_readme_python_example_runs(tmp_path: Path) -> None:
    """Run as a user would: a fresh interpreter in an empty folder, where ``x.png`` must appear."""
    code = readme_python_example()
    assert 'save("x.png")' in code  # what the checks below look for
    preset = re.search(r'lantern\.load\("(\w+)"\)', code)
    assert preset is not None, "the example loads an embedded preset (no download in a test)"
    data = json.loads((ROOT / "lantern" / "presets" / preset.group(1) / "data.json").read_text())
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.png"]
    with Image.open(tmp_path / "x.png") as image:
        assert image.format == "PNG" and image.mode == "RGB"
        assert image.size == (data["image_size"], data["image_size"])
        pixels = np.asarray(image).reshape(-1, 3)
    assert len(np.unique(pixels, axis=0)) > 16  # a picture, not a blank or constant image
