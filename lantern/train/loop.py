"""The one training loop, shared by the tokenizer, target and drafter trainers.

A trainer is a :class:`TrainTask` (model, batches, loss, evaluation, final save); the loop owns
everything else: the optimiser and schedule, bf16 autocast, progress, periodic checkpoints and
exact resume, the resolved config and ``provenance.json``. It runs on ``accelerate`` so the same
command runs data-parallel under ``accelerate launch`` or ``torchrun``.

Exact resume rests on one choice: the data order and every random draw of a step are pure
functions of ``(seed, step)`` (see :func:`batch_indices` and :func:`step_generator`), and the
global torch RNG (dropout) is re-seeded from ``(seed, step, rank)`` at every step, so a
checkpoint only needs the model, optimiser, scheduler, the task's extra state and the step
counter. Those are written by :func:`_save_training_state` as safetensors and tensor-only torch
files, read back through :func:`lantern.io.load_checkpoint`: ``accelerate``'s own
``load_state`` fully unpickles parts of a checkpoint folder, so a tampered folder passed to
``--resume`` could run code.

Data parallelism: ``--batch-size`` is the global batch. Process ``r`` of ``w`` takes the r-th
contiguous slice of every global batch (:class:`BatchPart`); a draw that belongs to an example
(augmentation, class dropout, feature noise) is keyed by the example's position in the global
batch, never by the rank, and DDP averages the gradients of equal-sized slices. So ``w``
processes follow the same trajectory as one process with the same global batch (equal up to
floating-point summation order), and a checkpoint, written by process 0 only, holds nothing
that depends on ``w``: a run may be resumed with another number of processes. Every process
must see the same ``--out`` folder (on several nodes: a shared file system); that is checked.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lantern.distributed import before_process_group, end_process_group
from lantern.errors import LanternError, check
from lantern.io import (
    TRAIN_CONFIG_FILE,
    LanternWarning,
    atomic_path,
    ensure_writable_dir,
    finite_or_null,
    load_checkpoint,
    load_safetensors,
    load_state_dict_strict,
    read_json_object,
    save_safetensors,
    write_json,
)
from lantern.validate import MAX_TRAIN_BATCH, MAX_TRAIN_STEPS

CHECKPOINT_DIR = "checkpoints"
STATE_FILE = "trainer_state.json"
PROVENANCE_FILE = "provenance.json"
LOG_FILE = "train_log.jsonl"
# Files of one checkpoint folder besides STATE_FILE. (Checkpoints of older lanterns also hold
# rng_state_{rank}.pt files; the per-step re-seeding made them unnecessary, and they are ignored.)
MODEL_FILE, OPTIMIZER_FILE, SCHEDULER_FILE, EXTRA_FILE = ("model.safetensors", "optimizer.pt", "scheduler.pt",
                                                          "extra_state.pt")

# Loop fields that may change between a run and its resumption without changing the result.
_RESUMABLE_CHANGES = frozenset({"checkpoint_every", "keep_checkpoints", "log_every"})


@dataclass(frozen=True)
class LoopConfig:
    """Optimiser, schedule and bookkeeping of one training run."""

    steps: int = 1000
    batch_size: int = 32
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio (cosine / linear)
    warmup_steps: int = 50
    schedule: str = "cosine"  # cosine | linear | constant
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 = off
    clip_mode: str = "norm"  # norm | value (EAGLE/LANTERN clip drafter gradients by value)
    precision: str = "bf16"  # bf16 (autocast, also on CPU) | fp32
    seed: int = 0
    checkpoint_every: int = 200
    keep_checkpoints: int = 2
    log_every: int = 10

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "checkpoint_every", "keep_checkpoints", "log_every"):
            v = getattr(self, name)
            check(isinstance(v, int) and v >= 1, f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        check(self.steps <= MAX_TRAIN_STEPS, f"--steps must be at most {MAX_TRAIN_STEPS:,} (one run), got {self.steps}")
        # (a batch of 10^8 examples was gathered for minutes before anything failed)
        check(self.batch_size <= MAX_TRAIN_BATCH,
              f"--batch-size must be at most {MAX_TRAIN_BATCH:,} (the global batch), got {self.batch_size}")
        check(isinstance(self.warmup_steps, int) and self.warmup_steps >= 0,
              f"--warmup-steps must be an integer >= 0, got {self.warmup_steps!r}")
        check(self.lr > 0 and math.isfinite(self.lr), f"--lr must be a positive number, got {self.lr!r}")
        check(0.0 <= self.min_lr_ratio <= 1.0, f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        check(self.schedule in ("cosine", "linear", "constant"),
              f"--schedule must be cosine, linear or constant, got {self.schedule!r}")
        check(self.clip_mode in ("norm", "value"), f"--clip-mode must be norm or value, got {self.clip_mode!r}")
        check(self.precision in ("bf16", "fp32"), f"--precision must be bf16 or fp32, got {self.precision!r}")
        # finite: inf would also fail writing train_config.json, which is strict JSON
        check(self.grad_clip >= 0 and math.isfinite(self.grad_clip),
              f"--grad-clip must be a number >= 0 (0 = off), got {self.grad_clip!r}")
        check(self.weight_decay >= 0 and math.isfinite(self.weight_decay),
              f"--weight-decay must be a number >= 0, got {self.weight_decay!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LoopConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass(frozen=True)
class BatchPart:
    """This process's share of a global batch of ``size`` examples: positions ``[start, stop)``."""

    start: int
    stop: int
    size: int

    @classmethod
    def whole(cls, size: int) -> BatchPart:
        return cls(0, size, size)

    @classmethod
    def of_rank(cls, size: int, rank: int, world: int) -> BatchPart:
        share = size // world
        return cls(rank * share, (rank + 1) * share, size)

    def take(self, values: Tensor) -> Tensor:
        """This part's rows of ``values`` drawn for the whole global batch (``values.shape[0] == size``)."""
        return values[self.start : self.stop]


