"""From a stack, a resolved method and conditions to codes: the one run path of the CLI, the API,
the demo and the bench (batches, per-image seeds, the drafter and acceptance loaded once)."""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from lantern.decoding import compiling
from lantern.decoding.cache import CachePool
from lantern.decoding.compiling import resolve_compile
from lantern.decoding.config import SamplingConfig, check_pjd_fits, check_window_fits
from lantern.decoding.drafting import TreeDrafter
from lantern.decoding.jacobi import JacobiDrafter
from lantern.decoding.loop import (
    Acceptance,
    CodeHead,
    Decode,
    Drafter,
    GenerationOutput,
    SpecStats,
    Target,
    generate,
    start_decode,
)
from lantern.decoding.pac import PACDrafter
from lantern.decoding.pjd import GridJacobiDrafter, grid_chains
from lantern.decoding.rng import RowRandom
from lantern.decoding.sampling import make_generators, validate_sampling_for_vocab
from lantern.errors import check
from lantern.methods import MethodConfig
from lantern.parts import ModelParts, parts_of
from lantern.targets.base import Conditions, ConditionSet, Stack
from lantern.targets.llamagen_stack import ModelStack
from lantern.targets.text import Captions
from lantern.validate import check_batch_memory


def image_seed(seed: int, index: int) -> int:
    """Seed of image ``index`` in a run: independent of batch size, so batching never changes
    an image."""
    return (seed * 1_000_003 + index) % (2**63)


@dataclass
class RunResult:
    codes: Tensor  # [num_images, N]
    output_stats: list[GenerationOutput]
    wall_seconds: float
    method: MethodConfig  # as resolved for the run (e.g. lantern k capped at the table's K_max)
    # of wall_seconds, the first calls of compiled regions: compiling (or reading inductor's cache), not decoding
    compile_seconds: float = 0.0

    @classmethod
    def from_counts(cls, codes: Tensor, target_forwards: Tensor, drafter_forwards: int, wall_seconds: float,
                    method: MethodConfig, compile_seconds: float = 0.0) -> RunResult:
        """A run put together from its images' codes [N, T] and forward counts [N] (the shards of
        a job decoded by several processes, or by several runs of a resumed job)."""
        stats = SpecStats(target_forwards=target_forwards, generated_tokens=codes.shape[1],
                          drafter_forwards=drafter_forwards)
        return cls(codes=codes, output_stats=[GenerationOutput(codes, stats)], wall_seconds=wall_seconds,
                   method=method, compile_seconds=compile_seconds)

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
            "compile_seconds": self.compile_seconds,
        }


def run_generation(
    stack: Stack,
    labels: list[int],
    seed: int,
    sampling: SamplingConfig,
    method: MethodConfig,
    batch_size: int = 8,
    progress: bool = False,
    parts: ModelParts | None = None,
    compile: str | None = None,
    indices: Sequence[int] | None = None,
    prepared: PreparedMethod | None = None,
) -> RunResult:
    """Generate one image per entry of ``labels``, ``batch_size`` rows at a time (see
    :func:`run_conditions` for ``parts``, ``prepared`` and ``indices``)."""
    return run_conditions(stack, stack.encode(labels), seed, sampling, method, batch_size, progress, parts, compile,
                          prepared, indices)


def run_generation_t2i(stack: ModelStack, captions: Captions, seed: int, sampling: SamplingConfig,
                       method: MethodConfig, batch_size: int = 8, progress: bool = False,
                       parts: ModelParts | None = None, compile: str | None = None,
                       indices: Sequence[int] | None = None, prepared: PreparedMethod | None = None) -> RunResult:
    """Generate one image per caption row (``lantern.targets.text.T5Encoder.encode``), ``batch_size`` rows
    at a time, seeded exactly as for labels."""
    return run_conditions(stack, stack.from_captions(captions), seed, sampling, method, batch_size, progress,
                          parts, compile, prepared, indices)


