"""tests/data/fid_inception_reference.npz: pytorch-fid's own FID Inception on the seeded state dict
of tests/test_metrics.py's recipe (``_fid_state``), and its 2048-d features for the recipe's images.

torchvision does not import beside lantern's torch, so this runs in a venv of its own, once:

    python3 -m venv /tmp/tvenv && /tmp/tvenv/bin/pip install torch==2.14.1 torchvision==0.29.1 numpy
    /tmp/tvenv/bin/pip install --no-deps pytorch-fid==0.3.0
    /tmp/tvenv/bin/python scripts/make_fid_reference.py

(2026-12-01: torch 2.14.1, torchvision 0.29.1, pytorch-fid 0.3.0.) No weights are downloaded: the
network's own loader is handed the recipe's state dict.
"""
import sys
from pathlib import Path

import numpy as np
import torch
from pytorch_fid import inception as pfid

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "fid_inception_reference.npz"
sys.path.insert(0, str(ROOT / "tests"))
from reference_recipes import fid_state  # noqa: E402  (the tests' recipe: plain torch)


def fid_images():  # the test's images, in [0, 1]
    g = torch.Generator().manual_seed(1)
    return torch.rand(2, 3, 64, 64, generator=g), torch.rand(1, 3, 320, 320, generator=g)


inc = pfid._inception_v3(num_classes=1008, aux_logits=False, weights=None)
inc.Mixed_5b = pfid.FIDInceptionA(192, pool_features=32)
inc.Mixed_5c = pfid.FIDInceptionA(256, pool_features=64)
inc.Mixed_5d = pfid.FIDInceptionA(288, pool_features=64)
inc.Mixed_6b = pfid.FIDInceptionC(768, channels_7x7=128)
inc.Mixed_6c = pfid.FIDInceptionC(768, channels_7x7=160)
inc.Mixed_6d = pfid.FIDInceptionC(768, channels_7x7=160)
inc.Mixed_6e = pfid.FIDInceptionC(768, channels_7x7=192)
inc.Mixed_7b = pfid.FIDInceptionE_1(1280)
inc.Mixed_7c = pfid.FIDInceptionE_2(2048)
shapes = {k: tuple(v.shape) for k, v in inc.state_dict().items()}
state = fid_state(shapes)
pfid.load_state_dict_from_url = lambda *a, **k: state
model = pfid.InceptionV3([3]).eval()
small, large = fid_images()
with torch.no_grad():
    f_small = model(small)[0].squeeze(3).squeeze(2)
    f_large = model(large)[0].squeeze(3).squeeze(2)
print(len(shapes), "keys;", f_small.shape, f_large.shape, float(f_small.std()), float(f_large.mean()))
np.savez_compressed(OUT, small=f_small.numpy().astype(np.float32),
         large=f_large.numpy().astype(np.float32), keys=np.array(sorted(shapes)),
         shapes=np.array([",".join(map(str, shapes[k])) for k in sorted(shapes)]),
         torch=np.array(torch.__version__), torchvision=np.array(__import__("torchvision").__version__))
