"""LlamaGen model: checkpoint compatibility, RoPE quirk, KV-cached decoding vs full recomputation."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lantern.decoding.config import SamplingConfig
from lantern.decoding.sampling import apply_cfg
from lantern.errors import CheckpointError, LanternError
from lantern.models.llamagen import LlamaGen, LlamaGenConfig, apply_rope, llamagen_config, official_to_hf, rope_table_2d
from lantern.targets.llamagen import LlamaGenTarget
from lantern.testing import tiny_llamagen


def _meta_state(name: str, **kw: object) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = LlamaGen(llamagen_config(name, **kw))
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "name,n_layer,dim,ffn",
    [("GPT-B", 12, 768, 2048), ("GPT-L", 24, 1024, 2816), ("GPT-XL", 36, 1280, 3584)],
)
def test_official_key_set_and_shapes(name: str, n_layer: int, dim: int, ffn: int) -> None:
    """Official keys and shapes ([LlamaGen code], c2i, 256 px); built on meta, nothing allocated."""
    shapes = _meta_state(name)
    expected = {
        "cls_embedding.embedding_table.weight": (1001, dim),
        "tok_embeddings.weight": (16384, dim),
        "norm.weight": (dim,),
        "output.weight": (16384, dim),
    }
    for i in range(n_layer):
        expected |= {
            f"layers.{i}.attention.wqkv.weight": (3 * dim, dim),
            f"layers.{i}.attention.wo.weight": (dim, dim),
            f"layers.{i}.feed_forward.w1.weight": (ffn, dim),
            f"layers.{i}.feed_forward.w3.weight": (ffn, dim),
            f"layers.{i}.feed_forward.w2.weight": (dim, ffn),
            f"layers.{i}.attention_norm.weight": (dim,),
            f"layers.{i}.ffn_norm.weight": (dim,),
        }
    assert shapes == expected


def test_t2i_keys_and_large_configs() -> None:
    shapes = _meta_state("GPT-XL", model_type="t2i", cls_token_num=120)
    assert shapes["cls_embedding.cap_proj.fc1.weight"] == (1280, 2048)
    assert shapes["cls_embedding.cap_proj.fc2.weight"] == (1280, 1280)
    assert shapes["cls_embedding.uncond_embedding"] == (120, 2048)
    assert "cls_embedding.embedding_table.weight" not in shapes
    # GPT-3B: head_dim 100, FFN 8704 ([LlamaGen code] gpt.py).
    s3b = _meta_state("GPT-3B")
    assert s3b["layers.0.feed_forward.w1.weight"] == (8704, 3200)
    assert llamagen_config("GPT-3B").head_dim == 100
    assert _meta_state("GPT-XXL")["layers.47.feed_forward.w2.weight"] == (1536, 4096)


def test_parameter_count_matches_published_size() -> None:
    with torch.device("meta"):
        model = LlamaGen(llamagen_config("GPT-XL"))
    n = sum(p.numel() for p in model.parameters())
    assert 770e6 < n < 780e6  # 775M in the LlamaGen paper


def test_unknown_config_name() -> None:
    with pytest.raises(LanternError, match="unknown LlamaGen config 'GPT-Q'.*GPT-B"):
        llamagen_config("GPT-Q")


def _tiny_logits(model: LlamaGen) -> torch.Tensor:
    labels = torch.tensor([1, 4])
    tokens = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    return model(labels, tokens)[0]


def test_official_checkpoint_round_trip(tmp_path) -> None:
    model = tiny_llamagen(seed=3)
    state = dict(model.state_dict())
    state["freqs_cis"] = torch.zeros(3)  # stray tensor in older files: must be ignored
    for container in ("model", "module", "state_dict", None):
        path = tmp_path / f"ckpt_{container}.pt"
        obj = state if container is None else {container: state, "steps": 10, "args": argparse.Namespace(lr=1e-4)}
        torch.save(obj, path)
        loaded = LlamaGen.from_official_checkpoint(path, model.config).eval()
        assert torch.equal(_tiny_logits(loaded), _tiny_logits(model))


def test_hf_port_round_trip(tmp_path) -> None:
    model = tiny_llamagen(seed=4, model_type="t2i", cls_token_num=6, caption_dim=12)
    hf = official_to_hf(model.state_dict(), model.config)
    assert "model.layers.1.self_attn.k_proj.weight" in hf and "lm_head.weight" in hf
    assert "model.cls_embedding.uncond_embedding" in hf
    save_file({k: v.contiguous() for k, v in hf.items()}, str(tmp_path / "model.safetensors"))
    cfg = model.config
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": cfg.dim,
                "num_hidden_layers": cfg.n_layer,
                "num_attention_heads": cfg.n_head,
                "intermediate_size": cfg.hidden_ffn,
                "vocab_size": cfg.vocab_size,
                "input_type": "t2i",
                "cls_token_num": cfg.cls_token_num,
                "caption_dim": cfg.caption_dim,
                "block_size": cfg.block_size,
                "rms_norm_eps": cfg.norm_eps,
                "rope_theta": 10000.0,
            }
        )
    )
    loaded = LlamaGen.from_pretrained(tmp_path).eval()
    captions = torch.randn(2, 6, 12)
    tokens = torch.randint(0, cfg.vocab_size, (2, 10))
    assert torch.equal(loaded(captions, tokens)[0], model(captions, tokens)[0])


def _hf_port(folder: Path, seed: int = 4) -> LlamaGen:
    """A tiny t2i model saved as LANTERN's HF port, in two shards with their index."""
    model = tiny_llamagen(seed=seed, model_type="t2i", cls_token_num=6, caption_dim=12)
    hf = {k: v.contiguous() for k, v in official_to_hf(model.state_dict(), model.config).items()}
    folder.mkdir()
    keys = sorted(hf)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, part in shards.items():
        save_file({k: hf[k] for k in part}, str(folder / name))
    weight_map = {k: name for name, part in shards.items() for k in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = model.config
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head, "intermediate_size": cfg.hidden_ffn, "vocab_size": cfg.vocab_size,
        "input_type": "t2i", "cls_token_num": cfg.cls_token_num, "caption_dim": cfg.caption_dim,
        "block_size": cfg.block_size, "rms_norm_eps": cfg.norm_eps, "rope_theta": 10000.0}))
    return model