def run_conditions(
    stack: Stack,
    conditions: ConditionSet,  # stack.encode's (or ModelParts.encode's packed) conditions of every image
    seed: int,
    sampling: SamplingConfig,
    method: MethodConfig,
    batch_size: int = 8,
    progress: bool = False,
    parts: ModelParts | None = None,
    compile: str | None = None,
    prepared: PreparedMethod | None = None,
    indices: Sequence[int] | None = None,
) -> RunResult:
    """The one run path of every stack: ``batch_size`` rows at a time, image ``i`` seeded with
    ``image_seed(seed, indices[i])`` (so batching never changes an image). ``indices``: each row's
    place in the whole request (default 0, 1, ...): a shard of a request (``lantern.distributed``)
    gives the same images as the whole request. ``prepared``: the method already prepared
    (:func:`prepare_method`, ``Pipeline.prepare``); else it is prepared from ``parts`` (the loaded
    drafter and proximity table; default: the stack's own, read now)."""
    order = list(range(len(conditions))) if indices is None else list(indices)
    check(len(order) == len(conditions), f"{len(order)} image indices for {len(conditions)} conditions")
    run = prepare_run(stack, sampling, method, batch_size, conditions, parts, compile, prepared)
    outputs: list[GenerationOutput] = []
    start, compiling_before = time.perf_counter(), compiling.first_call_seconds
    for lo in range(0, len(conditions), batch_size):
        chunk = conditions.rows(lo, lo + batch_size)
        outputs.append(generate_rows(run, chunk, seed, order[lo : lo + len(chunk)], progress))
    wall = time.perf_counter() - start
    codes = torch.cat([o.codes for o in outputs])
    return RunResult(codes=codes, output_stats=outputs, wall_seconds=wall, method=run.method,
                     compile_seconds=compiling.first_call_seconds - compiling_before)


def prepare_run(
    stack: Stack,
    sampling: SamplingConfig,
    method: MethodConfig,
    batch_size: int,
    conditions: ConditionSet,
    parts: ModelParts | None = None,
    compile: str | None = None,
    prepared: PreparedMethod | None = None,
) -> PreparedMethod:
    """The checks of a run (sampling, batch size, the cache memory of ``batch_size`` of these
    conditions) and its method, loaded once (or ``prepared``)."""
    validate_sampling_for_vocab(sampling, stack.vocab_size)
    check(batch_size >= 1, f"--batch-size must be >= 1, got {batch_size}")
    run = prepared or prepare_method(stack, method, sampling, parts, compile)
    batch = max(1, min(batch_size, len(conditions)))
    nbytes = stack.cache_bytes(sampling, verify_nodes(run.method, stack), conditions, batch)
    check_batch_memory(nbytes, batch, stack.device)  # before the cache is allocated
    return run


def generate_rows(parts: PreparedMethod, conditions: Conditions, seed: int, indices: Sequence[int],
                  progress: bool = False) -> GenerationOutput:
    """One batch: row ``r`` of ``conditions`` is image ``indices[r]`` of the request, with that image's seed."""
    gens = make_generators([image_seed(seed, i) for i in indices], parts.stack.device)
    return parts.generate(conditions.cond, gens, progress, cond_mask=conditions.mask,
                          guidance=conditions.guidance_rows())


