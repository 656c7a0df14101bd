"""Offline quality metrics (lantern.eval.metrics) and the feature-net trainer (lantern.train.features).

Known answers where they exist (identical sets, constructed point clouds, a hand-computed 1-D
case, FID against a direct eigendecomposition), orderings where they do not (real vs corrupted
images in the committed digits feature space), and the committed feature nets' accuracy.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from reference_recipes import VGG16_CONVS, VGG16_POOLED, fid_state, vgg16_state

from lantern.cli.main import main
from lantern.errors import LanternError
from lantern.eval.metrics import (
    Features,
    extract_features,
    frechet_distance,
    kernel_distance,
    knn_radii,
    load_feature_extractor,
    precision_recall,
    quality_metrics,
    reference_images,
)
from lantern.models.features import FeatureNet


@pytest.fixture(scope="module")
def digits() -> tuple:
    extractor = load_feature_extractor("digits")
    images, labels = reference_images("digits")  # the 500 held-out test digits
    return extractor, images, labels


@pytest.fixture(scope="module")
def digits_features(digits: tuple) -> Features:
    extractor, images, _ = digits
    return extract_features(extractor, images)


def _blur(images: torch.Tensor) -> torch.Tensor:
    k = torch.tensor([1.0, 4, 6, 4, 1])
    k = (k[:, None] * k[None]) / 256
    c = images.shape[1]
    padded = F.pad(images, (2, 2, 2, 2), mode="replicate")
    return F.conv2d(padded, k.expand(c, 1, 5, 5), groups=c)


def _noise(images: torch.Tensor, sigma: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (images + sigma * torch.randn(images.shape, generator=g)).clamp(-1, 1)


# ----------------------------------------------------------------------------------------------
# Known answers
# ----------------------------------------------------------------------------------------------


def test_identical_sets(digits: tuple, digits_features: Features) -> None:
    extractor, _, labels = digits
    f = Features(digits_features.features[:200], digits_features.logits[:200], extractor.name)
    m = quality_metrics(f, f, labels[:200], extractor, kid_subset_size=200)
    # FID of a set against itself is 0 up to float64 rounding: tolerance 1e-6 of the feature
    # variance (trace of the covariance, the scale FID is measured in).
    scale = float(torch.cov(f.features.T).trace())
    assert abs(m.fid) < 1e-6 * scale, (m.fid, scale)
    # With subsets of all N images, torchmetrics' unbiased MMD^2 estimator of a set against itself
    # is exactly -2 (mean diagonal kernel - mean off-diagonal kernel) / N: close to 0, not 0.
    x = f.features
    kernel = (x @ x.T / x.shape[1] + 1) ** 3
    n = x.shape[0]
    diag, off = kernel.diag().mean(), (kernel.sum() - kernel.diag().sum()) / (n * (n - 1))
    assert m.kid_mean == pytest.approx(float(-2 * (diag - off) / n), rel=1e-9, abs=1e-12)
    assert abs(m.kid_std) < 1e-12
    assert m.precision == 1.0 and m.recall == 1.0
    assert (m.num_real, m.num_fake, m.k, m.kid_subset_size) == (200, 200, 3, 200)
    assert "not comparable" in m.note and "lantern feature net digits" in m.feature_net


def test_fid_matches_direct_computation() -> None:
    g = torch.Generator().manual_seed(1)
    real = torch.randn(60, 5, generator=g, dtype=torch.float64) @ torch.randn(5, 5, generator=g, dtype=torch.float64)
    fake = 0.7 * torch.randn(80, 5, generator=g, dtype=torch.float64) + 0.3

    def sqrtm(a: torch.Tensor) -> torch.Tensor:
        w, v = torch.linalg.eigh(a)
        return v @ torch.diag(w.clamp_min(0).sqrt()) @ v.T

    s1, s2 = torch.cov(real.T), torch.cov(fake.T)
    root = sqrtm(s1)
    middle = torch.linalg.eigvalsh(root @ s2 @ root).clamp_min(0).sqrt().sum()
    direct = (real.mean(0) - fake.mean(0)).pow(2).sum() + s1.trace() + s2.trace() - 2 * middle
    assert frechet_distance(real, fake) == pytest.approx(float(direct), rel=1e-9)
    assert frechet_distance(fake, real) == pytest.approx(float(direct), rel=1e-9)


def test_kid_is_reproducible_by_seed() -> None:
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(40, 8, generator=g), torch.randn(40, 8, generator=g) + 0.5
    assert kernel_distance(a, b, subset_size=20, seed=3) == kernel_distance(a, b, subset_size=20, seed=3)
    assert kernel_distance(a, b, subset_size=20, seed=3) != kernel_distance(a, b, subset_size=20, seed=4)


def test_precision_recall_hand_computed_1d() -> None:
    real = torch.tensor([[0.0], [1.0], [2.0], [3.0], [10.0]])
    fake = torch.tensor([[2.4], [5.0], [20.0], [16.9]])
    # k = 1 radii: real 1, 1, 1, 1, 7; fake 2.6, 2.6, 3.1, 3.1.
    assert knn_radii(real, k=1).sqrt().tolist() == pytest.approx([1, 1, 1, 1, 7])
    # fake inside the real balls: 2.4 (near 2), 5 (within 7 of 10), 16.9 (within 7 of 10); not 20.
    # real inside the fake balls: 0, 1, 2, 3 (within 2.6 of 2.4); not 10.
    assert precision_recall(real, fake, k=1) == pytest.approx((0.75, 0.8))


def test_precision_recall_constructed_clouds() -> None:
    g = torch.Generator().manual_seed(0)
    centers = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0], [10.0, 10.0]])
    real = (centers[:, None] + 0.3 * torch.randn(4, 50, 2, generator=g)).reshape(-1, 2)
    # Far away: nothing overlaps.
    assert precision_recall(real, real + 100.0) == (0.0, 0.0)
    # Half the modes, the very same points: every fake is real, half the real set is covered.
    assert precision_recall(real, real[:100]) == (1.0, 0.5)
    # Half the modes, fresh samples of those modes: precision ~1, recall ~0.5.
    fresh = (centers[:2, None] + 0.3 * torch.randn(2, 50, 2, generator=g)).reshape(-1, 2)
    precision, recall = precision_recall(real, fresh)
    assert precision > 0.9 and 0.4 < recall <= 0.5, (precision, recall)


def test_precision_recall_duplicates_are_inside() -> None:
    # Four copies of each point: k-th neighbour radius is 0, a point equal to a center is still inside.
    real = torch.randn(5, 3, generator=torch.Generator().manual_seed(0)).repeat(4, 1) * 1e3
    assert precision_recall(real, real) == (1.0, 1.0)


# ----------------------------------------------------------------------------------------------
# Orderings with the committed digits feature net
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_corrupted_digits_score_worse(digits: tuple, digits_features: Features) -> None:
    extractor, images, labels = digits
    # Reference: the first 250 test digits; clean: the other 250 (same distribution, other images).
    # Corruptions are of the clean sample, so every candidate shows the same 250 digits.
    ref = Features(digits_features.features[:250], digits_features.logits[:250], extractor.name)
    clean = images[250:]
    scores = {name: quality_metrics(ref, fake, labels[250:], extractor)
              for name, fake in (("clean", clean), ("blur", _blur(clean)), ("noise", _noise(clean, 0.5)))}
    for bad in ("blur", "noise"):
        assert scores[bad].fid > scores["clean"].fid + 1.0, {k: v.fid for k, v in scores.items()}
        assert scores[bad].kid_mean > scores["clean"].kid_mean + 0.01, {k: v.kid_mean for k, v in scores.items()}
        assert scores[bad].precision < scores["clean"].precision, {k: v.precision for k, v in scores.items()}
    # Two real samples of one distribution: KID ~0 (within 2 subset std; measured -0.07 +- 0.05, blur
    # +0.13, noise +0.55), precision/recall high (measured 0.94 / 0.91).
    clean = scores["clean"]
    assert abs(clean.kid_mean) < 2 * clean.kid_std and clean.precision > 0.8 and clean.recall > 0.8, clean


# ----------------------------------------------------------------------------------------------
# The committed feature nets
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["digits", "photos"])
def test_committed_feature_nets_classify(preset: str) -> None:
    extractor = load_feature_extractor(preset)
    assert f"lantern feature net {preset} (128-d, test acc" in extractor.name
    # The default reference: digits test split; photos fresh crops of the training regions.
    images, labels = reference_images(preset, 300)
    f = extract_features(extractor, images)
    m = quality_metrics(f, f, labels, extractor)
    assert m.class_accuracy is not None and m.class_accuracy >= 0.9, m.class_accuracy
    shuffled = labels[torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))]
    chance = 1.0 / extractor.num_classes
    m = quality_metrics(f, f, shuffled, extractor)
    assert abs(m.class_accuracy - chance) < 0.07, (m.class_accuracy, chance)


def test_committed_feature_nets_files() -> None:
    for preset in ("digits", "photos"):
        folder = Path(__file__).resolve().parents[1] / "lantern" / "presets" / preset / "features"
        for name in ("config.json", "model.safetensors", "provenance.json"):
            assert (folder / name).is_file(), folder / name
        assert (folder / "model.safetensors").stat().st_size < 2 * 1024 * 1024
        prov = json.loads((folder / "provenance.json").read_text())
        assert prov["kind"] == "features" and "train-features" in prov["command"]
        assert prov["metrics"]["test_accuracy"] >= (0.95 if preset == "digits" else 0.8)
        if preset == "photos":
            assert prov["metrics"]["fresh_crops_accuracy"] >= 0.95
        data = json.loads((folder.parent / "data.json").read_text())
        config = json.loads((folder / "config.json").read_text())
        assert (config["in_channels"], config["image_size"]) == (data["channels"], data["image_size"])


# ----------------------------------------------------------------------------------------------
# Other extractors
# ----------------------------------------------------------------------------------------------


class _Stats(torch.nn.Module):
    """Stands in for Inception: reports what it was fed (min, max, channels, height, width)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        shape = torch.tensor([float(x.shape[1]), float(x.shape[2]), float(x.shape[3])]).expand(n, 3)
        return torch.cat([x.amin((1, 2, 3))[:, None], x.amax((1, 2, 3))[:, None], shape, x.mean((1, 2, 3))[:, None]], 1)


