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
    assert err.count("\n") == 1, err
    last = err.strip()
    assert "Meta's original Chameleon-format release" in last
    assert "leloy/Anole-7b-v0.1-hf" in last
    assert f"--vq {root / 'tokenizer' / 'vqgan.ckpt'}" in last
    assert "only used with" not in last and "not a model folder" not in last


def test_official_llamagen_checkpoint_file_as_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "c2i_L_256.pt"
    torch.save({"model": {}}, ckpt)
    rc = main(["generate", "--model", str(ckpt), "--labels", "0", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    last = err.strip()
    assert f"--model {ckpt} is a checkpoint file, not a model folder" in last
    assert "lantern convert-llamagen --gpt-ckpt GPT.pt --vq-ckpt VQ.pt --out DIR" in last


def test_official_vq_checkpoint_file_as_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """LANTERN's README lays LlamaGen's vq_ds16_t2i.pt beside its HF port (jadohu/LlamaGen-T2I)."""
    port = tmp_path / "LlamaGen-T2I"
    port.mkdir()
    (port / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama", '
                                      '"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, '
                                      '"input_type": "t2i", "block_size": 16, "cls_token_num": 120}')
    vq = tmp_path / "vq_ds16_t2i.pt"
    torch.save({"model": {}}, vq)
    rc = main(["generate", "--model", str(port), "--tokenizer", str(vq), "--labels", "0", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    last = err.strip()
    assert f"--tokenizer {vq} is a file, not a VQ tokenizer folder" in last
    assert "VQModel.from_official_checkpoint" in last
    assert "no such folder" not in last


def _shard(folder: Path, n: int = 3) -> None:
    """model.safetensors as a download of n shards with their index (every real 7B folder)."""
    import json

    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    keys, weight_map = sorted(state), {}
    for i in range(n):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file({k: state[k].contiguous() for k in keys[i::n]}, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys[i::n], name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("family", ["janus", "emu3", "chameleon"])
def test_a_download_missing_a_shard_is_named_the_same_way_in_every_family(tmp_path: Path, family: str) -> None:
    """An interrupted ``hf download`` leaves the index listing a shard that is not there. Janus and
    Emu3 said so in transformers' words (FileNotFoundError), Chameleon without the way out."""
    import lantern
    from lantern.errors import LanternError
    from lantern.testing import make_tiny_chameleon_folder, make_tiny_emu3_folder, make_tiny_janus_folder

    folder = {"janus": make_tiny_janus_folder, "emu3": make_tiny_emu3_folder,
              "chameleon": make_tiny_chameleon_folder}[family](tmp_path / family)
    _shard(Path(folder))
    assert lantern.load(folder).stack.vocab_size > 0  # whole, it loads
    (Path(folder) / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(LanternError) as e:
        lantern.load(folder)
    assert str(e.value) == (f"{Path(folder) / 'model.safetensors.index.json'} lists the shard "
                            f"model-00002-of-00003.safetensors, which is not in {folder} (an interrupted download? "
                            "download the model again)")