class TrainTask(ABC):
    """What a trainer provides to :func:`train`. ``model`` holds exactly the trained parameters."""

    kind: str  # "tokenizer" | "target" | "drafter"
    model: nn.Module

    @abstractmethod
    def num_examples(self) -> int: ...

    @abstractmethod
    def make_batch(self, indices: Tensor, step: int, device: torch.device, part: BatchPart | None = None) -> Any:
        """Collate the examples ``indices`` for ``step``: this process's ``part`` of the global batch
        (None: the whole batch). Draws come from :func:`step_generator` and are made for the whole
        global batch (or per example position), so they do not depend on the number of processes."""

    @abstractmethod
    def loss(self, model: nn.Module, batch: Any, step: int) -> tuple[Tensor, dict[str, float]]:
        """Scalar loss and floats to log. ``model`` is the (possibly DDP-wrapped) trained module."""

    @abstractmethod
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Held-out metrics of the unwrapped model (called at the end of training)."""

    @abstractmethod
    def save(self, model: nn.Module, out: Path) -> None:
        """Write the final ``from_pretrained`` folder into ``out``."""

    @abstractmethod
    def config_dict(self) -> dict[str, Any]:
        """Everything besides the loop config that determines the result (for resume checks)."""

    @abstractmethod
    def data_fingerprint(self) -> str: ...

    def parameters(self) -> Iterable[nn.Parameter]:
        return (p for p in self.model.parameters() if p.requires_grad)

    def after_step(self, model: nn.Module, batch: Any, step: int) -> dict[str, float]:
        """Hook after the optimiser step (e.g. dead-code restarts). Returns floats to log."""
        return {}

    def extra_state(self) -> Any | None:
        """An object with ``state_dict``/``load_state_dict`` to checkpoint beside the model (or None)."""
        return None

    def bind(self, accelerator: Any) -> None:
        """Called once before training with the ``accelerate.Accelerator`` in use."""
        self.accelerator = accelerator


# ----------------------------------------------------------------------------------------------
# Determinism helpers
# ----------------------------------------------------------------------------------------------


def step_generator(seed: int, step: int, stream: int = 0, device: torch.device | str = "cpu",
                   example: int | None = None) -> torch.Generator:
    """A generator that depends only on (seed, step, stream[, example]): resuming replays the same
    draws. ``example`` (a position in the global batch) gives each example its own stream."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + step) * 31 + stream if example is None else _mix(seed, step, stream, example))
    return g


def _mix(*values: int) -> int:
    """A 63-bit seed from integers: no two tuples share a stream (unlike a linear formula)."""
    digest = hashlib.blake2b(repr(values).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def batch_indices(seed: int, step: int, batch_size: int, num_examples: int) -> Tensor:
    """Global example ids for ``step``: consecutive slices of per-epoch permutations (wrapping)."""
    start = step * batch_size
    out: list[Tensor] = []
    while len(out) == 0 or sum(t.numel() for t in out) < batch_size:
        epoch, offset = divmod(start, num_examples)
        perm = torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        need = batch_size - sum(t.numel() for t in out)
        piece = perm[offset : offset + need]
        out.append(piece)
        start += piece.numel()
    return torch.cat(out)


def lr_lambda(cfg: LoopConfig) -> Any:
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        frac = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * frac)) if cfg.schedule == "cosine" else 1.0 - frac
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape

    return factor