class _StatsWithFlag(torch.nn.Module):
    """The StyleGAN2-ADA export's signature: features only with return_features=True."""

    def forward(self, x: torch.Tensor, return_features: bool = False) -> torch.Tensor:
        if not return_features:
            return torch.zeros(x.shape[0], 1008)
        return torch.stack([x.mean((1, 2, 3)), x.std((1, 2, 3))], 1)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:--feature-net torchscript.*running the file's TorchScript code")  # trusted here
def test_torchscript_extractor(tmp_path: Path) -> None:
    path = tmp_path / "stats.pt"
    torch.jit.script(_Stats()).save(str(path))
    extractor = load_feature_extractor(f"torchscript:{path}", input_size=31, trust_checkpoint=True)
    assert extractor.dim == 6 and "stats.pt (6-d, 31px)" in extractor.name and not extractor.has_classifier
    grey = torch.cat([torch.full((2, 1, 16, 16), -1.0), torch.ones(2, 1, 16, 16)])
    f = extract_features(extractor, grey).features
    fed = [[0.0, 0.0], [0.0, 0.0], [255.0, 255.0], [255.0, 255.0]]  # [-1, 1] -> 0..255
    torch.testing.assert_close(f[:, :2], torch.tensor(fed, dtype=f.dtype), atol=1e-3, rtol=0)
    assert f[:, 2:5].tolist() == [[3.0, 31.0, 31.0]] * 4  # grey repeated to 3 channels, resized
    g = torch.Generator().manual_seed(0)
    real, fake = torch.rand(10, 3, 8, 8, generator=g) * 2 - 1, torch.rand(12, 3, 8, 8, generator=g) * 2 - 1
    m = quality_metrics(real, fake, torch.zeros(12, dtype=torch.long), extractor, kid_subset_size=5)
    assert m.class_accuracy is None and m.num_fake == 12 and np.isfinite(m.fid)

    flagged = tmp_path / "flagged.pt"
    torch.jit.script(_StatsWithFlag()).save(str(flagged))
    assert load_feature_extractor(f"torchscript:{flagged}", trust_checkpoint=True).dim == 2


