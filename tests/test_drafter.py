"""EAGLE drafter module: official LANTERN folders load strictly, lantern folders round-trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import OFFICIAL_DRAFTER_CONFIG, official_drafter_state
from safetensors.torch import save_file

from lantern.errors import CheckpointError
from lantern.models.drafter import DrafterConfig, EagleDrafterModel


def test_official_key_set() -> None:
    """Our module's parameter names and shapes equal the official checkpoint's ([LANTERN code])."""
    model = EagleDrafterModel(DrafterConfig.from_official(OFFICIAL_DRAFTER_CONFIG))
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert ours == {k: tuple(v.shape) for k, v in official_drafter_state(OFFICIAL_DRAFTER_CONFIG).items()}
    assert model.config.target_cls_token_num == 120 and model.config.block_size == 256


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_official_folder_loads_with_embeddings_from_the_checkpoint(tmp_path: Path, fmt: str) -> None:
    state = official_drafter_state(OFFICIAL_DRAFTER_CONFIG)
    (tmp_path / "config.json").write_text(json.dumps(OFFICIAL_DRAFTER_CONFIG))
    if fmt == "bin":
        torch.save(state, tmp_path / "pytorch_model.bin")
    else:
        save_file(state, str(tmp_path / "model.safetensors"))
    model = EagleDrafterModel.from_pretrained(tmp_path)
    assert torch.equal(model.embed_tokens.weight, state["embed_tokens.weight"])
    assert torch.equal(model.fc.bias, state["fc.bias"])


def test_official_folder_with_missing_key(tmp_path: Path) -> None:
    state = official_drafter_state(OFFICIAL_DRAFTER_CONFIG)
    del state["fc.bias"]
    (tmp_path / "config.json").write_text(json.dumps(OFFICIAL_DRAFTER_CONFIG))
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="missing keys: fc.bias"):
        EagleDrafterModel.from_pretrained(tmp_path)


def test_lantern_folder_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = EagleDrafterModel(
        DrafterConfig(
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=2,
            vocab_size=50,
            target_cls_token_num=1,
            block_size=16,
        )
    ).eval()
    model.save_pretrained(tmp_path / "d")
    loaded = EagleDrafterModel.from_pretrained(tmp_path / "d").eval()
    feats, tokens = torch.randn(2, 5, 32), torch.randint(0, 50, (2, 5))
    pos = torch.arange(5).expand(2, -1)
    mask = torch.ones(5, 5, dtype=torch.bool).tril().expand(2, -1, -1)
    assert torch.equal(loaded(feats, tokens, pos, mask), model(feats, tokens, pos, mask))
