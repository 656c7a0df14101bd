"""EAGLE drafter training (lantern.train.drafter): feature data, batch layout, loss, training, resume."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from torch import Tensor

from lantern.decoding.config import SamplingConfig
from lantern.drafters.checks import HEAD_SHA_KEY, head_sha256
from lantern.drafters.eagle import EagleBackend
from lantern.errors import LanternError
from lantern.models.drafter import DrafterConfig, EagleDrafterModel
from lantern.models.llamagen import LlamaGen
from lantern.testing import tiny_llamagen
from lantern.train.codes import CodeSet
from lantern.train.drafter import (
    DrafterData,
    DrafterRecipe,
    DrafterTask,
    drafter_losses,
    evaluate_drafter,
    initial_drafter,
    make_drafter_data,
    teacher_forced_batch,
    train_drafter,
)
from lantern.train.loop import LoopConfig, RunOptions

V, N, C = 64, 16, 4  # vocabulary, image tokens (4x4), classes


def markov_codes(count: int, seed: int) -> CodeSet:
    """Learnable synthetic codes: x_t = (5 x_{t-1} + 7 label + 3) mod V with prob 0.8, else uniform."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, C, (count,), generator=g)
    x = torch.empty(count, N, dtype=torch.long)
    x[:, 0] = torch.randint(0, V, (count,), generator=g)
    for t in range(1, N):
        rule = (5 * x[:, t - 1] + 7 * labels + 3) % V
        noise = torch.randint(0, V, (count,), generator=g)
        x[:, t] = torch.where(torch.rand(count, generator=g) < 0.8, rule, noise)
    return CodeSet(x, labels, {"vocab_size": V, "num_classes": C, "grid": 4})


def trained_target(codes: CodeSet, steps: int = 60) -> LlamaGen:
    """A tiny target fitted briefly to ``codes``, so its next-token distributions carry structure."""
    target = tiny_llamagen(num_classes=C, block_size=N, vocab_size=V).train()
    opt = torch.optim.AdamW(target.parameters(), lr=3e-3)
    for s in range(steps):
        idx = torch.randint(0, len(codes), (64,), generator=torch.Generator().manual_seed(s))
        logits, _ = target(codes.labels[idx], codes.codes[idx])
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), codes.codes[idx].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return target.eval()


@dataclass
class World:
    target: LlamaGen
    train_codes: CodeSet
    train: DrafterData
    test: DrafterData
    root: Path


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    root = tmp_path_factory.mktemp("drafter")
    train_codes = markov_codes(1024, seed=0)
    target = trained_target(train_codes)
    make_drafter_data(target, train_codes, root / "train", progress=False, shard_size=300, batch_size=64)
    make_drafter_data(target, markov_codes(64, seed=1), root / "test", progress=False, seed=1)
    return World(target, train_codes, DrafterData.load(root / "train"), DrafterData.load(root / "test"), root)


def loop_config(**overrides: object) -> LoopConfig:
    base: dict[str, object] = dict(steps=150, batch_size=16, lr=2e-3, warmup_steps=10, precision="fp32",
                                   checkpoint_every=100, log_every=50, grad_clip=0.5, clip_mode="value")
    base.update(overrides)
    return LoopConfig(**base)  # type: ignore[arg-type]


# ---- data ------------------------------------------------------------------------------------


def test_data_shapes_and_features_equal_a_target_forward(world: World) -> None:
    d, cfg = world.train, world.target.config
    assert len(d) == 1024 and d.meta["count"] == 1024 and len(d.meta["shards"]) == 4  # 300+300+300+124
    assert d.hidden.shape == (1024, cfg.cls_token_num + N, cfg.dim) and d.hidden.dtype == torch.bfloat16
    assert d.tokens.shape == (1024, N) and d.labels.shape == (1024,)
    assert torch.equal(d.tokens, world.train_codes.codes)
    dropped = d.labels == cfg.num_classes
    assert torch.equal(d.labels[~dropped], world.train_codes.labels[~dropped])
    rows = torch.tensor([0, 1, 299, 300, 1023, *dropped.nonzero().flatten()[:3].tolist()])
    with torch.no_grad():
        _, direct = world.target(d.labels[rows], world.train_codes.codes[rows])
    torch.testing.assert_close(d.hidden[rows].float(), direct, atol=2e-2, rtol=1e-2)  # bf16 storage


def test_cond_dropout_fraction_is_p_and_deterministic_per_seed(world: World, tmp_path: Path) -> None:
    codes = markov_codes(600, seed=5)
    made = {}
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        make_drafter_data(world.target, codes, tmp_path / name, cond_dropout=0.3, seed=seed, progress=False)
        made[name] = DrafterData.load(tmp_path / name)
    frac = float((made["a"].labels == C).float().mean())
    assert 0.24 < frac < 0.36 and made["a"].meta["num_dropped"] == round(frac * 600)
    assert torch.equal(made["a"].labels, made["b"].labels) and made["a"].fingerprint() == made["b"].fingerprint()
    assert not torch.equal(made["a"].labels, made["c"].labels)
    assert made["a"].fingerprint() != made["c"].fingerprint()