# ----------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------


def _checkpoints(out: Path) -> list[Path]:
    """``out``'s finished checkpoints, by step (a copy named ``step-N.bak``, say, is not one)."""
    root = out / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if re.fullmatch(r"step-\d+", p.name) and (p / STATE_FILE).is_file()]
    return sorted(done, key=lambda p: int(p.name.split("-")[1]))


def latest_checkpoint(out: str | os.PathLike[str]) -> Path | None:
    found = _checkpoints(Path(out))
    return found[-1] if found else None


def _config_differences(saved: Mapping[str, Any], current: Mapping[str, Any], prefix: str = "") -> list[str]:
    diffs = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, "<absent>"), current.get(key, "<absent>")
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            diffs += _config_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            diffs.append(f"{prefix}{key}: checkpoint {json.dumps(a)}, now {json.dumps(b)}")
    return diffs


def _run_differences(saved: Mapping[str, Any], loop: LoopConfig, kind: str, task_config: Mapping[str, Any],
                     data_fingerprint: str | None = None) -> list[str]:
    """What differs between a saved run's settings (a checkpoint's state, or ``train_config.json``:
    kind, loop and task; the data fingerprint where saved and ``data_fingerprint`` is given) and
    this run's, the kind first (a run of another trainer differs in everything else too)."""
    if saved.get("kind") != kind:
        return [f"kind: checkpoint {saved.get('kind')!r}, now {kind!r}"]
    saved_loop = {k: v for k, v in dict(saved.get("loop") or {}).items() if k not in _RESUMABLE_CHANGES}
    now_loop = {k: v for k, v in loop.to_dict().items() if k not in _RESUMABLE_CHANGES}
    diffs = _config_differences(saved_loop, now_loop, "loop.")
    diffs += _config_differences(dict(saved.get("task") or {}), json.loads(json.dumps(task_config)), "task.")
    if data_fingerprint is not None and "data_fingerprint" in saved and saved["data_fingerprint"] != data_fingerprint:
        diffs.append("training data differs from the data the checkpoint was trained on (fingerprint)")
    return diffs


def _task_differences(saved: Mapping[str, Any], loop: LoopConfig, task: TrainTask) -> list[str]:
    return _run_differences(saved, loop, task.kind, task.config_dict(), task.data_fingerprint())


def _first_of(diffs: list[str]) -> str:
    """The first difference, and how many more (a refusal is one line)."""
    return (diffs[0] if diffs else "") + (f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else "")


def _check_resumable(state: Mapping[str, Any], loop: LoopConfig, task: TrainTask, where: Path) -> None:
    diffs = _task_differences({"data_fingerprint": None, **state}, loop, task)
    check(not diffs, f"cannot resume from {where}: the settings differ from the run's: {_first_of(diffs)}; "
                     "resume with the original settings, or train into a new --out folder")


def check_out_before_data(out: str | os.PathLike[str], loop: LoopConfig, kind: str, task_config: Mapping[str, Any],
                          resume: bool, data_keys: tuple[str, ...] = ("data",)) -> None:
    """The refusals of :func:`train` about ``out`` that need no training data, for a trainer that
    spends long making its data first (``train-chameleon-drafter`` generates every image): a
    folder of something else, a run of another trainer, checkpoints or a finished run without
    ``--resume``, and a resume with other settings. ``task_config``: the task's settings without
    the keys ``data_keys``, which depend on the data; they are compared again once it is made."""
    path = Path(out)
    saved = _saved_run(path, kind)
    if saved is None:
        return
    if (path / PROVENANCE_FILE).is_file():
        _check_finished_run(path, loop, kind, task_config, resume, saved, data_keys)
        return
    latest = latest_checkpoint(path)
    if latest is None:
        return  # interrupted before its first checkpoint: the run starts afresh
    check(resume, _HAS_CHECKPOINTS.format(out=path))
    state = read_json_object(latest / STATE_FILE, "checkpoint state")
    diffs = _run_differences(_without(state, data_keys), loop, kind, _without_keys(task_config, data_keys))
    check(not diffs, f"cannot resume from {latest}: the settings differ from the run's: {_first_of(diffs)}; "
                     "resume with the original settings, or train into a new --out folder")


