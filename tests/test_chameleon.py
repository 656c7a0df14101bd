"""Chameleon-family targets (Anole, Lumina-mGPT) on tiny random transformers models.

What is checked, all against transformers' own uncached forward (``ChameleonLM.reference_hidden``)
over the full token sequence, with guidance, image-token restriction and new-line tokens applied
as the public inference code does:

* cached prefill + decoding (left-padded prompts, per-row positions) = full recomputation;
* tree verification (with end-of-row shadow nodes) = causal attention along every tree path, and
  commit then decode = sequential decoding;
* greedy speculative decoding (EAGLE drafter, oracle drafter, SJD) = greedy AR, token for token,
  for both layouts, batch 1 and 3, with and without guidance;
* exact speculative sampling (EAGLE drafters, coupled SJD) reproduces the target's joint law of
  the first tokens (chi-square);
* real-size (7B) key names and shapes on the meta device; bad input errors.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch
from conftest import (
    ANOLE,
    CHAMELEON_LAYOUTS,
    CHAMELEON_PROMPTS,
    LUMINA,
    NON_SQUARE_LAYOUTS,
    chameleon_greedy_ar,
    chameleon_lm,
)
from torch import Tensor

from lantern.decoding.config import SamplingConfig, TreeConfig
from lantern.decoding.loop import DraftTree, GenerationOutput, generate
from lantern.decoding.sampling import apply_cfg, make_generators, probs_from_logits
from lantern.decoding.trees import tree_from_parents
from lantern.errors import LanternError
from lantern.methods import MethodConfig
from lantern.models.chameleon import (
    ChameleonLM,
    ImageLayout,
    anole_layout,
    code_token_name,
    default_vocabulary_map,
    image_token_ids,
    lumina_layout,
)
from lantern.targets.chameleon import ChameleonTarget, encode_prompts
from lantern.targets.chameleon_stack import init_chameleon_drafter
from lantern.testing import chameleon_parts, chi_square_pooled, chi_square_threshold

pytest.importorskip("transformers")  # part of the dev extra; CI installs it


# -- reference: transformers' forward over full sequences ------------------------------------------


@torch.no_grad()
def _reference_logits(lm: ChameleonLM, layout: ImageLayout, text: list[int], codes: list[int], cfg: float) -> Tensor:
    """Guided code logits [V] for the code after ``codes``, by full recomputation."""
    bpe = lm.code_to_bpe(torch.tensor(codes, dtype=torch.long)).tolist() if codes else []
    full = layout.sequence(text, bpe)
    cond = lm.image_logits(lm.reference_hidden(torch.tensor([full]))[0, -1])
    if cfg == 1.0:
        return cond
    image_part = full[len(layout.head) + len(text) + len(layout.tail) + len(layout.prefix) :]
    uncond_seq = [*layout.uncond, *image_part]
    uncond = lm.image_logits(lm.reference_hidden(torch.tensor([uncond_seq]))[0, -1])
    return apply_cfg(torch.stack([cond, uncond]), cfg, 2)[0]


def _greedy_reference(lm: ChameleonLM, layout: ImageLayout, text: list[int], cfg: float) -> list[int]:
    codes: list[int] = []
    for _ in range(layout.num_tokens):
        codes.append(int(_reference_logits(lm, layout, text, codes, cfg).argmax()))
    return codes


# -- cache and tree attention ----------------------------------------------------------------------


@pytest.mark.parametrize("layout", [*CHAMELEON_LAYOUTS, *NON_SQUARE_LAYOUTS])
@pytest.mark.parametrize("cfg", [1.0, 3.0])
def test_cached_decoding_equals_full_recomputation(layout: str, cfg: float) -> None:
    """Left-padded batch, cached AR = transformers' forward per prompt (new-line tokens included);
    Lumina-mGPT's wide and tall grids too."""
    lay = {**CHAMELEON_LAYOUTS, **NON_SQUARE_LAYOUTS}[layout]
    codes = chameleon_greedy_ar(lay, cfg)
    for row, text in enumerate(CHAMELEON_PROMPTS):
        assert codes[row].tolist() == _greedy_reference(chameleon_lm(), lay, text, cfg)


def _random_tree(t: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, t)]
    return torch.tensor(parents)