def test_load_round_trip_and_folder_errors(world: World, tmp_path: Path) -> None:
    again = DrafterData.load(world.root / "train")
    assert torch.equal(again.hidden, world.train.hidden) and torch.equal(again.labels, world.train.labels)
    assert again.fingerprint() == world.train.fingerprint()
    meta = json.loads((world.root / "train" / "meta.json").read_text())
    assert meta["cond_dropout"] == 0.1 and meta["seed"] == 0 and meta["source"] == "real"
    assert meta["codes_fingerprint"] == world.train_codes.fingerprint() and len(meta["target_fingerprint"]) == 64

    (tmp_path / "empty").mkdir()
    with pytest.raises(LanternError, match="is empty"):
        DrafterData.load(tmp_path / "empty")
    (tmp_path / "nometa").mkdir()
    (tmp_path / "nometa" / "shard-00000.safetensors").write_bytes(b"x")
    with pytest.raises(LanternError, match="no meta.json"):
        DrafterData.load(tmp_path / "nometa")
    shutil.copytree(world.root / "test", tmp_path / "corrupt")
    shard = tmp_path / "corrupt" / "shard-00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(LanternError, match="corrupt"):
        DrafterData.load(tmp_path / "corrupt")
    with pytest.raises(LanternError, match="already holds drafter data"):
        make_drafter_data(world.target, world.train_codes, world.root / "train", progress=False)


def test_generated_source_adds_target_samples(world: World, tmp_path: Path) -> None:
    codes = markov_codes(8, seed=2)
    make_drafter_data(world.target, codes, tmp_path / "gen", source="generated", num_generated=6, progress=False,
                      sampling=SamplingConfig(temperature=1.0, top_k=8))
    d = DrafterData.load(tmp_path / "gen")
    assert len(d) == 14 and d.meta["num_real"] == 8 and d.meta["num_generated"] == 6
    assert torch.equal(d.tokens[:8], codes.codes)
    kept = d.labels[8:] != C  # generated labels cycle over the classes (unless dropped)
    assert torch.equal(d.labels[8:][kept], (torch.arange(6) % C)[kept])
    with pytest.raises(LanternError, match="--source generated"):
        make_drafter_data(world.target, codes, tmp_path / "bad", num_generated=3, progress=False)


# ---- batch layout and loss -------------------------------------------------------------------


def test_batch_layout_and_loss_mask_hand_built() -> None:
    """cls = 3, n = 4: positions 0..5 are fed; tokens [0, 0, x0..x3]; loss on positions 2..5."""
    cls, n, d = 3, 4, 8
    hidden = torch.randn(2, cls + n, d)
    codes = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    b = teacher_forced_batch(hidden, codes, cls)
    assert torch.equal(b.tokens, torch.tensor([[0, 0, 5, 6, 7, 8], [0, 0, 9, 10, 11, 12]]))
    assert b.loss_mask[0].nonzero().flatten().tolist() == list(range(cls - 1, cls + n - 1))
    assert torch.equal(b.features, hidden[:, :6]) and torch.equal(b.targets, hidden[:, 1:])
    assert torch.equal(b.positions[0], torch.arange(6)) and torch.equal(b.mask[0], torch.ones(6, 6).tril().bool())

    head = torch.nn.Linear(d, 16, bias=False)
    recipe = DrafterRecipe(p_weight=0.0)
    pred = b.targets.clone()
    pred[:, :cls - 1] += 5.0  # outside the mask: no loss
    assert float(drafter_losses(pred, b, head, recipe).loss_v) == 0.0
    pred[0, cls] += 0.5  # inside: SmoothL1 0.5 * 0.5^2 in every dim, one of 8 loss positions
    out = drafter_losses(pred, b, head, DrafterRecipe(p_weight=0.1))
    torch.testing.assert_close(out.loss_v, torch.tensor(0.125 / (8 + 1e-5)))
    # Soft CE: at the unperturbed positions it equals the target entropy; the total weighs both.
    torch.testing.assert_close(out.total, out.loss_v + 0.1 * out.loss_p)


