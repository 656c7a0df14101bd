"""EAGLE drafters for Chameleon-family targets (Anole, Lumina-mGPT), trained on self-distilled images.

Janus / Janus-Pro and Emu3 models train the same way, through their own target (the Chameleon
adapter with their guidance rows). Janus: the drafter's prefix is the image-start token's feature,
its code embeddings start from the model's generation embedding + aligner and its logits come from
the model's generation head (an MLP, shared frozen like Chameleon's Linear code head). Emu3: the
prefix is the size header's features, and row ends are read at the end-of-line token, as for
Lumina-mGPT.

LANTERN trains its Lumina-mGPT / Anole drafters on sequences the target generated itself, plus an
unconditional copy ([LANTERN code] generate_train_data.py). Here:

1. the target samples ``num_per_prompt`` images per prompt (plain AR, the run's sampling settings);
2. one teacher-forced pass per batch through the stack's own target (the chain
   of all codes verified as one tree) gives, for the conditional *and* the unconditional stream,
   exactly the features the drafter reads at inference: the image prefix's features, then per code
   the state that predicts the next code (at Lumina-mGPT's new-line token after a row's last code);
3. the drafter is trained on them with the LlamaGen drafter's loss and layout
   (:func:`lantern.train.drafter.teacher_forced_batch`, ``cls`` = the image prefix length), using
   the shared loop (accelerate, checkpoints, exact resume).

The features are kept on disk, not in memory (bfloat16, 2 x (prefix + codes) x hidden per image:
about 38 MB per Lumina-mGPT-768 image at 7B size, 380 GB for LANTERN's 10,000 images): one
file-backed tensor (``torch.from_file``, memory-mapped) per split in a temporary folder beside
``--out`` (or in ``feature_dir``), removed when the run ends. A batch reads its rows from it, so
memory holds what the page cache keeps, and the disk, checked before any image is generated, bounds
the run. Under ``torchrun`` each process writes its own copy.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import math
import os
import shutil
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lantern.decoding.config import SamplingConfig
from lantern.decoding.trees import tree_from_parents
from lantern.drafters.checks import check_chameleon_drafter
from lantern.errors import check
from lantern.methods import MethodConfig
from lantern.models.drafter import EagleDrafterModel
from lantern.outputs import made_folder, remove_stale_staging, staging_name
from lantern.run import run_conditions
from lantern.targets.base import Conditions
from lantern.targets.chameleon import encode_prompts
from lantern.targets.chameleon_stack import ChameleonStack, init_chameleon_drafter
from lantern.train.drafter import (
    TRAINING_INFO_FILE,
    DrafterBatch,
    DrafterRecipe,
    _FrozenHead,
    add_feature_noise,
    drafter_step_loss,
    state_fingerprint,
    teacher_forced_batch,
)
from lantern.train.loop import (
    BatchPart,
    LoopConfig,
    RunOptions,
    TrainResult,
    TrainTask,
    check_out_before_data,
    launched_as_main,
    train,
)

if TYPE_CHECKING:  # Janus models load through transformers, an optional extra
    from lantern.targets.janus import JanusStack


@torch.no_grad()
def teacher_forced_features(stack: ChameleonStack, token_lists: Sequence[Sequence[int]], codes: Tensor,
                            cfg_scale: float = 3.0) -> Tensor:
    """[2B, P + N, D] drafter features for a Chameleon stack's prompt token lists and their codes [B, N]
    (:func:`stack_features` of the prompts as ``encode_prompts`` lays them out)."""
    ids, mask = encode_prompts(token_lists, stack.layout)
    return stack_features(stack, Conditions(ids.to(stack.device), mask.to(stack.device)), codes, cfg_scale)


@torch.no_grad()
def stack_features(stack: ChameleonStack | JanusStack, conditions: Conditions, codes: Tensor,
                   cfg_scale: float = 3.0) -> Tensor:
    """[2B, P + N, D] drafter features for encoded prompts and their codes [B, N]: conditional rows,
    then unconditional ones, as the stack's own target hands them to the drafter (so a Janus
    model's guidance rows are its pad-token prompts, not Chameleon's guidance context)."""
    layout, lm = stack.layout, stack.model
    b, n = codes.shape
    check(n == layout.num_tokens, f"codes have {n} tokens per image, the layout {layout.num_tokens}")
    sampling = SamplingConfig(temperature=1.0, top_k=0, cfg_scale=max(cfg_scale, 1.0 + 1e-3))  # 2 streams
    target = stack.make_target(sampling, max_tree_nodes=n)
    _, prefix = target.start(conditions.cond.to(lm.device), None if conditions.mask is None
                             else conditions.mask.to(lm.device))  # [2B, P, D]
    chain = tree_from_parents(torch.arange(-1, n - 1, device=lm.device).expand(b, -1).contiguous())
    _, hidden = target.verify(codes.to(lm.device), chain.mask, chain.depth)  # [2B, N, D]
    return torch.cat([prefix, hidden], dim=1)


def head_fingerprint(stack: ChameleonStack | JanusStack) -> str:
    """sha256 of the code head the drafter shares (all its parameters: Janus's is an MLP): a
    different target changes it."""
    data = b"".join(p.detach().float().cpu().numpy().tobytes() for p in stack.model.image_head.parameters())
    return hashlib.sha256(data).hexdigest()


def starting_drafter(stack: ChameleonStack | JanusStack, seed: int,
                     initial: EagleDrafterModel | None) -> EagleDrafterModel:
    """The drafter training starts from: a float32 copy of ``initial``, else one initialised from the target."""
    if initial is not None:
        check_chameleon_drafter(initial.config, stack.model, stack.layout, "--initial", family=stack.kind)
        return copy.deepcopy(initial).float()
    return init_chameleon_drafter(stack.model, stack.layout, seed).float()


def drafter_settings(recipe: DrafterRecipe, drafter: dict[str, Any], initial_fingerprint: str) -> dict[str, Any]:
    """The task's settings a resumed run must share, but for its data (``data``, known once the images are made)."""
    return {"recipe": recipe.to_dict(), "drafter": drafter, "initial_weights": initial_fingerprint}


class ChameleonDrafterTask(TrainTask):
    """Drafter training on in-memory teacher-forced features (run by :func:`lantern.train.loop.train`)."""

    kind = "drafter"
    model: EagleDrafterModel

    def __init__(self, stack: ChameleonStack | JanusStack, hidden: Tensor, codes: Tensor, test_hidden: Tensor,
                 test_codes: Tensor, recipe: DrafterRecipe, seed: int, start: EagleDrafterModel, data_id: str) -> None:
        check(hidden.shape[0] >= 1, "drafter training: no training examples")
        self.stack, self.recipe, self.seed, self.data_id = stack, recipe, seed, data_id
        self.hidden, self.codes, self.test_hidden, self.test_codes = hidden, codes, test_hidden, test_codes
        self.cls = len(stack.layout.prefix)
        self.model = start  # (starting_drafter's: trained in place)
        self.model.embed_tokens.weight.requires_grad_(not recipe.freeze_embeddings)
        self.initial_fingerprint = state_fingerprint(self.model)
        self.lm_head = _FrozenHead(stack.model.image_head)

    def bind(self, accelerator: Any) -> None:
        super().bind(accelerator)
        self.lm_head.to(accelerator.device)  # the frozen image head scores on the training device

    def num_examples(self) -> int:
        return int(self.hidden.shape[0])

    def make_batch(self, indices: Tensor, step: int, device: torch.device,
                   part: BatchPart | None = None) -> DrafterBatch:
        batch = teacher_forced_batch(self.hidden[indices].float(), self.codes[indices], self.cls)
        return add_feature_noise(batch, self.recipe, self.seed, step, part).to(device)

    def loss(self, model: nn.Module, batch: DrafterBatch, step: int) -> tuple[Tensor, dict[str, float]]:
        return drafter_step_loss(model, batch, self.lm_head, self.recipe)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        assert isinstance(model, EagleDrafterModel)
        return teacher_forced_metrics(model, self.lm_head, self.test_hidden, self.test_codes, self.cls)

    def save(self, model: nn.Module, out: Path) -> None:
        assert isinstance(model, EagleDrafterModel)
        info = {"target_head_fingerprint": head_fingerprint(self.stack), "layout": self.stack.layout.name,
                "recipe": self.recipe.to_dict(), "data": self.data_id}
        model.save_pretrained(out, extra_files={TRAINING_INFO_FILE: info})

    def config_dict(self) -> dict[str, Any]:
        return {**drafter_settings(self.recipe, self.model.config.to_dict(), self.initial_fingerprint),
                "data": self.data_id}

    def data_fingerprint(self) -> str:
        return self.data_id


@torch.no_grad()
def teacher_forced_metrics(drafter: EagleDrafterModel, head: nn.Module, hidden: Tensor, codes: Tensor, cls: int,
                           batch_size: int = 16) -> dict[str, float]:
    """Held-out ``top1`` (drafter argmax = target argmax) and ``accept_prob`` (mean Σ min(p, q),
    the single-draft exact acceptance probability at temperature 1)."""
    was_training = drafter.training
    drafter.eval()
    top1 = accept = 0.0
    count = 0
    for lo in range(0, hidden.shape[0], batch_size):
        batch = teacher_forced_batch(hidden[lo : lo + batch_size].float(), codes[lo : lo + batch_size], cls)
        batch = batch.to(drafter.device)
        pred = drafter(batch.features, batch.tokens, batch.positions, batch.mask)
        m = batch.loss_mask
        p, q = head(batch.targets[m]).softmax(-1), head(pred[m]).softmax(-1)
        top1 += float((p.argmax(-1) == q.argmax(-1)).sum())
        accept += float(torch.minimum(p, q).sum(-1).sum())
        count += int(m.sum())
    drafter.train(was_training)
    if not count:  # no held-out images (--eval-prompts 0): nothing was measured, and 0 would read as a score
        return {"top1": float("nan"), "accept_prob": float("nan")}
    return {"top1": top1 / count, "accept_prob": accept / count}


def train_chameleon_drafter(
    stack: ChameleonStack | JanusStack, prompts: Sequence[str], loop: LoopConfig, options: RunOptions, *,
    sampling: SamplingConfig, num_per_prompt: int = 1, eval_prompts: int = 1, recipe: DrafterRecipe | None = None,
    initial: EagleDrafterModel | None = None, batch_size: int = 8,
    feature_dir: str | os.PathLike[str] | None = None,
) -> TrainResult:
    """Self-distil images for ``prompts`` (the last ``eval_prompts`` held out), extract features,
    train; the result in ``options.out`` loads with ``EagleDrafterModel.from_pretrained``. Data-parallel,
    every process self-distils all images (deterministic: the same on each), then trains its slice.
    ``feature_dir``: where the features' temporary folder goes (default: beside ``options.out``)."""
    check(num_per_prompt >= 1, f"--num-per-prompt must be >= 1, got {num_per_prompt}")
    check(0 <= eval_prompts < len(prompts), f"--eval-prompts must be in [0, {len(prompts)}), got {eval_prompts}")
    recipe = recipe or DrafterRecipe()
    # what would refuse the run after the images are made, refused before (a real target takes hours on them)
    start = starting_drafter(stack, loop.seed, initial)
    check_out_before_data(options.out, loop, ChameleonDrafterTask.kind,
                          drafter_settings(recipe, start.config.to_dict(), state_fingerprint(start)), options.resume)
    all_prompts = [p for p in prompts for _ in range(num_per_prompt)]
    images = len(all_prompts)
    split = images - eval_prompts * num_per_prompt  # the last prompts' images are held out
    width = len(stack.layout.prefix) + stack.layout.num_tokens
    with feature_parent(options.out, feature_dir) as parent:
        check_feature_space(parent, 2 * images * width * stack.model.hidden_size * torch.bfloat16.itemsize)
        conditions = stack.encode(all_prompts)
        result = run_conditions(stack, conditions, loop.seed, sampling, MethodConfig(), batch_size,
                                progress=options.progress and launched_as_main())
        codes = result.codes.cpu()
        train_codes, test_codes = torch.cat([codes[:split], codes[:split]]), torch.cat([codes[split:], codes[split:]])
        data_id = hashlib.sha256(codes.numpy().tobytes() + repr(list(prompts)).encode()).hexdigest()
        with feature_folder(parent, options.out) as folder:
            shape = (width, stack.model.hidden_size)
            # rows: conditional images then unconditional ones, each split in prompt order
            hidden = file_tensor(Path(folder) / "train.bf16", (2 * split, *shape))
            test_hidden = file_tensor(Path(folder) / "test.bf16", (2 * (images - split), *shape))
            for lo in range(0, images, batch_size):
                hi = min(lo + batch_size, images)
                h = stack_features(stack, conditions.rows(lo, hi), result.codes[lo:hi], sampling.cfg_scale)
                _write_rows(hidden, test_hidden, h.to("cpu", torch.bfloat16), lo, split, images)
            task = ChameleonDrafterTask(stack, hidden, train_codes, test_hidden, test_codes, recipe, loop.seed,
                                        start, data_id)
            return train(task, loop, options)


@contextlib.contextmanager
def feature_parent(out: str | os.PathLike[str], feature_dir: str | os.PathLike[str] | None) -> Iterator[Path]:
    """The folder the features' temporary folder goes in: ``feature_dir``, else ``out``'s parent
    (the disk the user chose for the run), created if missing, and removed again afterwards if it
    was created and is left empty (a failed run leaves no folder behind)."""
    parent = Path(feature_dir) if feature_dir is not None else Path(out).resolve().parent
    flag = "--feature-dir" if feature_dir is not None else "--out"
    with made_folder(parent, flag) as made:
        check(made.is_dir(), f"{flag}: {made} is not a folder (the training features are kept there)")
        yield made


@contextlib.contextmanager
def feature_folder(parent: Path, out: str | os.PathLike[str]) -> Iterator[Path]:
    """The run's temporary features folder in ``parent``, ``.OUT-features-HOST.tmp-PID``, removed
    afterwards. A SIGKILLed run cannot remove its own (up to about 95 GB for Janus-Pro-7B): the next
    run on this host removes those whose process is gone. The host is in the name because
    ``--feature-dir`` may be shared by the nodes of a job, whose PIDs this host cannot see."""
    base = parent / f"{Path(out).name}-features-{socket.gethostname()}"
    remove_stale_staging(base)
    folder = parent / staging_name(base.name)
    folder.mkdir()
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def check_feature_space(parent: Path, needed: int) -> None:
    """One line, before any image is generated, when ``parent``'s disk cannot hold ``needed`` bytes."""
    free = shutil.disk_usage(parent).free
    check(needed <= free, f"drafter training needs {needed / 1e9:.2f} GB for its features in {parent}, which has "
                          f"{free / 1e9:.2f} GB free: pass --feature-dir on a larger disk, or fewer prompts")


def file_tensor(path: Path, shape: tuple[int, ...]) -> Tensor:
    """A zeroed bfloat16 tensor of ``shape`` backed by the file ``path`` (memory-mapped, shared):
    writes go to the file, reads come from the page cache."""
    numel = math.prod(shape)
    if numel == 0:  # mmap cannot map an empty file
        return torch.zeros(shape, dtype=torch.bfloat16)
    return torch.from_file(str(path), shared=True, size=numel, dtype=torch.bfloat16).view(shape)


def _write_rows(hidden: Tensor, test_hidden: Tensor, h: Tensor, lo: int, split: int, images: int) -> None:
    """Rows of ``h`` [2b, W, D] (images lo..lo+b: conditional, then unconditional) into their places:
    training image i at rows i and split + i, held-out image i at i - split and i - split + held-out."""
    b = h.shape[0] // 2
    idx = torch.arange(lo, lo + b)
    fit, held = idx < split, idx >= split  # training images, held-out images
    hidden[idx[fit]] = h[:b][fit]
    hidden[split + idx[fit]] = h[b:][fit]
    test_hidden[idx[held] - split] = h[:b][held]
    test_hidden[images - split + idx[held] - split] = h[b:][held]