def test_clip_extractor(tmp_path: Path) -> None:
    try:
        import transformers
    except ImportError:
        with pytest.raises(LanternError, match="transformers"):
            load_feature_extractor(f"clip:{tmp_path}")
        return
    config = transformers.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=32, patch_size=16, projection_dim=8)
    transformers.CLIPVisionModelWithProjection(config).save_pretrained(tmp_path / "clip")
    extractor = load_feature_extractor(f"clip:{tmp_path / 'clip'}")
    assert extractor.dim == 8
    assert extract_features(extractor, torch.zeros(3, 1, 20, 20)).features.shape == (3, 8)


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------


def test_bad_inputs(digits: tuple, digits_features: Features, tmp_path: Path) -> None:
    extractor, images, labels = digits
    f10 = Features(digits_features.features[:10], digits_features.logits[:10], extractor.name)
    with pytest.raises(LanternError, match="real and fake images differ in shape"):
        quality_metrics(images[:10], images[:10].expand(-1, 3, -1, -1), None, extractor)
    with pytest.raises(LanternError, match="fake have 3 channels"):
        quality_metrics(f10, images[:10].expand(-1, 3, -1, -1), None, extractor)
    with pytest.raises(LanternError, match="fake are 16x16"):
        quality_metrics(f10, images[:10, :, :16, :16], None, extractor)
    with pytest.raises(LanternError, match=r"fake must be \[N, C, H, W\]"):
        quality_metrics(f10, images[0], None, extractor)
    with pytest.raises(LanternError, match="k=3 needs at least 4 images per set, got 10 real and 3 fake"):
        quality_metrics(f10, images[:3], None, extractor)
    with pytest.raises(LanternError, match="k=3 needs at least 4"):
        precision_recall(f10.features, f10.features[:3])
    with pytest.raises(LanternError, match="fake: need at least 2 images"):
        frechet_distance(f10.features, f10.features[:1])
    with pytest.raises(LanternError, match="kid_subset_size 11 is larger"):
        quality_metrics(f10, f10, None, extractor, kid_subset_size=11)
    with pytest.raises(LanternError, match="fake_labels must be a 1-D tensor with one label per image"):
        quality_metrics(f10, f10, labels[:9], extractor)
    with pytest.raises(LanternError, match=r"fake_labels must be in \[0, 10\)"):
        quality_metrics(f10, f10, labels[:10] + 10, extractor)
    with pytest.raises(LanternError, match="real are images: pass an extractor"):
        quality_metrics(images[:10], f10)
    with pytest.raises(LanternError, match="real and fake features differ in size"):
        frechet_distance(f10.features, f10.features[:, :5])
    with pytest.raises(LanternError, match="no such file or folder"):
        load_feature_extractor(str(tmp_path / "missing"))
    with pytest.raises(LanternError, match="torchscript feature network not found"):
        load_feature_extractor(f"torchscript:{tmp_path / 'missing.pt'}")
    (tmp_path / "junk.pt").write_text("not a model")
    with pytest.raises(LanternError, match="is not a TorchScript file"), \
            pytest.warns(UserWarning, match="running the file's TorchScript code"):
        load_feature_extractor(f"torchscript:{tmp_path / 'junk.pt'}", trust_checkpoint=True)


