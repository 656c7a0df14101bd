"""How much of the ideal speculative speed-up does the decoding loop keep? (CPU, tiny random target)

With an oracle drafter (the target itself, ``lantern.drafters.oracle``) every draft on the target's own
path is accepted, so "mean accepted tokens per target forward" is the ideal speed-up: what SD
would give if drafting were free and a tree verify cost as much as a one-token AR step. The
measured wall-clock ratio falls short of it for three reasons, printed separately:

* drafting: the oracle runs *uncached full forwards* of the target (deliberately expensive). Its
  time is recorded inside ``OracleBackend`` and subtracted for the "drafting-excluded" ratio,
  which is what a free drafter would give; tree building in ``TreeDrafter`` stays in.
* verification: one forward over a T-node tree (x2 rows with CFG) costs more than a one-token
  step, especially on CPU where compute, not weight loading, dominates.
* the loop's own overhead: acceptance, cache commit, bookkeeping.

Runs are interleaved (AR, SD, AR, SD, ...) after one warm-up of each, so machine-load drift hits
both sides alike.

    .venv/bin/python benchmarks/oracle_speedup.py  # ~4 min on 2 busy CPU cores
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lantern.decoding.config import SamplingConfig, TreeConfig
from lantern.decoding.loop import generate
from lantern.decoding.sampling import make_generators
from lantern.decoding.trees import TreeBuffers
from lantern.drafters.oracle import OracleBackend, make_oracle_drafter
from lantern.models.llamagen import LlamaGen
from lantern.targets.llamagen import LlamaGenTarget
from lantern.testing import tiny_llamagen


class TimedTarget(LlamaGenTarget):
    """A target that records the wall time of its prefill and verify forwards."""

    seconds = 0.0

    def start(self, cond: Tensor, cond_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        t0 = time.perf_counter()
        out = super().start(cond, cond_mask)
        self.seconds += time.perf_counter() - t0
        return out

    def verify(self, tokens: Tensor, tree_mask: Tensor, depth: Tensor, tree: TreeBuffers | None = None
               ) -> tuple[Tensor, Tensor]:
        t0 = time.perf_counter()
        out = super().verify(tokens, tree_mask, depth, tree)
        self.seconds += time.perf_counter() - t0
        return out


@dataclass
class Timing:
    """Measurements of one mode over the repeats."""

    wall: list[float] = field(default_factory=list)
    drafting: list[float] = field(default_factory=list)  # inside the oracle backend
    target: list[float] = field(default_factory=list)  # target prefill + verify forwards
    forwards: float = 0.0  # mean target forwards per row
    mean_accepted: float = 1.0

    def med(self, name: str) -> float:
        return statistics.median(getattr(self, name))


def run_once(
    model: LlamaGen, labels: Tensor, sampling: SamplingConfig, tree: TreeConfig | None, args: argparse.Namespace
) -> tuple[float, float, float, float, float]:
    """(wall s, drafting s, target-forward s, target forwards per row, mean accepted)."""
    gens = None if sampling.greedy else make_generators([args.seed * 1000 + i for i in range(len(labels))])
    drafter = None
    nodes = 1
    if tree is not None:
        drafter = make_oracle_drafter(model, labels, sampling, tree, logit_scale=args.logit_scale)
        nodes = drafter.num_nodes
    target = TimedTarget(model, sampling, max_tree_nodes=nodes)
    t0 = time.perf_counter()
    out = generate(target, labels, generators=gens, drafter=drafter)
    wall = time.perf_counter() - t0
    drafting = drafter.backend.seconds if drafter is not None and isinstance(drafter.backend, OracleBackend) else 0.0
    forwards = float(out.stats.target_forwards.float().mean())
    return wall, drafting, target.seconds, forwards, out.stats.mean_accepted


def measure(args: argparse.Namespace) -> dict[tuple[str, str], Timing]:
    model = tiny_llamagen(
        seed=args.seed,
        logit_std=args.logit_std,
        dim=args.dim,
        n_layer=args.layers,
        n_head=args.heads,
        vocab_size=args.vocab,
        block_size=args.tokens_grid**2,
        num_classes=10,
    )
    labels = torch.arange(args.batch) % model.config.num_classes
    tree = TreeConfig.parse(args.tree)
    samplings = {
        "greedy": SamplingConfig(temperature=0, cfg_scale=args.cfg_scale),
        "sampling": SamplingConfig(temperature=1.0, top_k=args.top_k, cfg_scale=args.cfg_scale),
    }
    modes = [(s, m) for s in samplings for m in ("AR", "SD")]
    timings = {mode: Timing() for mode in modes}
    for repeat in range(args.repeats + 1):  # repeat 0 is the warm-up, not recorded
        for s_name, m_name in modes:
            wall, drafting, target_s, fwd, acc = run_once(
                model, labels, samplings[s_name], tree if m_name == "SD" else None, args
            )
            print(
                f"  [{'warm-up' if repeat == 0 else f'repeat {repeat}'}] {s_name} {m_name}: {wall:.2f} s",
                file=sys.stderr,
            )
            if repeat == 0:
                continue
            t = timings[(s_name, m_name)]
            t.wall.append(wall)
            t.drafting.append(drafting)
            t.target.append(target_s)
            t.forwards, t.mean_accepted = fwd, acc
    return timings


def report(args: argparse.Namespace, timings: dict[tuple[str, str], Timing]) -> None:
    n = args.tokens_grid**2
    print(
        f"tiny random LlamaGen on CPU: dim {args.dim}, {args.layers} layers, {args.heads} heads, vocab {args.vocab}, "
        f"{n} tokens ({args.tokens_grid}x{args.tokens_grid}), batch {args.batch}, cfg {args.cfg_scale}, "
        f"top-k {args.top_k} (sampling), tree {args.tree}, oracle logit_scale {args.logit_scale}, "
        f"torch threads {torch.get_num_threads()}, median of {args.repeats} interleaved repeats after a warm-up"
    )
    print(
        "drafting = time inside the oracle backend (uncached full target forwards); "
        "loop overhead = wall - drafting - target forwards\n"
    )
    header = (
        "| mode | method | target fwd/row | tokens/fwd (ideal) | wall s | drafting s | target fwd s | "
        "loop overhead s | ratio raw | ratio drafting-excluded |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for s_name in ("greedy", "sampling"):
        ar, sd = timings[(s_name, "AR")], timings[(s_name, "SD")]
        for m_name, t in (("AR", ar), ("SD", sd)):
            wall, drafting, target_s = t.med("wall"), t.med("drafting"), t.med("target")
            overhead = wall - drafting - target_s
            raw = ar.med("wall") / wall
            excl = ar.med("wall") / (wall - drafting)
            print(
                f"| {s_name} | {m_name} | {t.forwards:.1f} | {t.mean_accepted:.2f} | {wall:.3f} | {drafting:.3f} | "
                f"{target_s:.3f} | {overhead:.3f} | {raw:.2f}x | {excl:.2f}x |"
            )
    for s_name in ("greedy", "sampling"):
        print("\n" + summary(s_name, timings[(s_name, "AR")], timings[(s_name, "SD")]))


def summary(name: str, ar: Timing, sd: Timing) -> str:
    """One sentence: ideal vs drafting-excluded ratio, and where the difference goes."""
    sd_no_draft = sd.med("wall") - sd.med("drafting")
    ar_step = ar.med("target") / ar.forwards  # s per target forward, prefill included
    sd_step = sd.med("target") / sd.forwards
    sd_overhead = (sd_no_draft - sd.med("target")) / sd_no_draft
    ar_overhead = (ar.med("wall") - ar.med("target")) / ar.med("wall")
    return (
        f"{name}: ideal {sd.mean_accepted:.2f}x; drafting-excluded {ar.med('wall') / sd_no_draft:.2f}x. "
        f"A verify forward over the tree costs {sd_step / ar_step:.2f}x a one-token AR step "
        f"({1000 * sd_step:.1f} vs {1000 * ar_step:.1f} ms, prefill included); loop overhead is "
        f"{100 * sd_overhead:.0f}% of the drafting-excluded SD time ({100 * ar_overhead:.0f}% for AR)."
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--tokens-grid", type=int, default=16, help="image side in tokens (16 -> 256 tokens)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tree", default="static:mc_sim_7b_63", help="chain:N, static:NAME or dynamic")
    p.add_argument("--cfg-scale", type=float, default=4.0)
    p.add_argument("--top-k", type=int, default=100, help="top-k of the sampling runs")
    p.add_argument("--logit-scale", type=float, default=1.0, help="oracle logits x this (1 = q equals p)")
    p.add_argument("--logit-std", type=float, default=0.5, help="init scale of the random output layer")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch default)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    with torch.no_grad():
        report(args, measure(args))


if __name__ == "__main__":
    main()