def _path(parents: list[int], node: int) -> list[int]:
    out = []
    while node > 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


@pytest.mark.parametrize("start_codes", [0, 1, 2, 4])  # where the tree's row boundaries fall
@pytest.mark.parametrize("cfg", [1.0, 3.0])
@pytest.mark.parametrize("shape", ["square", "wide", "tall"])
def test_tree_attention_equals_causal_paths(start_codes: int, cfg: float, shape: str) -> None:
    """Every node's verify logits = full recomputation along its root path (Lumina: new-line
    shadows inserted wherever a path crosses a row end), for two rows at different offsets, on
    square, wide and tall grids."""
    lm, lay = chameleon_lm(), NON_SQUARE_LAYOUTS.get(shape, LUMINA)
    sampling = SamplingConfig(temperature=1.0, top_k=0, cfg_scale=cfg)
    ids, mask = encode_prompts(CHAMELEON_PROMPTS[:2], lay)
    target = ChameleonTarget(lm, lay, sampling, max_tree_nodes=12)
    logits0, _ = target.start(ids, mask)
    g = torch.Generator().manual_seed(start_codes)
    prefix = torch.randint(0, lm.num_codes, (2, start_codes + 1), generator=g)  # committed codes + root
    # commit start_codes codes one at a time (AR), row 1 one code further than row 0
    for j in range(start_codes):
        tree = tree_from_parents(torch.full((2, 1), -1))
        target.verify(prefix[:, j : j + 1], tree.mask, tree.depth)
        target.commit(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long))
    t = 10
    parents = torch.stack([_random_tree(t, 11), _random_tree(t, 12)])
    buffers = tree_from_parents(parents)
    tokens = torch.randint(0, lm.num_codes, (2, t), generator=g)
    tokens[:, 0] = prefix[:, start_codes]
    logits, hidden = target.verify(tokens, buffers.mask, buffers.depth)
    assert hidden.shape == (target.streams * 2, t, lm.hidden_size)
    for b in range(2):
        known = prefix[b, :start_codes].tolist()
        for node in range(t):
            codes = known + [int(tokens[b, i]) for i in [0, *_path(parents[b].tolist(), node)]]
            ref = _reference_logits(lm, lay, CHAMELEON_PROMPTS[b], codes, cfg)
            torch.testing.assert_close(logits[b, node], ref, atol=2e-4, rtol=1e-4)


def test_commit_then_decode_equals_sequential() -> None:
    """Keep a 3-node path that crosses a row end, then verify again: the cache holds exactly the
    sequence (codes and the new-line token) that sequential decoding would have built."""
    lm, lay, cfg = chameleon_lm(), LUMINA, 3.0
    sampling = SamplingConfig(temperature=1.0, top_k=0, cfg_scale=cfg)
    ids, mask = encode_prompts(CHAMELEON_PROMPTS[:1], lay)
    target = ChameleonTarget(lm, lay, sampling, max_tree_nodes=8)
    target.start(ids, mask)
    # chain root(code 0) -> a -> b -> c; codes 0..2 fill row 0, so c starts row 1 after a new-line
    parents = torch.tensor([[-1, 0, 1, 2, 0]])
    buffers = tree_from_parents(parents)
    tokens = torch.tensor([[3, 7, 1, 12, 9]])
    target.verify(tokens, buffers.mask, buffers.depth)
    target.commit(torch.tensor([[0, 1, 2, 3]]), torch.tensor([4]))
    root = tree_from_parents(torch.full((1, 1), -1))
    logits, _ = target.verify(torch.tensor([[5]]), root.mask, root.depth)
    ref = _reference_logits(lm, lay, CHAMELEON_PROMPTS[0], [3, 7, 1, 12, 5], cfg)
    torch.testing.assert_close(logits[0, 0], ref, atol=2e-4, rtol=1e-4)


# -- greedy speculative decoding = greedy AR --------------------------------------------------------


