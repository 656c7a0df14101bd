"""The distribution: ``lantern --version`` / ``lantern.__version__`` from the installed metadata,
the PyPI name ``lantern-ar`` (``lantern`` on PyPI is an unrelated project), and a wheel that
carries the package, its embedded presets, the serve page and the ``lantern`` command."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

import lantern
from lantern.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_version_is_the_installed_distributions(capsys: pytest.CaptureFixture[str]) -> None:
    assert PROJECT["name"] == lantern.DISTRIBUTION == "lantern-ar"
    # an install older than pyproject.toml (a renamed or bumped package) shows up here
    assert lantern.__version__ == metadata.version("lantern-ar") == PROJECT["version"]
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"lantern {PROJECT['version']} (lantern-ar)"


@pytest.mark.slow
def test_wheel_holds_the_package_presets_and_command(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("lantern_ar-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    info = f"lantern_ar-{PROJECT['version']}.dist-info"
    assert {"lantern/__init__.py", "lantern/version.py", "lantern/decoding/loop.py", f"{info}/METADATA"} <= names
    assert any(n.startswith("lantern/presets/photos/") and n.endswith(".safetensors") for n in names)
    assert {f"lantern/serve/static/{f}" for f in ("index.html", "app.js", "style.css")} <= names  # the serve page
    assert "lantern/py.typed" in names  # PEP 561: type checkers read lantern's own annotations
    assert not any(n.startswith("tests/") for n in names)
    meta = zipfile.ZipFile(wheel).read(f"{info}/METADATA").decode()
    assert "Name: lantern-ar" in meta
    entry = zipfile.ZipFile(wheel).read(f"{info}/entry_points.txt").decode()
    assert "lantern = lantern.cli.main:main" in entry
