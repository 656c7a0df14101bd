"""From a model stack and a method name to images: the glue the CLI, the demo and the bench share.

A *method* is a configuration of the one loop (``lantern.generate``):

=============  ====================  ======================================
method         tree                  acceptance
=============  ====================  ======================================
``ar``         none                  plain sampling
``sd``         dynamic (EAGLE-2)     exact
``sd-static``  naive_extend_57       exact
``lantern``    dynamic (EAGLE-2)     relaxed, absolute delta (LANTERN)
``lantern++``  naive_extend_57       relaxed, relative lambda (LANTERN++)
=============  ====================  ======================================
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from lantern.config import SamplingConfig, TreeConfig
from lantern.errors import check
from lantern.generate import GenerationOutput, generate
from lantern.sampling import make_generators, validate_sampling_for_vocab
from lantern.stack import ModelStack
from lantern.target import LlamaGenTarget

METHODS = ("ar", "sd", "sd-static", "lantern", "lantern++")


def image_seed(seed: int, index: int) -> int:
    """Seed of image ``index`` in a run: independent of batch size, so batching never changes
    an image."""
    return (seed * 1_000_003 + index) % (2**63)


@dataclass(frozen=True)
class MethodConfig:
    method: str = "ar"
    tree: TreeConfig = field(default_factory=TreeConfig)

    def __post_init__(self) -> None:
        check(self.method in METHODS, f"--method must be one of {', '.join(METHODS)}, got {self.method!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RunResult:
    codes: Tensor  # [num_images, N]
    output_stats: list[GenerationOutput]
    wall_seconds: float

    def stats_dict(self) -> dict[str, Any]:
        forwards = torch.cat([o.stats.target_forwards for o in self.output_stats])
        n_tokens = self.codes.shape[1]
        per_image = n_tokens / forwards.float()
        return {
            "num_images": int(self.codes.shape[0]),
            "generated_tokens": int(self.codes.numel()),
            "tokens_per_image": n_tokens,
            "target_forwards": int(forwards.sum()),
            "mean_accepted": float(per_image.mean()),
            "drafter_forwards": sum(o.stats.drafter_forwards for o in self.output_stats),
            "wall_seconds": self.wall_seconds,
        }


def run_generation(
    stack: ModelStack,
    labels: list[int],
    seed: int,
    sampling: SamplingConfig,
    method: MethodConfig,
    batch_size: int = 8,
    progress: bool = False,
) -> RunResult:
    """Generate one image per entry of ``labels``, ``batch_size`` rows at a time."""
    validate_sampling_for_vocab(sampling, stack.target.config.vocab_size)
    check(batch_size >= 1, f"--batch-size must be >= 1, got {batch_size}")
    device = stack.target.device
    label_t = torch.tensor(labels, dtype=torch.long, device=device)
    stack.target.check_labels(label_t)
    outputs: list[GenerationOutput] = []
    start = time.perf_counter()
    for lo in range(0, len(labels), batch_size):
        chunk = label_t[lo : lo + batch_size]
        gens = make_generators([image_seed(seed, i) for i in range(lo, lo + len(chunk))], device)
        target = LlamaGenTarget(stack.target, sampling, max_tree_nodes=_max_tree_nodes(method.tree))
        outputs.append(generate(target, chunk, generators=gens, progress=progress))
    wall = time.perf_counter() - start
    codes = torch.cat([o.codes for o in outputs])
    return RunResult(codes=codes, output_stats=outputs, wall_seconds=wall)


def _max_tree_nodes(tree: TreeConfig) -> int:
    if tree.kind == "none":
        return 1
    if tree.kind == "dynamic":
        return tree.total_tokens + 1
    from lantern.trees import resolve_tree_choices

    name = tree.name if tree.kind == "static" else f"chain:{tree.depth}"
    return len(resolve_tree_choices(name)) + 1