class _OracleChain:
    """Drafts the target's own greedy continuation (by full recomputation), with every
    ``wrong_every``-th draft replaced by another code: long accepted runs that cross row ends,
    and rejections, both happen."""

    def __init__(self, lm: ChameleonLM, layout: ImageLayout, prompts: list[list[int]], cfg: float, depth: int,
                 wrong_every: int) -> None:
        self.lm, self.layout, self.prompts, self.cfg = lm, layout, prompts, cfg
        self.depth, self.wrong_every = depth, wrong_every
        self.forwards = 0
        self.seqs: list[list[int]] = []
        self.calls = 0

    def start(self, hidden: Tensor, root: Tensor) -> None:
        self.seqs = [[int(r)] for r in root]

    def propose(self, generators: object, active: Tensor, max_depth: Tensor) -> DraftTree:
        b = len(self.seqs)
        tokens = torch.zeros(b, self.depth + 1, dtype=torch.long)
        for row in range(b):
            seq = list(self.seqs[row])
            tokens[row, 0] = seq[-1]
            for d in range(1, self.depth + 1):
                if len(seq) >= self.layout.num_tokens:
                    nxt = 0
                else:
                    nxt = int(_reference_logits(self.lm, self.layout, self.prompts[row], seq, self.cfg).argmax())
                self.calls += 1
                if self.calls % self.wrong_every == 0:
                    nxt = (nxt + 1) % self.lm.num_codes
                seq.append(nxt)
                tokens[row, d] = nxt
        parents = torch.arange(-1, self.depth).expand(b, -1)
        self.forwards += 1
        return DraftTree(tokens=tokens, buffers=tree_from_parents(parents.contiguous()))

    def commit(self, hidden: Tensor, next_tokens: Tensor, num_new: Tensor) -> None:
        for row in range(len(self.seqs)):
            self.seqs[row].extend(int(x) for x in next_tokens[row, : int(num_new[row])])


@pytest.mark.parametrize("layout", list(CHAMELEON_LAYOUTS))
@pytest.mark.parametrize("cfg", [1.0, 3.0])
def test_greedy_oracle_speculative_reproduces_ar(layout: str, cfg: float) -> None:
    lay = CHAMELEON_LAYOUTS[layout]
    ids, mask = encode_prompts(CHAMELEON_PROMPTS, lay)
    sampling = SamplingConfig(temperature=0.0, top_k=0, cfg_scale=cfg)
    drafter = _OracleChain(chameleon_lm(), lay, CHAMELEON_PROMPTS, cfg, depth=4, wrong_every=5)
    target = ChameleonTarget(chameleon_lm(), lay, sampling, max_tree_nodes=5)
    out = generate(target, ids, drafter=drafter, cond_mask=mask)
    assert torch.equal(out.codes, chameleon_greedy_ar(lay, cfg))
    assert out.stats.mean_accepted > 2.0  # long accepted runs really happened


@pytest.mark.parametrize("layout", list(CHAMELEON_LAYOUTS))
@pytest.mark.parametrize("cfg", [1.0, 3.0])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize(
    "method,tree",
    [("sd", "dynamic"), ("sd-static", "static:mc_sim_7b_63"), ("lantern++", "chain:4"), ("sjd", None)],
)
def test_greedy_speculative_reproduces_ar(layout: str, cfg: float, batch: int, method: str, tree: str | None) -> None:
    """A random EAGLE drafter (or SJD) with exact greedy acceptance must give AR's codes."""
    lay = CHAMELEON_LAYOUTS[layout]
    prompts = CHAMELEON_PROMPTS[:batch]
    ids, mask = encode_prompts(prompts, lay)
    sampling = SamplingConfig(temperature=0.0, top_k=0, cfg_scale=cfg)
    resolved = MethodConfig.resolve(method, tree=tree, lantern_lambda=1.0 if method == "lantern++" else None,
                                    sjd_window=4 if method == "sjd" else None)
    drafter = None if method == "sjd" else init_chameleon_drafter(chameleon_lm(), lay).eval()
    target, draft = chameleon_parts(chameleon_lm(), lay, sampling, resolved, drafter, chameleon_lm().image_head)
    out = generate(target, ids, drafter=draft, cond_mask=mask)
    assert torch.equal(out.codes, chameleon_greedy_ar(lay, cfg, prompts))


