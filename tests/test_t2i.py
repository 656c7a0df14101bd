"""LlamaGen text-to-image: T5 front end (left padding, [LlamaGen code]), decoding from captions, the CLI's
--prompt/--prompts, bad input, and checkpoint layouts of the real GPT-XL T2I sizes (on ``meta``).

Everything runs offline on tiny random models built here: a one-layer T5 encoder with a word-level
tokenizer (transformers cannot download one), and a 2-layer LlamaGen T2I target whose
``cls_token_num`` is the tokenizer's ``max_length`` and whose ``caption_dim`` is T5's ``d_model``.

Sampling exactness: the t2i path runs the same loop, acceptance and drafters as c2i, whose
chi-square tests (tests/test_speculative.py, tests/test_lantern_e2e.py) do not depend on the kind
of condition. What is t2i-specific is the caption prefill and the caption mask in every verify
forward; those are covered here by cached-vs-uncached logits (the p every method samples from),
greedy speculative == greedy AR (oracle and EAGLE drafters), invisibility of padded caption slots,
and batch independence of sampled runs.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import T5_DIM, T5_MAXLEN, T5_WORDS, tiny_clip, tiny_t2i_target
from PIL import Image

import lantern
from lantern.cli.main import main
from lantern.decoding.config import SamplingConfig, TreeConfig
from lantern.decoding.loop import generate
from lantern.decoding.sampling import apply_cfg
from lantern.drafters.checks import check_t2i_drafter_layout
from lantern.drafters.oracle import make_oracle_drafter
from lantern.errors import LanternError
from lantern.io import check_state_dict, write_json
from lantern.methods import MethodConfig
from lantern.models.drafter import DrafterConfig, EagleDrafterModel
from lantern.models.llamagen import LlamaGen, config_from_hf, hf_to_official, llamagen_config, official_to_hf
from lantern.run import run_generation_t2i
from lantern.targets.base import Conditions, PackedConditions
from lantern.targets.llamagen import LlamaGenTarget
from lantern.targets.llamagen_stack import ModelStack, check_target_architecture, load_stack
from lantern.targets.text import Captions, check_t5_folder, left_pad, load_t5, normalize_prompt, read_prompts
from lantern.testing import make_random_stack
from lantern.train.drafter import DrafterData

PROMPTS = [
    "A photo of a  CAT",  # 6 tokens with </s>: 6 padded slots
    "a red car on the beach with blue sky and mountains and a house in the snow",  # truncated to 12
    "dog",  # 2 tokens
]


@pytest.fixture(autouse=True, scope="module")
def _offline() -> Iterator[None]:
    """No hub look-ups: every model here is a local folder."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield


# ---- tiny T5 folder and T2I stack ------------------------------------------------------------


@pytest.fixture(scope="module")
def captions(t2i_stack: Path) -> Captions:
    return load_t5(t2i_stack / "t5", T5_MAXLEN).encode(PROMPTS)


# ---- the T5 front end: left padding ([LlamaGen code]) ---------------------------------------


def test_left_padding_follows_llamagen(t5_dir: Path, captions: Captions) -> None:
    """Valid rows rotated to the end, padded rows exactly 0, mask flipped: LlamaGen's
    ``cat(emb[v:], emb[:v]) * flip(mask)`` on the right-padded encoder output."""
    from transformers import AutoTokenizer, T5EncoderModel

    tok = AutoTokenizer.from_pretrained(str(t5_dir))
    enc = T5EncoderModel.from_pretrained(str(t5_dir)).eval()
    batch = tok([normalize_prompt(p) for p in PROMPTS], max_length=T5_MAXLEN, padding="max_length", truncation=True,
                add_special_tokens=True, return_tensors="pt")
    mask = batch["attention_mask"]
    assert mask.sum(1).tolist() == [6, T5_MAXLEN, 2]  # right-padded, the long prompt truncated
    assert batch["input_ids"][0, 5] == 1 and batch["input_ids"][2].tolist()[:3] == [T5_WORDS.index("dog") + 3, 1, 0]
    with torch.no_grad():
        emb = enc(input_ids=batch["input_ids"], attention_mask=mask).last_hidden_state
    flipped = torch.flip(mask, dims=[-1])
    for r in range(len(PROMPTS)):
        v = int(mask[r].sum())
        expect = torch.cat([emb[r, v:], emb[r, :v]]) * flipped[r, :, None]
        assert torch.allclose(captions.embeddings[r], expect, atol=1e-6)
        assert torch.equal(captions.mask[r], flipped[r].bool())
        assert torch.count_nonzero(captions.embeddings[r, : T5_MAXLEN - v]) == 0  # padded slots exactly 0


def test_left_pad_handles_either_padding_side() -> None:
    emb = torch.arange(2 * 5 * 2, dtype=torch.float32).reshape(2, 5, 2) + 1
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    a = left_pad(emb, right)
    assert torch.equal(a.embeddings[0], torch.cat([torch.zeros(2, 2), emb[0, :3]]))
    assert torch.equal(a.embeddings[1], emb[1]) and a.mask.tolist()[0] == [False, False, True, True, True]
    b = left_pad(emb, left)  # already left-padded input stays as it is (rows zeroed)
    assert torch.equal(b.embeddings[0], torch.cat([torch.zeros(2, 2), emb[0, 2:]]))


def test_encoding_is_independent_of_batch_and_case(t2i_stack: Path, captions: Captions) -> None:
    enc = load_t5(t2i_stack / "t5", T5_MAXLEN)
    alone = enc.encode(["dog"])
    assert torch.allclose(alone.embeddings[0], captions.embeddings[2], atol=1e-5)
    assert torch.equal(alone.mask[0], captions.mask[2])
    assert normalize_prompt("  A photo\tof a  CAT ") == "a photo of a cat"
    same = enc.encode(["a photo of a cat"], batch_size=1)
    assert torch.allclose(same.embeddings[0], captions.embeddings[0], atol=1e-5)
    with pytest.raises(LanternError, match="prompt 1 is empty"):
        enc.encode(["dog", "  "])


# ---- a long request's conditions, packed on the host ---------------------------------------------


def test_packed_captions_rebuild_the_plain_rows_bit_for_bit(t2i_stack: Path, captions: Captions) -> None:
    """Packed in two chunks with 3 images a prompt, any order of images taken gives exactly the rows
    of the repeated plain captions, while the host holds each prompt once and only its valid slots."""
    stack = load_stack(t2i_stack)
    plain = stack.from_captions(captions.repeat_interleave(3))  # the rows a run used to hold on the device
    once = stack.from_captions(captions)
    packed = PackedConditions.pack(iter([once.rows(0, 2), once.rows(2, 3)]), repeats=3)
    assert len(packed) == len(plain) == 9
    valid = int(captions.mask.sum())
    assert valid < 3 * T5_MAXLEN and tuple(packed.values.shape) == (valid, T5_DIM)  # 6 + 12 + 2 slots
    assert packed.values.device.type == "cpu"
    for order in ([*range(9)], [8, 0, 4, 4, 1], [5]):
        got, want = packed.take(order), plain.take(order)
        assert torch.equal(got.cond, want.cond) and torch.equal(got.mask, want.mask), order
        assert got.cond.dtype == want.cond.dtype and got.cond.device == want.cond.device
    assert torch.equal(packed.rows(7, 20).cond, plain.rows(7, 20).cond)
    with pytest.raises(LanternError, match=r"image index \[9\] out of range for 9 conditions"):
        packed.take([2, 9])


