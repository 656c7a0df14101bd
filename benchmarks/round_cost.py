"""Cost of one decoding round at real model sizes (random weights), in AR steps, and the speed-up it allows.

For each target shape (LlamaGen GPT-B / GPT-L / GPT-XL, and a Lumina-mGPT-class width: hidden 4096
with a few layers, scaled to the real 32), with the released drafter shape for it (one target-sized
EAGLE layer), each tree and batch size, the script times

* the AR round: one token per round (forward, sampling, code write, position advance), and
* a speculative round: drafter chain or tree, verify, acceptance, commits,

``Chameleon-B`` / ``Chameleon-7B`` run the Chameleon adapter itself (transformers' Chameleon layers
with q/k LayerNorms, Lumina-mGPT's layout: a new-line token after every row of codes, inserted as
shadow nodes, whose slots a compiled round always carries) at GPT-B's width with a 256 x 256 image
(16 x 16 codes) and at Lumina-mGPT-7B's with a 768 x 768 one (48 x 48; 2 and 4 layers, scaled to 32).
Their drafter is lantern's (an EAGLE layer in code space), or with ``--chameleon-drafter released``
one in the format of LANTERN's released Chameleon drafters (a full Chameleon layer over the whole
token sequence, new-lines included: ``lantern.drafters.released``), of the target's width.

Both are timed through the loop's own round (``lantern.decoding.loop.start_decode``), compiled as one region
with ``--compile`` (the default: ``auto``, i.e. CUDA graphs on a GPU), with classifier-free
guidance (2 model rows per image). Weights are random, so every round accepts exactly ``--accept``
drafts (``Acceptance.fixed_accept``: a benchmark-only override; the acceptance rule still runs).
It prints the round cost in AR steps and the projected speed-up = τ ÷ round cost, where τ is the
tokens per round measured on ``photos`` for that tree (``--tau``; a device-independent number).

    python benchmarks/round_cost.py --configs GPT-B --batch-sizes 1,4 --out benchmarks/results/round-cost-cpu
    python benchmarks/round_cost.py --configs GPT-XL --batch-sizes 1,16 --device cuda --out round-cost-gpu
    python benchmarks/round_cost.py --configs GPT-B,Chameleon-B --batch-sizes 1 --compile off --out round-cost-eager
    python benchmarks/round_cost.py --configs Chameleon-B --chameleon-drafter released --batch-sizes 1 --out rc-released

Writes OUT/round_cost.json and OUT/round_cost.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from lantern.decoding.compiling import resolve_compile
from lantern.decoding.config import SamplingConfig, TreeConfig
from lantern.decoding.drafting import TreeDrafter
from lantern.decoding.loop import Acceptance, start_decode
from lantern.decoding.rng import RowRandom
from lantern.drafters.checks import drafter_dtype
from lantern.drafters.eagle import EagleBackend
from lantern.drafters.released import ReleasedDrafterBackend
from lantern.eval.report import machine_description
from lantern.models.chameleon_drafter import ReleasedChameleonDrafter
from lantern.models.drafter import DrafterConfig, EagleDrafterModel
from lantern.models.llamagen import LlamaGen, LlamaGenConfig, llamagen_config
from lantern.targets.base import inference_dtype
from lantern.targets.chameleon import ChameleonTarget, encode_prompts
from lantern.targets.chameleon_stack import eagle_backend, init_chameleon_drafter
from lantern.targets.llamagen import LlamaGenTarget

# tau measured on photos (README demo / benchmarks/RESULTS.md): tree -> tokens per round
PHOTOS_TAU = {"chain:6": 4.84, "chain:8": 7.06, "chain:3": 2.64}
LUMINA_LAYERS = 32  # Lumina-mGPT 7B
# Chameleon-family shapes through the Chameleon adapter: transformers ChameleonConfig fields, the
# Lumina-mGPT image size, and the layer counts built (two: the cost is extrapolated to ``layers``)
CHAMELEON_SHAPES: dict[str, dict[str, Any]] = {
    "Chameleon-B": {"config": dict(hidden_size=768, intermediate_size=2048, num_attention_heads=12,
                                   num_key_value_heads=12), "image_size": 256, "built": [12], "layers": 12},
    "Chameleon-7B": {"config": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                                    num_key_value_heads=32), "image_size": 768, "built": [2, 4], "layers": 32},
}
PROMPT = list(range(100, 112))  # 12 text tokens


def shape(name: str, layers: int | None) -> tuple[LlamaGenConfig, int]:
    """(config to build, real layer count it stands for). ``Lumina-7B``: hidden 4096, 32 heads,
    8192 image codes, 1024 tokens (32 x 32), built with ``layers`` layers and scaled to 32."""
    if name == "Lumina-7B":
        cfg = LlamaGenConfig(dim=4096, n_layer=layers or 2, n_head=32, vocab_size=8192, block_size=1024,
                             num_classes=1000)
        return cfg, LUMINA_LAYERS
    cfg = llamagen_config(name, vocab_size=16384, block_size=256, num_classes=1000)
    return cfg, cfg.n_layer


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def time_rounds(model: LlamaGen | Any, drafter: torch.nn.Module | None, tree: TreeConfig | None, batch: int,
                accept: int, compile: str | None, rounds: int, repeats: int) -> tuple[float, float]:
    """(median ms per round, first-round seconds: compilation included) of ``rounds`` rounds from
    the start of an image, ``repeats`` times (a fresh decode each, the graphs reused). ``model``: a
    LlamaGen, or a ``(ChameleonLM, ImageLayout)`` pair."""
    sampling = SamplingConfig(temperature=1.0, top_k=1000, cfg_scale=4.0)
    nodes = 1 if tree is None else tree.num_nodes
    if isinstance(model, LlamaGen):
        device, cfg, mask = model.device, model.config, None
        target: Any = LlamaGenTarget(model, sampling, max_tree_nodes=nodes, compile=compile)
        cond = torch.arange(batch, device=device) % cfg.num_classes
        head, vocab, context = model.output, cfg.vocab_size, cfg.cls_token_num + cfg.block_size
    else:
        lm, layout = model
        device = lm.device
        target = ChameleonTarget(lm, layout, sampling, max_tree_nodes=nodes, compile=compile)
        cond, mask = (t.to(device) for t in encode_prompts([PROMPT] * batch, layout))
        head, vocab = lm.image_head, lm.num_codes
    samples, first = [], 0.0
    for rep in range(repeats + 1):
        tree_drafter = None
        if drafter is not None and tree is not None:
            if isinstance(model, LlamaGen):
                backend: Any = EagleBackend(drafter, head, sampling, 2, context + tree.drafter_slots, compile=compile)
            elif isinstance(drafter, ReleasedChameleonDrafter):  # as ChameleonStack.draft_backend builds it
                backend = ReleasedDrafterBackend(drafter, head, sampling, target, 2 * tree.drafter_slots)
            else:
                assert isinstance(drafter, EagleDrafterModel)
                backend = eagle_backend(drafter, head, sampling, target, layout, tree.drafter_slots, compile, None)
            tree_drafter = TreeDrafter(backend, tree, sampling, vocab)
        rng = RowRandom.from_seeds(list(range(batch)), device)
        decode = start_decode(target, cond, rng, tree_drafter, Acceptance(fixed_accept=accept), mask, compile=compile)
        active = torch.ones(batch, dtype=torch.bool, device=device)
        _sync(device)
        t0 = time.perf_counter()
        decode.round(active)  # the first round of a decode: compiles on the first repeat
        _sync(device)
        if rep == 0:
            first = time.perf_counter() - t0
            continue
        t0 = time.perf_counter()
        for _ in range(rounds):
            decode.round(active)
        _sync(device)
        samples.append((time.perf_counter() - t0) / rounds * 1000)
    return statistics.median(samples), first


def build(name: str, layers: int | None, device: torch.device, dtype: torch.dtype, chameleon_drafter: str = "lantern"
          ) -> tuple[Any, torch.nn.Module, int, int]:
    """(model for :func:`time_rounds`, its drafter, layers built, real layers) of a config name."""
    if name in CHAMELEON_SHAPES:
        from lantern.models.chameleon import ChameleonLM, layout_by_name
        from lantern.testing import tiny_chameleon, tiny_released_drafter

        spec = CHAMELEON_SHAPES[name]
        n = layers or spec["built"][0]
        hf = tiny_chameleon(num_codes=8192, logit_std=0.02, vocab_size=65536, num_hidden_layers=n,
                            max_position_embeddings=4096, initializer_range=0.02, **spec["config"])
        lm = ChameleonLM(hf).to(device, dtype).eval()
        layout = layout_by_name("lumina-mgpt", spec["image_size"])
        drafter: torch.nn.Module = (tiny_released_drafter(lm, layout.name) if chameleon_drafter == "released"
                                    else init_chameleon_drafter(lm, layout))
        drafter = drafter.to(device, drafter_dtype(dtype, device)).eval()
        return (lm, layout), drafter, n, spec["layers"]
    cfg, real_layers = shape(name, layers)
    model = LlamaGen(cfg).init_weights(seed=0, zero_output=False).to(device, dtype).eval()
    drafter = EagleDrafterModel(DrafterConfig.for_target(cfg)).to(device, drafter_dtype(dtype, device)).eval()
    return model, drafter, cfg.n_layer, real_layers


def run(name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    rows = []
    layer_points: list[int | None] = [None]
    if name == "Lumina-7B":
        layer_points = [2, 4]
    elif name in CHAMELEON_SHAPES:
        layer_points = list(CHAMELEON_SHAPES[name]["built"])
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        per_layers: dict[int, dict[str, float]] = {}
        for layers in layer_points:
            model, drafter, built, real_layers = build(name, layers, device, dtype, args.chameleon_drafter)
            ms: dict[str, float] = {}
            ms["ar"], start = time_rounds(model, None, None, batch, 0, args.compile, args.rounds, args.repeats)
            print(f"{name} ({built} layers) B={batch} ar: {ms['ar']:.2f} ms/round (first round {start:.1f} s)")
            for spec in args.trees.split(","):
                tree = TreeConfig.parse(spec)
                accept = min(args.accept, tree.max_depth)
                ms[spec], start = time_rounds(model, drafter, tree, batch, accept, args.compile, args.rounds,
                                              args.repeats)
                print(f"  {spec}: {ms[spec]:.2f} ms/round = {ms[spec] / ms['ar']:.2f} AR steps "
                      f"(first round {start:.1f} s)")
            per_layers[built] = ms
            del model, drafter
        if len(per_layers) == 2:  # linear in layers: per-layer slope, extrapolated to the real count
            (l0, a), (l1, b) = sorted(per_layers.items())
            ms = {k: a[k] + (b[k] - a[k]) / (l1 - l0) * (real_layers - l0) for k in a}
        for spec in args.trees.split(","):
            cost = ms[spec] / ms["ar"]
            tau = PHOTOS_TAU.get(spec, args.tau)
            drafter_kind = args.chameleon_drafter if name in CHAMELEON_SHAPES else "lantern"
            rows.append({"config": name, "layers": real_layers, "drafter": drafter_kind, "batch": batch, "tree": spec,
                         "ar_ms": ms["ar"],
                         "round_ms": ms[spec], "round_ar_steps": cost, "tau": tau, "projected_speedup": tau / cost,
                         "measured_layers": sorted(per_layers)})
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| config | batch | tree | AR round ms | spec round ms | round (AR steps) | τ (photos) | projected |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['batch']} | {r['tree']} | {r['ar_ms']:.2f} | {r['round_ms']:.2f} | "
                     f"{r['round_ar_steps']:.2f} | {r['tau']:.2f} | {r['projected_speedup']:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="GPT-B",
                    help="GPT-B, GPT-L, GPT-XL, Lumina-7B, Chameleon-B, Chameleon-7B (comma-separated)")
    ap.add_argument("--trees", default="chain:6,chain:8", help="tree specs (chain:N, static:NAME, dynamic)")
    ap.add_argument("--tau", type=float, default=4.8, help="tokens per round for trees not in PHOTOS_TAU")
    ap.add_argument("--accept", type=int, default=4, help="drafts accepted per round (fixed)")
    ap.add_argument("--chameleon-drafter", choices=["lantern", "released"], default="lantern",
                    help="the Chameleon shapes' drafter: lantern's, or LANTERN's released format")
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--compile", default="auto", help="off, auto, or a torch.compile mode")
    ap.add_argument("--rounds", type=int, default=20, help="rounds per timed repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="round-cost")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = inference_dtype(args.dtype, device)
    args.compile = resolve_compile(args.compile, device)
    rows = [r for name in args.configs.split(",") for r in run(name.strip(), args, device, dtype)]
    table = markdown(rows)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": dt.date.today().isoformat(), "machine": machine_description(), "device": str(device),
            "dtype": str(dtype).replace("torch.", ""), "compile": args.compile, "accept": args.accept,
            "threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows}
    (out / "round_cost.json").write_text(json.dumps(meta, indent=2) + "\n")
    (out / "round_cost.md").write_text(table + "\n")
    print(f"wrote {out / 'round_cost.json'} and {out / 'round_cost.md'}")


if __name__ == "__main__":
    main()