@dataclass
class PreparedMethod:
    """Everything loaded once per run: the drafter weights and the acceptance rule of a stack."""

    stack: Stack
    method: MethodConfig
    sampling: SamplingConfig
    drafter: torch.nn.Module | None
    acceptance: Acceptance
    compile: str | None = None  # a lantern.decoding.compiling mode; None = eager
    _head_copy: CodeHead | None = field(default=None, repr=False)
    # Caches reused image after image (fixed addresses for CUDA graphs, no allocation per image).
    _caches: CachePool = field(default_factory=CachePool, repr=False)

    def drafter_head(self, lm_head: CodeHead) -> CodeHead:
        """The target's lm_head in the drafter's precision (a copy, made once, when they differ)."""
        assert self.drafter is not None
        dtype = next(self.drafter.parameters()).dtype
        if lm_head.weight.dtype == dtype:
            return lm_head
        if self._head_copy is None:
            self._head_copy = copy.deepcopy(lm_head).to(dtype)
        return self._head_copy

    def parts(self, head: CodeHead | None = None) -> tuple[Target, Drafter | GridJacobiDrafter | None]:
        """A fresh target adapter and drafter for one batch (they hold per-batch state); ``head``:
        the drafter's lm_head (default: the target's, in the drafter's precision)."""
        tree, stack = self.method.tree, self.stack
        if self.method.pjd is not None:  # PJD: a chain per open image row, R of them per round
            grid = GridJacobiDrafter(self.method.pjd, self.sampling, stack.vocab_size, stack.num_tokens,
                                     width=stack.grid_width)
            return stack.make_target(self.sampling, grid.num_nodes, compile=self.compile,
                                     cache_pool=self._caches), grid
        target = stack.make_target(self.sampling, tree.num_nodes, compile=self.compile, cache_pool=self._caches)
        if self.method.pac is not None:  # SJD-PAC: SJD's chain plus proactive drafting's subtree
            assert self.method.jacobi is not None
            return target, PACDrafter(self.method.jacobi, self.method.pac, self.sampling, stack.vocab_size,
                                      stack.num_tokens, stack.grid_width)
        if self.method.jacobi is not None:
            return target, JacobiDrafter(self.method.jacobi, self.sampling, stack.vocab_size, stack.num_tokens,
                                         stack.grid_width)
        if self.drafter is None:
            return target, None
        head = head if head is not None else self.drafter_head(target.lm_head)
        backend = stack.draft_backend(self.drafter, head, self.sampling, target, tree.drafter_slots,
                                      compile=self.compile, cache_pool=self._caches)
        return target, TreeDrafter(backend, tree, self.sampling, stack.vocab_size)

    def start(self, conditions: Conditions, seeds: Sequence[int], *, eager: bool = False,
              caches: CachePool | None = None) -> Decode:
        """Prefill a batch and return the decode in progress (what a server drives round by round):
        row ``r`` of ``conditions`` draws from the stream of image seed ``seeds[r]``, as in
        :func:`generate_rows`. ``eager``: build it uncompiled (rows prefilled to join a running batch
        with ``Decode.take_rows``: no compilation for their group size); ``caches``: its own cache pool
        (so it does not reset the caches of a batch in progress). The decode's tensors, its codes
        too, are the pool's (``lantern.decoding.resident``): the next decode of the same method and
        batch size in that pool reuses them, so clone what you keep."""
        parts = replace(self, compile=None) if eager else self
        if caches is not None:
            parts = replace(parts, _caches=caches)
        target, drafter = parts.parts()
        device = self.stack.device
        rng = None if self.sampling.greedy else RowRandom.from_generators(make_generators(list(seeds), device), device)
        with torch.inference_mode():
            return start_decode(target, conditions.cond, rng, drafter, self.acceptance, conditions.mask, parts.compile,
                                parts._caches, conditions.guidance_rows())

    def generate(
        self,
        cond: Tensor,
        generators: list[torch.Generator],
        progress: bool = False,
        cond_mask: Tensor | None = None,
        guidance: tuple[Tensor, Tensor] | None = None,
    ) -> GenerationOutput:
        """cond: one batch of ``Stack.encode``'s conditions (labels [B], captions [B, cls, C] or
        prompt ids [B, L]); cond_mask: their mask (captions, prompts); guidance: their own
        unconditional rows (``Conditions.guidance_rows``: Emu3's negative prompts)."""
        target, drafter = self.parts()
        return generate(target, cond, generators=generators, drafter=drafter, acceptance=self.acceptance,
                        cond_mask=cond_mask, progress=progress, compile=self.compile, caches=self._caches,
                        guidance=guidance)


