"""From a model stack and a method name to images: the glue the CLI, the demo and the bench share.

A *method* is a configuration of the one loop (``lantern.generate``):

=================  ====================  ==========================================
method             tree                  acceptance
=================  ====================  ==========================================
``ar``             none                  plain sampling
``sd``             dynamic (EAGLE-2)     exact
``sd-static``      naive_extend_57       exact
``lantern``        dynamic (EAGLE-2)     relaxed, absolute delta (LANTERN)
``lantern++``      naive_extend_57       relaxed, relative lambda (LANTERN++)
``sjd``            chain of the window   exact (SJD: the target drafts for itself)
``sjd-lantern``    chain of the window   relaxed, absolute delta
``sjd-lantern++``  chain of the window   relaxed, relative lambda
``sjd-coupled``    chain of the window   exact (SJD with coupled redraws: SCD)
``sjd-coupled-*``  chain of the window   relaxed (``-lantern``: delta, ``-lantern++``: lambda)
``gsd``            chain of the window   grouped (GSD: dynamic groups, no table)
``pjd``            a chain per open row  SJD's rule per row (PJD: 2-D parallel Jacobi; lossy
                                         unless ``--pjd-context`` = the row length)
``pjd-lantern*``   a chain per open row  relaxed (``-lantern``: delta, ``-lantern++``: lambda)
=================  ====================  ==========================================

The SJD methods (``lantern.decoding.jacobi``) load no drafter: ``MethodConfig.jacobi`` holds the window
length, initialisation and coupling (``independent`` for ``sjd*``, ``maximal`` or ``gumbel`` for
``sjd-coupled*``), and the relaxed ones read the proximity table like LANTERN. The PJD methods
(``lantern.decoding.pjd``) hold ``MethodConfig.pjd`` (window, context) instead; their tree is a chain of the
window (each open row's chain), and the loop runs its grid round for them.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from lantern.decoding.cache import CachePool
from lantern.decoding.compiling import resolve_compile
from lantern.decoding.config import RESIDUALS, RelaxationConfig, SamplingConfig, TreeConfig
from lantern.decoding.drafting import TreeDrafter
from lantern.decoding.jacobi import COUPLINGS, JacobiConfig, JacobiDrafter, check_window_fits
from lantern.decoding.loop import Acceptance, Drafter, GenerationOutput, SpecStats, Target, generate
from lantern.decoding.pjd import (
    DEFAULT_PJD_CONTEXT,
    DEFAULT_PJD_WINDOW,
    GridJacobiDrafter,
    PJDConfig,
    check_pjd_fits,
    grid_chains,
)
from lantern.decoding.sampling import make_generators, validate_sampling_for_vocab
from lantern.errors import check
from lantern.targets.checks import drafter_dtype
from lantern.targets.stack import Conditions, ModelStack, Stack
from lantern.targets.text import Captions
from lantern.validate import check_batch_memory

COUPLED_METHODS = ("sjd-coupled", "sjd-coupled-lantern", "sjd-coupled-lantern++")
SJD_METHODS = ("sjd", "sjd-lantern", "sjd-lantern++", *COUPLED_METHODS, "gsd")
PJD_METHODS = ("pjd", "pjd-lantern", "pjd-lantern++")
METHODS = ("ar", "sd", "sd-static", "lantern", "lantern++", *SJD_METHODS, *PJD_METHODS)
# Each relaxed method's rule: LANTERN's (absolute delta) or LANTERN++'s (relative lambda), or
# GSD's grouped acceptance.
RELAXED_RULE = {"lantern": "lantern", "lantern++": "lantern++", "sjd-lantern": "lantern", "sjd-lantern++": "lantern++",
                "sjd-coupled-lantern": "lantern", "sjd-coupled-lantern++": "lantern++", "gsd": "gsd",
                "pjd-lantern": "lantern", "pjd-lantern++": "lantern++"}
LANTERN_METHODS = tuple(m for m, rule in RELAXED_RULE.items() if rule != "gsd")  # the ones --lantern-* tunes


def image_seed(seed: int, index: int) -> int:
    """Seed of image ``index`` in a run: independent of batch size, so batching never changes
    an image."""
    return (seed * 1_000_003 + index) % (2**63)


DEFAULT_STATIC_TREE = "naive_extend_57"  # LANTERN++'s effective tree for LlamaGen (SPEC §3.4)
DEFAULT_LANTERN = RelaxationConfig(k=1000, delta=0.1, mode="absolute")  # SPEC §4.6 code defaults
DEFAULT_LANTERN_PP = RelaxationConfig(k=10, lam=5.0, mode="relative")  # SPEC §5 run.sh (k, λ) = (10, 5)
# What the bound limits: each acceptance test (the paper's) or each emitted token
# (docs/relaxation_budget.md). The default was chosen from tau measurements on the photos preset.
BUDGETS = ("test", "token")
DEFAULT_BUDGET = "test"
DEFAULT_JACOBI = JacobiConfig()  # SPEC §6: window 16, random initialisation
# sjd-coupled*: the coupling and initialisation with the highest tau on the photos preset
# (docs/DESIGN.md: 12 images, window 16: maximal 2.73 / gumbel 2.51 with random guesses,
# maximal 3.25 / gumbel 2.85 with repeat_horizon; sjd 2.12 / 2.22).
DEFAULT_COUPLING = "maximal"
DEFAULT_COUPLED_INIT = "repeat_horizon"
# sjd-lantern(++): a uniform random guess was never drawn from the model, so the relaxed test accepts
# it with probability up to delta above p(x) and random codes enter the image (photos, 100 images:
# FID 4.89 with random guesses, 0.77 with repeat_horizon, AR 1.17 +- 0.21; benchmarks/RESULTS.md).
RELAXED_JACOBI_METHODS = ("sjd-lantern", "sjd-lantern++")
DEFAULT_GSD_GROUP = 7  # GSD's released code: the tokens ranked within 7 places of the draft
# The tree ``--tree auto`` answers when speculation loses on the device (and that ``--tree`` takes
# to turn it off): a drafter method with this tree decodes as plain AR.
AR_FALLBACK_TREE = "ar"


@dataclass(frozen=True)
class MethodConfig:
    """A decoding method: its tree and acceptance rule, resolved from a name plus overrides."""

    method: str = "ar"
    tree: TreeConfig = field(default_factory=TreeConfig)
    relaxation: RelaxationConfig | None = None
    k_explicit: bool = False  # a default k larger than the proximity table is capped, an explicit one is an error
    jacobi: JacobiConfig | None = None  # SJD methods only: window length and initialisation
    pjd: PJDConfig | None = None  # PJD methods only: window and context

    def __post_init__(self) -> None:
        check(self.method in METHODS, f"--method must be one of {', '.join(METHODS)}, got {self.method!r}")
        check(
            (self.tree.kind == "none") == (self.method == "ar"),
            f"method {self.method!r} {'takes no' if self.method == 'ar' else 'needs a'} draft tree",
        )
        sjd = self.method in SJD_METHODS
        check(
            (self.jacobi is not None) == sjd,
            f"method {self.method!r} {'needs' if sjd else 'takes no'} Jacobi settings (window, init)",
        )
        if self.jacobi is not None:  # SJD verifies its window as a chain, so the tree follows from it
            coupled = self.method in COUPLED_METHODS
            check(
                self.method == "gsd" or (self.jacobi.coupling != "independent") == coupled,
                f"method {self.method!r} needs coupling {'maximal or gumbel' if coupled else 'independent'}, "
                f"got {self.jacobi.coupling!r}",
            )
            chain = TreeConfig(kind="chain", depth=self.jacobi.window)
            check(self.tree == chain, f"method {self.method!r} needs tree chain:{self.jacobi.window} (its window)")
        grid = self.method in PJD_METHODS
        check((self.pjd is not None) == grid,
              f"method {self.method!r} {'needs' if grid else 'takes no'} PJD settings (window, context)")
        if self.pjd is not None:  # each open row's window is verified as a chain
            chain = TreeConfig(kind="chain", depth=self.pjd.window)
            check(self.tree == chain, f"method {self.method!r} needs tree chain:{self.pjd.window} (its window)")

    @classmethod
    def resolve(
        cls,
        method: str,
        tree: str | None = None,
        k: int | None = None,
        delta: float | None = None,
        lam: float | None = None,
        window: int | None = None,
        init: str | None = None,
        residual: str | None = None,
        budget: str | None = None,
        coupling: str | None = None,
        group: int | None = None,
        pjd_window: int | None = None,
        pjd_context: int | None = None,
    ) -> MethodConfig:
        """Defaults per method (see the module table), with CLI-style overrides. ``residual``
        (``--lantern-residual``): what a relaxed method continues with after a rejection;
        ``coupling`` (``--sjd-coupling``): how ``sjd-coupled*`` redraws its guesses; ``group``
        (``--gsd-group``): GSD's group width; ``pjd_window`` / ``pjd_context`` (``--pjd-window`` /
        ``--pjd-context``): PJD's window and row-opening context."""
        check(method in METHODS, f"--method must be one of {', '.join(METHODS)}, got {method!r}")
        relaxation = _resolve_relaxation(method, k, delta, lam, residual, budget, group)
        if method in PJD_METHODS:
            check(tree is None, f"--tree is not used by {method}: it verifies a chain of --pjd-window guesses per row")
            check(window is None and init is None and coupling is None,
                  f"--sjd-window / --sjd-init / --sjd-coupling are not used by {method} (it takes --pjd-window, "
                  "--pjd-context)")
            pjd = PJDConfig(window=DEFAULT_PJD_WINDOW if pjd_window is None else pjd_window,
                            context=DEFAULT_PJD_CONTEXT if pjd_context is None else pjd_context)
            chain = TreeConfig(kind="chain", depth=pjd.window)
            return cls(method=method, tree=chain, relaxation=relaxation, k_explicit=k is not None, pjd=pjd)
        check(pjd_window is None and pjd_context is None, f"--pjd-window / --pjd-context need --method "
                                                          f"{' or '.join(PJD_METHODS)}")
        if method in SJD_METHODS:
            check(tree is None, f"--tree is not used by {method}: it verifies a chain of --sjd-window guesses")
            jacobi = JacobiConfig(
                window=DEFAULT_JACOBI.window if window is None else window,
                init=init if init is not None else _default_init(method),
                coupling=_resolve_coupling(method, coupling),
            )
            chain = TreeConfig(kind="chain", depth=jacobi.window)
            return cls(method=method, tree=chain, relaxation=relaxation, k_explicit=k is not None, jacobi=jacobi)
        check(window is None and init is None, f"--sjd-window / --sjd-init need --method {' or '.join(SJD_METHODS)}")
        check(coupling is None, f"--sjd-coupling needs --method {' or '.join((*COUPLED_METHODS, 'gsd'))}")
        if method == "ar" or tree == AR_FALLBACK_TREE:  # --tree ar: speculation off (auto's fallback)
            check(method != "ar" or tree in (None, "none", AR_FALLBACK_TREE),
                  "--tree is only used with speculative methods")
            return cls(method="ar")
        default_tree = "dynamic" if method in ("sd", "lantern") else f"static:{DEFAULT_STATIC_TREE}"
        tree_cfg = TreeConfig.parse(tree or default_tree)
        return cls(method=method, tree=tree_cfg, relaxation=relaxation, k_explicit=k is not None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _default_init(method: str) -> str:
    if method in COUPLED_METHODS or method in RELAXED_JACOBI_METHODS:
        return DEFAULT_COUPLED_INIT
    return DEFAULT_JACOBI.init


def _resolve_coupling(method: str, coupling: str | None) -> str:
    """``sjd-coupled*``: ``--sjd-coupling`` (maximal | gumbel, default DEFAULT_COUPLING); ``gsd``:
    any coupling, independent by default (GSD's own SJD); the other SJD methods redraw
    independently and take no coupling."""
    if method == "gsd":
        check(coupling is None or coupling in COUPLINGS,
              f"--sjd-coupling must be one of {', '.join(COUPLINGS)}, got {coupling!r}")
        return "independent" if coupling is None else coupling
    if method not in COUPLED_METHODS:
        check(coupling is None, f"--sjd-coupling needs --method {' or '.join((*COUPLED_METHODS, 'gsd'))}; {method} "
                                "redraws its guesses independently")
        return "independent"
    choices = [c for c in COUPLINGS if c != "independent"]
    check(coupling is None or coupling in choices,
          f"--sjd-coupling must be one of {', '.join(choices)}, got {coupling!r}")
    return DEFAULT_COUPLING if coupling is None else coupling


def _resolve_relaxation(
    method: str,
    k: int | None,
    delta: float | None,
    lam: float | None,
    residual: str | None = None,
    budget: str | None = None,
    group: int | None = None,
) -> RelaxationConfig | None:
    """A relaxed method's rule with its defaults and the CLI overrides; None for exact methods."""
    rule = RELAXED_RULE.get(method)
    if rule != "gsd":
        check(group is None, f"--gsd-group needs --method gsd, got --method {method}")
    if rule in (None, "gsd"):
        check(
            k is None and delta is None and lam is None and residual is None and budget is None,
            f"--lantern-* options need a relaxed method ({', '.join(LANTERN_METHODS)})",
        )
    if rule is None:
        return None
    if rule == "gsd":
        check(group is None or (isinstance(group, int) and not isinstance(group, bool) and group >= 1),
              f"--gsd-group must be an integer >= 1, got {group!r}")
        return RelaxationConfig(k=DEFAULT_GSD_GROUP if group is None else group, mode="group")
    check(budget in (None, *BUDGETS), f"--lantern-budget must be one of {', '.join(BUDGETS)}, got {budget!r}")
    budget = DEFAULT_BUDGET if budget is None else budget
    if rule == "lantern":  # absolute bound; the relative-bound twin of method X is X++
        check(lam is None, f"--lantern-lambda belongs to {method}++ (relative bound); {method} uses --lantern-delta")
        base = replace(DEFAULT_LANTERN, delta=DEFAULT_LANTERN.delta if delta is None else delta)
    else:
        twin = method.removesuffix("++")
        check(delta is None, f"--lantern-delta belongs to {twin} (absolute bound); {method} uses --lantern-lambda")
        base = replace(DEFAULT_LANTERN_PP, lam=DEFAULT_LANTERN_PP.lam if lam is None else lam)
    check(residual is None or residual in RESIDUALS,
          f"--lantern-residual must be one of {', '.join(RESIDUALS)}, got {residual!r}")
    return replace(base, k=base.k if k is None else k, residual=base.residual if residual is None else residual,
                   budget=budget)  # type: ignore[arg-type]


@dataclass
class RunResult:
    codes: Tensor  # [num_images, N]
    output_stats: list[GenerationOutput]
    wall_seconds: float
    method: MethodConfig  # as resolved for the run (e.g. lantern k capped at the table's K_max)

    @classmethod
    def from_counts(cls, codes: Tensor, target_forwards: Tensor, drafter_forwards: int, wall_seconds: float,
                    method: MethodConfig) -> RunResult:
        """A run put together from its images' codes [N, T] and forward counts [N] (the shards of
        a job decoded by several processes, or by several runs of a resumed job)."""
        stats = SpecStats(target_forwards=target_forwards, generated_tokens=codes.shape[1],
                          drafter_forwards=drafter_forwards)
        return cls(codes=codes, output_stats=[GenerationOutput(codes, stats)], wall_seconds=wall_seconds,
                   method=method)

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
    stack: Stack,
    labels: list[int],
    seed: int,
    sampling: SamplingConfig,
    method: MethodConfig,
    batch_size: int = 8,
    progress: bool = False,
    drafter_dir: str | None = None,
    proximity: str | None = None,
    compile: str | None = None,
    indices: Sequence[int] | None = None,
) -> RunResult:
    """Generate one image per entry of ``labels``, ``batch_size`` rows at a time (see
    :func:`run_conditions` for ``indices``)."""
    return run_conditions(stack, stack.encode(labels), seed, sampling, method, batch_size, progress, drafter_dir,
                          proximity, compile, indices=indices)


