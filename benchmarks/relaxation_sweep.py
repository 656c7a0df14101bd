"""Mean accepted length vs the relaxation bound, on a tiny random target (CPU, fixed seed).

The drafter is a temperature-perturbed copy of the target (an oracle backend whose guided logits
are scaled by ``--logit-scale``), so q differs from p the way a trained drafter's does. The
proximity table comes from a random codebook, so neighbours carry no semantic meaning here: the
script shows the mechanism (acceptance rising with delta and lambda, exact at delta = 0 /
lambda = 1), not image quality.

    .venv/bin/python benchmarks/relaxation_sweep.py
"""

from __future__ import annotations

import argparse

import torch

from lantern.decoding.config import RelaxationConfig, SamplingConfig, TreeConfig
from lantern.decoding.loop import Acceptance, generate
from lantern.decoding.sampling import make_generators
from lantern.drafters.oracle import make_oracle_drafter
from lantern.targets.llamagen import LlamaGenTarget
from lantern.targets.proximity import build_proximity
from lantern.testing import tiny_llamagen


def run(
    args: argparse.Namespace, tree: TreeConfig, relaxation: RelaxationConfig | None, neighbours: torch.Tensor
) -> float:
    model = tiny_llamagen(seed=args.seed, logit_std=args.logit_std)
    sampling = SamplingConfig(temperature=1.0, top_k=args.top_k, cfg_scale=args.cfg_scale)
    labels = torch.arange(args.batch) % model.config.num_classes
    drafter = make_oracle_drafter(model, labels, sampling, tree, logit_scale=args.logit_scale)
    target = LlamaGenTarget(model, sampling, max_tree_nodes=drafter.num_nodes)
    acceptance = Acceptance(relaxation, neighbours[:, : relaxation.k] if relaxation else None)
    gens = make_generators([args.seed * 1000 + i for i in range(args.batch)])
    out = generate(target, labels, generators=gens, drafter=drafter, acceptance=acceptance)
    return out.stats.mean_accepted


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--k", type=int, default=64, help="neighbours per token")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--cfg-scale", type=float, default=1.0)
    p.add_argument("--logit-scale", type=float, default=0.5, help="drafter = target logits x this (q != p)")
    p.add_argument("--logit-std", type=float, default=0.25, help="init scale of the tiny target's output layer")
    args = p.parse_args()

    vocab = 256
    codebook = torch.randn(vocab, 8, generator=torch.Generator().manual_seed(args.seed))
    neighbours = build_proximity(codebook, k_max=args.k).neighbours_for(args.k)

    dynamic = TreeConfig(kind="dynamic", depth=4, top_k=10, total_tokens=58)
    static = TreeConfig.parse("static:naive_extend_57")
    print(
        f"tiny random target (V={vocab}, 64 tokens), drafter = target logits x {args.logit_scale}, k = {args.k}, "
        f"batch {args.batch}, seed {args.seed}"
    )
    print("\nLANTERN (dynamic tree, absolute bound)")
    print("| delta | mean accepted |\n|---|---|")
    for delta in (0.0, 0.05, 0.1, 0.2, 0.4):
        relax = RelaxationConfig(k=args.k, delta=delta, mode="absolute")
        print(f"| {delta:.2f} | {run(args, dynamic, relax, neighbours):.3f} |")
    print("\nLANTERN++ (static naive_extend_57, relative bound)")
    print("| lambda | mean accepted |\n|---|---|")
    for lam in (1.0, 2.0, 5.0, 10.0, 20.0):
        relax = RelaxationConfig(k=args.k, lam=lam, mode="relative")
        print(f"| {lam:.0f} | {run(args, static, relax, neighbours):.3f} |")


if __name__ == "__main__":
    main()
