"""tests/data/hps_reference.npz: OpenCLIP's own CLIP (open_clip 3.3.0's ``CLIP``, the model HPS v2
fine-tunes) at the tiny shapes of tests/conftest.py's ``tiny_clip(hidden_act="gelu")``, seeded: its
state dict, and the HPS score of each image against its prompt as ``hpsv2.score`` computes it
(``encode_image`` and ``encode_text``, normalised, their dot product) on pixels already
preprocessed as lantern's scorer does and the token ids of tiny_clip's tokenizer.

open_clip needs torchvision, which does not import beside lantern's torch, so this runs in a venv of
its own, once:

    python3 -m venv /tmp/tvenv && /tmp/tvenv/bin/pip install torch==2.14.1 torchvision==0.29.1 numpy
    /tmp/tvenv/bin/pip install --no-deps open_clip_torch==3.3.0 && /tmp/tvenv/bin/pip install regex ftfy
    /tmp/tvenv/bin/python scripts/make_hps_reference.py

(2026-12-01: torch 2.14.1, torchvision 0.29.1, open_clip 3.3.0.)
"""
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "hps_reference.npz"
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI's, as lantern.eval.metrics.CLIP_MEAN / CLIP_STD
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# tiny_clip's words: "[BOS]" 0, "[PAD]" 1, "[EOS]" 2, "[UNK]" 3, "a" 4, "kite" 5, "over" 6, "beach" 7, "two" 8,
# "dogs" 9, "red" 10, "car" 11, "cat" 12; prompts as its tokenizer pads them (padding=True, "[PAD]")
PROMPTS = ["a kite over a beach", "two dogs", "a red car", "a cat"]
IDS = [[4, 5, 6, 4, 7], [8, 9, 1, 1, 1], [4, 10, 11, 1, 1], [4, 12, 1, 1, 1]]

torch.manual_seed(0)
model = CLIP(embed_dim=8, vision_cfg=CLIPVisionCfg(layers=1, width=16, head_width=8, mlp_ratio=2.0, patch_size=16,
                                                    image_size=32),
             text_cfg=CLIPTextCfg(context_length=77, vocab_size=13, width=16, heads=2, layers=1, mlp_ratio=2.0))
with torch.no_grad():  # open_clip initialises some weights at zero or one: random values exercise every part
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and name != "logit_scale":
            tensor.copy_(torch.randn(tensor.shape) * (0.3 if tensor.dim() > 1 else 0.1) + (1.0 if "ln" in name and
                                                                                          name.endswith("weight")
                                                                                          else 0.0))
model.eval()
g = torch.Generator().manual_seed(1)
images = torch.rand(4, 3, 24, 24, generator=g) * 2 - 1  # lantern's images, [-1, 1]
pixels = F.interpolate(images, size=(32, 32), mode="bicubic", align_corners=False, antialias=True)
pixels = ((pixels.clamp(-1, 1) + 1) / 2 - torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)) / torch.tensor(CLIP_STD).view(
    1, 3, 1, 1)
with torch.no_grad():
    image = model.encode_image(pixels, normalize=True)
    text = model.encode_text(torch.tensor([row + [1] * (77 - len(row)) for row in IDS]), normalize=True)
    scores = (image * text).sum(-1)
state = {k: v.numpy() for k, v in model.state_dict().items()}
np.savez_compressed(OUT, images=images.numpy(), scores=scores.numpy(), prompts=np.array(PROMPTS),
                    **{f"state/{k}": v for k, v in state.items()})
print(OUT, scores.tolist(), sorted(state)[:4], len(state))
