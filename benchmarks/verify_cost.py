"""Verify-cost curve of real-size LlamaGen shapes (random weights): what tree size a device affords.

For each config (GPT-B / GPT-L / GPT-XL ...) the script times one target forward over n tree
tokens after a half-image prefix, with CFG (2 model rows per image), and divides by the time of a
one-token step: the curve `lantern profile` measures for a stack, but for the published model
sizes, whose weights cannot be downloaded here. Weights are random: the cost of a forward does not
depend on their values.

    python benchmarks/verify_cost.py --configs GPT-B,GPT-L --dtype bfloat16 --out benchmarks/results/verify-cost-cpu

Writes OUT/verify_cost.json and OUT/verify_cost.png (ratio vs tokens, one line per config).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import time
from pathlib import Path

import torch

from lantern.decoding.config import SamplingConfig
from lantern.decoding.trees import tree_from_parents
from lantern.eval.report import machine_description
from lantern.models.llamagen import LlamaGen, llamagen_config
from lantern.targets.base import inference_dtype
from lantern.targets.llamagen import LlamaGenTarget

POINTS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def curve(name: str, device: torch.device, dtype: torch.dtype, batch: int, repeats: int,
          points: tuple[int, ...] = POINTS, compile: str | None = None) -> dict[str, object]:
    """Median ms of a verify over n tree tokens for each n in ``points`` (``compile``: the
    compiled target step, one graph per n, compiled during the untimed first pass)."""
    cfg = llamagen_config(name, vocab_size=16384, block_size=256, num_classes=1000)
    model = LlamaGen(cfg).init_weights(seed=0, zero_output=False).to(device, dtype).eval()
    target = LlamaGenTarget(model, SamplingConfig(cfg_scale=4.0), max_tree_nodes=max(points), compile=compile)
    target.start(torch.arange(batch, device=device) % cfg.num_classes)
    assert target.cache is not None
    target.cache.lengths += cfg.block_size // 2  # a half-finished image: a realistic prefix
    samples: dict[int, list[float]] = {n: [] for n in points}
    t_first = time.perf_counter()
    for rep in range(repeats + 1):  # the first pass warms up; points interleave within a pass
        if rep == 1:
            warmup_s = time.perf_counter() - t_first
        for n in points:
            tree = tree_from_parents(torch.arange(-1, n - 1, device=device)[None].expand(batch, -1).contiguous())
            tokens = torch.zeros(batch, n, dtype=torch.long, device=device)
            _sync(device)
            t0 = time.perf_counter()
            target.verify(tokens, tree.mask, tree.depth)
            _sync(device)
            if rep > 0:
                samples[n].append(time.perf_counter() - t0)
    ms = [statistics.median(samples[n]) * 1000 for n in points]
    params = sum(p.numel() for p in model.parameters())
    return {"config": name, "params_m": round(params / 1e6, 1), "tokens": list(points), "ms": ms,
            "ratio": [m / ms[0] for m in ms], "compile": compile, "warmup_seconds": round(warmup_s, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="GPT-B,GPT-L,GPT-XL")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-size", type=int, default=1, help="images (model rows = 2x with CFG)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--points", default=",".join(map(str, POINTS)), help="tree sizes (tokens incl. the root)")
    ap.add_argument("--compile", default=None,
                    help="time the compiled target step: auto (CUDA graphs on a GPU), default, reduce-overhead ...")
    ap.add_argument("--out", default="verify-cost")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = inference_dtype(args.dtype, device)
    points = tuple(int(x) for x in args.points.split(","))
    assert points[0] == 1, "--points must start at 1 (the one-token step every ratio divides by)"
    results = []
    for name in args.configs.split(","):
        r = curve(name.strip(), device, dtype, args.batch_size, args.repeats, points, args.compile)
        results.append(r)
        shown = "  ".join(f"{n}:{ratio:.2f}x" for n, ratio in zip(r["tokens"], r["ratio"], strict=True))
        print(f"{r['config']} ({r['params_m']}M): {shown}  (1 token {r['ms'][0]:.2f} ms; "
              f"first pass {r['warmup_seconds']} s)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": dt.date.today().isoformat(), "machine": machine_description(), "device": str(device),
            "dtype": str(dtype).replace("torch.", ""), "batch_size": args.batch_size, "cfg_rows": 2 * args.batch_size,
            "threads": torch.get_num_threads(), "torch": torch.__version__, "prefix": "half image (128 tokens)",
            "compile": args.compile}
    (out / "verify_cost.json").write_text(json.dumps({**meta, "curves": results}, indent=2) + "\n")
    os.environ.setdefault("MPLCONFIGDIR", "/tmp/lantern-mpl")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.4), dpi=120)
    for r in results:
        ax.plot(r["tokens"], r["ratio"], "o-", label=f"{r['config']} ({r['params_m']}M)")
    ax.set_xlabel("tokens verified in one forward")
    ax.set_ylabel("cost / one-token step")
    ax.set_title(f"verify cost, {meta['device']} {meta['dtype']}, batch {args.batch_size} (CFG)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "verify_cost.png")
    print(f"wrote {out}/verify_cost.json and verify_cost.png")


if __name__ == "__main__":
    main()
