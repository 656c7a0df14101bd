"""Folders and files as the official releases ship them, given where lantern reads something else:
each is named in one line that says what it is and what to pass instead."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lantern.cli.main import main


def _original_chameleon_release(root: Path) -> Path:
    """Meta's original Chameleon layout (facebook/chameleon-7b, GAIR/Anole-7b-v0.1): no config.json."""
    (root / "models" / "7b").mkdir(parents=True)
    (root / "models" / "7b" / "params.json").write_text('{"dim": 4096, "n_layers": 32, "n_heads": 32}')
    (root / "models" / "7b" / "consolidated.pth").write_bytes(b"")
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "text_tokenizer.json").write_text("{}")
    (root / "tokenizer" / "vqgan.yaml").write_text("model: {}\n")
    (root / "tokenizer" / "vqgan.ckpt").write_bytes(b"")
    return root


@pytest.mark.parametrize("extra", [[], ["--layout", "anole"]])
def test_original_chameleon_release_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             extra: list[str]) -> None:
    root = _original_chameleon_release(tmp_path / "Anole-7b-v0.1")
    rc = main(["generate", "--model", str(root), *extra, "--prompt", "a cat", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2
    last = err.strip().splitlines()[-1]
    assert "Meta's original Chameleon-format release" in last
    assert "leloy/Anole-7b-v0.1-hf" in last
    assert f"--vq {root / 'tokenizer' / 'vqgan.ckpt'}" in last
    assert "only used with" not in last and "not a model folder" not in last