_HAS_CHECKPOINTS = ("--out {out} already holds training checkpoints; pass --resume to continue that run, "
                    "or choose a new --out folder")


def _without_keys(config: Mapping[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in keys}


def _without(saved: Mapping[str, Any], data_keys: tuple[str, ...]) -> dict[str, Any]:
    """A saved run's settings without its data fingerprints (the task's ``data_keys`` and the state's
    ``data_fingerprint``)."""
    task = saved.get("task")
    rest = {k: v for k, v in saved.items() if k != "data_fingerprint"}
    return {**rest, "task": _without_keys(task, data_keys)} if isinstance(task, Mapping) else rest


# ----------------------------------------------------------------------------------------------
# Provenance
# ----------------------------------------------------------------------------------------------


def git_commit() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if sha.returncode != 0:
        return "unknown"
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def provenance(task: TrainTask, loop: LoopConfig, metrics: Mapping[str, Any], command: str | None,
               wall_seconds: float, resumed_from: int | None) -> dict[str, Any]:
    import platform

    return {
        "kind": task.kind,
        "command": command if command is not None else " ".join(sys.argv),
        "data_fingerprint": task.data_fingerprint(),
        "git_commit": git_commit(),
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip() + f", {os.cpu_count()} cpus",
        "steps": loop.steps,
        "resumed_from_step": resumed_from,
        "wall_seconds_this_run": round(wall_seconds, 1),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "metrics": dict(metrics),
    }


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------


@dataclass
class TrainResult:
    out: Path
    metrics: dict[str, float]
    steps_run: int
    resumed_from: int | None
    finished: bool  # False when stopped early by ``stop_after``
    main_process: bool = True  # False on the other processes of a data-parallel run (no metrics)
    nothing_to_do: bool = False  # --resume of a run that had already finished: nothing was run or written


@dataclass(frozen=True)
class RunOptions:
    """Where one training run writes and how it runs, shared by every trainer (``lantern train ...``).

    ``stop_after`` ends this process after that many global steps (after any checkpoint due at
    that step), as if it had been killed: a later ``resume=True`` run continues exactly.
    ``command`` is recorded in the provenance (default: this process's ``sys.argv``).
    """

    out: str | os.PathLike[str]
    resume: bool = False
    progress: bool = True
    stop_after: int | None = None
    command: str | None = None
    adapt_threads: bool = False  # on a CPU, train on the cores other processes leave free (``--threads auto``)


def train(task: TrainTask, loop: LoopConfig, options: RunOptions) -> TrainResult:
    """Run (or resume) ``task`` into ``options.out``; returns final held-out metrics.

    A run that fails before its first checkpoint removes the ``out`` folder it created: there is
    nothing in it to resume. Under ``accelerate launch``/``torchrun`` only process 0 evaluates
    and writes; the others return with ``main_process=False`` and no metrics.
    """
    created = not Path(options.out).exists()
    owns_group = not _process_group_exists()  # else an embedding program's, left to it
    try:
        result = _train(task, loop, options)
    except BaseException:
        if created and latest_checkpoint(Path(options.out)) is None:
            shutil.rmtree(options.out, ignore_errors=True)
        if owns_group:
            _end_accelerate_group(failed=True)
        raise
    if owns_group:
        _end_accelerate_group(failed=False)
    return result


def _process_group_exists() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _end_accelerate_group(*, failed: bool) -> None:
    """Destroy the process group accelerate created for this run, before interpreter exit (see
    :func:`lantern.distributed.end_process_group`: left alive, its gloo threads now and then abort
    the process at exit, issue 30), and forget accelerate's state of it, so that a later run in
    this process starts a new one."""
    if not _process_group_exists():
        return
    end_process_group(failed=failed)
    if _process_group_exists():
        return  # kept (NCCL after a failure): accelerate's state still describes it
    from accelerate.state import AcceleratorState

    reset = getattr(AcceleratorState, "_reset_state", None)  # private API: skip if a release drops it
    if reset is not None:
        reset(reset_partial_state=True)


@dataclass
class _Run:
    """What the steps of one training process share."""

    accelerator: Any
    task: TrainTask
    loop: LoopConfig
    out: Path
    parts: _TrainingState


def _train(task: TrainTask, loop: LoopConfig, options: RunOptions) -> TrainResult:
    from accelerate import Accelerator

    if _check_out(Path(options.out), loop, task, options.resume):
        return TrainResult(Path(options.out), {}, 0, loop.steps, finished=True, nothing_to_do=True)
    out = ensure_writable_dir(options.out)
    resume, stop_after = options.resume, options.stop_after
    accelerator = _make_accelerator(Accelerator, loop.precision)
    world = accelerator.num_processes
    check(loop.batch_size % world == 0, f"--batch-size {loop.batch_size} (the global batch) must be divisible by "
                                        f"the number of processes, {world}")
    existing = _latest_on_every_process(accelerator, out)
    check(existing is None or resume, _HAS_CHECKPOINTS.format(out=out))
    torch.manual_seed(loop.seed)
    optimizer = torch.optim.AdamW(list(task.parameters()), lr=loop.lr, betas=(loop.beta1, loop.beta2),
                                  weight_decay=loop.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(loop))
    model, optimizer = accelerator.prepare(task.model, optimizer)
    task.bind(accelerator)
    run = _Run(accelerator, task, loop, out, _TrainingState(model, optimizer, scheduler, task.extra_state()))
    resumed_from = _resume_from(run, existing) if resume and existing is not None else None
    if resume and existing is None and accelerator.is_main_process:
        # (a job script that always passes --resume is right to; a typo in --out deserves a word)
        warnings.warn(f"--resume: {out} holds no checkpoint of this run; starting it at step 0", LanternWarning,
                      stacklevel=2)
    start_step = resumed_from or 0
    if accelerator.is_main_process:
        write_json(out / TRAIN_CONFIG_FILE, {"kind": task.kind, "loop": loop.to_dict(), "task": task.config_dict()})
        _keep_log_until(out / LOG_FILE, start_step)
    check(task.num_examples() >= 1, f"{task.kind} training: the training set is empty")
    t0 = time.time()
    end = loop.steps if stop_after is None else min(loop.steps, stop_after)
    log = _run_steps(run, start_step, end, options.progress, options.adapt_threads)
    steps_run = end - start_step
    if end < loop.steps:
        return TrainResult(out, {}, steps_run, resumed_from, finished=False, main_process=accelerator.is_main_process)
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:  # process 0 alone evaluates and writes; the others are done
        return TrainResult(out, {}, steps_run, resumed_from, finished=True, main_process=False)
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.eval()
    if options.progress:  # the held-out evaluation takes a while (a drafter's decodes images) and has no bar
        what = "feature net" if task.kind == "features" else task.kind
        print(f"lantern: evaluating the {what} on its held-out split", file=sys.stderr, flush=True)
    metrics = {k: float(v) for k, v in task.evaluate(unwrapped).items()}
    metrics["final_train_loss"] = log.get("loss", float("nan"))  # NaN when no step ran (resumed at the end)
    prov = provenance(task, loop, metrics, options.command, time.time() - t0, resumed_from)
    try:
        task.save(unwrapped, out)  # each file atomically: a failed write leaves no partial file
        write_json(out / PROVENANCE_FILE, finite_or_null({**prov, "processes": world}))
    except OSError as e:
        raise LanternError(f"--out: could not write the trained model into {out}: {e.strerror or e}; free some "
                           "space and run the same command with --resume") from None
    return TrainResult(out, metrics, steps_run, resumed_from, finished=True)


def _check_out(out: Path, loop: LoopConfig, task: TrainTask, resume: bool) -> bool:
    """What ``--out`` may hold before a run writes its model files there: nothing, or a run of this
    trainer (its ``train_config.json``). A folder of anything else (an input model folder, a
    user's files) would be overwritten. True when it holds this very run, finished: ``--resume``
    has nothing to do, and must not touch it (it would rewrite the provenance of a run of no
    steps); the same command without ``--resume`` is refused rather than retrain over it."""
    saved = _saved_run(out, task.kind)
    if saved is None or not (out / PROVENANCE_FILE).is_file():
        return False  # new, or a run under way or interrupted: the checkpoints decide (_train)
    _check_finished_run(out, loop, task.kind, task.config_dict(), resume, saved, (),
                        task.data_fingerprint())
    return True


def check_out_kind(out: str | os.PathLike[str], kind: str) -> None:
    """The refusals about ``out`` that need neither the model nor the data (a folder of something
    else, a run of another trainer), for a command that loads a large model before training."""
    _saved_run(Path(out), kind)


def _saved_run(out: Path, kind: str) -> dict[str, Any] | None:
    """The settings of the ``kind`` run ``out`` holds (its ``train_config.json``); None for a new or
    empty folder. Refuses a folder of something else, and a run of another trainer."""
    if not out.is_dir() or not any(out.iterdir()):
        return None
    config = out / TRAIN_CONFIG_FILE
    check(config.is_file(), f"--out {out} is not empty and holds no training run (no {TRAIN_CONFIG_FILE}); "
                            "train into a new or empty folder")
    saved = read_json_object(config, "training configuration")
    check(saved.get("kind") == kind, f"--out {out} holds a {saved.get('kind')!r} training run, not a "
                                     f"{kind!r} one; train into another folder")
    return saved


def _check_finished_run(out: Path, loop: LoopConfig, kind: str, task_config: Mapping[str, Any], resume: bool,
                        saved: Mapping[str, Any], data_keys: tuple[str, ...],
                        data_fingerprint: str | None = None) -> None:
    """A finished run in ``out`` is left as it is: refused without ``--resume``, and with it unless
    its settings (``saved``) are this run's (but for ``data_keys``)."""
    check(resume, f"--out {out} already holds a finished {kind} run; train into a new --out folder")
    diffs = _run_differences(_without(saved, data_keys) if data_keys else saved, loop, kind,
                             _without_keys(task_config, data_keys), data_fingerprint)
    check(not diffs, f"--resume: {out} holds a finished {kind} run of other settings: "
                     f"{_first_of(diffs)}; train into a new --out folder")


def _keep_log_until(path: Path, step: int) -> None:
    """The log's lines up to ``step``, where this run starts: a resumed run logs the steps after its
    checkpoint again, and a run started afresh where an interrupted one left its log (no
    checkpoint yet) would follow that run's lines."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            logged = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(logged, int) and logged <= step:
            kept.append(line + "\n")
    with atomic_path(path) as tmp:
        tmp.write_text("".join(kept))


def _resume_from(run: _Run, existing: Path) -> int:
    """Load the checkpoint ``existing`` into ``run``; returns its step."""
    state = read_json_object(existing / STATE_FILE, "checkpoint state")
    check(isinstance(state.get("loop"), dict) and isinstance(state.get("task"), dict)
          and isinstance(state.get("step"), int),
          f"checkpoint state {existing / STATE_FILE} lacks its step, loop or task settings")
    _check_resumable(state, run.loop, run.task, existing)
    step = int(state["step"])
    check(step == int(existing.name.split("-")[1]) and step >= 0,
          f"checkpoint state {existing / STATE_FILE} says step {step}, but the checkpoint is {existing.name}")
    _load_training_state(run.accelerator, existing, run.parts)
    if step > run.loop.steps:
        raise LanternError(f"cannot resume: checkpoint {existing} is at step {step}, past --steps {run.loop.steps}")
    return step


def _run_steps(run: _Run, start: int, end: int, progress: bool, adapt_threads: bool = False) -> dict[str, float]:
    """Steps ``[start, end)``, logging and checkpointing; returns the last logged values.
    ``adapt_threads``: on a CPU, every 10 s the intra-op threads follow what other processes leave
    free (``lantern.machine.AdaptiveThreads``: a thread on a busy core stalls every op)."""
    from tqdm.auto import tqdm

    from lantern.machine import AdaptiveThreads

    accelerator, task, loop, parts = run.accelerator, run.task, run.loop, run.parts
    world, rank = accelerator.num_processes, accelerator.process_index
    part = BatchPart.of_rank(loop.batch_size, rank, world)
    parts.model.train()
    bar = tqdm(total=loop.steps, initial=start, desc=f"train {task.kind}", dynamic_ncols=True,
               disable=not (progress and accelerator.is_main_process))
    log: dict[str, float] = {}

    def threads_now(threads: int) -> None:
        torch.set_num_threads(threads)
        if accelerator.is_main_process:
            bar.write(f"lantern: other processes' load changed: training on {threads} thread{'s' * (threads > 1)}",
                      file=sys.stderr)

    adapt = (AdaptiveThreads(torch.get_num_threads(), threads_now)
             if adapt_threads and accelerator.device.type == "cpu" else None)
    try:
        for step in range(start, end):
            if adapt is not None:
                adapt.check()
            torch.manual_seed(_mix(loop.seed, step, rank))  # dropout: a function of the step, nothing to checkpoint
            indices = part.take(batch_indices(loop.seed, step, loop.batch_size, task.num_examples()))
            batch = task.make_batch(indices, step, accelerator.device, part)
            with accelerator.autocast():
                loss, log = task.loss(parts.model, batch, step)
            mean_loss = _mean_over_processes(accelerator, {"loss": float(loss.detach())})["loss"]
            check(math.isfinite(mean_loss), f"{task.kind} training diverged at step {step}: loss is {mean_loss}")
            _optimizer_step(accelerator, loop, parts, loss)
            log = {"loss": mean_loss, **log, **task.after_step(accelerator.unwrap_model(parts.model), batch, step)}
            done = step + 1
            bar.update(1)
            if done % loop.log_every == 0 or done == end:
                log = _mean_over_processes(accelerator, log)  # the global batch's values, as one process logs them
                bar.set_postfix({k: f"{v:.4g}" for k, v in log.items()}, refresh=False)
                if accelerator.is_main_process:
                    with open(run.out / LOG_FILE, "a") as f:
                        line = finite_or_null({"step": done, "lr": parts.scheduler.get_last_lr()[0], **log})
                        f.write(json.dumps(line, allow_nan=False) + "\n")
            if done % loop.checkpoint_every == 0 or (done == end and done < loop.steps):
                _save_checkpoint(accelerator, run.out, done, loop, task, parts)
    finally:  # the count the run started with, for whatever runs next in this process
        if adapt is not None:
            torch.set_num_threads(adapt.most)
    bar.close()
    return log


def _optimizer_step(accelerator: Any, loop: LoopConfig, parts: _TrainingState, loss: Tensor) -> None:
    """Backward (DDP averages the processes' gradients), clipping, the optimiser and schedule step."""
    parts.optimizer.zero_grad(set_to_none=True)
    accelerator.backward(loss)
    if loop.grad_clip > 0:
        if loop.clip_mode == "norm":
            accelerator.clip_grad_norm_(parts.model.parameters(), loop.grad_clip)
        else:
            accelerator.clip_grad_value_(parts.model.parameters(), loop.grad_clip)
    parts.optimizer.step()
    parts.scheduler.step()


def _mean_over_processes(accelerator: Any, values: dict[str, float]) -> dict[str, float]:
    """``values`` averaged over the processes (equal slices: the global batch's means)."""
    if accelerator.num_processes == 1 or not values:
        return values
    t = torch.tensor(list(values.values()), dtype=torch.float64, device=accelerator.device)
    return dict(zip(values, accelerator.reduce(t, "mean").tolist(), strict=True))


def _latest_on_every_process(accelerator: Any, out: Path) -> Path | None:
    """The latest checkpoint in ``out``, checked to be the one every process sees."""
    found = latest_checkpoint(out)
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        seen = gather_object([found.name if found is not None else "none"])
        check(len(set(seen)) == 1, f"--out {out}: the processes see different checkpoints ({', '.join(seen)}); "
                                   "on several nodes --out must be on a file system they all share")
    return found


def launched_as_main() -> bool:
    """Whether this is process 0 of a data-parallel launch (or a lone run), before the loop's
    Accelerator exists: for progress bars of work done ahead of training."""
    return int(os.environ.get("RANK", "0")) == 0


def process_device(device: str) -> str:
    """``device`` for this process: a bare ``cuda`` becomes ``cuda:LOCAL_RANK`` under a
    data-parallel launcher, so each process of a node uses its own GPU (as accelerate does)."""
    local_rank = os.environ.get("LOCAL_RANK")
    if device == "cuda" and local_rank is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"cuda:{int(local_rank)}"
    return device


def _make_accelerator(accelerator_cls: Any, precision: str) -> Any:
    """An Accelerator for ``precision``. accelerate keeps process-global state; a single-process
    run (tests, notebooks) may train twice with different precisions, so reset it there."""
    from accelerate.state import AcceleratorState, DistributedType, PartialState

    before_process_group()  # accelerate's state creates the group: let end_process_group free it
    mixed = "bf16" if precision == "bf16" else "no"
    reset = getattr(AcceleratorState, "_reset_state", None)  # private API: skip if a release drops it
    if getattr(AcceleratorState, "_shared_state", None) and reset is not None \
            and PartialState().distributed_type == DistributedType.NO:
        reset(reset_partial_state=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # Under torchrun without a GPU, accelerate treats every process as a lone run unless told cpu=True
    # (``accelerate launch --cpu`` tells it through ACCELERATE_USE_CPU): the processes would overwrite
    # each other's output.
    accelerator = accelerator_cls(mixed_precision=mixed, cpu=world > 1 and not torch.cuda.is_available())
    check(accelerator.num_processes == world,
          f"launched as {world} processes (WORLD_SIZE) but accelerate sees {accelerator.num_processes}: "
          "launch with `accelerate launch` or `torchrun`, and check the accelerate configuration")
    return accelerator


def _save_checkpoint(accelerator: Any, out: Path, step: int, loop: LoopConfig, task: TrainTask,
                     parts: _TrainingState) -> None:
    """Process 0 writes ``checkpoints/step-N`` atomically (temp folder, then rename) and prunes old
    ones; the other processes wait for it (the state is the same on every process)."""
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        root = out / CHECKPOINT_DIR
        final = root / f"step-{step:08d}"
        tmp = root / f".tmp-step-{step:08d}"
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        state = {"step": step, "kind": task.kind, "loop": loop.to_dict(), "task": task.config_dict(),
                 "data_fingerprint": task.data_fingerprint(), "processes": accelerator.num_processes}
        try:
            _save_training_state(accelerator, tmp, parts)
            write_json(tmp / STATE_FILE, json.loads(json.dumps(state)))
        except OSError as e:  # a full disk, a quota: drop the half-written checkpoint, keep the earlier ones
            shutil.rmtree(tmp, ignore_errors=True)
            raise LanternError(f"--out: could not write checkpoint {final}: {e.strerror or e}; training stopped "
                               f"before step {step} was saved (earlier checkpoints are intact: free some space and "
                               "continue with --resume)") from None
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in _checkpoints(out)[: -loop.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


# ----------------------------------------------------------------------------------------------
# Checkpoint contents
# ----------------------------------------------------------------------------------------------


@dataclass
class _TrainingState:
    """What a checkpoint restores besides the step: the (prepared) model, optimiser, schedule and
    the task's extra state (an object with ``state_dict``/``load_state_dict``, or None)."""

    model: nn.Module
    optimizer: Any
    scheduler: Any
    extra: Any | None


def _save_training_state(accelerator: Any, directory: Path, parts: _TrainingState) -> None:
    """Weights as safetensors; optimiser, schedule and extra state as tensor-only torch files."""
    weights = accelerator.unwrap_model(parts.model).state_dict()
    save_safetensors({k: v.detach().contiguous().cpu() for k, v in weights.items()}, directory / MODEL_FILE)
    torch.save(parts.optimizer.state_dict(), directory / OPTIMIZER_FILE)
    torch.save(parts.scheduler.state_dict(), directory / SCHEDULER_FILE)
    if parts.extra is not None:
        torch.save(parts.extra.state_dict(), directory / EXTRA_FILE)


def _load_training_state(accelerator: Any, directory: Path, parts: _TrainingState) -> None:
    """Restore what :func:`_save_training_state` wrote; every file is read without unpickling code."""
    if not (directory / OPTIMIZER_FILE).is_file() and (directory / "optimizer.bin").is_file():
        raise LanternError(f"cannot resume from {directory}: it was written by an older lantern (accelerate's "
                           "pickled state, which lantern no longer reads); train into a new --out folder")
    weights = load_safetensors(directory / MODEL_FILE, "checkpoint weights")
    load_state_dict_strict(accelerator.unwrap_model(parts.model), weights, f"checkpoint weights in {directory}")
    _restore(parts.optimizer, directory / OPTIMIZER_FILE, "optimizer state")
    check_optimizer_shapes(parts.optimizer, accelerator.unwrap_model(parts.model),
                           f"optimizer state {directory / OPTIMIZER_FILE}")
    _restore(parts.scheduler, directory / SCHEDULER_FILE, "scheduler state")
    if parts.extra is not None:
        _restore(parts.extra, directory / EXTRA_FILE, "training state")


def _restore(obj: Any, path: Path, what: str) -> None:
    state = load_checkpoint(path, what)
    try:
        obj.load_state_dict(state)
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
        raise LanternError(f"{what} {path} does not fit this run: {e}") from None


def check_optimizer_shapes(optimizer: torch.optim.Optimizer, model: nn.Module, what: str) -> None:
    """Each per-parameter state tensor (AdamW's moments) has its parameter's shape. torch checks
    only how many parameters a loaded state has: one from a run of another width loads, and the
    first step failed deep inside the optimiser."""
    names = {id(param): name for name, param in model.named_parameters()}
    for param in (p for group in optimizer.param_groups for p in group["params"]):
        for key, value in optimizer.state.get(param, {}).items():
            if isinstance(value, Tensor) and value.dim() > 0 and value.shape != param.shape:
                raise LanternError(f"{what} does not fit this run: its {key} of {names.get(id(param), 'a parameter')} "
                                   f"has shape {tuple(value.shape)}, the parameter {tuple(param.shape)}")