@pytest.mark.parametrize("layout", list(CHAMELEON_LAYOUTS))
@pytest.mark.parametrize("cfg", [1.0, 3.0])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("coupling", ["maximal", "gumbel"])
def test_greedy_coupled_sjd_reproduces_ar(layout: str, cfg: float, batch: int, coupling: str) -> None:
    """Coupled SJD's greedy codes equal AR's (Lumina's row ends are shadow nodes in its chains)."""
    lay = CHAMELEON_LAYOUTS[layout]
    ids, mask = encode_prompts(CHAMELEON_PROMPTS[:batch], lay)
    sampling = SamplingConfig(temperature=0.0, top_k=0, cfg_scale=cfg)
    resolved = MethodConfig.resolve("sjd-coupled", sjd_window=4, sjd_coupling=coupling)
    target, draft = chameleon_parts(chameleon_lm(), lay, sampling, resolved, None, chameleon_lm().image_head)
    out = generate(target, ids, drafter=draft, cond_mask=mask)
    assert torch.equal(out.codes, chameleon_greedy_ar(lay, cfg, CHAMELEON_PROMPTS[:batch]))


def test_sampled_coupled_sjd_rows_independent_of_batch() -> None:
    """Sampled coupled SJD on the Lumina layout: a row's codes do not depend on its batch-mates."""
    sampling = SamplingConfig(temperature=1.0, top_k=8, cfg_scale=2.0)
    resolved = MethodConfig.resolve("sjd-coupled", sjd_window=4, sjd_coupling="gumbel")

    def run(prompts: list[list[int]], seeds: list[int]) -> Tensor:
        ids, mask = encode_prompts(prompts, LUMINA)
        target, draft = chameleon_parts(chameleon_lm(), LUMINA, sampling, resolved, None, chameleon_lm().image_head)
        return generate(target, ids, generators=make_generators(seeds), drafter=draft, cond_mask=mask).codes

    together = run(CHAMELEON_PROMPTS, [1, 2, 3])
    for i in range(3):
        assert torch.equal(together[i], run(CHAMELEON_PROMPTS[i : i + 1], [i + 1])[0]), i


# -- exact sampling reproduces the target distribution ---------------------------------------------

DIST_ROWS = 4000
DIST_TOKENS = 3  # codes 0..2 of a 2 x 2 Lumina grid: a new-line token sits between code 1 and 2
DIST_LAYOUT = ImageLayout(name="lumina-mgpt", height=2, width=2, prefix=(8197, 8805, 8805),
                          uncond=(8197, 8805, 8805), eol=8803)
DIST_SAMPLING = SamplingConfig(temperature=1.0, top_k=4, cfg_scale=2.0)
DIST_PROMPT = [101, 102]


@cache
def _dist_lm() -> ChameleonLM:
    return chameleon_lm(seed=5, num_codes=6, logit_std=0.2)


@torch.no_grad()
def _exact_joint(sampling: SamplingConfig) -> Tensor:
    lm, v = _dist_lm(), 6
    joint = torch.ones(1, dtype=torch.float64)
    prefixes: list[list[int]] = [[]]
    for _ in range(DIST_TOKENS):
        p = torch.stack([
            probs_from_logits(_reference_logits(lm, DIST_LAYOUT, DIST_PROMPT, pre, sampling.cfg_scale)[None],
                              sampling)[0]
            for pre in prefixes
        ]).double()
        joint = (joint[:, None] * p).reshape(-1)
        prefixes = [pre + [c] for pre in prefixes for c in range(v)]
    return joint


def _chi_square(codes: Tensor, p: Tensor) -> tuple[float, int]:
    return chi_square_pooled(codes, p, 6)


