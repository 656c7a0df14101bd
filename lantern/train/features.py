"""A small CNN classifier trained by lantern: the feature network of :mod:`lantern.eval.metrics`.

Published FID/KID use an Inception network trained on ImageNet; those weights cannot be downloaded
here, and Inception features are a poor fit for 32x32 digits anyway. Instead lantern trains a
small classifier on the real training images of a data set (digits: which digit; photos: which
photo a crop comes from) and uses its penultimate embedding as the feature space for FID, KID and
precision/recall, and its predictions for class accuracy of generated images. Numbers measured
in this space rank image sets within one data set; they are **not** comparable with published
Inception FIDs.

Images are the data sets' float tensors ``[N, C, S, S]`` in ``[-1, 1]`` (``pixel / 127.5 - 1``),
fed to the network unchanged.

Architecture: a 3x3 conv stem at full resolution, then one stride-2 3x3 conv per further width
(GroupNorm + SiLU after every conv, so a feature never depends on the other images of a batch),
global average pooling, a linear projection to ``feature_dim`` (the embedding) and a linear
classifier head on that embedding.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lantern.errors import check
from lantern.models.features import FeatureNet, FeatureNetConfig
from lantern.train.loop import BatchPart, LoopConfig, RunOptions, TrainResult, TrainTask, step_generator, train

# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FeatureRecipe:
    max_shift: int = 2  # random translation of up to this many pixels (edge pixels repeated)
    flip: bool = False  # random left-right flips: right for photos, wrong for digits
    zoom: float = 1.0  # random zoom-in up to this factor (crop a part, resize back); 1 = off
    blur: float = 0.0  # probability of a Gaussian blur, sigma uniform in [0.5, blur_sigma] px
    blur_sigma: float = 2.0
    label_smoothing: float = 0.0
    eval_batch_size: int = 256

    def __post_init__(self) -> None:
        check(isinstance(self.max_shift, int) and self.max_shift >= 0,
              f"--max-shift must be an integer >= 0, got {self.max_shift!r}")
        check(1.0 <= self.zoom <= 4.0, f"--zoom must be in [1, 4], got {self.zoom!r}")
        check(0.0 <= self.blur <= 1.0, f"--blur must be a probability in [0, 1], got {self.blur!r}")
        check(0.5 <= self.blur_sigma <= 8.0, f"--blur-sigma must be in [0.5, 8], got {self.blur_sigma!r}")
        check(0.0 <= self.label_smoothing < 1.0, f"--label-smoothing must be in [0, 1), got {self.label_smoothing!r}")
        check(self.eval_batch_size >= 1, f"eval_batch_size must be >= 1, got {self.eval_batch_size!r}")


def _gaussian_blur(image: Tensor, sigma: float) -> Tensor:
    """Separable Gaussian blur of one ``[C, H, W]`` image (edge pixels repeated)."""
    r = max(1, round(2 * sigma))
    x = torch.arange(-r, r + 1, dtype=image.dtype)
    k = torch.exp(-0.5 * (x / sigma) ** 2)
    k = k / k.sum()
    c = image.shape[0]
    out = F.pad(image[None], (r, r, r, r), mode="replicate")
    out = F.conv2d(out, k.view(1, 1, 1, -1).expand(c, 1, 1, -1), groups=c)
    return F.conv2d(out, k.view(1, 1, -1, 1).expand(c, 1, -1, 1), groups=c)[0]


def _zoom(image: Tensor, factor: float, fx: float, fy: float) -> Tensor:
    """Crop a ``1/factor`` part of ``image`` at relative position (fx, fy); resize back (bilinear)."""
    _, h, w = image.shape
    ch, cw = max(2, round(h / factor)), max(2, round(w / factor))
    top, left = round(fy * (h - ch)), round(fx * (w - cw))
    part = image[None, :, top : top + ch, left : left + cw]
    return F.interpolate(part, size=(h, w), mode="bilinear", align_corners=False)[0]


def augment(images: Tensor, recipe: FeatureRecipe, generator: torch.Generator, part: BatchPart | None = None) -> Tensor:
    """Random shifts, flips, zooms and blurs of a batch, drawn from ``generator`` only (exact resume).
    ``images`` are ``part`` of a global batch: the draws are made for the global batch and sliced."""
    _, _, h, w = images.shape
    part = part or BatchPart.whole(images.shape[0])
    b, s = part.size, recipe.max_shift
    # Fixed-size draws whatever the recipe, so the stream does not depend on which options are on.
    offsets = part.take(torch.randint(0, 2 * s + 1, (b, 2), generator=generator))
    flips = part.take(torch.rand(b, generator=generator)) < 0.5
    zooms = 1.0 + (recipe.zoom - 1.0) * part.take(torch.rand(b, generator=generator))
    where = part.take(torch.rand(b, 2, generator=generator))
    blurs = part.take(torch.rand(b, generator=generator)) < recipe.blur
    sigmas = 0.5 + (recipe.blur_sigma - 0.5) * part.take(torch.rand(b, generator=generator))
    out = []
    for i in range(images.shape[0]):
        image = images[i]
        if recipe.zoom > 1.0:
            image = _zoom(image, float(zooms[i]), float(where[i, 0]), float(where[i, 1]))
        if blurs[i]:
            image = _gaussian_blur(image, float(sigmas[i]))
        if s:
            y, x = offsets[i].tolist()
            image = F.pad(image[None], (s, s, s, s), mode="replicate")[0, :, y : y + h, x : x + w]
        if recipe.flip and flips[i]:
            image = image.flip(-1)
        out.append(image)
    return torch.stack(out)


class FeatureTask(TrainTask):
    kind = "features"
    model: FeatureNet

    def __init__(self, model: FeatureNet, data: Any, eval_data: Any, recipe: FeatureRecipe, seed: int,
                 extra_eval: Mapping[str, Any] | None = None) -> None:
        cfg = model.config
        self.extra_eval = dict(extra_eval or {})
        for what, ds in (("training", data), ("held-out", eval_data), *self.extra_eval.items()):
            check(ds.channels == cfg.in_channels,
                  f"the feature net takes {cfg.in_channels}-channel images, the {what} set has {ds.channels}")
            check(ds.image_size == cfg.image_size,
                  f"the feature net takes {cfg.image_size}px images, the {what} set has {ds.image_size}px")
            check(ds.num_classes <= cfg.num_classes,
                  f"the {what} set has {ds.num_classes} classes, the feature net only {cfg.num_classes}")
        self.model, self.data, self.eval_data, self.recipe, self.seed = model, data, eval_data, recipe, seed

    def num_examples(self) -> int:
        return len(self.data)

    def make_batch(self, indices: Tensor, step: int, device: torch.device,
                   part: BatchPart | None = None) -> tuple[Tensor, Tensor]:
        from lantern.data import batch_images

        images, labels = batch_images(self.data, indices.tolist())
        images = augment(images, self.recipe, step_generator(self.seed, step), part)
        return images.to(device), labels.to(device)

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor], step: int) -> tuple[Tensor, dict[str, float]]:
        images, labels = batch
        logits = model(images).float()
        loss = F.cross_entropy(logits, labels, label_smoothing=self.recipe.label_smoothing)
        return loss, {"acc": float((logits.argmax(-1) == labels).float().mean())}

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        net = self._unwrap(model).eval()
        out: dict[str, float] = {}
        for name, data in (("test", self.eval_data), *self.extra_eval.items()):
            accuracy, loss = self._accuracy(net, data)
            out.update({f"{name}_accuracy": accuracy, f"{name}_loss": loss, f"{name}_images": float(len(data))})
        out["chance_accuracy"] = 1.0 / self.eval_data.num_classes
        return out

    def _accuracy(self, net: FeatureNet, data: Any) -> tuple[float, float]:
        from lantern.data import batch_images

        device = net.head.weight.device
        n, bs = len(data), self.recipe.eval_batch_size
        correct, nll = 0, 0.0
        for lo in range(0, n, bs):
            images, labels = batch_images(data, list(range(lo, min(lo + bs, n))))
            logits = net(images.to(device)).float()
            labels = labels.to(device)
            correct += int((logits.argmax(-1) == labels).sum())
            nll += float(F.cross_entropy(logits, labels, reduction="sum"))
        return correct / n, nll / n

    def _unwrap(self, model: nn.Module) -> FeatureNet:
        return model.module if hasattr(model, "module") else model  # type: ignore[return-value]

    def save(self, model: nn.Module, out: Path) -> None:
        self._unwrap(model).save_pretrained(out)

    def config_dict(self) -> dict[str, Any]:
        return {"data": self.data.describe(), "eval_data": self.eval_data.describe(),
                "extra_eval": {k: v.describe() for k, v in self.extra_eval.items()},
                "model": self.model.config.to_dict(), "recipe": asdict(self.recipe)}

    def data_fingerprint(self) -> str:
        return self.data.fingerprint()


def feature_config_for(data: Any, **overrides: Any) -> FeatureNetConfig:
    """A config matching ``data`` (channels, size, classes, class names) with ``overrides``."""
    return FeatureNetConfig(in_channels=data.channels, image_size=data.image_size, num_classes=data.num_classes,
                            class_names=tuple(data.class_names), **overrides)


def train_features(
    config: FeatureNetConfig,
    data: Any,
    eval_data: Any,
    recipe: FeatureRecipe,
    loop: LoopConfig,
    options: RunOptions,
    *,
    extra_eval: Mapping[str, Any] | None = None,
) -> TrainResult:
    """Train a :class:`FeatureNet` into ``options.out``; final metrics hold ``test_accuracy`` (held-out split)
    and ``NAME_accuracy`` for every ``extra_eval`` data set."""
    torch.manual_seed(loop.seed)  # the initial weights are a function of the seed
    model = FeatureNet(config)
    task = FeatureTask(model, data, eval_data, recipe, loop.seed, extra_eval)
    return train(task, loop, options)