def verify_nodes(method: MethodConfig, stack: Stack) -> int:
    """Tokens per verify forward, root included: what a target's cache leaves room for."""
    if method.pjd is None:
        return method.tree.num_nodes
    width = stack.grid_width  # PJD verifies R chains of a window each
    return method.tree.num_nodes * grid_chains(method.pjd.window, method.pjd.context, width,
                                               stack.num_tokens // width)


def check_group_fits(method: MethodConfig, vocab_size: int) -> None:
    """GSD's group is a window of probability ranks: past the vocabulary it holds every token
    already, and a number past int64 would overflow in the rank comparison."""
    relaxation = method.relaxation
    if relaxation is None or relaxation.mode != "group":
        return
    check(relaxation.k <= vocab_size,
          f"--gsd-group must be at most the vocabulary size ({vocab_size} codes), got {relaxation.k}",
          field="gsd_group")


def prepare_method(
    stack: Stack,
    method: MethodConfig,
    sampling: SamplingConfig,
    parts: ModelParts | None = None,
    compile: str | None = None,
) -> PreparedMethod:
    """The method ready to run on ``stack``: its drafter and proximity table taken from ``parts``
    (loaded there on first need, so preparing many methods or trees reads each once; default: the
    stack's own, read now), checked against the target.

    compile: None / "off" (eager), "auto" or a torch.compile mode (``lantern.decoding.compiling``): the
    target step, the drafter steps and the acceptance run compiled, AR included.
    """
    from lantern.drafters.checks import check_tree_fits, warn_if_the_tail_is_outrun

    parts = parts_of(stack, parts)
    check_group_fits(method, stack.vocab_size)
    drafter = None
    if method.jacobi is not None:  # SJD: the target drafts for itself, no weights to load
        check_window_fits(method.jacobi, stack.num_tokens)
    elif method.pjd is not None:  # PJD likewise, on the image grid
        check_pjd_fits(method.pjd, stack.num_tokens // stack.grid_width, stack.grid_width)
    elif method.tree.kind != "none":
        check_tree_fits(method.tree, stack.num_tokens)
        warn_if_the_tail_is_outrun(method.tree, stack.network())
        drafter = parts.drafter(method.method)
    acceptance, resolved = load_acceptance(method, parts)
    return PreparedMethod(stack, resolved, sampling, drafter, acceptance, resolve_compile(compile, stack.device))


def load_acceptance(method: MethodConfig, parts: ModelParts) -> tuple[Acceptance, MethodConfig]:
    """The method's acceptance rule, with the proximity table a relaxed rule needs (``parts``'s,
    validated against the codebook when it was read), and the method with k as actually used: a
    default k larger than the table's K_max is capped, an explicit one is an error. The released
    code's residuals (``residual`` official / official-lumina) also remove the (k+1)-th neighbour,
    so they take k+1 columns of the table (and a default k is capped at K_max - 1)."""
    relaxation = method.relaxation
    if relaxation is None or relaxation.is_exact or not relaxation.uses_table:
        return Acceptance(relaxation, subsequence=method.subsequence), method
    table = parts.table(method.method)
    extra = 0 if relaxation.residual == "paper" else 1
    if relaxation.k + extra > table.k_max and not method.k_explicit:
        relaxation = replace(relaxation, k=table.k_max - extra)
    table.check_k(relaxation.k)
    # (the table is named by its K_max, not its path: the server answers this to clients)
    check(relaxation.k + extra <= table.k_max,
          f"--lantern-residual {relaxation.residual} removes k+1 = {relaxation.k + 1} neighbours per rejection, "
          f"but the proximity table holds K_max = {table.k_max}: use --lantern-k {table.k_max - 1} or less",
          field="lantern_residual")
    neighbours = table.neighbours_for(relaxation.k + extra).to(parts.stack.device)
    return Acceptance(relaxation, neighbours, method.subsequence), replace(method, relaxation=relaxation)
