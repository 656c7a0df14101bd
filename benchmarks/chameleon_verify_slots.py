"""Cost of the new-line slots a static Chameleon verify makes room for, by the bound used.

A compiled or deterministic verify on Lumina-mGPT's layout carries a fixed number of new-line
slots. The first bound was the tree's leaves x ceil(T / width), which for LANTERN++'s default
tree (``naive_extend_57``, 58 nodes) gives every node a slot: 116 tokens. The bound now is the
widest depth level x ceil(depth levels / width): 16 slots, 74 tokens. This times one verify of
that tree under static shapes, eagerly, both ways (``tree=None`` gives the nodes' bound, which
equals the first one here), on ``round_cost.py``'s ``Chameleon-B`` (random weights, Lumina-mGPT's
layout at 256 x 256, 16 codes per row), in default and deterministic mode, at batch 1 and 8.

    python benchmarks/chameleon_verify_slots.py

Run it alone: two torch processes on a small machine distort each other's times.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import round_cost  # noqa: E402  (a sibling script, not a package)

from lantern.decoding.config import SamplingConfig  # noqa: E402
from lantern.decoding.trees import TreeBuffers, static_tree, tree_from_parents  # noqa: E402
from lantern.models.invariant import make_batch_invariant  # noqa: E402
from lantern.targets.chameleon import ChameleonTarget, encode_prompts  # noqa: E402


def median_verify_ms(target: ChameleonTarget, tokens: torch.Tensor, tree: TreeBuffers, bound: TreeBuffers | None,
                     ids: torch.Tensor, mask: torch.Tensor, reps: int = 10) -> float:
    times = []
    with torch.inference_mode():
        target.start(ids, mask)
        for _ in range(reps + 2):
            t0 = time.perf_counter()
            target.verify(tokens, tree.mask, tree.depth, tree=bound)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) * 1000


def main() -> int:
    (lm, layout), _, _, _ = round_cost.build("Chameleon-B", None, torch.device("cpu"), torch.float32)
    sampling = SamplingConfig(temperature=1.0, top_k=1000, cfg_scale=4.0)
    print("| mode | batch | verify ms, nodes' bound (116 tokens) | verify ms, widest level (74 tokens) | ratio |")
    print("|---|---|---|---|---|")
    for mode in ("default", "deterministic"):
        make_batch_invariant(lm, mode == "deterministic")
        for batch in (1, 8):
            tree = tree_from_parents(static_tree("naive_extend_57").parents[None].expand(batch, -1).contiguous())
            ids, mask = encode_prompts([round_cost.PROMPT] * batch, layout)
            tokens = torch.randint(0, lm.num_codes, (batch, tree.num_nodes), generator=torch.Generator().manual_seed(0))
            ms = []
            for bound in (None, tree):
                target = ChameleonTarget(lm, layout, sampling, max_tree_nodes=tree.num_nodes)
                target.static = True  # the shapes of a compiled or deterministic verify, timed eagerly
                ms.append(median_verify_ms(target, tokens, tree, bound, ids, mask))
            print(f"| {mode} | {batch} | {ms[0]:.1f} | {ms[1]:.1f} | {ms[1] / ms[0]:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