def test_a_sharded_hf_port_reads_the_shards_its_index_lists(tmp_path: Path) -> None:
    """A shard the index does not list (a stale file of an older download, here with zeroed
    weights) is never read: it used to be merged in by a glob, silently replacing weights."""
    model = _hf_port(tmp_path / "m")
    stale = {"model.layers.0.self_attn.o_proj.weight": torch.zeros(model.config.dim, model.config.dim)}
    save_file(stale, str(tmp_path / "m" / "model-00003-of-00003.safetensors"))
    save_file(stale, str(tmp_path / "m" / "model.safetensors"))
    loaded = LlamaGen.from_pretrained(tmp_path / "m").eval()
    captions, tokens = torch.randn(2, 6, 12), torch.randint(0, model.config.vocab_size, (2, 10))
    assert torch.equal(loaded(captions, tokens)[0], model(captions, tokens)[0])


@pytest.mark.parametrize(("damage", "message"), [
    ("shard", "model.safetensors.index.json lists the shard model-00002-of-00002.safetensors, which is not in"),
    ("block_size", "HF config is missing 'block_size'"),
    ("input_type", "HF config is missing 'input_type'"),
    ("cls_token_num", "HF config is missing 'cls_token_num' (caption tokens)"),
    ("q_proj", "model.layers.0.self_attn.q_proj.weight has shape [64, 63], config.json expects [64, 64]"),
])
def test_a_damaged_hf_port_is_refused_in_one_line(tmp_path: Path, damage: str, message: str) -> None:
    """A missing shard, a config without a field LANTERN's code reads (a default decided the image
    size or the condition kind silently), a projection of another width (a torch.cat error)."""
    from safetensors.torch import load_file

    folder = tmp_path / "m"
    _hf_port(folder)
    if damage == "shard":
        (folder / "model-00002-of-00002.safetensors").unlink()
    elif damage == "q_proj":
        for shard in folder.glob("*.safetensors"):
            state = load_file(str(shard))
            if "model.layers.0.self_attn.q_proj.weight" in state:
                state["model.layers.0.self_attn.q_proj.weight"] = state["model.layers.0.self_attn.q_proj.weight"][:, 1:]
                save_file({k: v.contiguous() for k, v in state.items()}, str(shard))
    else:
        config = json.loads((folder / "config.json").read_text())
        del config[damage]
        (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(LanternError) as err:
        LlamaGen.from_pretrained(folder)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_folder_round_trip(tmp_path) -> None:
    model = tiny_llamagen(seed=5)
    model.save_pretrained(tmp_path / "m")
    loaded = LlamaGen.from_pretrained(tmp_path / "m").eval()
    assert loaded.config == model.config
    assert torch.equal(_tiny_logits(loaded), _tiny_logits(model))


def test_checkpoint_with_missing_or_misshaped_keys(tmp_path) -> None:
    model = tiny_llamagen()
    state = dict(model.state_dict())
    del state["layers.1.attention.wo.weight"]
    state["norm.weight"] = torch.ones(7)
    torch.save({"model": state}, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError) as err:
        LlamaGen.from_official_checkpoint(tmp_path / "bad.pt", model.config)
    msg = str(err.value)
    assert "missing keys: layers.1.attention.wo.weight" in msg
    assert "norm.weight (checkpoint (7,), model (64,))" in msg


def test_rope_table_and_condition_quirk() -> None:
    """Condition rows of the 2D table are zeros, so condition q and k are exactly 0 ([LlamaGen code] gpt.py)."""
    cfg = LlamaGenConfig(dim=64, n_layer=1, n_head=2, vocab_size=32, block_size=16, cls_token_num=3, multiple_of=32)
    table = rope_table_2d(cfg)  # [3 + 16, 16, 2]
    assert table.shape == (19, 16, 2)
    assert torch.count_nonzero(table[:3]) == 0
    # Cell (r=2, c=1) at index cls + 2*4 + 1: angles [2*w, 1*w] with w_j = 10000^(-2j/16), j < 8.
    w = 10000.0 ** (-torch.arange(0, 16, 2)[:8].float() / 16)
    angles = torch.cat([2 * w, 1 * w])
    assert torch.allclose(table[3 + 9, :, 0], angles.cos()) and torch.allclose(table[3 + 9, :, 1], angles.sin())
    x = torch.randn(1, 19, 2, 32)
    rotated = apply_rope(x, table[None])
    assert torch.count_nonzero(rotated[:, :3]) == 0
    # Interleaved pairs: (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin)
    c, s = table[5, 0]
    assert torch.allclose(
        rotated[0, 5, 0, :2],
        torch.stack([x[0, 5, 0, 0] * c - x[0, 5, 0, 1] * s, x[0, 5, 0, 1] * c + x[0, 5, 0, 0] * s]),
    )


def test_condition_positions_have_zero_query_and_key() -> None:
    """In a real model, q and k at the condition positions are exactly 0, so every attention
    logit against a condition key is 0 and conditions act only through their values."""
    model = tiny_llamagen(seed=2, model_type="t2i", cls_token_num=4, caption_dim=8)
    captions = torch.randn(1, 4, 8)
    tokens = torch.randint(0, 256, (1, 6))
    attn = model.layers[0].attention
    h = model.layers[0].attention_norm(torch.cat([model.embed_condition(captions), model.tok_embeddings(tokens)], 1))
    q, k, _ = attn.wqkv(h).split(64, dim=-1)
    rope = model.rope_at(torch.arange(10)[None])
    q, k = apply_rope(q.view(1, 10, 4, 16), rope), apply_rope(k.view(1, 10, 4, 16), rope)
    assert torch.count_nonzero(k[:, :4]) == 0 and torch.count_nonzero(q[:, :4]) == 0
    assert torch.count_nonzero(k[:, 4:]) > 0
    # Scores of image queries against condition keys: [H, 6, 4], all exactly 0.
    scores = q[0, 4:].transpose(0, 1) @ k[0, :4].transpose(0, 1).transpose(1, 2)
    assert torch.count_nonzero(scores) == 0


def _teacher_forced_cached_logits(
    model: LlamaGen, labels: torch.Tensor, codes: torch.Tensor, sampling: SamplingConfig, chunk_sizes: torch.Tensor
) -> torch.Tensor:
    """Feed ``codes`` through the cached path, each row committing its own number of tokens per
    step (so rows sit at different lengths), and collect the logits predicting every token."""
    b, n = codes.shape
    target = LlamaGenTarget(model, sampling, max_tree_nodes=4)
    first, _ = target.start(labels)
    out = torch.zeros(b, n, model.config.vocab_size)
    out[:, 0] = first
    done = torch.zeros(b, dtype=torch.long)  # tokens committed per row
    step = 0
    t = 4
    chain = torch.ones(t, t, dtype=torch.bool).tril().expand(b, -1, -1)
    depth = torch.arange(t).expand(b, -1)
    while bool((done < n - 1).any()):
        idx = (done[:, None] + torch.arange(t)).clamp(max=n - 1)
        tokens = codes.gather(1, idx)
        logits, _ = target.verify(tokens, chain, depth)
        keep = torch.minimum(chunk_sizes[:, step % chunk_sizes.shape[1]], n - 1 - done).clamp(min=0)
        for r in range(b):
            for j in range(int(keep[r])):
                out[r, done[r] + j + 1] = logits[r, j]
        target.commit(torch.arange(t).expand(b, -1), keep)
        done += keep
        step += 1
    return out


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_kv_cache_matches_full_recomputation(cfg_scale: float) -> None:
    """Cached decoding, batch 3 at different per-row lengths, equals the uncached pass (<= 1e-4)."""
    torch.manual_seed(0)
    model = tiny_llamagen(seed=1)
    labels = torch.tensor([0, 5, 9])
    codes = torch.randint(0, 256, (3, 64))
    sizes = torch.tensor([[1, 3, 2], [4, 1, 1], [2, 2, 4]])
    cached = _teacher_forced_cached_logits(model, labels, codes, SamplingConfig(cfg_scale=cfg_scale), sizes)
    full_c = model(labels, codes[:, :-1])[0]
    full_u = model(model.null_condition(3), codes[:, :-1])[0]
    full = full_c if cfg_scale == 1.0 else apply_cfg(torch.cat([full_c, full_u]), cfg_scale, 2)
    assert (cached - full).abs().max().item() <= 1e-4


def test_labels_out_of_range() -> None:
    model = tiny_llamagen()
    target = LlamaGenTarget(model, SamplingConfig())
    with pytest.raises(LanternError, match="label 10 is out of range.*10 classes"):
        target.start(torch.tensor([0, 10]))
    with pytest.raises(LanternError, match="label -1 is out of range"):
        target.start(torch.tensor([-1]))


def test_a_folder_of_no_known_family_says_what_a_model_folder_holds(tmp_path: Path) -> None:
    """A folder with neither a config.json nor a LlamaGen stack's folders (a Chameleon download
    missing its config.json, say) was refused as "has no tokenizer/ folder; pass --tokenizer DIR",
    a flag Chameleon-family models refuse."""
    import lantern

    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(LanternError) as err:
        lantern.load(tmp_path)
    assert str(err.value) == (f"model {tmp_path} is not a model folder lantern reads: it has no config.json (a "
                              "Chameleon, Janus or Emu3 folder has one) and no target/ and tokenizer/ folders (a "
                              "LlamaGen stack)")


def test_a_folder_of_official_checkpoints_says_to_convert_them(tmp_path: Path) -> None:
    """A folder of LlamaGen's downloads (``c2i_B_256.pt``, ``vq_ds16_c2i.pt``) was refused as "has
    no tokenizer/ folder", which sends the user the wrong way."""
    import lantern

    model = tiny_llamagen()
    torch.save({"model": model.state_dict()}, tmp_path / "c2i_B_256.pt")
    torch.save({"model": {}}, tmp_path / "vq_ds16_c2i.pt")
    with pytest.raises(LanternError) as err:
        lantern.load(tmp_path)
    assert str(err.value) == (f"model {tmp_path} holds official checkpoint files (c2i_B_256.pt, vq_ds16_c2i.pt), not a "
                              "model folder: convert them once with `lantern convert-llamagen --gpt-ckpt GPT.pt "
                              "--vq-ckpt VQ.pt --out DIR` and pass that folder")


def test_an_hf_port_samples_with_llamagens_defaults_where_generation_json_is_silent(tmp_path: Path) -> None:
    """LANTERN's HF port (jadohu/LlamaGen-T2I) is an official model: without a generation.json it
    sampled with lantern's CFG 1 and no top-k, where LlamaGen's sample_t2i.py (and a stack that
    convert-llamagen writes) uses CFG 7.5 and top-k 1000. lantern-format targets keep lantern's."""
    from lantern.targets.llamagen_stack import load_stack
    from lantern.testing import tiny_vq

    (tmp_path / "port").mkdir()
    _hf_port(tmp_path / "port" / "target")
    tiny_vq().save_pretrained(tmp_path / "port" / "tokenizer")
    port = load_stack(tmp_path / "port")
    assert port.hf_port and port.default_sampling() == {"cfg_scale": 7.5, "top_k": 256, "temperature": 1.0,
                                                        "top_p": 1.0}  # top-k 1000 keeps all 256 codes
    assert port.sampling_origin("cfg_scale") == "LlamaGen's sample_t2i.py default"
    (tmp_path / "port" / "generation.json").write_text(json.dumps({"cfg_scale": 2.0}))
    assert load_stack(tmp_path / "port").default_sampling()["cfg_scale"] == 2.0  # the file still wins
    own_target = tiny_llamagen(seed=4, model_type="t2i", cls_token_num=6, caption_dim=12)
    own_target.save_pretrained(tmp_path / "own" / "target")
    tiny_vq().save_pretrained(tmp_path / "own" / "tokenizer")
    own = load_stack(tmp_path / "own")
    assert not own.hf_port and own.default_sampling() == {}
