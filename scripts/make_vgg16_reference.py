"""tests/data/vgg16_reference.npz: torchvision's own VGG16 (``models.vgg16()``, the network LANTERN's
``eval_prec_recall.py`` runs) on the seeded state dict of tests/test_metrics.py's ``_vgg16_state``:
``classifier[:4](features(x).view(-1, 7 * 7 * 512))`` for the test's two images, preprocessed as
lantern's extractor does (resized to 224, ImageNet-normalised).

torchvision does not import beside lantern's torch, so this runs in a venv of its own, once:

    python3 -m venv /tmp/tvenv && /tmp/tvenv/bin/pip install torch==2.14.1 torchvision==0.29.1 numpy
    /tmp/tvenv/bin/python scripts/make_vgg16_reference.py

(2026-12-01: torch 2.14.1, torchvision 0.29.1.)
"""
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import torchvision

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "vgg16_reference.npz"
CONVS = {0: (3, 64), 2: (64, 64), 5: (64, 128), 7: (128, 128), 10: (128, 256), 12: (256, 256), 14: (256, 256),
         17: (256, 512), 19: (512, 512), 21: (512, 512), 24: (512, 512), 26: (512, 512), 28: (512, 512)}


def vgg16_state(seed: int = 0) -> dict[str, torch.Tensor]:  # tests/test_metrics.py's _vgg16_state
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i, (cin, cout) in CONVS.items():
        state[f"features.{i}.weight"] = torch.randn(cout, cin, 3, 3, generator=g) * (2 / (9 * cin)) ** 0.5
        state[f"features.{i}.bias"] = torch.randn(cout, generator=g) * 0.01
    for i, (fin, fout) in {0: (25088, 4096), 3: (4096, 4096), 6: (4096, 1000)}.items():
        state[f"classifier.{i}.weight"] = torch.randn(fout, fin, generator=g) * (2 / fin) ** 0.5
        state[f"classifier.{i}.bias"] = torch.randn(fout, generator=g) * 0.01
    return state


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
