"""The feature net lantern trains per preset (metrics' embedding): its config and model."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from lantern.errors import check
from lantern.io import CONFIG_NAME, config_of, load_model_folder, load_state_dict_strict, save_model_folder

MODEL_TYPE = "lantern-feature-net"


@dataclass(frozen=True)
class FeatureNetConfig:
    in_channels: int = 3
    image_size: int = 64  # the size it was trained on; metrics refuse other sizes
    num_classes: int = 11
    widths: tuple[int, ...] = (32, 64, 128, 128)  # stem width, then one stride-2 stage per entry
    blocks_per_stage: int = 0  # extra stride-1 convs after each stride-2 conv
    feature_dim: int = 128
    norm_groups: int = 8
    class_names: tuple[str, ...] = ()  # optional, for reports

    def __post_init__(self) -> None:
        check(self.in_channels in (1, 3), f"feature net: in_channels must be 1 or 3, got {self.in_channels!r}")
        for name in ("image_size", "num_classes", "feature_dim", "norm_groups"):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= 1, f"feature net: {name} must be an integer >= 1, got {value!r}")
        check(isinstance(self.blocks_per_stage, int) and self.blocks_per_stage >= 0,
              f"feature net: blocks_per_stage must be an integer >= 0, got {self.blocks_per_stage!r}")
        check(len(self.widths) >= 1 and all(isinstance(w, int) and w >= 1 for w in self.widths),
              f"feature net: widths must be positive integers, got {self.widths!r}")
        bad = [w for w in self.widths if w % self.norm_groups]
        check(not bad, f"feature net: every width must be divisible by norm_groups={self.norm_groups}, got {bad}")
        check(not self.class_names or len(self.class_names) == self.num_classes,
              f"feature net: {len(self.class_names)} class names for {self.num_classes} classes")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["widths"], d["class_names"] = list(self.widths), list(self.class_names)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FeatureNetConfig:
        """Build from :meth:`to_dict` output; unknown keys are an error (typo or another model)."""
        check(isinstance(d, Mapping), f"feature net config must be a mapping, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        check(not unknown, f"unknown feature net config keys: {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        d = dict(d)
        for key in ("widths", "class_names"):
            if key in d:
                d[key] = tuple(d[key])
        return cls(**d)


def _conv(cin: int, cout: int, stride: int, groups: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=stride, padding=1), nn.GroupNorm(groups, cout), nn.SiLU())


class FeatureNet(nn.Module):
    """CNN classifier; :meth:`features` is the embedding used by :mod:`lantern.eval.metrics`."""

    def __init__(self, config: FeatureNetConfig) -> None:
        super().__init__()
        self.config = config
        g, w = config.norm_groups, config.widths
        layers: list[nn.Module] = [_conv(config.in_channels, w[0], 1, g)]
        for cin, cout in zip(w[:-1], w[1:], strict=True):
            layers.append(_conv(cin, cout, 2, g))
            layers += [_conv(cout, cout, 1, g) for _ in range(config.blocks_per_stage)]
        self.body = nn.Sequential(*layers)
        self.project = nn.Linear(w[-1], config.feature_dim)
        self.head = nn.Linear(config.feature_dim, config.num_classes)

    def features(self, images: Tensor) -> Tensor:
        """``[N, C, S, S]`` in ``[-1, 1]`` -> embedding ``[N, feature_dim]``."""
        check(images.dim() == 4 and images.shape[1] == self.config.in_channels,
              f"feature net: expected images [N, {self.config.in_channels}, H, W], got {tuple(images.shape)}")
        return self.project(self.body(images).mean(dim=(2, 3)))

    def classify_features(self, features: Tensor) -> Tensor:
        """Embedding ``[N, feature_dim]`` -> class logits ``[N, num_classes]``."""
        return self.head(features)

    def forward(self, images: Tensor) -> Tensor:
        return self.classify_features(self.features(images))

    def save_pretrained(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``config.json`` (``model_type = lantern-feature-net``) + ``model.safetensors`` (fp32)."""
        config = {"model_type": MODEL_TYPE, **self.config.to_dict()}
        return save_model_folder(directory, config, {k: v.float() for k, v in self.state_dict().items()})

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str]) -> FeatureNet:
        """Load a folder written by :meth:`save_pretrained` (keys and shapes checked strictly)."""
        raw, state_dict = load_model_folder(directory)
        check(isinstance(raw, dict), f"model config in {directory} must be a JSON object")
        model_type = raw.pop("model_type", None)
        check(model_type == MODEL_TYPE, f"{directory} holds model_type {model_type!r}, not a {MODEL_TYPE!r}")
        with config_of(Path(directory) / CONFIG_NAME):
            config = FeatureNetConfig.from_dict(raw)
        model = cls(config)
        load_state_dict_strict(model, state_dict, f"model folder {directory}")
        return model.eval()