@cache
def _dist_run(method: str) -> GenerationOutput:
    """``method``, ``method@compiled`` (inductor, one compiled region per round)."""
    method, _, compiled = method.partition("@")
    mode = "default" if compiled else None
    lm = _dist_lm()
    ids, mask = encode_prompts([DIST_PROMPT] * DIST_ROWS, DIST_LAYOUT)
    width = ids.shape[1]  # one prompt: no padding column for any of the 2 x 4000 cache rows
    gens = make_generators(list(range(DIST_ROWS)))
    if method == "ar":
        target = ChameleonTarget(lm, DIST_LAYOUT, DIST_SAMPLING, prompt_width=width)
        return generate(target, ids, generators=gens, cond_mask=mask)
    if method.startswith("sjd-coupled"):  # coupled SJD: its redraws cross the row end (a shadow node)
        coupling = method.split(":")[1]
        resolved = MethodConfig.resolve("sjd-coupled", sjd_window=3, sjd_init="random", sjd_coupling=coupling)
        target, draft = chameleon_parts(lm, DIST_LAYOUT, DIST_SAMPLING, resolved, None, lm.image_head, mode, width)
        return generate(target, ids, generators=gens, drafter=draft, cond_mask=mask, compile=mode)
    tree = {"sd": "chain:3", "sd-static": "static:mc_sim_7b_63", "sd-static9": "static:cpu_9"}[method]
    resolved = MethodConfig.resolve("sd", tree=tree)
    drafter = init_chameleon_drafter(lm, DIST_LAYOUT, seed=1).eval()
    target, draft = chameleon_parts(lm, DIST_LAYOUT, DIST_SAMPLING, resolved, drafter, lm.image_head, mode, width)
    return generate(target, ids, generators=gens, drafter=draft, cond_mask=mask, compile=mode)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ar", "sd", "sd-static", "sjd-coupled:maximal", "sjd-coupled:gumbel",
                                    "sd-static9@compiled", "sjd-coupled:maximal@compiled"])
def test_exact_sampling_matches_target_distribution(method: str) -> None:
    """Chi-square goodness of fit of codes 0..2 (216 cells, 4^3 = 64 under top-k 4) against the
    exact joint from transformers' forward, at significance 0.001: a false-positive rate of 0.1 %
    per test for a correct implementation (fixed seeds, so deterministic). ``@compiled``: the round
    compiled by inductor (the adapter's static shapes: whole-cache mask, fixed new-line shadows), on
    the 9-node static tree (siblings at three depths; 98 s cold against 126 s for the 63-node one)."""
    p = _exact_joint(DIST_SAMPLING)
    out = _dist_run(method)
    codes = out.codes[:, :DIST_TOKENS]
    cell = (codes * torch.tensor([36, 6, 1])).sum(1)
    assert bool((p[cell] > 0).all()), "a sample fell outside the top-k support"
    stat, df = _chi_square(codes, p)
    assert df >= 30
    assert stat < chi_square_threshold(df), f"chi2 = {stat:.1f} with {df} dof"
    if method != "ar":
        assert out.stats.mean_accepted > 1.2  # drafts were accepted: the speculative path ran


@pytest.mark.slow
def test_chi_square_has_power() -> None:
    """The same speculative samples are rejected against a slightly different target (guidance
    2.5 instead of 2.0), so the test above can fail."""
    codes = _dist_run("sd").codes[:, :DIST_TOKENS]
    wrong = SamplingConfig(temperature=1.0, top_k=4, cfg_scale=2.5)
    stat, df = _chi_square(codes, _exact_joint(wrong))
    assert stat > chi_square_threshold(df)


# -- real sizes on the meta device -----------------------------------------------------------------


def _expected_chameleon_7b_keys() -> dict[str, tuple[int, ...]]:
    """The HF Chameleon-7B checkpoint layout (Anole-7b-hf), written out from the transformers
    conversion's naming: 32 layers, hidden 4096, 32 heads of 128, MLP 11008, vocab 65536; the q/k
    LayerNorms carry one gamma/beta per head ([heads, head_dim]). Lumina-mGPT-7B-* differs only
    there: one row per model-parallel shard, [1, 128] (test_lumina_mgpt_shard_norms_...)."""
    keys: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (65536, 4096),
        "model.norm.weight": (4096,),
        "lm_head.weight": (65536, 4096),
    }
    for i in range(32):
        pre = f"model.layers.{i}."
        for proj in ("q", "k", "v", "o"):
            keys[pre + f"self_attn.{proj}_proj.weight"] = (4096, 4096)
        for norm in ("q_norm", "k_norm"):
            keys[pre + f"self_attn.{norm}.weight"] = (32, 128)
            keys[pre + f"self_attn.{norm}.bias"] = (32, 128)
        keys[pre + "mlp.gate_proj.weight"] = (11008, 4096)
        keys[pre + "mlp.up_proj.weight"] = (11008, 4096)
        keys[pre + "mlp.down_proj.weight"] = (4096, 11008)
        keys[pre + "input_layernorm.weight"] = (4096,)
        keys[pre + "post_attention_layernorm.weight"] = (4096,)
    return keys