def run_generation_t2i(stack: ModelStack, captions: Captions, seed: int, sampling: SamplingConfig,
                       method: MethodConfig, batch_size: int = 8, progress: bool = False,
                       drafter_dir: str | None = None, proximity: str | None = None,
                       compile: str | None = None, indices: Sequence[int] | None = None) -> RunResult:
    """Generate one image per caption row (``lantern.targets.text.T5Encoder.encode``), ``batch_size`` rows
    at a time, seeded exactly as for labels."""
    return run_conditions(stack, stack.from_captions(captions), seed, sampling, method, batch_size, progress,
                          drafter_dir, proximity, compile, indices=indices)


def run_conditions(
    stack: Stack,
    conditions: Conditions,  # from stack.encode: labels, captions or prompt ids of every image
    seed: int,
    sampling: SamplingConfig,
    method: MethodConfig,
    batch_size: int = 8,
    progress: bool = False,
    drafter_dir: str | os.PathLike[str] | None = None,
    proximity: str | os.PathLike[str] | None = None,
    compile: str | None = None,
    prepared: PreparedMethod | None = None,
    indices: Sequence[int] | None = None,
) -> RunResult:
    """The one run path of every stack: ``batch_size`` rows at a time, image ``i`` seeded with
    ``image_seed(seed, indices[i])`` (so batching never changes an image). ``indices``: each row's
    place in the whole request (default 0, 1, ...): a shard of a request (``lantern.distributed``)
    gives the same images as the whole request. ``prepared``: the method already loaded
    (:func:`prepare_method`), instead of loading it from ``drafter_dir`` / ``proximity``."""
    order = list(range(len(conditions))) if indices is None else list(indices)
    check(len(order) == len(conditions), f"{len(order)} image indices for {len(conditions)} conditions")
    parts = prepare_run(stack, sampling, method, batch_size, conditions, drafter_dir, proximity, compile, prepared)
    outputs: list[GenerationOutput] = []
    start = time.perf_counter()
    for lo in range(0, len(conditions), batch_size):
        chunk = conditions.rows(lo, lo + batch_size)
        outputs.append(generate_rows(parts, chunk, seed, order[lo : lo + len(chunk)], progress))
    wall = time.perf_counter() - start
    codes = torch.cat([o.codes for o in outputs])
    return RunResult(codes=codes, output_stats=outputs, wall_seconds=wall, method=parts.method)