def test_task_batch_noise_embeddings_and_initial_loss(world: World) -> None:
    recipe = DrafterRecipe(noise_width=0.2)
    task = DrafterTask(world.target, world.train, world.test, recipe, seed=0)
    idx = torch.tensor([3, 700, 5])
    b1, b2 = task.make_batch(idx, 7, torch.device("cpu")), task.make_batch(idx, 7, torch.device("cpu"))
    clean = world.train.hidden[idx, :-1].float()
    assert torch.equal(b1.features, b2.features)  # a function of (seed, step): resumable
    assert 0 < float((b1.features - clean).abs().max()) <= 0.1
    assert not torch.equal(task.make_batch(idx, 8, torch.device("cpu")).features, b1.features)
    assert torch.equal(b1.targets, world.train.hidden[idx, 1:].float())  # targets are clean
    assert torch.equal(task.model.embed_tokens.weight, world.target.tok_embeddings.weight)
    trained = {id(p) for p in task.parameters()}
    assert id(task.model.embed_tokens.weight) not in trained and len(trained) == len(list(task.model.parameters())) - 1
    loss, log = task.loss(task.model, b1, 7)
    assert torch.isfinite(loss) and set(log) == {"loss_v", "loss_p", "top1"}
    torch.testing.assert_close(float(loss.detach()), log["loss_v"] + 0.1 * log["loss_p"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [1, 3])
def test_training_layout_equals_inference(cls: int) -> None:
    """The drafter's teacher-forced outputs equal what EagleBackend computes while decoding."""
    d, n = 64, 16
    cfg = DrafterConfig.for_target(tiny_llamagen(vocab_size=V, block_size=n).config, target_cls_token_num=cls)
    torch.manual_seed(0)
    drafter = EagleDrafterModel(cfg).eval()
    head = torch.nn.Linear(d, V, bias=False)
    hidden, codes = torch.randn(2, cls + n, d), torch.randint(0, V, (2, n))
    b = teacher_forced_batch(hidden, codes, cls)
    with torch.no_grad():
        full = head(drafter(b.features, b.tokens, b.positions, b.mask))
    backend = EagleBackend(drafter, head, SamplingConfig(), streams=1, max_len=cls + n + 8)
    backend.start(hidden[:, :cls], codes[:, 0])
    torch.testing.assert_close(backend.begin(), full[:, cls - 1], atol=1e-5, rtol=1e-5)
    backend.commit(hidden[:, cls : cls + 3], codes[:, 1:4], torch.tensor([3, 3]))
    torch.testing.assert_close(backend.begin(), full[:, cls + 2], atol=1e-5, rtol=1e-5)


# ---- training --------------------------------------------------------------------------------


@pytest.mark.slow
def test_micro_training_beats_the_untrained_drafter(world: World) -> None:
    before = evaluate_drafter(initial_drafter(world.target, DrafterRecipe(), seed=0), world.target, world.test)
    result = train_drafter(world.target, world.train, world.test, DrafterRecipe(), loop_config(),
                           RunOptions(world.root / "run", progress=False))
    assert result.finished and result.steps_run == 150
    drafter = EagleDrafterModel.from_pretrained(world.root / "run")
    after = evaluate_drafter(drafter, world.target, world.test)
    assert after["top1"] == pytest.approx(result.metrics["top1"])
    assert before["top1"] < 0.05 and after["top1"] > before["top1"] + 0.12
    assert after["top3"] > after["top1"] and after["accept_prob"] > before["accept_prob"] + 0.1
    assert after["mean_accepted"] > before["mean_accepted"] + 0.4
    assert torch.equal(drafter.embed_tokens.weight, world.target.tok_embeddings.weight)  # stayed frozen
    info = json.loads((world.root / "run" / "drafter_training.json").read_text())
    assert info["data_fingerprint"] == world.train.fingerprint()
    assert info[HEAD_SHA_KEY] == head_sha256(world.target.output.weight)  # what a later load compares


def _final_state(out: Path) -> dict[str, Tensor]:
    return EagleDrafterModel.from_pretrained(out).state_dict()


def test_exact_resume(world: World, tmp_path: Path) -> None:
    loop = loop_config(steps=12, checkpoint_every=4, warmup_steps=3, precision="bf16")
    args = (world.target, world.train, world.test, DrafterRecipe(), loop)
    split = RunOptions(tmp_path / "split", progress=False)
    train_drafter(*args, RunOptions(tmp_path / "straight", progress=False), eval_generation=False)
    part = train_drafter(*args, replace(split, stop_after=8), eval_generation=False)
    assert not part.finished
    rest = train_drafter(*args, replace(split, resume=True), eval_generation=False)
    assert rest.resumed_from == 8 and rest.steps_run == 4
    a, b = _final_state(tmp_path / "straight"), _final_state(tmp_path / "split")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_with_another_recipe_fails(world: World, tmp_path: Path) -> None:
    loop = loop_config(steps=8, checkpoint_every=4)
    train_drafter(world.target, world.train, world.test, DrafterRecipe(), loop,
                  RunOptions(tmp_path, progress=False, stop_after=4), eval_generation=False)
    with pytest.raises(LanternError, match="p_weight"):
        train_drafter(world.target, world.train, world.test, DrafterRecipe(p_weight=0.2), loop,
                      RunOptions(tmp_path, progress=False, resume=True), eval_generation=False)


def test_data_from_another_target_is_refused(world: World) -> None:
    same_shape = tiny_llamagen(seed=1, num_classes=C, block_size=N, vocab_size=V)
    with pytest.raises(LanternError, match="different target model"):
        DrafterTask(same_shape, world.train, world.test)
    wider = tiny_llamagen(num_classes=C, block_size=N, vocab_size=V, dim=32)
    with pytest.raises(LanternError, match="dim 64"):
        DrafterTask(wider, world.train, world.test)
    bigger = tiny_llamagen(num_classes=C, block_size=25, vocab_size=V)
    with pytest.raises(LanternError, match="block_size 16"):
        DrafterTask(bigger, world.train, world.test)