def test_real_size_keys_and_shapes_on_meta() -> None:
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration

    with torch.device("meta"):
        model = ChameleonForConditionalGeneration(ChameleonConfig(vocabulary_map=default_vocabulary_map(8192)))
    state = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.startswith("model.vqmodel.")}
    assert state == _expected_chameleon_7b_keys()
    lm = ChameleonLM(model)
    assert lm.num_codes == 8192 and tuple(lm.image_head.weight.shape) == (8192, 4096)
    assert lm.image_ids.device.type == "meta"  # the model's device (see test_code_ids_live_on_the_models_device)
    assert image_token_ids(model.config, 8192).tolist() == list(range(4, 8196))
    lay = lumina_layout(768)
    assert (lay.height, lay.width, lay.prefix, lay.eol) == (48, 48, (8197, 8804 + 24, 8804 + 24), 8803)
    assert anole_layout().num_tokens == 1024


def test_vocabulary_map_is_honoured() -> None:
    lm = chameleon_lm()
    vocab_map = lm.config.vocabulary_map
    for code in (0, 7, 15):
        assert int(lm.image_ids[code]) == vocab_map[code_token_name(code)]
    weight = lm.hf.lm_head.weight
    torch.testing.assert_close(lm.image_head.weight, weight[lm.image_ids])


def test_layout_sequence_matches_lumina_item_processor() -> None:
    """Rows of width codes, each followed by the new-line token (as Lumina's process_image builds)."""
    lay = lumina_layout(64)  # 4 x 4 codes, size tokens 8804 + 2
    seq = lay.sequence([500, 501], list(range(1000, 1016)))
    assert seq[:6] == [0, 500, 501, 8710, 8197, 8806] and seq[6] == 8806
    image = seq[7:]
    assert len(image) == 4 * 5 and all(image[i] == 8803 for i in (4, 9, 14, 19))
    assert lay.format_prompt("a cat").startswith("Generate an image of 64x64 according to the following prompt:\n")


# -- bad input -------------------------------------------------------------------------------------


def test_bad_layouts_and_vocabularies() -> None:
    with pytest.raises(LanternError, match="multiple of 32"):
        lumina_layout(100)
    with pytest.raises(LanternError, match="guidance context must end with the image prefix"):
        ImageLayout(name="x", height=2, width=2, prefix=(8197,), uncond=(0,))

    class Cfg:
        vocabulary_map = {"IMGIMGAZ": 4}
        vocab_size = 100

    with pytest.raises(LanternError, match="no image token for codes"):
        image_token_ids(Cfg(), 2)
    Cfg.vocabulary_map = {}  # no map (LANTERN's Anole config): LANTERN's offset-4 convention
    assert image_token_ids(Cfg(), 3).tolist() == [4, 5, 6]


def test_prompt_context_must_end_with_prefix() -> None:
    target = ChameleonTarget(chameleon_lm(), LUMINA, SamplingConfig(temperature=0.0, top_k=0))
    with pytest.raises(LanternError, match="image prefix"):
        target.start(torch.tensor([[0, 101, 102]]))


def test_tree_exceeding_cache_is_refused() -> None:
    target = ChameleonTarget(chameleon_lm(), ANOLE, SamplingConfig(temperature=0.0, top_k=0), max_tree_nodes=2)
    ids, mask = encode_prompts(CHAMELEON_PROMPTS[:1], ANOLE)
    target.start(ids, mask)
    buffers = tree_from_parents(torch.tensor([[-1, 0, 1]]))
    with pytest.raises(LanternError, match="exceeds"):
        target.verify(torch.zeros(1, 3, dtype=torch.long), buffers.mask, buffers.depth)


def test_unused_tree_config_is_rejected() -> None:
    assert TreeConfig.parse("chain:3").depth == 3  # sanity of the helper used above
    with pytest.raises(LanternError):
        MethodConfig.resolve("sd", tree="chain:0")