def test_packing_keeps_labels_and_prompt_ids_and_refuses_right_padding() -> None:
    labels = Conditions(torch.tensor([5, 1, 7]))
    packed = PackedConditions.pack([labels], repeats=2)
    assert packed.take([5, 0, 2]).cond.tolist() == [7, 5, 1] and packed.take([1]).mask is None
    ids = torch.tensor([[0, 0, 4, 9], [3, 8, 2, 6]])  # left-padded prompt ids, as Chameleon's
    mask = torch.tensor([[False, False, True, True], [True, True, True, True]])
    packed = PackedConditions.pack([Conditions(ids, mask)])
    assert packed.values.tolist() == [4, 9, 3, 8, 2, 6]
    assert torch.equal(packed.take([1, 0]).cond, ids[[1, 0]]) and torch.equal(packed.take([1, 0]).mask, mask[[1, 0]])
    with pytest.raises(LanternError, match="packing needs left-padded conditions"):
        PackedConditions.pack([Conditions(ids, mask.flip(1))])


def test_pipeline_prompts_equal_the_plain_captions_run(t2i_stack: Path) -> None:
    """``pipe(prompts=..., num_per_label=2)`` (packed, 3 rows a batch, so a prompt's images straddle
    batches) makes the codes of a run over the plain repeated captions."""
    pipe = lantern.load(t2i_stack)
    out = pipe(prompts=[PROMPTS[0], PROMPTS[2]], num_per_label=2, batch_size=3, seed=4, top_k=40, method="ar")
    caps = load_t5(t2i_stack / "t5", T5_MAXLEN).encode([PROMPTS[0], PROMPTS[2]]).repeat_interleave(2)
    expect = run_generation_t2i(pipe.stack, caps, 4, SamplingConfig(top_k=40), MethodConfig.resolve("ar"),
                                batch_size=3).codes
    assert torch.equal(out.codes, expect)


def test_read_prompts(tmp_path: Path) -> None:
    f = tmp_path / "p.txt"
    f.write_text("a cat\n\n  a dog on the beach  \n\n")
    assert read_prompts(f) == ["a cat", "a dog on the beach"]
    # a probe: Notepad's BOM became part of the first prompt (another image), and a U+2028 inside a
    # line split it in two; CRLF files read as LF ones
    f.write_bytes("\ufeffa cat\r\na dog\u2028on the beach\r\n".encode())
    assert read_prompts(f) == ["a cat", "a dog\u2028on the beach"]
    (tmp_path / "bom.txt").write_bytes("\ufeff\n".encode())
    with pytest.raises(LanternError, match="holds no prompts"):
        read_prompts(tmp_path / "bom.txt")
    with pytest.raises(LanternError, match="--prompts: no such file"):
        read_prompts(tmp_path / "missing.txt")
    (tmp_path / "blank.txt").write_text("\n   \n")
    with pytest.raises(LanternError, match="holds no prompts"):
        read_prompts(tmp_path / "blank.txt")
    with pytest.raises(LanternError, match="is not a file"):
        read_prompts(tmp_path)


def test_the_fields_prompt_sets_are_read_as_they_come(tmp_path: Path) -> None:
    """PartiPrompts' .tsv (Prompt column) and COCO caption .json files, as jadohu/LANTERN's
    data/prompts holds them: read line by line, the header and the category columns became
    prompts."""
    tsv = tmp_path / "PartiPrompts.tsv"
    tsv.write_text("Prompt\tCategory\tChallenge\tNote\nbond\tAbstract\tBasic\tx\na red car\tVehicles\tBasic\t\n\n")
    assert read_prompts(tsv) == ["bond", "a red car"]
    strings, objects = tmp_path / "captions_val2017_longest.json", tmp_path / "captions_train2017_extracted.json"
    strings.write_text(json.dumps(["A cat on a mat.", "  ", "Two dogs."]))
    assert read_prompts(strings) == ["A cat on a mat.", "Two dogs."]
    objects.write_text(json.dumps([{"image_id": 1, "caption": "A bus."}, {"id": 2, "prompt": "A tree."}]))
    assert read_prompts(objects) == ["A bus.", "A tree."]
    coco = tmp_path / "captions_val2017.json"
    coco.write_text(json.dumps({"info": {}, "annotations": [{"image_id": 9, "id": 1, "caption": "A kite."}]}))
    assert read_prompts(coco) == ["A kite."]
    (tmp_path / "x.tsv").write_text("Category\tNote\nAbstract\tx\n")
    with pytest.raises(LanternError, match=r"is a .tsv without a Prompt or caption column \(its header: category, "):
        read_prompts(tmp_path / "x.tsv")
    (tmp_path / "x.json").write_text(json.dumps([{"caption": 3}]))
    with pytest.raises(LanternError, match=r"entry 0 is neither a string nor an object with a prompt / caption"):
        read_prompts(tmp_path / "x.json")
    (tmp_path / "y.json").write_text(json.dumps({"captions": []}))
    with pytest.raises(LanternError, match=r"is JSON but not a list of prompts"):
        read_prompts(tmp_path / "y.json")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00a")
    with pytest.raises(LanternError, match="not UTF-8"):
        read_prompts(tmp_path / "bin.txt")


