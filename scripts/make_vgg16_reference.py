"""tests/data/vgg16_reference.npz: torchvision's own VGG16 (``models.vgg16()``, the network LANTERN's
``eval_prec_recall.py`` runs) on the seeded state dict of tests/test_metrics.py's ``_vgg16_state``:
``classifier[:4](features(x).view(-1, 7 * 7 * 512))`` for the test's two images, preprocessed as
lantern's extractor does (resized to 224, ImageNet-normalised).

torchvision does not import beside lantern's torch, so this runs in a venv of its own, once:

    python3 -m venv /tmp/tvenv && /tmp/tvenv/bin/pip install torch==2.14.1 torchvision==0.29.1 numpy
    /tmp/tvenv/bin/python scripts/make_vgg16_reference.py

(2026-12-01: torch 2.14.1, torchvision 0.29.1.)
"""
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import torchvision

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "vgg16_reference.npz"
sys.path.insert(0, str(ROOT / "tests"))
from reference_recipes import vgg16_state  # noqa: E402  (the tests' recipe: plain torch)

net = torchvision.models.vgg16()
net.load_state_dict(vgg16_state())
net.eval()
g = torch.Generator().manual_seed(1)
images = [torch.rand(1, 3, 224, 224, generator=g) * 2 - 1, torch.rand(1, 3, 64, 64, generator=g) * 2 - 1]
out = []
with torch.no_grad():
    for im in images:
        x = (F.interpolate(im, size=(224, 224), mode="bilinear", align_corners=False, antialias=True) + 1) / 2
        x = (x - torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)) / torch.tensor([0.229, 0.224, 0.225]).view(
            1, 3, 1, 1)
        out.append(net.classifier[:4](net.features(x).view(-1, 7 * 7 * 512)).numpy().astype(np.float32))
np.savez_compressed(OUT, at224=out[0], at64=out[1], torch=np.array(torch.__version__),
                    torchvision=np.array(torchvision.__version__))
print(OUT, [o.shape for o in out], float(out[0].std()))