def test_not_a_chameleon_folder(tmp_path: Path) -> None:
    from lantern.models.chameleon import check_chameleon_folder

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(LanternError, match="not a Chameleon config"):
        check_chameleon_folder(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "chameleon"}')  # a probe: blamed on the vqmodel's keys
    with pytest.raises(LanternError, match="config.json has no vq_config"):
        check_chameleon_folder(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "chameleon", "vq_config": {}}')
    with pytest.raises(LanternError, match="no weights"):
        check_chameleon_folder(tmp_path)
    (tmp_path / "proximity.safetensors").write_bytes(b"")  # a folder's other safetensors are not its weights
    with pytest.raises(LanternError, match="no weights"):
        check_chameleon_folder(tmp_path)


def _shard_norm_folder(folder: Path, shards: int, odd_layer_rows: int | None = None) -> dict[str, Tensor]:
    """A tiny Chameleon folder in Lumina-mGPT's layout: every q/k LayerNorm ``[shards, head_dim]``,
    ``model_parallel_size: shards``. Returns the per-head state it stands for, each head h taking
    shard ``h // (heads / shards)``'s row, as Lumina's ``ChameleonLayerNorm.repeat_param``
    (``repeat_interleave`` over the shard's heads) makes it at run time."""
    import json
    import re

    from safetensors.torch import load_file, save_file

    from lantern.testing import tiny_chameleon

    tiny_chameleon(seed=5).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    heads = {"q": config["num_attention_heads"], "k": config["num_key_value_heads"]}
    state = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(6)
    expected = dict(state)
    for key in list(state):
        match = re.fullmatch(r"model\.layers\.(\d+)\.self_attn\.([qk])_norm\.(weight|bias)", key)
        if match is None:
            continue
        n = odd_layer_rows if odd_layer_rows is not None and match[1] == "1" else shards
        rows = torch.randn(n, state[key].shape[-1], generator=gen)
        state[key] = rows
        per_shard = heads[match[2]] // shards
        expected[key] = torch.stack([rows[min(h // per_shard, n - 1)] for h in range(heads[match[2]])])
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config.update(model_parallel_size=shards, architectures=["ChameleonXLLMXForConditionalGeneration"])
    (folder / "config.json").write_text(json.dumps(config))
    return expected


@pytest.mark.parametrize("shards", [1, 2])
def test_lumina_mgpt_shard_norms_load_as_its_code_repeats_them(tmp_path: Path, shards: int) -> None:
    """Lumina-mGPT's released folders hold each q/k LayerNorm once per model-parallel shard
    (``[1, 128]`` at 7B: Alpha-VLLM/Lumina-mGPT's converter), where transformers' Chameleon holds
    one row per head; they failed to load ("q_norm.weight MISMATCH"). Each of the model's heads
    must hold its shard's row, and every other weight the file's."""
    from lantern.models.chameleon import load_chameleon

    expected = _shard_norm_folder(tmp_path / "m", shards)
    state = load_chameleon(tmp_path / "m", dtype=torch.float32).hf.state_dict()
    assert {k for k in expected if not k.startswith("model.vqmodel.")} <= set(state)
    for key, value in expected.items():
        if not key.startswith("model.vqmodel."):
            assert torch.equal(state[key], value), key


def test_shard_norms_of_another_shape_are_refused_in_one_line(tmp_path: Path) -> None:
    from lantern.models.chameleon import load_chameleon

    _shard_norm_folder(tmp_path / "m", 1, odd_layer_rows=2)  # layer 0 [1, 8], layer 1 [2, 8]
    with pytest.raises(LanternError) as err:
        load_chameleon(tmp_path / "m", dtype=torch.float32)
    assert "model.layers.1.self_attn.q_norm.weight has shape [2, 8]; expected [1, 8]" in str(err.value)
    assert "\n" not in str(err.value)


def test_code_ids_live_on_the_models_device() -> None:
    """``ChameleonLM`` wraps a model already on its device (``load_chameleon``: ``ChameleonLM(model.to(device))``)
    and is not moved after, so its code -> BPE table must be made there: a CPU table indexed by CUDA
    codes (``code_to_bpe`` in every verify) fails on a GPU. A meta model stands in for a CUDA one."""
    from lantern.testing import tiny_chameleon

    lm = ChameleonLM(tiny_chameleon(num_codes=16).to("meta"))
    assert lm.image_ids.device.type == "meta"
    assert lm.code_to_bpe(torch.zeros(2, 3, dtype=torch.long, device="meta")).device.type == "meta"
