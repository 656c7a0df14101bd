"""Whole-image decode time through the Chameleon adapter, default and deterministic mode.

``round_cost.py`` times rounds from the start of an image; this times whole images, prefill
included, where the prompt width, the cache's length and the new-line slots weigh as they do in
use. The model is ``round_cost.py``'s ``Chameleon-B`` (transformers' Chameleon layers at GPT-B's
width, random weights, Lumina-mGPT's layout at 256 x 256: 16 x 16 codes and a new-line token after
each row), with its 12-token prompt. For each mode (default; deterministic, the batch-invariant
matmuls of ``lantern.models.invariant``), method (``ar``; ``sjd-coupled``, which needs no drafter)
and batch size, it decodes one whole image per row, eagerly, twice, and keeps the faster.

    python benchmarks/chameleon_decode_cost.py --out q/decode-cost.json
    python benchmarks/chameleon_decode_cost.py --only "deterministic sjd-coupled B=8" --out q/one.json

Run it alone: two torch processes on a small machine distort each other's times.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import round_cost  # noqa: E402  (a sibling script, not a package)

from lantern.decoding.config import SamplingConfig  # noqa: E402
from lantern.decoding.loop import generate  # noqa: E402
from lantern.decoding.sampling import make_generators  # noqa: E402
from lantern.methods import MethodConfig  # noqa: E402
from lantern.models.invariant import make_batch_invariant  # noqa: E402
from lantern.targets.chameleon import encode_prompts  # noqa: E402
from lantern.testing import chameleon_parts  # noqa: E402

METHODS = (("ar", {}), ("sjd-coupled", {"sjd_window": 16}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--only", default=None, help='one row, e.g. "deterministic ar B=8"')
    p.add_argument("--out", required=True, help="JSON file: row -> seconds per image batch")
    args = p.parse_args(argv)
    (lm, layout), _, _, _ = round_cost.build("Chameleon-B", None, torch.device("cpu"), torch.float32)
    sampling = SamplingConfig(temperature=1.0, top_k=1000, cfg_scale=4.0)
    results: dict[str, float] = {}
    for mode in ("default", "deterministic"):
        make_batch_invariant(lm, mode == "deterministic")
        for name, settings in METHODS:
            method = MethodConfig.resolve(name, **settings)
            for batch in (int(b) for b in args.batch_sizes.split(",")):
                key = f"{mode} {name} B={batch}"
                if args.only not in (None, key):
                    continue
                ids, mask = encode_prompts([round_cost.PROMPT] * batch, layout)
                times = []
                for _ in range(2):
                    target, drafter = chameleon_parts(lm, layout, sampling, method, None, lm.image_head)
                    t0 = time.perf_counter()
                    with torch.inference_mode():
                        out = generate(target, ids, generators=make_generators(list(range(batch))), drafter=drafter,
                                       cond_mask=mask)
                    times.append(time.perf_counter() - t0)
                results[key] = min(times)
                print(f"{key}: {min(times):.2f} s ({out.stats.steps} rounds)", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