def test_missing_torchmetrics_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "torchmetrics", None)  # import torchmetrics -> ImportError
    monkeypatch.setitem(__import__("sys").modules, "torchmetrics.image.fid", None)
    with pytest.raises(LanternError, match=r"lantern-ar\[bench\]"):
        frechet_distance(torch.randn(5, 2), torch.randn(5, 2))


# ----------------------------------------------------------------------------------------------
# train-features end to end
# ----------------------------------------------------------------------------------------------


def _image_folder(root: Path, n: int = 12, size: int = 16) -> Path:
    """Three classes of smooth coloured blobs."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:size, 0:size] / size
    lines = []
    for i in range(n):
        cx, cy = rng.uniform(0.2, 0.8, 2)
        blob = np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / 0.1)
        color = np.eye(3)[i % 3] * 255
        Image.fromarray((blob[..., None] * color).astype(np.uint8)).save(root / f"img{i:02d}.png")
        lines.append(f"img{i:02d}.png,{i % 3}")
    (root / "labels.csv").write_text("\n".join(lines) + "\n")
    return root


def test_train_features_cli(tmp_path: Path) -> None:
    folder = _image_folder(tmp_path / "imgs")
    common = ["train-features", "--data", str(folder), "--labels-file", str(folder / "labels.csv"),
              "--widths", "8,16", "--feature-dim", "8", "--norm-groups", "4", "--max-shift", "1", "--flip",
              "--zoom", "1.3", "--blur", "0.5", "--steps", "4", "--batch-size", "4", "--warmup-steps", "1",
              "--checkpoint-every", "2", "--precision", "fp32", "--no-progress"]
    assert main([*common, "--out", str(tmp_path / "full")]) == 0
    prov = json.loads((tmp_path / "full" / "provenance.json").read_text())
    assert prov["kind"] == "features" and 0.0 <= prov["metrics"]["test_accuracy"] <= 1.0
    assert prov["metrics"]["test_images"] == 1.0 and prov["metrics"]["chance_accuracy"] == pytest.approx(1 / 3)
    net = FeatureNet.from_pretrained(tmp_path / "full")
    assert (net.config.in_channels, net.config.image_size, net.config.num_classes) == (3, 16, 3)
    extractor = load_feature_extractor(str(tmp_path / "full"))
    assert extractor.dim == 8 and "test acc" in extractor.name
    # Killed after step 2 and resumed: the same weights as the uninterrupted run (augmentation
    # draws are a function of (seed, step)).
    assert main([*common, "--out", str(tmp_path / "split"), "--stop-after", "2"]) == 0
    assert main([*common, "--out", str(tmp_path / "split"), "--resume"]) == 0
    a, b = (load_file(str(tmp_path / run / "model.safetensors")) for run in ("full", "split"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _prec_recall_features(state: dict[str, torch.Tensor], images: torch.Tensor) -> torch.Tensor:
    """LANTERN's ``eval_prec_recall.py`` on images in [-1, 1], written out op by op from torchvision's
    layout: [0, 1], resized to 224, ImageNet-normalised, ``vgg16.features``, flattened to 7 * 7 * 512,
    ``classifier[:4]`` (fc1, ReLU, dropout, fc2) in eval mode."""
    x = F.interpolate((images.expand(-1, 3, -1, -1) + 1) / 2, size=(224, 224), mode="bilinear",
                      align_corners=False, antialias=True)
    x = (x - torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)) / torch.tensor([0.229, 0.224, 0.225]).view(
        1, 3, 1, 1)
    for i in VGG16_CONVS:
        x = F.relu(F.conv2d(x, state[f"features.{i}.weight"], state[f"features.{i}.bias"], padding=1))
        if i in VGG16_POOLED:
            x = F.max_pool2d(x, 2)
    x = F.relu(F.linear(x.reshape(-1, 7 * 7 * 512), state["classifier.0.weight"], state["classifier.0.bias"]))
    return F.linear(x, state["classifier.3.weight"], state["classifier.3.bias"])


def test_vgg16_extractor_gives_lanterns_precision_recall_features(tmp_path: Path) -> None:
    """``vgg16:PATH`` reads torchvision's VGG16 file (pickled state dict or safetensors) without
    running code and gives its fc2 features before the ReLU, as LANTERN's evaluation takes them."""
    from safetensors.torch import save_file

    state = vgg16_state()
    torch.save(state, tmp_path / "vgg16-397923af.pth")
    save_file(state, tmp_path / "vgg16.safetensors")
    g = torch.Generator().manual_seed(1)
    # one at VGG's size, one resized up
    images = [torch.rand(1, 3, 224, 224, generator=g) * 2 - 1, torch.rand(1, 3, 64, 64, generator=g) * 2 - 1]
    expected = [_prec_recall_features(state, im) for im in images]
    # and torchvision's own VGG16 on the same state dict (scripts/make_vgg16_reference.py: torchvision
    # cannot share this venv), so the op-by-op reference above is checked too
    with np.load(Path(__file__).parent / "data" / "vgg16_reference.npz", allow_pickle=False) as ref:
        torchvision_says = [torch.from_numpy(ref["at224"]), torch.from_numpy(ref["at64"])]
    for a, b in zip(expected, torchvision_says, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-4)
    for name in ("vgg16-397923af.pth", "vgg16.safetensors"):
        extractor = load_feature_extractor(f"vgg16:{tmp_path / name}")
        assert extractor.dim == 4096 and extractor.name == f"VGG16 fc2 {name} (4096-d, 224px)"
        with torch.no_grad():
            got = [extractor(im) for im in images]
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
            assert (a < 0).any()  # fc2 before its ReLU
    grey = extract_features(extractor, torch.zeros(2, 1, 32, 32)).features  # grey images: repeated to RGB
    assert grey.shape == (2, 4096)