def prepare_run(
    stack: Stack,
    sampling: SamplingConfig,
    method: MethodConfig,
    batch_size: int,
    conditions: Conditions,
    drafter_dir: str | os.PathLike[str] | None = None,
    proximity: str | os.PathLike[str] | None = None,
    compile: str | None = None,
    prepared: PreparedMethod | None = None,
) -> PreparedMethod:
    """The checks of a run (sampling, batch size, the cache memory of ``batch_size`` of these
    conditions) and its method, loaded once (or ``prepared``)."""
    validate_sampling_for_vocab(sampling, stack.vocab_size)
    check(batch_size >= 1, f"--batch-size must be >= 1, got {batch_size}")
    parts = prepared or prepare_method(stack, method, sampling, drafter_dir, proximity, compile)
    batch = max(1, min(batch_size, len(conditions)))
    nbytes = stack.cache_bytes(sampling, verify_nodes(parts.method, stack), conditions, batch)
    check_batch_memory(nbytes, batch, stack.device)  # before the cache is allocated
    return parts


def generate_rows(parts: PreparedMethod, conditions: Conditions, seed: int, indices: Sequence[int],
                  progress: bool = False) -> GenerationOutput:
    """One batch: row ``r`` of ``conditions`` is image ``indices[r]`` of the request, with that image's seed."""
    gens = make_generators([image_seed(seed, i) for i in indices], parts.stack.device)
    return parts.generate(conditions.cond, gens, progress, cond_mask=conditions.mask)


