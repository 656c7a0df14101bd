"""The embedded presets (``digits``, ``photos``): trained stacks shipped in lantern/presets.

Every statistic is measured on held-out images of the preset's own data set (the test split,
disjoint from training), encoded with the preset's tokenizer. The thresholds sit well below the
values measured when the presets were built (docs/presets.md) and well above what an untrained
model scores, so they catch a broken or swapped component rather than noise. Everything is
deterministic (fixed data, no sampling), so there is no false-positive rate to state.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lantern.cli.main import main
from lantern.decoding.config import SamplingConfig
from lantern.models.drafter import EagleDrafterModel
from lantern.targets.base import PRESETS, PRESETS_DIR
from lantern.targets.llamagen_stack import load_stack
from lantern.targets.proximity import ProximityTable, build_proximity
from lantern.train.heldout import drafter_agreement, encode_dataset, stack_dataset, target_statistics, unigram_bits

# name: (image shape, held-out images, min PSNR dB, min bits saved vs unigram, min drafter top-1)
EXPECT = {
    "digits": ((1, 32, 32), 200, 25.0, 3.0, 0.40),  # measured on 500: 28.6 dB, 5.6 bits saved, top-1 0.465
    "photos": ((3, 64, 64), 64, 25.0, 3.0, 0.50),  # measured on 500: 29.6 dB, 4.7 bits saved, top-1 0.626
}
BUDGET_MB = 60.0


@pytest.fixture(scope="module", params=PRESETS)
def preset(request: pytest.FixtureRequest):  # noqa: ANN201
    name = request.param
    stack = load_stack(name)
    shape, n, *_ = EXPECT[name]
    test = stack_dataset(stack, "test", num_samples=n)
    train = stack_dataset(stack, "train", num_samples=4 * n)
    test_codes, test_labels, test_psnr = encode_dataset(stack.tokenizer, test)
    train_codes, _, _ = encode_dataset(stack.tokenizer, train)
    return name, stack, test_codes, test_labels, test_psnr, train_codes


def test_presets_fit_the_size_budget() -> None:
    total = sum(f.stat().st_size for name in PRESETS for f in (PRESETS_DIR / name).rglob("*") if f.is_file())
    assert total / 1e6 <= BUDGET_MB, f"presets take {total / 1e6:.1f} MB > {BUDGET_MB} MB"


def test_preset_folders_record_provenance() -> None:
    for name in PRESETS:
        prov = json.loads((PRESETS_DIR / name / "provenance.json").read_text())
        for part in ("tokenizer", "target", "drafter"):
            step = prov["steps"][part]
            assert step["command"].startswith("lantern train-"), step["command"]
            assert len(step["data_fingerprint"]) == 64 and step["git_commit"] and step["metrics"]


@pytest.mark.slow
def test_codes_decode_to_images_of_the_right_size_and_quality(preset) -> None:  # noqa: ANN001
    name, stack, codes, _, psnr, _ = preset
    shape, _, min_psnr, *_ = EXPECT[name]
    images = stack.tokenizer.decode(codes[:4])
    assert tuple(images.shape[1:]) == shape
    assert codes.shape[1] == stack.target.config.block_size
    assert float(psnr.mean()) >= min_psnr, f"{name}: held-out PSNR {float(psnr.mean()):.2f} dB"


@pytest.mark.slow
def test_target_beats_the_unigram_baseline(preset) -> None:  # noqa: ANN001
    name, stack, codes, labels, _, train_codes = preset
    margin = EXPECT[name][3]
    vocab = stack.target.config.vocab_size
    stats = target_statistics(stack.target, codes, labels, SamplingConfig(**stack.default_sampling()))
    unigram = unigram_bits(train_codes, codes, vocab)
    assert unigram > 6.0  # the codebook is really used: a collapsed tokenizer would make this trivial
    assert stats["bits_per_token"] <= unigram - margin, (name, stats, unigram)
    # Flat next-token distributions (LANTERN's premise) even under the preset's sampling settings
    assert 0.05 < stats["mean_top1_prob_sampling"] < 0.9


@pytest.mark.slow
def test_drafter_agrees_with_the_target(preset) -> None:  # noqa: ANN001
    name, stack, codes, labels, *_ = preset
    drafter = EagleDrafterModel.from_pretrained(stack.drafter_dir).float()
    trained = drafter_agreement(drafter, stack.target, codes, labels)
    assert trained["top1"] >= EXPECT[name][4], (name, trained)
    assert trained["top3"] >= trained["top1"]
    torch.manual_seed(0)
    untrained = EagleDrafterModel(drafter.config)
    untrained.embed_tokens.weight.data.copy_(drafter.embed_tokens.weight.data)
    base = drafter_agreement(untrained, stack.target, codes, labels)
    assert trained["top1"] > base["top1"] + 0.2 and trained["accept_prob"] > base["accept_prob"] + 0.1


@pytest.mark.slow
def test_proximity_table_matches_the_tokenizer(preset) -> None:  # noqa: ANN001
    name, stack, *_ = preset
    table = ProximityTable.load(stack.proximity_file)
    weight = stack.tokenizer.quantize.embedding.weight.detach()
    table.validate(weight)
    assert table.vocab_size == stack.target.config.vocab_size
    rebuilt = build_proximity(weight, k_max=table.k_max, metric=table.metric, normalize=table.normalized)
    assert torch.equal(rebuilt.neighbours, table.neighbours)


@pytest.mark.slow
def test_generate_uses_the_presets_own_drafter_and_table(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for method in ("sd", "lantern", "lantern++"):
        assert main(["generate", "--model", "digits", "--labels", "3,7", "--method", method, "--out",
                     str(tmp_path / method), "--no-progress"]) == 0
        run = json.loads((tmp_path / method / "run.json").read_text())
        generation = json.loads((PRESETS_DIR / "digits" / "generation.json").read_text())
        assert run["sampling"] == {k: generation[k] for k in ("temperature", "top_k", "top_p", "cfg_scale")}
        tree = run["method"]["tree"]
        assert generation["trees"][method] == (f"chain:{tree['depth']}" if tree["kind"] == "chain"
                                               else f"{tree['kind']}:{tree['name']}")
        assert run["stats"]["mean_accepted"] > 1.2, (method, run["stats"])
    capsys.readouterr()


@pytest.mark.slow
def test_demo_prints_the_table_and_writes_the_grid(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["demo", "--model", "digits", "--num-images", "4", "--methods", "ar,lantern++", "--out",
                 str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "lantern++" in out and "speed-up" in out
    demo = json.loads((tmp_path / "demo.json").read_text())
    rows = {r["method"]: r for r in demo["results"]}
    assert rows["ar"]["mean_accepted"] == 1.0 and rows["ar"]["target_forwards"] == 4 * 64  # summed over rows
    assert rows["lantern++"]["mean_accepted"] > 1.5
    assert rows["lantern++"]["target_forwards"] < rows["ar"]["target_forwards"]
    assert (tmp_path / "demo_grid.png").stat().st_size > 1000
