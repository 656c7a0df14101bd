"""``lantern bench`` across the ranks of a ``torchrun`` / ``accelerate launch`` job.

Every decode of the benchmark (quality images, the second AR seed, the tau curves, the sweep,
the timed images) is shared out by :func:`lantern.distributed.shard`, each image keeping its own
seed, and the codes and per-image forward counts are gathered in request order on every rank, so
all ranks follow the same steps and the quality numbers (computed once, on rank 0) are those of a
single-process run.

Speed under several ranks: each rank times its shard of the speed images the way one process
does (methods interleaved chunk by chunk, ``repeats`` passes). A method's wall-clock per repeat
is the **slowest rank's** time for its shard: the ranks decode in parallel, so that is when the
whole set of speed images is done; ``seconds_per_image`` is then that wall-clock over all speed
images (the job's time per image, not one image's latency) and the speed-up is against AR timed
the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lantern.decoding.config import SamplingConfig
from lantern.distributed import DistContext, all_gather, check_enough_items, shard
from lantern.errors import LanternError
from lantern.methods import MethodConfig
from lantern.parts import ModelParts
from lantern.run import RunResult, run_conditions
from lantern.targets.base import Conditions, Stack


def check_bench_ranks(config: Any, ctx: DistContext) -> None:
    """Before anything loads: enough quality images for every rank, and no per-process auto trees or
    windows (each rank would time itself, and could choose another one)."""
    if not ctx.enabled:
        return
    check_enough_items(config.num_images, ctx, "--num-images images")
    if any(m.tree == "auto" for m in config.methods):
        raise LanternError("--tree auto times this process alone; under several processes pass the trees to use "
                           "(e.g. the ones a single-process run chose)")
    auto = [m.name for m in config.methods if m.window == "auto"]
    if auto:
        raise LanternError(f"window=auto ({auto[0]}) times this process alone; under several processes pass the "
                           "window to use (e.g. the one a single-process run chose)")


def no_metrics(codes: torch.Tensor, labels: list[int]) -> dict[str, Any]:
    """The quality function of ranks other than 0: rank 0 alone computes the metrics."""
    return {}


class RankRunner:
    """:class:`lantern.eval.bench.BenchRunner` for one rank: decode this rank's shard, gather all shards."""

    def __init__(self, ctx: DistContext, parts: ModelParts | None = None) -> None:
        self.ctx, self.parts = ctx, parts  # parts: read once for every run (None: the stack's own)

    def loaded(self, stack: Stack) -> ModelParts:
        if self.parts is None:
            self.parts = ModelParts(stack)
        return self.parts

    def _mine(self, n: int) -> list[int]:
        return list(shard(n, self.ctx.rank, self.ctx.world_size))  # a contiguous block of the request

    def generate(self, stack: Stack, conditions: Conditions, seed: int, sampling: SamplingConfig,
                 method: MethodConfig, batch_size: int) -> RunResult:
        mine = self._mine(len(conditions))
        part = None
        if mine:
            r = run_conditions(stack, conditions.rows(mine[0], mine[-1] + 1), seed, sampling, method, batch_size,
                               parts=self.loaded(stack), indices=mine)
            part = _payload(r)
        return _merge(all_gather(part, self.ctx), method)

    def time(self, stack: Stack, sampling: SamplingConfig, resolved: Mapping[str, MethodConfig],
             conditions: Conditions, seed: int, batch_size: int = 1, repeats: int = 1, progress: bool = False,
             compile: str | None = None, startup: dict[str, float] | None = None,
             chunk_walls: dict[str, list[list[float]]] | None = None,
             ) -> tuple[dict[str, RunResult], dict[str, list[float]]]:
        from lantern.eval.bench import time_methods

        mine = self._mine(len(conditions))
        part = None
        if mine:
            own: dict[str, float] = {}
            chunks: dict[str, list[list[float]]] = {}
            runs, walls = time_methods(stack, sampling, resolved, conditions.rows(mine[0], mine[-1] + 1), seed,
                                       batch_size, repeats, progress, compile, own, indices=mine,
                                       parts=self.loaded(stack), chunk_walls=chunks)
            part = ({name: _payload(r) for name, r in runs.items()}, walls, own, chunks)
        parts = [p for p in all_gather(part, self.ctx) if p is not None]
        merged = {name: _merge([p[0][name] for p in parts], cfg) for name, cfg in resolved.items()}
        # The ranks decode in parallel: a pass is over when its slowest rank is.
        walls = {name: [max(p[1][name][rep] for p in parts) for rep in range(repeats)] for name in resolved}
        if startup is not None:
            startup.update({name: max(p[2].get(name, 0.0) for p in parts) for name in resolved})
        if chunk_walls is not None:  # every rank's chunks, in rank order (each timed beside AR on its rank)
            chunk_walls.update({name: [[s for p in parts for s in p[3][name][rep]] for rep in range(repeats)]
                                for name in resolved})
        return merged, walls


def _payload(r: RunResult) -> dict[str, Any]:
    """What a rank sends of a run: codes, per-image forwards, drafter forwards, seconds, the method."""
    return {"codes": r.codes.cpu(), "forwards": torch.cat([o.stats.target_forwards for o in r.output_stats]).cpu(),
            "drafter_forwards": sum(o.stats.drafter_forwards for o in r.output_stats),
            "seconds": r.wall_seconds, "method": r.method}


def _merge(parts: list[dict[str, Any] | None], method: MethodConfig) -> RunResult:
    """The ranks' runs as one run in request order (rank 0's shard first); its wall-clock is the
    slowest rank's; its method as rank 0 resolved it (e.g. k capped at the table's K_max)."""
    given = [p for p in parts if p is not None]
    return RunResult.from_counts(torch.cat([p["codes"] for p in given]), torch.cat([p["forwards"] for p in given]),
                                 sum(p["drafter_forwards"] for p in given), max(p["seconds"] for p in given),
                                 given[0]["method"] if given else method)