@dataclass
class PreparedMethod:
    """Everything loaded once per run: the drafter weights and the acceptance rule of a stack."""

    stack: Stack
    method: MethodConfig
    sampling: SamplingConfig
    drafter: torch.nn.Module | None
    acceptance: Acceptance
    compile: str | None = None  # a lantern.decoding.compiling mode; None = eager
    _head_copy: torch.nn.Linear | None = field(default=None, repr=False)
    # Caches reused image after image (fixed addresses for CUDA graphs, no allocation per image).
    _caches: CachePool = field(default_factory=CachePool, repr=False)

    def drafter_head(self, lm_head: torch.nn.Linear) -> torch.nn.Linear:
        """The target's lm_head in the drafter's precision (a copy, made once, when they differ)."""
        assert self.drafter is not None
        dtype = next(self.drafter.parameters()).dtype
        if lm_head.weight.dtype == dtype:
            return lm_head
        if self._head_copy is None:
            self._head_copy = copy.deepcopy(lm_head).to(dtype)
        return self._head_copy

    def parts(self, head: torch.nn.Linear | None = None) -> tuple[Target, Drafter | GridJacobiDrafter | None]:
        """A fresh target adapter and drafter for one batch (they hold per-batch state); ``head``:
        the drafter's lm_head (default: the target's, in the drafter's precision)."""
        tree, stack = self.method.tree, self.stack
        if self.method.pjd is not None:  # PJD: a chain per open image row, R of them per round
            grid = GridJacobiDrafter(self.method.pjd, self.sampling, stack.vocab_size, stack.num_tokens,
                                     width=stack.grid_width)
            return stack.make_target(self.sampling, grid.num_nodes, compile=self.compile,
                                     cache_pool=self._caches), grid
        target = stack.make_target(self.sampling, tree.num_nodes, compile=self.compile, cache_pool=self._caches)
        if self.method.jacobi is not None:
            return target, JacobiDrafter(self.method.jacobi, self.sampling, stack.vocab_size, stack.num_tokens)
        if self.drafter is None:
            return target, None
        head = head if head is not None else self.drafter_head(target.lm_head)
        backend = stack.draft_backend(self.drafter, head, self.sampling, target, tree.drafter_slots,
                                      compile=self.compile, cache_pool=self._caches)
        return target, TreeDrafter(backend, tree, self.sampling, stack.vocab_size)

    def generate(
        self,
        cond: Tensor,
        generators: list[torch.Generator],
        progress: bool = False,
        cond_mask: Tensor | None = None,
    ) -> GenerationOutput:
        """cond: one batch of ``Stack.encode``'s conditions (labels [B], captions [B, cls, C] or
        prompt ids [B, L]); cond_mask: their mask (captions, prompts)."""
        target, drafter = self.parts()
        return generate(target, cond, generators=generators, drafter=drafter, acceptance=self.acceptance,
                        cond_mask=cond_mask, progress=progress, compile=self.compile)


