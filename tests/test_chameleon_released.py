"""LANTERN's released Anole / Lumina-mGPT drafters: strict loading and drafting on their sequence.

Checkpoints are synthesised in the releases' exact key layout (the 7B shapes on the meta device,
tiny random configs of the same layout for running). What is checked:

* the 7B key / shape tables, written out here from the official ``data/configs/*.json`` and
  ``cnets_*.py``, equal what lantern builds; the release is recognised from the q_norm shape;
* greedy speculative decoding with a released-layout drafter = greedy AR, token for token, both
  layouts, batch 1 and 3, with and without guidance;
* the drafter's committed input at every round (tokens, features, positions, per stream) equals
  the sequence the official layout builds from the prompt and image prefix (reference below);
* a released-layout drafter trained briefly here on the tiny target's own sequences, in that
  reference layout, drafts far better than an untrained one (so inference feeds what training
  fed);
* folders of the wrong release, size or keys give one-line errors.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import ANOLE, CHAMELEON_LAYOUTS, CHAMELEON_PROMPTS, LUMINA, chameleon_lm
from torch import Tensor

from lantern.decoding.config import SamplingConfig
from lantern.decoding.loop import generate
from lantern.decoding.sampling import apply_cfg, make_generators
from lantern.drafters.released import ReleasedDrafterBackend, load_chameleon_drafter
from lantern.errors import CheckpointError, LanternError
from lantern.methods import MethodConfig
from lantern.models.chameleon import ImageLayout
from lantern.models.chameleon_drafter import (
    ReleasedChameleonDrafter,
    ReleasedDrafterConfig,
    detect_layout,
    load_released_drafter,
    save_released_drafter,
)
from lantern.targets.chameleon import ChameleonTarget, encode_prompts
from lantern.testing import chameleon_parts, tiny_released_drafter

pytest.importorskip("transformers")

# The tests that need a drafter trained here (_trained_drafter: seconds per layout) run the Lumina layout in
# the fast tier (pytest -m "not slow"), both layouts in the full suite.
TRAINED_LAYOUTS = ["lumina", pytest.param("anole", marks=pytest.mark.slow)]


def _run(layout: ImageLayout, drafter: ReleasedChameleonDrafter | None, prompts: list[list[int]], cfg: float,
         method: str = "sd", tree: str | None = "dynamic") -> tuple[Any, ReleasedDrafterBackend | None]:
    """Greedy generation; returns (output, the drafter backend)."""
    ids, mask = encode_prompts(prompts, layout)
    sampling = SamplingConfig(temperature=0.0, top_k=0, cfg_scale=cfg)
    if drafter is None:
        return generate(ChameleonTarget(chameleon_lm(), layout, sampling), ids, cond_mask=mask), None
    target, draft = chameleon_parts(chameleon_lm(), layout, sampling, MethodConfig.resolve(method, tree=tree), drafter,
                                    chameleon_lm().image_head)
    assert draft is not None
    backend = draft.backend  # type: ignore[attr-defined]
    assert isinstance(backend, ReleasedDrafterBackend)
    return generate(target, ids, drafter=draft, cond_mask=mask), backend


# -- 7B key / shape tables (written out from the official config files and cnets_*.py) -----------

# data/configs/anole_config.json and lumina_mgpt_config.json (the fields the drafter reads; both
# files are identical here apart from Lumina's "dropout": 0.05, which is inactive at inference).
OFFICIAL_CONFIG = {
    "model_type": "chameleon", "attention_bias": False, "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 11008, "max_position_embeddings": 4096, "mlp_bias": False, "model_parallel_size": 1,
    "num_attention_heads": 32, "num_hidden_layers": 1, "num_key_value_heads": 32, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 10000.0, "swin_norm": False, "vocab_size": 65536,
}


def _table(norm_rows: int) -> dict[str, tuple[int, ...]]:
    d, f, v, hd = 4096, 11008, 65536, 128
    table = {
        "embed_tokens.weight": (v, d),
        "fc.weight": (d, 2 * d),
        "fc.bias": (d,),
        "layers.0.input_layernorm.weight": (d,),
        "layers.0.post_attention_layernorm.weight": (d,),
        "layers.0.mlp.gate_proj.weight": (f, d),
        "layers.0.mlp.up_proj.weight": (f, d),
        "layers.0.mlp.down_proj.weight": (d, f),
    }
    for p in "qkvo":
        table[f"layers.0.self_attn.{p}_proj.weight"] = (d, d)
    for n in "qk":  # ChameleonLayerNorm: Anole [num_heads, head_dim]; Lumina [model_parallel_size, head_dim]
        table[f"layers.0.self_attn.{n}_norm.weight"] = (norm_rows, hd)
        table[f"layers.0.self_attn.{n}_norm.bias"] = (norm_rows, hd)
    return table


RELEASE_TABLES = {"anole": _table(32), "lumina-mgpt": _table(1)}


@pytest.mark.parametrize("layout", list(RELEASE_TABLES))
def test_released_7b_keys_and_shapes_on_meta(layout: str) -> None:
    expected = RELEASE_TABLES[layout]
    with torch.device("meta"):
        model = ReleasedChameleonDrafter(ReleasedDrafterConfig.from_json(OFFICIAL_CONFIG, layout))
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == expected
    meta_state = {k: torch.empty(s, device="meta") for k, s in expected.items()}
    assert detect_layout(OFFICIAL_CONFIG, meta_state, "x") == layout


# -- greedy = AR ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", list(CHAMELEON_LAYOUTS))
@pytest.mark.parametrize("cfg", [1.0, 3.0])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("method,tree", [("sd", "dynamic"), ("sd-static", "static:mc_sim_7b_63"), ("sd", "chain:4")])
def test_greedy_with_released_drafter_reproduces_ar(layout: str, cfg: float, batch: int, method: str,
                                                    tree: str) -> None:
    lay = CHAMELEON_LAYOUTS[layout]
    drafter = tiny_released_drafter(chameleon_lm(), lay.name)
    out, backend = _run(lay, drafter, CHAMELEON_PROMPTS[:batch], cfg, method, tree)
    ar, _ = _run(lay, None, CHAMELEON_PROMPTS[:batch], cfg)
    assert torch.equal(out.codes, ar.codes)
    assert backend is not None and backend.forwards > 0


def test_sampled_rows_do_not_depend_on_batch_mates() -> None:
    """LANTERN++ sampling with a released-layout drafter: a row's codes are the same alone and in a
    batch with other (differently padded) prompts, and a repeated run is identical."""
    sampling = SamplingConfig(temperature=1.0, top_k=8, cfg_scale=3.0)
    method = MethodConfig.resolve("sd-static", tree="static:mc_sim_7b_63")
    drafter = tiny_released_drafter(chameleon_lm(), LUMINA.name)

    def run(prompts: list[list[int]], seeds: list[int]) -> Tensor:
        ids, mask = encode_prompts(prompts, LUMINA)
        target, draft = chameleon_parts(chameleon_lm(), LUMINA, sampling, method, drafter, chameleon_lm().image_head)
        return generate(target, ids, drafter=draft, cond_mask=mask, generators=make_generators(seeds, "cpu")).codes

    batch = run(CHAMELEON_PROMPTS, [5, 6, 7])
    assert torch.equal(batch, run(CHAMELEON_PROMPTS, [5, 6, 7]))
    for i in range(len(CHAMELEON_PROMPTS)):
        assert torch.equal(run([CHAMELEON_PROMPTS[i]], [5 + i])[0], batch[i])


# -- the drafter's input sequence ------------------------------------------------------------------


@torch.no_grad()
def _reference_entries(layout: ImageLayout, text: list[int], codes: list[int], stream: int) -> tuple[Tensor, ...]:
    """The official layout's drafter sequence for a prompt and image: the stream's whole token
    sequence (conditional: head + prompt + tail + prefix; unconditional: the guidance context),
    then the codes' BPE ids with a new-line token after each row (Lumina-mGPT); entry p =
    (feature of token p, BPE id of token p+1, position p)."""
    lm = chameleon_lm()
    bpe = lm.code_to_bpe(torch.tensor(codes)).tolist()
    seq = layout.sequence(text, bpe)
    if stream == 1:
        seq = [*layout.uncond, *seq[len(layout.head) + len(text) + len(layout.tail) + len(layout.prefix) :]]
    feats = lm.reference_hidden(torch.tensor([seq]))[0]
    return torch.tensor(seq[1:]), feats[:-1], torch.arange(len(seq) - 1)


def _record_context(backend: ReleasedDrafterBackend) -> list[list[tuple[Tensor, Tensor, Tensor]]]:
    """Wrap the backend's context pass; per round and stream row: (tokens, features, positions)
    of the real entries it absorbed (the prompt's, absorbed at ``start``, count with the first
    round's)."""
    rounds: list[list[tuple[Tensor, Tensor, Tensor]]] = []
    absorb, start = backend._absorb_pending, backend.start
    prompt: list[list[tuple[Tensor, Tensor, Tensor]]] = []  # absorbed by start, not yet merged
    starting = False

    def spy_start(hidden: Tensor, root: Tensor, path_width: int | None = None) -> None:
        nonlocal starting
        starting = True
        start(hidden, root, path_width)
        starting = False

    def spy(pending: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        assert backend.cache is not None and backend.col_real is not None
        feats, tokens, counts = pending
        real = backend.col_real.gather(1, backend.cache.lengths[:, None] + torch.arange(tokens.shape[1]))
        out, positions = absorb(pending)
        rows = []
        for n in range(tokens.shape[0]):
            c = int(counts[n])
            keep = real[n, :c]
            rows.append((tokens[n, :c][keep], feats[n, :c][keep].float(), positions[n, :c][keep]))
        if starting:
            prompt.append(rows)
            return out, positions
        if prompt:
            rows = [(torch.cat([p[0], r[0]]), torch.cat([p[1], r[1]]), torch.cat([p[2], r[2]]))
                    for p, r in zip(prompt.pop(), rows, strict=True)]
        rounds.append(rows)
        return out, positions

    backend.start, backend._absorb_pending = spy_start, spy  # type: ignore[method-assign]
    return rounds


@pytest.mark.parametrize("layout", TRAINED_LAYOUTS)
@pytest.mark.parametrize("tree", [pytest.param("dynamic", marks=pytest.mark.slow), "chain:2"])
def test_drafter_sequence_equals_official_layout(layout: str, tree: str) -> None:
    """Every round's absorbed entries continue the reference sequence exactly, for both streams
    of every row (left-padded prompts of different lengths, guidance on)."""
    lay, cfg = CHAMELEON_LAYOUTS[layout], 3.0
    ids, mask = encode_prompts(CHAMELEON_PROMPTS, lay)
    sampling = SamplingConfig(temperature=0.0, top_k=0, cfg_scale=cfg)
    drafter = _trained_drafter(layout)  # long accepted runs: entries cross row ends in one commit
    method = MethodConfig.resolve("sd", tree=tree)
    target, draft = chameleon_parts(chameleon_lm(), lay, sampling, method, drafter, chameleon_lm().image_head)
    backend = draft.backend  # type: ignore[union-attr]
    rounds = _record_context(backend)
    out = generate(target, ids, drafter=draft, cond_mask=mask)
    assert len(rounds) >= 2 and out.stats.mean_accepted > 1.5, (len(rounds), out.stats.mean_accepted)
    b = len(CHAMELEON_PROMPTS)
    for n in range(2 * b):
        prompt = CHAMELEON_PROMPTS[n % b]
        ref_tok, ref_feat, ref_pos = _reference_entries(lay, prompt, out.codes[n % b].tolist(), n // b)
        done = 0
        for rows in rounds:  # the sequence so far is a prefix of the reference after every round
            tok, feat, pos = rows[n]
            assert torch.equal(tok, ref_tok[done : done + len(tok)])
            assert torch.equal(pos, ref_pos[done : done + len(tok)])
            torch.testing.assert_close(feat, ref_feat[done : done + len(tok)], atol=1e-4, rtol=1e-4)
            done += len(tok)
        assert done >= len(ref_tok) - 5  # it followed the image to (almost) its end


def _uncached_chain(drafter: ReleasedChameleonDrafter, layout: ImageLayout, entries: tuple[Tensor, ...],
                    root_index: int, chain: list[int]) -> list[Tensor]:
    """Reference drafting along a chain, by full recomputation: the committed entries, then per
    drafted code an entry (previous output, code) at the next position, and after a code that
    ends a row an entry (its output, new-line) first, as the official drafter drafts the forced
    new-line. Returns the output that predicts each chain position's successor (root first)."""
    tok, feat, pos = (t.clone() for t in entries)

    def last_output() -> Tensor:
        causal = torch.ones(len(tok), len(tok), dtype=torch.bool).tril()[None]
        return drafter(feat[None], tok[None], pos[None], causal)[0, -1]

    def step(x: int) -> Tensor:
        nonlocal tok, feat, pos
        last = last_output()
        tok, feat = torch.cat([tok, torch.tensor([x])]), torch.cat([feat, last[None]])
        pos = torch.cat([pos, pos[-1:] + 1])
        return last

    bpe = chameleon_lm().code_to_bpe(torch.tensor(chain)).tolist()
    outs = []
    for i in range(len(chain) + 1):
        if layout.eol is not None and (root_index + i + 1) % layout.width == 0:
            step(layout.eol)
        if i < len(chain):
            outs.append(step(bpe[i]))
    return [*outs, last_output()]


@pytest.mark.parametrize("layout", TRAINED_LAYOUTS)
@torch.no_grad()
def test_draft_entries_equal_recomputation(layout: str) -> None:
    """Every round's drafted chain (positions, new-line steps across row ends, cache masks) gives
    the logits that full recomputation over the reference sequence plus the chain gives."""
    lay, cfg = CHAMELEON_LAYOUTS[layout], 3.0
    ids, mask = encode_prompts(CHAMELEON_PROMPTS, lay)
    sampling = SamplingConfig(temperature=0.0, top_k=0, cfg_scale=cfg)
    drafter = _trained_drafter(layout)
    method = MethodConfig.resolve("sd", tree="chain:3")
    target, draft = chameleon_parts(chameleon_lm(), lay, sampling, method, drafter, chameleon_lm().image_head)
    backend = draft.backend  # type: ignore[union-attr]
    rounds = _record_context(backend)
    drafted: list[list[Tensor]] = []  # per round: root logits, then each depth's logits [B, V]
    chains: list[list[Tensor]] = []
    begin, feed = backend.begin, backend.feed

    def spy_begin() -> Tensor:
        drafted.append([begin()])
        chains.append([])
        assert backend.codes_done is not None
        chains[-1].append(backend.codes_done.clone())
        return drafted[-1][0]

    def spy_feed(parent: Tensor, tokens: Tensor, depth: int, ancestors: Tensor) -> Tensor:
        out = feed(parent, tokens, depth, ancestors)
        drafted[-1].append(out[:, 0])
        chains[-1].append(tokens[:, 0].clone())
        return out

    backend.begin, backend.feed = spy_begin, spy_feed  # type: ignore[method-assign]
    out = generate(target, ids, drafter=draft, cond_mask=mask)
    b = len(CHAMELEON_PROMPTS)
    refs = [_reference_entries(lay, CHAMELEON_PROMPTS[n % b], out.codes[n % b].tolist(), n // b) for n in range(2 * b)]
    done = [0] * (2 * b)
    checked = 0
    for r, rows in enumerate(rounds):
        for row in range(b):
            heads = []
            for n in (row, row + b):
                done[n] += len(rows[n][0])
                entries = tuple(t[: done[n]] for t in refs[n])
                chain = [int(c[row]) for c in chains[r][1:]]
                heads.append(_uncached_chain(drafter, lay, entries, int(chains[r][0][row]), chain))
            for depth, logits in enumerate(drafted[r]):
                ref = apply_cfg(chameleon_lm().image_head(torch.stack([heads[0][depth], heads[1][depth]])), cfg, 2)[0]
                torch.testing.assert_close(logits[row], ref, atol=2e-4, rtol=1e-4)
                checked += 1
    assert checked >= 3 * len(rounds)


# -- a drafter trained on the reference layout drafts well ----------------------------------------

TRAIN_PROMPTS = [*CHAMELEON_PROMPTS, [104, 151], [105], [106, 152, 107, 108]]  # left padding of 0..3 columns


def _train_entries(layout: ImageLayout, cfg: float) -> list[tuple[Tensor, ...]]:
    """(tokens, features, positions, next features, first image entry) of both streams of every
    training prompt, in the reference layout, from the target's own greedy images."""
    out, _ = _run(layout, None, TRAIN_PROMPTS, cfg)
    data = []
    for i, text in enumerate(TRAIN_PROMPTS):
        for stream in (0, 1):
            tok, feat, pos = _reference_entries(layout, text, out.codes[i].tolist(), stream)
            first = len(tok) - (layout.num_tokens + (layout.height if layout.eol else 0))
            data.append((tok, feat, pos, torch.cat([feat[1:], feat[-1:]]), torch.tensor(first - 1)))
    return data


@cache
def _trained_drafter(layout_key: str, steps: int = 150) -> ReleasedChameleonDrafter:
    """EAGLE's objective (SmoothL1 on the next feature + 0.1 x cross-entropy of its logits) over
    the image part of the reference sequences, full causal attention, as the official trainer."""
    lay = CHAMELEON_LAYOUTS[layout_key]
    data = _train_entries(lay, cfg=3.0)
    torch.manual_seed(0)
    model = tiny_released_drafter(chameleon_lm(), lay.name, seed=1).train()
    model.embed_tokens.weight.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    with torch.enable_grad():  # callers may run under no_grad
        _fit(model, opt, data, steps)
    return model.eval()


def _fit(model: ReleasedChameleonDrafter, opt: torch.optim.Optimizer, data: list[tuple[Tensor, ...]],
         steps: int) -> None:
    head = chameleon_lm().image_head
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.zeros(())
        for tok, feat, pos, nxt, first in data:
            t = tok.shape[0]
            causal = torch.ones(t, t, dtype=torch.bool).tril()[None]
            pred = model(feat[None], tok[None], pos[None], causal)[0, int(first) : -1]
            target = nxt[int(first) : -1]
            ce = -(head(target).softmax(-1) * head(pred).log_softmax(-1)).sum(-1).mean()
            loss = loss + F.smooth_l1_loss(pred, target) + 0.1 * ce
        loss.backward()
        opt.step()


@pytest.mark.parametrize("layout", TRAINED_LAYOUTS)
def test_trained_released_layout_drafter_beats_untrained(layout: str) -> None:
    lay = CHAMELEON_LAYOUTS[layout]
    trained, _ = _run(lay, _trained_drafter(layout), TRAIN_PROMPTS, 3.0, "sd", "chain:4")
    untrained_drafter = tiny_released_drafter(chameleon_lm(), lay.name, seed=1)
    untrained, _ = _run(lay, untrained_drafter, TRAIN_PROMPTS, 3.0, "sd", "chain:4")
    ar, _ = _run(lay, None, TRAIN_PROMPTS, 3.0)
    assert torch.equal(trained.codes, ar.codes)
    tau, tau0 = trained.stats.mean_accepted, untrained.stats.mean_accepted
    assert tau > tau0 + 0.8, (tau, tau0)


# -- folders and errors ----------------------------------------------------------------------------


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin"])
@pytest.mark.parametrize("layout", list(CHAMELEON_LAYOUTS))
def test_folder_round_trip(tmp_path: Path, layout: str, weights: str) -> None:
    lay = CHAMELEON_LAYOUTS[layout]
    drafter = tiny_released_drafter(chameleon_lm(), lay.name)
    save_released_drafter(drafter, tmp_path / "d", weights)
    loaded = load_chameleon_drafter(tmp_path / "d", chameleon_lm(), lay)
    assert isinstance(loaded, ReleasedChameleonDrafter) and loaded.config == drafter.config
    for k, v in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_wrong_release_is_refused(tmp_path: Path) -> None:
    save_released_drafter(tiny_released_drafter(chameleon_lm(), "lumina-mgpt"), tmp_path / "lumina")
    with pytest.raises(LanternError, match=r"Lumina-mGPT release's drafter .* layout is anole"):
        load_chameleon_drafter(tmp_path / "lumina", chameleon_lm(), ANOLE)
    save_released_drafter(tiny_released_drafter(chameleon_lm(), "anole"), tmp_path / "anole")
    with pytest.raises(LanternError, match=r"Anole release's drafter .* layout is lumina-mgpt"):
        load_chameleon_drafter(tmp_path / "anole", chameleon_lm(), LUMINA)


def test_wrong_size_is_refused(tmp_path: Path) -> None:
    cfg = ReleasedDrafterConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4,
                                vocab_size=4096, layout="anole")
    wide = ReleasedChameleonDrafter(cfg)
    save_released_drafter(wide, tmp_path / "d")
    with pytest.raises(LanternError, match=r"vocab_size 4096 \(target has 8832\); hidden_size 64 \(target has 32\)"):
        load_chameleon_drafter(tmp_path / "d", chameleon_lm(), ANOLE)


def _write(tmp_path: Path, state: dict[str, Tensor], config: dict[str, Any]) -> Path:
    from safetensors.torch import save_file

    from lantern.io import write_json

    d = tmp_path / "broken"
    d.mkdir(exist_ok=True)
    write_json(d / "config.json", config)
    save_file(state, str(d / "model.safetensors"))
    return d


def test_bad_folders_give_specific_errors(tmp_path: Path) -> None:
    good = tiny_released_drafter(chameleon_lm(), "anole")
    save_released_drafter(good, tmp_path / "good")
    import json

    config = json.loads((tmp_path / "good" / "config.json").read_text())
    state = {k: v.contiguous() for k, v in good.state_dict().items()}
    missing = {k: v for k, v in state.items() if k != "fc.bias"}
    with pytest.raises(CheckpointError, match="missing keys: fc.bias"):
        load_released_drafter(_write(tmp_path, missing, config))
    rows = dict(state, **{"layers.0.self_attn.q_norm.weight": torch.ones(3, 8)})
    with pytest.raises(LanternError, match="q_norm.weight has 3 rows, neither num_attention_heads"):
        load_released_drafter(_write(tmp_path, rows, config))
    no_norm = {k: v for k, v in state.items() if "q_norm" not in k}
    with pytest.raises(LanternError, match="has no layers.0.self_attn.q_norm.weight"):
        load_released_drafter(_write(tmp_path, no_norm, config))
    with pytest.raises(LanternError, match="is missing hidden_size"):
        load_released_drafter(_write(tmp_path, state, {k: v for k, v in config.items() if k != "hidden_size"}))
    with pytest.raises(LanternError, match=r"unsupported rope_scaling=\{'type': 'linear'"):
        load_released_drafter(_write(tmp_path, state, dict(config, rope_scaling={"type": "linear", "factor": 2})))
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "config.json").write_text(json.dumps(config))
    with pytest.raises(LanternError, match="has neither model.safetensors nor pytorch_model.bin"):
        load_released_drafter(tmp_path / "nothing")


@pytest.mark.slow
def test_released_drafter_through_lantern_load(tmp_path: Path) -> None:
    """``lantern.load(folder, drafter=RELEASED_FOLDER)``: the Python API drafts with a released-layout
    drafter (drafter forwards happen) and, greedy, decodes exactly AR's codes."""
    import lantern
    from lantern.models.chameleon import load_chameleon
    from lantern.models.chameleon_drafter import save_released_drafter
    from lantern.testing import make_tiny_chameleon_folder

    folder = make_tiny_chameleon_folder(tmp_path / "model")
    drafter = save_released_drafter(tiny_released_drafter(load_chameleon(folder, dtype=torch.float32)),
                                    tmp_path / "released")
    prompts = ["a cat", "a dog"]
    # 64 px: 4 x 4 codes with a row end after each row (the folder's default size decodes 16 x 16)
    ar = lantern.load(folder, image_size=64)(prompts=prompts, method="ar", seed=0, temperature=0)
    sd = lantern.load(folder, drafter=str(drafter), image_size=64)(prompts=prompts, method="sd", seed=0,
                                                                   temperature=0, tree="chain:3")
    assert torch.equal(torch.as_tensor(ar.codes), torch.as_tensor(sd.codes))
    assert sd.stats["drafter_forwards"] > 0 and sd.stats["target_forwards"] < ar.stats["target_forwards"]
