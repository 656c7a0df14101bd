"""Seeded weights that tests and the one-off reference scripts (``scripts/make_*_reference.py``,
run in a venv with torchvision) build alike: plain torch, no lantern, so both sides import it."""

from __future__ import annotations

import math

import torch

# torchvision's VGG16 layout: features.{i} convolutions, a 2x2 max pool after those in POOLED
VGG16_CONVS = {0: (3, 64), 2: (64, 64), 5: (64, 128), 7: (128, 128), 10: (128, 256), 12: (256, 256),
               14: (256, 256), 17: (256, 512), 19: (512, 512), 21: (512, 512), 24: (512, 512), 26: (512, 512),
               28: (512, 512)}
VGG16_POOLED = (2, 7, 14, 21, 28)


def vgg16_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """A state dict with the keys and shapes of torchvision's ``vgg16-397923af.pth``, He-scaled so
    activations stay of order one through the 13 convolutions."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i, (cin, cout) in VGG16_CONVS.items():
        state[f"features.{i}.weight"] = torch.randn(cout, cin, 3, 3, generator=g) * (2 / (9 * cin)) ** 0.5
        state[f"features.{i}.bias"] = torch.randn(cout, generator=g) * 0.01
    for i, (fin, fout) in {0: (25088, 4096), 3: (4096, 4096), 6: (4096, 1000)}.items():
        state[f"classifier.{i}.weight"] = torch.randn(fout, fin, generator=g) * (2 / fin) ** 0.5
        state[f"classifier.{i}.bias"] = torch.randn(fout, generator=g) * 0.01
    return state


def fid_state(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """A seeded FID Inception state dict of ``shapes`` (uniform draws in key order, batch-norm
    statistics kept sane). tests/data/fid_inception_reference.npz holds pytorch-fid's own network's
    features for it (scripts/make_fid_reference.py: pytorch-fid 0.3.0 on torchvision 0.29.1 and
    torch 2.14.1, which cannot share lantern's venv)."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for key in sorted(shapes):
        shape = shapes[key]
        if key.endswith("num_batches_tracked"):
            out[key] = torch.tensor(0)
            continue
        x = torch.rand(shape, generator=g)
        if key.endswith("running_var"):
            out[key] = 0.5 + x
        elif key.endswith("running_mean") or key.endswith("bn.bias"):
            out[key] = (x - 0.5) * 0.2
        elif key.endswith("bn.weight"):
            out[key] = 0.8 + 0.4 * x
        elif key.endswith("conv.weight"):
            out[key] = (x - 0.5) * 2 * math.sqrt(6 / math.prod(shape[1:]))
        else:
            out[key] = (x - 0.5) * 0.02
    return out