def verify_nodes(method: MethodConfig, stack: Stack) -> int:
    """Tokens per verify forward, root included: what a target's cache leaves room for."""
    if method.pjd is None:
        return method.tree.num_nodes
    width = stack.grid_width  # PJD verifies R chains of a window each
    return method.tree.num_nodes * grid_chains(method.pjd.window, method.pjd.context, width,
                                               stack.num_tokens // width)


def prepare_method(
    stack: Stack,
    method: MethodConfig,
    sampling: SamplingConfig,
    drafter_dir: str | os.PathLike[str] | None = None,
    proximity: str | os.PathLike[str] | None = None,
    compile: str | None = None,
    drafter: torch.nn.Module | None = None,
) -> PreparedMethod:
    """Load the drafter (unless ``drafter`` is given) and proximity table a method needs, checking
    they fit the target.

    compile: None / "off" (eager), "auto" or a torch.compile mode (``lantern.decoding.compiling``): the
    target step, the drafter steps and the acceptance run compiled, AR included.
    """
    from lantern.targets.checks import check_tree_fits

    if method.jacobi is not None:  # SJD: the target drafts for itself, no weights to load
        check_window_fits(method.jacobi, stack.num_tokens)
    elif method.pjd is not None:  # PJD likewise, on the image grid
        check_pjd_fits(method.pjd, stack.num_tokens // stack.grid_width, stack.grid_width)
    elif method.tree.kind != "none" and drafter is None:
        check_tree_fits(method.tree, stack.num_tokens)
        path = drafter_dir or stack.drafter_dir
        check(
            path is not None,
            f"--method {method.method} needs a drafter: pass --drafter DIR (the model folder has none)",
        )
        drafter = stack.load_drafter(path)
    elif drafter is not None:
        drafter = drafter.to(stack.device, drafter_dtype(stack.dtype, stack.device)).eval()
    acceptance, resolved = load_acceptance(method, proximity or stack.proximity_file, stack.codebook(), stack.device)
    return PreparedMethod(stack, resolved, sampling, drafter if method.tree.kind != "none" else None, acceptance,
                          resolve_compile(compile, stack.device))


def load_acceptance(
    method: MethodConfig, table_path: object, codebook: Tensor | None, device: torch.device
) -> tuple[Acceptance, MethodConfig]:
    """The method's acceptance rule, with the proximity table a relaxed rule needs (validated
    against ``codebook`` when given), and the method with k as actually used: a default k larger
    than the table's K_max is capped, an explicit one is an error. The released code's residuals
    (``residual`` official / official-lumina) also remove the (k+1)-th neighbour, so they take
    k+1 columns of the table (and a default k is capped at K_max - 1)."""
    relaxation = method.relaxation
    if relaxation is None or relaxation.is_exact or not relaxation.uses_table:
        return Acceptance(relaxation), method
    from lantern.targets.proximity import ProximityTable

    check(
        table_path is not None,
        f"--method {method.method} needs a latent proximity table: pass --proximity FILE "
        "(build one with `lantern build-proximity`)",
    )
    table = ProximityTable.load(str(table_path))
    if codebook is not None:
        table.validate(codebook)
    extra = 0 if relaxation.residual == "paper" else 1
    if relaxation.k + extra > table.k_max and not method.k_explicit:
        relaxation = replace(relaxation, k=table.k_max - extra)
    table.check_k(relaxation.k)
    check(relaxation.k + extra <= table.k_max,
          f"--lantern-residual {relaxation.residual} removes k+1 = {relaxation.k + 1} neighbours per rejection, "
          f"but the proximity table {table_path} holds K_max = {table.k_max}")
    neighbours = table.neighbours_for(relaxation.k + extra).to(device)
    return Acceptance(relaxation, neighbours), replace(method, relaxation=relaxation)