def test_t5_folder_checks(tmp_path: Path, t5_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert check_t5_folder(t5_dir, caption_dim=T5_DIM)["model_type"] == "t5"
    with pytest.raises(LanternError, match=r"d_model 32, but the target's caption projection expects 2048"):
        check_t5_folder(t5_dir, caption_dim=2048)
    with pytest.raises(LanternError, match="--t5: no such folder"):
        check_t5_folder(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LanternError, match="has no config.json"):
        check_t5_folder(tmp_path / "empty")
    bert = tmp_path / "bert"
    shutil.copytree(t5_dir, bert)
    write_json(bert / "config.json", {"model_type": "bert", "hidden_size": 32})
    with pytest.raises(LanternError, match="holds a 'bert' model, not a T5 encoder"):
        check_t5_folder(bert)
    import lantern.targets.text

    monkeypatch.setattr(lantern.targets.text.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(LanternError, match=r"need the transformers package.*lantern-ar\[t2i\]"):
        lantern.targets.text.load_t5(t5_dir, T5_MAXLEN)


# ---- decoding from captions -----------------------------------------------------------------


def test_cached_logits_match_uncached_forward_with_caption_mask(captions: Captions) -> None:
    """The p every method samples from: prefill + chunked verify/commit with the caption mask equals
    the uncached causal pass that hides padded caption columns (CFG with the stored uncond rows)."""
    model = tiny_t2i_target()
    sampling = SamplingConfig(cfg_scale=3.0)
    cond, mask = captions.embeddings, captions.mask
    codes = torch.randint(0, 256, (3, 64), generator=torch.Generator().manual_seed(0))
    t = 5
    fed = torch.cat([codes, torch.zeros(3, t, dtype=torch.long)], dim=1)  # the last chunk runs past the image
    target = LlamaGenTarget(model, sampling, max_tree_nodes=t)
    first, _ = target.start(cond, mask)
    got = [first[:, None]]
    chain, depth = torch.ones(t, t, dtype=torch.bool).tril().expand(3, -1, -1), torch.arange(t).expand(3, -1)
    for lo in range(0, 63, t):
        logits, _ = target.verify(fed[:, lo : lo + t], chain, depth)
        got.append(logits)
        target.commit(torch.arange(t).expand(3, -1), torch.full((3,), t))
    cached = torch.cat(got, dim=1)[:, :64]
    full_c = model(cond, codes[:, :-1], mask)[0]
    full_u = model(model.null_condition(3), codes[:, :-1], mask)[0]
    full = apply_cfg(torch.cat([full_c, full_u]), 3.0, 2)
    assert (cached - full).abs().max().item() <= 1e-4


@pytest.mark.parametrize("cfg_scale", [1.0, pytest.param(3.0, marks=pytest.mark.slow)])
@pytest.mark.parametrize("batch", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_greedy_speculative_reproduces_ar(t2i_stack: Path, captions: Captions, batch: int, cfg_scale: float) -> None:
    """Greedy SD with the stack's (random) EAGLE drafter on chain, static and dynamic trees, and
    greedy LANTERN++ with lambda = 1 (the exact rule), equal greedy AR token for token."""
    stack = load_stack(t2i_stack)
    caps = Captions(captions.embeddings[:batch], captions.mask[:batch])
    s = SamplingConfig(temperature=0, cfg_scale=cfg_scale)
    ar = run_generation_t2i(stack, caps, 0, s, MethodConfig.resolve("ar")).codes
    assert ar.shape == (batch, 64)
    for method, tree, lam in [("sd", "chain:4", None), ("sd-static", None, None), ("sd", None, None),
                              ("lantern++", "chain:3", 1.0)]:
        spec = run_generation_t2i(stack, caps, 0, s, MethodConfig.resolve(method, tree=tree, lantern_lambda=lam),
                                  batch_size=2)
        assert torch.equal(spec.codes, ar), (method, tree)


@pytest.mark.parametrize("cfg_scale", [1.0, pytest.param(3.0, marks=pytest.mark.slow)])
@pytest.mark.parametrize("batch", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_greedy_jacobi_reproduces_ar(t2i_stack: Path, captions: Captions, batch: int, cfg_scale: float) -> None:
    """Greedy SJD, coupled SJD (both couplings) and PJD with one row at a time on captions equal
    greedy AR token for token."""
    stack = load_stack(t2i_stack)
    caps = Captions(captions.embeddings[:batch], captions.mask[:batch])
    s = SamplingConfig(temperature=0, cfg_scale=cfg_scale)
    ar = run_generation_t2i(stack, caps, 0, s, MethodConfig.resolve("ar")).codes
    for method, coupling in [("sjd", None), ("sjd-coupled", "maximal"), ("sjd-coupled", "gumbel")]:
        resolved = MethodConfig.resolve(method, sjd_window=4, sjd_coupling=coupling)
        spec = run_generation_t2i(stack, caps, 0, s, resolved, batch_size=2)
        assert torch.equal(spec.codes, ar), (method, coupling)
    one_row = MethodConfig.resolve("pjd", pjd_window=3, pjd_context=8)  # PJD, one row at a time: lossless
    assert torch.equal(run_generation_t2i(stack, caps, 0, s, one_row, batch_size=2).codes, ar)


@pytest.mark.parametrize("tree", ["chain:4", pytest.param("static:naive_extend_57", marks=pytest.mark.slow)])
def test_greedy_oracle_accepts_many_and_reproduces_ar(captions: Captions, tree: str) -> None:
    """A drafter that is the target itself (uncached, masked forward) gets long paths accepted:
    multi-token commits under the caption mask still give AR's codes."""
    model = tiny_t2i_target()
    s = SamplingConfig(temperature=0, cfg_scale=3.0)
    cond, mask = captions.embeddings, captions.mask
    ar = generate(LlamaGenTarget(model, s), cond, cond_mask=mask).codes
    drafter = make_oracle_drafter(model, cond, s, TreeConfig.parse(tree), cond_mask=mask)
    out = generate(LlamaGenTarget(model, s, max_tree_nodes=drafter.num_nodes), cond, drafter=drafter, cond_mask=mask)
    assert torch.equal(out.codes, ar)
    assert out.stats.mean_accepted > 3.0


def test_padded_caption_slots_are_invisible(t2i_stack: Path, captions: Captions) -> None:
    stack = load_stack(t2i_stack)
    s = SamplingConfig(temperature=0, cfg_scale=2.0)
    noisy = captions.embeddings + torch.randn_like(captions.embeddings) * (~captions.mask)[..., None]
    a = run_generation_t2i(stack, captions, 0, s, MethodConfig.resolve("ar")).codes
    b = run_generation_t2i(stack, Captions(noisy, captions.mask), 0, s, MethodConfig.resolve("ar")).codes
    assert torch.equal(a, b)
    c = run_generation_t2i(stack, Captions(captions.embeddings, torch.ones_like(captions.mask)), 0, s,
                           MethodConfig.resolve("ar")).codes
    assert not torch.equal(a[0], c[0])  # the mask is used: unmasking the zero slots changes row 0


@pytest.mark.slow
def test_sampled_runs_do_not_depend_on_batch_size(t2i_stack: Path, captions: Captions) -> None:
    stack = load_stack(t2i_stack)
    s = SamplingConfig(top_k=40, cfg_scale=3.0)
    m = MethodConfig.resolve("lantern++", tree="chain:3")
    one = run_generation_t2i(stack, captions, 7, s, m, batch_size=1).codes
    three = run_generation_t2i(stack, captions, 7, s, m, batch_size=3).codes
    assert torch.equal(one, three)
    other = run_generation_t2i(stack, captions, 8, s, m, batch_size=3).codes
    assert not torch.equal(one, other)


def test_captions_must_fit_the_target(t2i_stack: Path, captions: Captions) -> None:
    stack = load_stack(t2i_stack)
    short = Captions(captions.embeddings[:, 2:], captions.mask[:, 2:])
    with pytest.raises(LanternError, match=r"the target expects \[N, 12, 32\]"):
        run_generation_t2i(stack, short, 0, SamplingConfig(), MethodConfig.resolve("ar"))


# ---- command line ---------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_prompts_write_images_and_run_json(t2i_stack: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["generate", "--model", str(t2i_stack), "--seed", "3", "--top-k", "40", "--cfg-scale", "2",
            "--num-per-prompt", "2", "--batch-size", "3", "--no-progress"]
    rc = main([*args, "--prompt", PROMPTS[0], "--prompt", PROMPTS[2], "--method", "sd-static", "--out", str(out)])
    assert rc == 0
    names = sorted(p.name for p in out.glob("0*.png"))
    assert names == ["0000_prompt0.png", "0001_prompt0.png", "0002_prompt1.png", "0003_prompt1.png"]
    assert Image.open(out / "0000_prompt0.png").size == (32, 32)
    run = json.loads((out / "run.json").read_text())
    assert run["prompts"] == [PROMPTS[0].strip(), PROMPTS[2]] and run["prompt_index"] == [0, 0, 1, 1]
    assert run["t5"] == str(t2i_stack / "t5") and run["t5_max_length"] == T5_MAXLEN
    assert "labels" not in run and run["method"]["method"] == "sd-static"
    codes = np.load(out / "codes.npy")
    # The same codes as the library call with the same captions and per-image seeds.
    stack = load_stack(t2i_stack)
    caps = load_t5(t2i_stack / "t5", T5_MAXLEN).encode([PROMPTS[0], PROMPTS[2]], batch_size=3).repeat_interleave(2)
    expect = run_generation_t2i(stack, caps, 3, SamplingConfig(top_k=40, cfg_scale=2.0),
                                MethodConfig.resolve("sd-static")).codes
    assert np.array_equal(codes, expect.numpy())

    # --prompts FILE, an explicit --t5 on a stack without t5/, a relaxed method.
    bare = tmp_path / "bare"
    bare.mkdir()
    for part in ("target", "tokenizer", "drafter", "proximity.safetensors"):
        (bare / part).symlink_to(t2i_stack / part)
    (tmp_path / "prompts.txt").write_text(f"{PROMPTS[0]}\n\n{PROMPTS[2]}\n")
    rc = main([*args, "--model", str(bare), "--prompts", str(tmp_path / "prompts.txt"), "--t5",
               str(t2i_stack / "t5"), "--method", "lantern++", "--tree", "chain:3", "--out", str(tmp_path / "o2")])
    assert rc == 0
    run2 = json.loads((tmp_path / "o2" / "run.json").read_text())
    assert run2["prompts"] == run["prompts"] and run2["stats"]["generated_tokens"] == 4 * 64


def _bad_t5(tmp_path: Path, t2i_stack: Path) -> Path:
    bad = tmp_path / "bert"
    shutil.copytree(t2i_stack / "t5", bad)
    write_json(bad / "config.json", {"model_type": "bert", "hidden_size": T5_DIM})
    return bad


def _chameleon(tmp_path: Path, t2i_stack: Path) -> Path:
    root = tmp_path / "chameleon"
    shutil.copytree(t2i_stack, root, symlinks=True)
    write_json(root / "target" / "config.json", {"model_type": "chameleon", "hidden_size": 64,
                                                 "architectures": ["ChameleonForConditionalGeneration"]})
    return root


def _stage_drafter(tmp_path: Path, t2i_stack: Path) -> Path:
    cfg = LlamaGen.from_pretrained(t2i_stack / "target").config
    EagleDrafterModel(DrafterConfig.for_target(cfg, block_size=16)).save_pretrained(tmp_path / "d16")
    return tmp_path / "d16"


BAD_INPUT = {
    "prompts-missing": (lambda tmp, st: ["--prompts", str(tmp / "nope.txt")], "--prompts: no such file"),
    "prompts-empty": (lambda tmp, st: ["--prompts", str(_write(tmp / "e.txt", "\n \n"))], "holds no prompts"),
    "prompt-blank": (lambda tmp, st: ["--prompt", "  "], "--prompt: prompt 0 is empty"),
    # a byte that is not UTF-8 on the command line: Python hands it over as a lone surrogate
    "prompt-not-text": (lambda tmp, st: ["--prompt", "a cat", "--prompt", "a \udcff cat"],
                        r"--prompt: prompt 1 is not valid text: character 2 \('\\udcff'\) is a lone surrogate"),
    "t5-missing": (lambda tmp, st: ["--prompt", "a cat", "--t5", str(tmp / "no-t5")], "--t5: no such folder"),
    "t5-not-t5": (lambda tmp, st: ["--prompt", "a cat", "--t5", str(_bad_t5(tmp, st))], "not a T5 encoder"),
    "t5-file": (lambda tmp, st: ["--prompt", "a cat", "--t5", str(_write(tmp / "f", "x"))], "is not a folder"),
    "labels-on-t2i": (lambda tmp, st: ["--labels", "0"], "is a text-to-image model; pass --prompt"),
    "no-condition": (lambda tmp, st: [], "generate needs --labels .* or --prompt / --prompts"),
    "t5-with-labels": (lambda tmp, st: ["--labels", "0", "--t5", str(st / "t5")], "--t5 is only used with"),
    "other-stage-drafter": (
        lambda tmp, st: ["--prompt", "a cat", "--method", "sd", "--drafter", str(_stage_drafter(tmp, st))],
        "use the drafter of the same stage",
    ),
}


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_reported_without_partial_output(
    t2i_stack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    make_args, message = BAD_INPUT[case]
    out = tmp_path / "out"
    args = make_args(tmp_path, t2i_stack)
    rc = main(["generate", "--model", str(t2i_stack), "--out", str(out), "--no-progress", *args])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("lantern: error: ") and re.search(message, err), err
    assert not out.exists() or list(out.iterdir()) == []


def test_no_t5_folder_and_wrong_model_kinds(
    t2i_stack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for part in ("target", "tokenizer"):
        (bare / part).symlink_to(t2i_stack / part)
    base = ["generate", "--out", str(tmp_path / "out"), "--no-progress"]
    assert main([*base, "--model", str(bare), "--prompt", "a cat"]) == 2
    assert "has no t5/ folder; pass --t5 DIR" in capsys.readouterr().err
    c2i = make_random_stack(tmp_path / "c2i", seed=1)
    assert main([*base, "--model", str(c2i), "--prompt", "a cat"]) == 2
    assert "is a class-conditional model; pass --labels" in capsys.readouterr().err
    labels_out = tmp_path / "labels-out"  # the class-label path is unchanged
    assert main(["generate", "--model", str(c2i), "--labels", "1,2", "--out", str(labels_out), "--no-progress"]) == 0
    assert sorted(p.name for p in labels_out.glob("0*.png")) == ["0000_label1.png", "0001_label2.png"]
    assert json.loads((labels_out / "run.json").read_text())["labels"] == [1, 2]
    assert main([*base, "--model", str(_chameleon(tmp_path, t2i_stack)), "--prompt", "a cat"]) == 2
    err = capsys.readouterr().err
    assert "unsupported architecture" in err and "ChameleonForConditionalGeneration" in err
    with pytest.raises(SystemExit) as exc:  # argparse: --labels and --prompt exclude each other
        main([*base, "--model", str(t2i_stack), "--labels", "0", "--prompt", "a cat"])
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


# ---- checkpoint layouts of the real sizes (meta device: nothing allocated) -------------------

XL = dict(n_layer=36, dim=1280, ffn=3584, caption_dim=2048, cls=120, vocab=16384)


def _official_t2i_keys() -> dict[str, tuple[int, ...]]:
    """[LlamaGen code]: the 'model' keys of t2i_XL_stage1_256.pt / t2i_XL_stage2_512.pt."""
    d, f, v = XL["dim"], XL["ffn"], XL["vocab"]
    keys = {
        "cls_embedding.cap_proj.fc1.weight": (d, XL["caption_dim"]),
        "cls_embedding.cap_proj.fc2.weight": (d, d),
        "cls_embedding.uncond_embedding": (XL["cls"], XL["caption_dim"]),
        "tok_embeddings.weight": (v, d),
        "norm.weight": (d,),
        "output.weight": (v, d),
    }
    for i in range(XL["n_layer"]):
        keys |= {
            f"layers.{i}.attention.wqkv.weight": (3 * d, d),
            f"layers.{i}.attention.wo.weight": (d, d),
            f"layers.{i}.feed_forward.w1.weight": (f, d),
            f"layers.{i}.feed_forward.w3.weight": (f, d),
            f"layers.{i}.feed_forward.w2.weight": (d, f),
            f"layers.{i}.attention_norm.weight": (d,),
            f"layers.{i}.ffn_norm.weight": (d,),
        }
    return keys


def _hf_port_keys() -> dict[str, tuple[int, ...]]:
    """[LANTERN code]: LANTERN's HF port (jadohu/LlamaGen-T2I, LlamaGen-T2I-2), LlamaForCausalLM names."""
    d, f, v = XL["dim"], XL["ffn"], XL["vocab"]
    keys = {
        "model.cls_embedding.cap_proj.fc1.weight": (d, XL["caption_dim"]),
        "model.cls_embedding.cap_proj.fc2.weight": (d, d),
        "model.cls_embedding.uncond_embedding": (XL["cls"], XL["caption_dim"]),
        "model.embed_tokens.weight": (v, d),
        "model.norm.weight": (d,),
        "lm_head.weight": (v, d),
    }
    for i in range(XL["n_layer"]):
        p = f"model.layers.{i}."
        keys |= {p + f"self_attn.{x}_proj.weight": (d, d) for x in "qkvo"}
        keys |= {
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
        }
    return keys


def _hf_config(block_size: int) -> dict[str, object]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1280,
            "num_hidden_layers": 36, "num_attention_heads": 20, "num_key_value_heads": 20,
            "intermediate_size": 3584, "vocab_size": 16384, "input_type": "t2i", "cls_token_num": 120,
            "caption_dim": 2048, "block_size": block_size, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": 2048, "class_dropout_p": 0.1}


def _meta(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    return {k: torch.empty(s, device="meta") for k, s in shapes.items()}


@pytest.mark.parametrize("block_size", [256, 1024], ids=["stage1-256px", "stage2-512px"])
def test_gpt_xl_t2i_checkpoint_layouts(block_size: int, tmp_path: Path) -> None:
    """GPT-XL T2I Stage I (256 tokens) and Stage II (1024 tokens): the model built from the named
    config has exactly the official checkpoint's keys and shapes, maps onto exactly the HF port's,
    and the HF port's config.json yields the same model config."""
    cfg = llamagen_config("GPT-XL", model_type="t2i", cls_token_num=120, block_size=block_size)
    with torch.device("meta"):
        model = LlamaGen(cfg)
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert ours == _official_t2i_keys()
    check_state_dict(model, _meta(_official_t2i_keys()), "official t2i checkpoint")  # what strict loading checks
    hf = official_to_hf(model.state_dict(), cfg)
    assert {k: tuple(v.shape) for k, v in hf.items()} == _hf_port_keys()
    back = hf_to_official(_meta(_hf_port_keys()), cfg)
    check_state_dict(model, back, "HF port")
    assert model.freqs_cis.shape[0] == 120 + block_size + LlamaGen.ROPE_PAD  # 120 zero rows, then the grid

    from_hf = config_from_hf(_hf_config(block_size))
    for field in ("dim", "n_layer", "n_head", "kv_heads", "hidden_ffn", "vocab_size", "model_type",
                  "cls_token_num", "caption_dim", "block_size", "norm_eps", "rope_base", "grid_size"):
        assert getattr(from_hf, field) == getattr(cfg, field), field
    write_json(tmp_path / "config.json", _hf_config(block_size))
    check_target_architecture(tmp_path)  # an HF port is a supported target folder


@pytest.mark.parametrize("input_type,block_size", [("t2i", 256), ("t2i2", 1024)])
def test_official_t2i_drafters_fit_their_stage(input_type: str, block_size: int) -> None:
    """LANTERN's llamagen_drafter (t2i) / llamagen2_drafter (t2i2) folders: [LANTERN code] keys, and they
    are accepted for the target of their own stage only."""
    raw = {"hidden_size": 1280, "intermediate_size": 3584, "num_attention_heads": 20, "num_key_value_heads": 20,
           "num_hidden_layers": 1, "vocab_size": 16384, "rms_norm_eps": 1e-6, "input_type": input_type}
    with torch.device("meta"):
        drafter = EagleDrafterModel(DrafterConfig.from_official(raw))
    shapes = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    assert shapes == {
        "embed_tokens.weight": (16384, 1280), "fc.weight": (1280, 2560), "fc.bias": (1280,),
        **{f"layers.0.self_attn.{p}_proj.weight": (1280, 1280) for p in "qkvo"},
        "layers.0.mlp.gate_proj.weight": (3584, 1280), "layers.0.mlp.up_proj.weight": (3584, 1280),
        "layers.0.mlp.down_proj.weight": (1280, 3584), "layers.0.post_attention_layernorm.weight": (1280,),
    }
    own = llamagen_config("GPT-XL", model_type="t2i", cls_token_num=120, block_size=block_size)
    other_stage = 1024 if block_size == 256 else 256
    other = llamagen_config("GPT-XL", model_type="t2i", cls_token_num=120, block_size=other_stage)
    check_t2i_drafter_layout(drafter, own, "drafter")
    with pytest.raises(LanternError, match="use the drafter of the same stage"):
        check_t2i_drafter_layout(drafter, other, "drafter")


def test_unsupported_target_architectures(tmp_path: Path) -> None:
    write_json(tmp_path / "config.json", {"model_type": "chameleon", "architectures": ["ChameleonForCausalLM"],
                                          "hidden_size": 4096})
    with pytest.raises(LanternError, match=r"unsupported architecture .*'chameleon'.*ChameleonForCausalLM"):
        check_target_architecture(tmp_path)
    write_json(tmp_path / "config.json", {"model_type": "t5", "d_model": 2048})
    with pytest.raises(LanternError, match="unsupported architecture"):
        check_target_architecture(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(LanternError, match="has no config.json"):
        check_target_architecture(tmp_path)


def test_bench_measures_with_the_users_prompts(t2i_stack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench --prompts FILE``: the evaluation's prompt set (COCO captions, PartiPrompts), cycled
    over the images, instead of 4 fixed prompts; a class-conditional model is refused in one line."""
    from lantern.api import load_model_stack
    from lantern.cli.main import main

    stack = load_model_stack(t2i_stack)
    assert stack.sample_conditions(2) == ["a photo of a red car", "a cat on a sofa"]
    stack.measure_with(["a kite", "two dogs"])
    assert stack.sample_conditions(3) == ["a kite", "two dogs", "a kite"]
    prompts = tmp_path / "captions.json"
    prompts.write_text(json.dumps(["a kite over a beach", "two dogs"]))
    argv = ["bench", "--methods", "ar", "--no-quality", "--speed-images", "2", "--curve-images", "0",
            "--no-ar-spread", "--no-progress", "--prompts", str(prompts)]
    from lantern.targets.llamagen_stack import ModelStack

    encoded: list[str] = []
    real_encode = ModelStack.encode
    monkeypatch.setattr(ModelStack, "encode", lambda self, conditions, *a, **k: (
        encoded.extend(conditions), real_encode(self, conditions, *a, **k))[1])
    assert main([*argv, "--model", str(t2i_stack), "--out", str(tmp_path / "b")]) == 0
    assert set(encoded) == {"a kite over a beach", "two dogs"}  # what the bench decoded
    run = json.loads((tmp_path / "b" / "run.json").read_text())
    assert run["prompts"] == {"file": str(prompts), "count": 2}
    capsys.readouterr()
    assert main([*argv, "--model", "digits", "--out", str(tmp_path / "c")]) == 2
    assert capsys.readouterr().err == ("lantern: error: --prompts: digits is class-conditional: bench draws its "
                                       "labels from its classes\n")


def test_clip_score_is_clips_cosine_of_each_image_and_its_prompt(tmp_path: Path) -> None:
    """``ClipScorer``: 100 x max(cos, 0) of the image and text embeddings (torchmetrics' CLIPScore),
    checked against transformers' whole CLIPModel (logits_per_image / logit_scale); a score depends
    on its own prompt (power: other prompts give other scores)."""
    import transformers

    from lantern.eval.metrics import CLIP_MEAN, CLIP_STD, ClipScorer

    folder = tiny_clip(tmp_path / "clip")
    scorer = ClipScorer(folder)
    gen = torch.Generator().manual_seed(0)
    images = torch.rand(24, 3, 24, 24, generator=gen) * 2 - 1
    prompts = ["a kite over a beach", "two dogs", "a red car", "a cat", "a red cat", "two kite"] * 4
    scores = scorer.scores(images, prompts, batch_size=4)
    model = transformers.CLIPModel.from_pretrained(str(folder)).eval()
    tokens = scorer.tokenizer(prompts, padding=True, return_tensors="pt")
    pixels = torch.nn.functional.interpolate(images, size=32, mode="bicubic", align_corners=False, antialias=True)
    pixels = (pixels.clamp(-1, 1) + 1) / 2
    pixels = (pixels - torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)) / torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    with torch.no_grad():
        out = model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"], pixel_values=pixels)
    cosine = out.logits_per_image.diagonal() / model.logit_scale.exp()
    assert torch.allclose(scores, 100 * cosine.clamp(min=0), atol=1e-3), (scores, cosine)
    assert (cosine > 0).any() and (cosine < 0).any()  # both sides of the clamp are exercised
    assert not torch.allclose(scorer.scores(images, prompts[::-1]), scores)
    prefixed = ClipScorer(folder, prefix="a red ")  # LANTERN's evaluation puts "A photo depicts " first
    assert torch.equal(prefixed.scores(images, prompts), scorer.scores(images, ["a red " + p for p in prompts]))
    with pytest.raises(LanternError, match="--clip-score: no such CLIP folder"):
        ClipScorer(tmp_path / "none")


def test_bench_scores_prompt_following_with_clip(t2i_stack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench --clip-score DIR``: every row's mean CLIP score of its images against their own
    prompts (a planted scorer, the length of each prompt, shows which prompts reach it, in order)."""
    from lantern.cli.main import main
    from lantern.eval.metrics import ClipScorer
    from lantern.targets.base import prompts_for

    clip = tiny_clip(tmp_path / "clip")
    seen: list[int] = []

    def planted(self: ClipScorer, images: torch.Tensor, prompts: list[str], batch_size: int = 64) -> torch.Tensor:
        seen.append(images.shape[0])
        return torch.tensor([float(len(p)) for p in prompts])

    monkeypatch.setattr(ClipScorer, "scores", planted)
    argv = ["bench", "--methods", "ar,sjd-coupled", "--num-images", "4", "--speed-images", "2", "--batch-size", "4",
            "--num-real", "4", "--curve-images", "0", "--no-ar-spread", "--no-progress", "--clip-score", str(clip)]
    assert main([*argv, "--model", str(t2i_stack), "--feature-net", f"clip:{clip}", "--out", str(tmp_path / "b")]) == 0
    rows = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert [r["method"] for r in rows] == ["ar", "sjd-coupled"]
    want = sum(len(p) for p in prompts_for(4)) / 4
    assert [r["clip_score"] for r in rows] == [want, want] and seen == [4, 4]
    assert "| CLIP |" in (tmp_path / "b" / "bench.md").read_text()
    assert json.loads((tmp_path / "b" / "run.json").read_text())["clip_score"] == "CLIP score, clip"
    capsys.readouterr()
    assert main([*argv, "--model", "digits", "--out", str(tmp_path / "c")]) == 2
    assert capsys.readouterr().err == ("lantern: error: --clip-score: digits is class-conditional: a CLIP score "
                                       "needs prompts\n")
    assert main([*argv, "--no-quality", "--model", str(t2i_stack), "--out", str(tmp_path / "d")]) == 2
    assert "--clip-score is a quality metric: drop --no-quality" in capsys.readouterr().err


def _word_prompts(n: int, seed: int) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(T5_WORDS) for _ in range(rng.randint(2, 6))) for _ in range(n)]


def _check_teacher_forced(stack: ModelStack, data: DrafterData, captions: list[str]) -> None:
    """A kept row's features are the target's teacher-forced hidden states under its caption, a
    dropped row's (label -1) under the unconditional caption with the caption's mask (the CFG
    stream), each checked against the other condition too (power)."""
    target, dropped = stack.target, data.labels == -1
    for row in (int(torch.nonzero(~dropped)[0]), int(torch.nonzero(dropped)[0])):
        enc = stack.encode([captions[row]])
        cond = target.null_condition(1).to(enc.cond.dtype) if dropped[row] else enc.cond
        with torch.no_grad():
            _, hidden = target(cond, data.tokens[row : row + 1], cond_mask=enc.mask)
            _, other = target(enc.cond if dropped[row] else target.null_condition(1), data.tokens[row : row + 1],
                              cond_mask=enc.mask)
        assert torch.allclose(hidden[0], data.hidden[row].float(), atol=2e-2, rtol=2e-2), row
        assert not torch.allclose(other[0], data.hidden[row].float(), atol=2e-2, rtol=2e-2), row  # power


def test_drafter_data_from_prompts_is_the_targets_own_images_teacher_forced(
        t2i_stack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``make-drafter-data --prompts`` (text-to-image LlamaGen had no drafter training): the codes
    are the images ``lantern.load`` gives for those prompts and seeds, the features the target's
    teacher-forced hidden states under each caption, or under the unconditional caption (with the
    caption's mask, as the CFG stream) for a dropped row; the last prompts are held out."""
    import lantern
    from lantern.api import load_model_stack
    from lantern.cli.main import main
    from lantern.train.drafter import DrafterData

    prompts = _word_prompts(10, 0)
    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n")
    sampling = {"cfg_scale": 3.0, "top_k": 20}
    argv = ["make-drafter-data", "--target", str(t2i_stack), "--prompts", str(tmp_path / "p.txt"), "--num-per-prompt",
            "2", "--eval-prompts", "2", "--cfg-scale", "3", "--top-k", "20", "--cond-dropout", "0.3", "--batch-size",
            "8", "--no-progress", "--out", str(tmp_path / "dd")]
    assert main(argv) == 0
    train, test = DrafterData.load(tmp_path / "dd" / "train"), DrafterData.load(tmp_path / "dd" / "test")
    stack = load_model_stack(t2i_stack)
    target = stack.target
    assert len(train) == 16 and len(test) == 4 and train.hidden.shape[1:] == (T5_MAXLEN + 64, target.config.dim)
    pipe = lantern.load(t2i_stack)
    assert torch.equal(train.tokens, pipe(prompts=prompts[:8], num_per_label=2, seed=0, **sampling).codes)
    assert torch.equal(test.tokens, pipe(prompts=prompts[8:], num_per_label=2, seed=1, **sampling).codes)
    dropped = train.labels == -1
    assert 0 < int(dropped.sum()) == train.meta["num_dropped"] < 16
    assert torch.equal(train.labels[~dropped], torch.arange(8).repeat_interleave(2)[~dropped])
    _check_teacher_forced(stack, train, [prompts[row // 2] for row in range(len(train))])
    # The held-out prompts' captions are kept (what train-drafter's speculative evaluation decodes
    # from), bit for bit what a run encodes; the training split keeps none.
    assert train.captions is None and test.captions is not None
    encoded = stack.encode(prompts[8:])
    assert torch.equal(test.captions.cond, encoded.cond) and torch.equal(test.captions.mask, encoded.mask)
    capsys.readouterr()
    assert main([*argv[:-1], str(tmp_path / "x"), "--source", "generated"]) == 2
    assert "--source is used with --codes" in capsys.readouterr().err
    assert main(["make-drafter-data", "--target", str(tmp_path), "--codes", str(tmp_path), "--num-per-prompt", "2",
                 "--out", str(tmp_path / "y")]) == 2
    assert "--num-per-prompt is used with --prompts" in capsys.readouterr().err
    assert main(["make-drafter-data", "--target", "digits", "--prompts", str(tmp_path / "p.txt"),
                 "--out", str(tmp_path / "z")]) == 2
    assert capsys.readouterr().err.startswith("lantern: error: --prompts: digits is not a text-to-image LlamaGen stack")


def _captioned_images(root: Path, captions: list[str]) -> list[Path]:
    """An img2dataset-style folder: numbered sub-folders, each image with its caption beside it; sizes
    differ (large and wide: halved before the resize; tall; square), one is greyscale."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(3)
    paths = []
    for i, caption in enumerate(captions):
        folder = root / f"{i // 4:05d}"
        folder.mkdir(parents=True, exist_ok=True)
        w, h = ((200, 130), (32, 44), (40, 40))[i % 3]
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        image = Image.fromarray(pixels).convert("L") if i == 1 else Image.fromarray(pixels)
        path = folder / f"{i:09d}.{'png' if i % 2 else 'jpg'}"
        image.save(path)
        path.with_suffix(".txt").write_text(f"  {caption}\n")  # img2dataset writes the caption as it came
        paths.append(path)
    return paths


def test_drafter_data_from_real_captioned_images(t2i_stack: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``make-drafter-data --images DIR`` (LANTERN's recipe: real LAION-COCO images, as img2dataset
    downloads them): each image is centre-cropped, resized to the target's size and encoded by the
    stack's tokenizer; the features are the target's teacher-forced hidden states under its caption
    (or the unconditional one); the last images are held out with their captions kept; made a shard
    at a time, the data is the same whatever the shard size. Images are squared as LlamaGen and
    LANTERN's ``extract_code`` square them: ADM's ``center_crop_arr``."""
    from lantern.api import load_model_stack
    from lantern.cli.main import main
    from lantern.data.captions import caption_folder
    from lantern.images import square_image
    from lantern.train.drafter import DrafterData, make_caption_drafter_data

    captions = _word_prompts(9, 2)
    paths = _captioned_images(tmp_path / "laion", captions)
    argv = ["make-drafter-data", "--target", str(t2i_stack), "--images", str(tmp_path / "laion"), "--eval-prompts",
            "2", "--cond-dropout", "0.3", "--batch-size", "4", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "dd")]) == 0
    assert capsys.readouterr().out.strip().endswith("/train (7 images) and " + f"{tmp_path / 'dd'}/test (2 images)")
    train, test = DrafterData.load(tmp_path / "dd" / "train"), DrafterData.load(tmp_path / "dd" / "test")
    stack = load_model_stack(t2i_stack)
    tokenizer = stack.tokenizer
    size = stack.grid_width * tokenizer.config.downsample_factor
    pixels = torch.stack([square_image(p, size, "x", "adm") for p in paths])
    with torch.no_grad():
        expected = tokenizer.encode(pixels)
    assert torch.equal(train.tokens, expected[:7]) and torch.equal(test.tokens, expected[7:])
    assert (train.meta["source"], train.meta["num_real"], train.meta["image_size"]) == ("real", 7, size)
    import numpy as np
    from PIL import Image

    def center_crop_arr(pil_image: Image.Image, image_size: int) -> np.ndarray:  # ADM's, as LANTERN copies it
        while min(*pil_image.size) >= 2 * image_size:
            pil_image = pil_image.resize(tuple(x // 2 for x in pil_image.size), resample=Image.BOX)
        scale = image_size / min(*pil_image.size)
        pil_image = pil_image.resize(tuple(round(x * scale) for x in pil_image.size), resample=Image.BICUBIC)
        arr = np.array(pil_image)
        crop_y, crop_x = (arr.shape[0] - image_size) // 2, (arr.shape[1] - image_size) // 2
        return arr[crop_y : crop_y + image_size, crop_x : crop_x + image_size]

    for path, image in zip(paths[:3], pixels[:3], strict=True):  # large and wide, tall (greyscale), square
        with Image.open(path) as raw:
            adm = torch.from_numpy(center_crop_arr(raw.convert("RGB"), size)).permute(2, 0, 1).float() / 127.5 - 1
        assert torch.equal(image, adm), path
    assert not torch.equal(pixels[0], square_image(paths[0], size, "x"))  # power: clean-fid's Lanczos differs
    dropped = train.labels == -1
    assert 0 < int(dropped.sum()) < 7 and torch.equal(train.labels[~dropped], torch.arange(7)[~dropped])
    _check_teacher_forced(stack, train, captions[:7])
    encoded = stack.encode(captions[7:])  # the held-out captions, kept for train-drafter's generation
    assert test.captions is not None and torch.equal(test.captions.cond, encoded.cond)
    # One shard at a time: three shards hold what one does
    pairs = caption_folder(tmp_path / "laion")
    assert [p for p, _ in pairs] == paths and [c for _, c in pairs] == captions
    for shard_size, name in ((3, "small"), (100, "one")):
        make_caption_drafter_data(stack, pairs[:7], tmp_path / name, shard_size=shard_size, cond_dropout=0.3,
                                  batch_size=2, progress=False)
    small, one = DrafterData.load(tmp_path / "small"), DrafterData.load(tmp_path / "one")
    assert (len(small.meta["shards"]), len(one.meta["shards"])) == (3, 1)
    assert torch.equal(small.tokens, one.tokens) and torch.equal(small.labels, one.labels)
    assert torch.equal(small.hidden, one.hidden) and torch.equal(one.tokens, train.tokens)
    # Bad input: one line, nothing written
    paths[4].with_suffix(".txt").unlink()
    for extra, message in ((["--cfg-scale", "3"], "--cfg-scale is used with --prompts, whose images the target "
                                                  "samples; --images are real"),
                           ([], f"--images: {paths[4]} has no caption ({paths[4].stem}.txt beside it")):
        assert main([*argv, *extra, "--out", str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("lantern: error: ") and err.count("\n") == 1 and message in err, err
        assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_a_text_to_image_drafter_trained_on_its_prompts_beats_its_initialisation(
        t2i_stack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The whole route: self-distilled data, ``train-drafter``, then greedy speculative decoding
    with the drafter gives AR's codes in fewer target forwards. The target has a 16-code book and
    peaked distributions, so that 300 steps can learn it (a 256-code random target's flat
    distributions leave top-1 near 0 whatever the drafter: measured 0.00 -> 0.01)."""
    import shutil

    import numpy as np

    from lantern.api import load_model_stack
    from lantern.cli.main import main
    from lantern.testing import tiny_llamagen, tiny_vq
    from lantern.train.drafter import DrafterData, DrafterRecipe, evaluate_drafter, initial_drafter

    stack = tmp_path / "stack"
    tiny_llamagen(3, logit_std=2.0, model_type="t2i", cls_token_num=T5_MAXLEN, caption_dim=T5_DIM, block_size=64,
                  vocab_size=16).save_pretrained(stack / "target")
    tiny_vq(0, 16).save_pretrained(stack / "tokenizer")
    shutil.copytree(t2i_stack / "t5", stack / "t5")
    t2i_stack = stack
    (tmp_path / "p.txt").write_text("\n".join(_word_prompts(48, 1)) + "\n")
    assert main(["make-drafter-data", "--target", str(t2i_stack), "--prompts", str(tmp_path / "p.txt"),
                 "--num-per-prompt", "4", "--eval-prompts", "8", "--cfg-scale", "3", "--no-progress",
                 "--out", str(tmp_path / "dd")]) == 0
    capsys.readouterr()
    assert main(["train-drafter", "--target", str(t2i_stack), "--data", str(tmp_path / "dd"), "--out",
                 str(tmp_path / "drafter"), "--steps", "600", "--batch-size", "16", "--lr", "3e-3", "--warmup-steps",
                 "10", "--precision", "fp32", "--no-progress"]) == 0
    # The held-out speculative generation (greedy sd, the first held-out captions) is reported, as
    # for a class-conditional drafter
    report = capsys.readouterr().out.splitlines()[-1]
    assert report.startswith(f"wrote drafter to {tmp_path / 'drafter'} | ") and "mean_accepted " in report, report
    reported = float(report.split("mean_accepted ")[1].split(",")[0])
    target = load_model_stack(t2i_stack).target
    test = DrafterData.load(tmp_path / "dd" / "test")
    from lantern.models.drafter import EagleDrafterModel

    before = evaluate_drafter(initial_drafter(target, DrafterRecipe()), target, test, generation=False)
    after = evaluate_drafter(EagleDrafterModel.from_pretrained(tmp_path / "drafter"), target, test, generation=False)
    print(f"held-out top1 {before['top1']:.2f} -> {after['top1']:.2f}, "
          f"accept {before['accept_prob']:.2f} -> {after['accept_prob']:.2f}")
    # measured: top1 0.07 -> 0.28, accept 0.07 -> 0.29, greedy sd 1.19 tokens per forward (AR: 1.00)
    assert after["top1"] > before["top1"] + 0.12 and after["accept_prob"] > before["accept_prob"] + 0.12
    runs = {}
    base = ["generate", "--model", str(t2i_stack), "--prompt", "a red car on the beach", "--prompt", "a dog",
            "--temperature", "0", "--cfg-scale", "3", "--no-progress"]
    for method, extra in (("ar", []), ("sd", ["--tree", "chain:4", "--drafter", str(tmp_path / "drafter")])):
        assert main([*base, "--method", method, *extra, "--out", str(tmp_path / method)]) == 0
        runs[method] = (np.load(tmp_path / method / "codes.npy"),
                        json.loads((tmp_path / method / "run.json").read_text())["stats"]["mean_accepted"])
    assert (runs["sd"][0] == runs["ar"][0]).all()
    print(f"greedy sd tokens/forward {runs['sd'][1]:.2f}, held-out evaluation {reported:.2f}")
    assert runs["sd"][1] > 1.1 and reported > 1.1


def test_real_images_are_centre_cropped_and_resized_as_a_reference(t2i_stack: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``bench --reference-images DIR``: FID against real photos of any size (COCO for a text model,
    as LANTERN's), centre-cropped and resized with Lanczos to the model's size, in file-name order."""
    from PIL import Image

    from lantern.cli.main import main
    from lantern.eval.metrics import folder_images

    real = tmp_path / "real"
    real.mkdir()
    wide = np.zeros((20, 60, 3), dtype=np.uint8)
    wide[:, 20:40] = (255, 0, 0)  # only the centre square is red: the crop keeps it, the sides go
    Image.fromarray(wide).save(real / "a.png")
    gen = np.random.default_rng(0)
    for name, shape in (("b.jpg", (50, 30, 3)), ("c.png", (16, 16, 3)), ("d.webp", (40, 40, 3)), ("e.png", (8, 9, 3))):
        Image.fromarray(gen.integers(0, 256, shape, dtype=np.uint8)).save(real / name)
    (real / "notes.txt").write_text("not an image")
    images = folder_images(real, 16, limit=4)
    assert images.shape == (4, 3, 16, 16) and images.min() >= -1 and images.max() <= 1
    assert torch.allclose(images[0, 0], torch.ones(16, 16), atol=0.02) and images[0, 1:].max() < -0.98
    assert torch.equal(images[2], folder_images(real, 16, limit=4)[2])
    with pytest.raises(LanternError, match=r"--reference-images: .* holds 1 images .* FID needs 2"):
        folder_images(real, 16, limit=1)
    # a wide model's images (8 x 16): the centre 2:1 crop of the 60 x 20 photo (x 10..50) keeps a
    # black quarter each side of the red half, which a square crop (all red) or a squashed whole
    # photo (a red third) would not
    images = folder_images(real, (8, 16), limit=4)
    assert images.shape == (4, 3, 8, 16)
    red = images[0, 0].mean(dim=0)  # per column
    assert bool((red[5:11] > 0.98).all()) and bool((red[:2] < -0.98).all()) and bool((red[-2:] < -0.98).all())
    assert abs(float((red > 0).float().mean()) - 0.5) < 0.13

    clip = tiny_clip(tmp_path / "clip")
    assert main(["bench", "--model", str(t2i_stack), "--methods", "ar", "--num-images", "4", "--speed-images", "2",
                 "--batch-size", "4", "--num-real", "4", "--curve-images", "0", "--no-ar-spread", "--no-progress",
                 "--feature-net", f"clip:{clip}", "--reference-images", str(real), "--out", str(tmp_path / "b")]) == 0
    run = json.loads((tmp_path / "b" / "run.json").read_text())
    assert (run["reference"], run["reference_images"], run["num_real"]) == ("images", str(real), 4)
    assert f"against 4 images of {real}" in (tmp_path / "b" / "bench.md").read_text()
    capsys.readouterr()
    assert main(["bench", "--model", str(t2i_stack), "--reference-images", str(tmp_path / "none"), "--out",
                 str(tmp_path / "c")]) == 2
    assert capsys.readouterr().err == f"lantern: error: --reference-images: no such folder {tmp_path / 'none'}\n"