def test_a_file_that_is_not_torchvisions_vgg16_is_named(tmp_path: Path) -> None:
    with pytest.raises(LanternError, match=r"^--feature-net vgg16:.*none\.pth: no such file \(torchvision's "):
        load_feature_extractor(f"vgg16:{tmp_path / 'none.pth'}")
    small = {"features.0.weight": torch.zeros(64, 3, 3, 3), "features.0.bias": torch.zeros(64),
             "fc.weight": torch.zeros(10, 2048)}  # another network's file
    torch.save(small, tmp_path / "other.pth")
    with pytest.raises(LanternError, match=r"\(torchvision's VGG16\) does not match the model: missing keys: "
                                           r"features\.2\.weight, features\.2\.bias, .*; unexpected keys: fc\.weight$"):
        load_feature_extractor(f"vgg16:{tmp_path / 'other.pth'}")
    torch.save({"state_dict": small}, tmp_path / "nested.pth")
    with pytest.raises(LanternError, match=r"expected a state dict of tensors \(torchvision's vgg16-397923af\.pth\), "
                                           r"got dict"):
        load_feature_extractor(f"vgg16:{tmp_path / 'nested.pth'}")


FID_REFERENCE = Path(__file__).parent / "data" / "fid_inception_reference.npz"


def test_inception_extractor_gives_pytorch_fids_features(tmp_path: Path) -> None:
    """``inception:PATH`` is pytorch-fid's FID Inception: torchvision's layer names and shapes (the
    reference's 566 keys), TensorFlow's pooling quirks, its resize and scaling; its features for a
    seeded state dict equal those pytorch-fid's own code computed (stored), at 64 px (enlarged)
    and 320 px (shrunk without antialias)."""
    with np.load(FID_REFERENCE, allow_pickle=False) as ref:
        keys, shapes = ref["keys"].tolist(), ref["shapes"].tolist()
        small, large = torch.from_numpy(ref["small"]), torch.from_numpy(ref["large"])
    state = fid_state({k: tuple(int(n) for n in s.split(",") if n) for k, s in zip(keys, shapes, strict=True)})
    del state["Conv2d_1a_3x3.bn.num_batches_tracked"]  # older saves lack the counters: they are filled in
    torch.save(state, tmp_path / "pt_inception-2015-12-05-6726825d.pth")
    extractor = load_feature_extractor(f"inception:{tmp_path / 'pt_inception-2015-12-05-6726825d.pth'}")
    assert sorted(extractor.net.state_dict()) == keys and extractor.dim == 2048
    g = torch.Generator().manual_seed(1)
    images = torch.rand(2, 3, 64, 64, generator=g), torch.rand(1, 3, 320, 320, generator=g)  # [0, 1]
    with torch.no_grad():
        got = [extractor(x * 2 - 1) for x in images]
    torch.testing.assert_close(got[0], small, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(got[1], large, rtol=2e-4, atol=2e-4)
    assert not torch.allclose(got[0][0], got[0][1])  # power: the images' features differ
    with pytest.raises(LanternError, match=r"\(the FID Inception\) does not match the model: missing keys: "):
        torch.save({k: v for k, v in state.items() if not k.startswith("Mixed_7c")}, tmp_path / "cut.pth")
        load_feature_extractor(f"inception:{tmp_path / 'cut.pth'}")
