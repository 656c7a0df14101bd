"""Training sub-commands of ``lantern``: from images to model folders.

    lantern train-tokenizer  --data photos --out runs/tok
    lantern extract-codes    --tokenizer runs/tok --data photos --out runs/codes
    lantern train-target     --codes runs/codes --out runs/target
    lantern make-drafter-data --target runs/target --codes runs/codes --out runs/ddata
    lantern train-drafter    --target runs/target --data runs/ddata --out runs/drafter
    lantern train-features   --data photos --out runs/features   (feature net for lantern.eval.metrics)

Every trainer checkpoints into ``OUT/checkpoints`` and continues exactly with ``--resume``;
``accelerate launch -m lantern.cli train-...`` (or ``torchrun -m lantern.cli train-...``) runs the
same command data-parallel with the same global ``--batch-size`` (see :mod:`lantern.train.loop`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from lantern.cli.common import add_sampling_args
from lantern.errors import LanternError, check
from lantern.validate import MAX_TRAIN_STEPS


def _int_tuple(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def _command() -> str:
    return "lantern " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def _add_loop_args(p: argparse.ArgumentParser, steps: int, batch_size: int, lr: float, warmup: int,
                   checkpoint_every: int, clip_mode: str = "norm", grad_clip: float = 1.0,
                   weight_decay: float = 0.0) -> None:
    g = p.add_argument_group("optimisation and checkpoints")
    g.add_argument("--steps", type=int, default=steps,
                   help=f"optimiser steps, at most {MAX_TRAIN_STEPS:,} (default {steps})")
    g.add_argument("--batch-size", type=int, default=batch_size, help=f"global batch size (default {batch_size})")
    g.add_argument("--lr", type=float, default=lr, help=f"peak learning rate (default {lr})")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr / peak lr (default 0.1)")
    g.add_argument("--warmup-steps", type=int, default=warmup, help=f"linear warm-up steps (default {warmup})")
    g.add_argument("--schedule", choices=["cosine", "linear", "constant"], default="cosine")
    g.add_argument("--weight-decay", type=float, default=weight_decay, help=f"AdamW decay (default {weight_decay})")
    g.add_argument("--grad-clip", type=float, default=grad_clip, help=f"0 = off (default {grad_clip})")
    g.add_argument("--clip-mode", choices=["norm", "value"], default=clip_mode, help=f"(default {clip_mode})")
    g.add_argument("--precision", choices=["bf16", "fp32"], default="bf16", help="bf16 autocast (default) or fp32")
    g.add_argument("--seed", type=int, default=0, help="initial weights, data order and every random draw")
    g.add_argument("--checkpoint-every", type=int, default=checkpoint_every,
                   help=f"steps between checkpoints (default {checkpoint_every})")
    g.add_argument("--keep-checkpoints", type=int, default=2)
    g.add_argument("--log-every", type=int, default=10)
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    g.add_argument("--stop-after", type=int, default=None, help=argparse.SUPPRESS)  # tests: simulate a kill
    g.add_argument("--no-progress", action="store_true", help="hide progress bars")
    from lantern.cli.common import add_threads_arg, add_trust_checkpoint_arg

    add_trust_checkpoint_arg(g)
    add_threads_arg(p)
    p.set_defaults(threads_follow_load=True)  # auto: adapted while training, not decided once at start


def _loop(args: argparse.Namespace) -> Any:
    """The loop settings; also checks --out before any data is read (every trainer calls this first)."""
    from lantern.outputs import check_training_out
    from lantern.train.loop import LoopConfig

    check_training_out(args.out)
    return LoopConfig(
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, min_lr_ratio=args.min_lr_ratio,
        warmup_steps=args.warmup_steps, schedule=args.schedule, weight_decay=args.weight_decay,
        grad_clip=args.grad_clip, clip_mode=args.clip_mode, precision=args.precision, seed=args.seed,
        checkpoint_every=args.checkpoint_every, keep_checkpoints=args.keep_checkpoints, log_every=args.log_every,
    )


def _run_options(args: argparse.Namespace) -> Any:
    """--out, --resume, --no-progress and --stop-after as the trainers' :class:`RunOptions`."""
    from lantern.cli.common import adapts_threads
    from lantern.train.loop import RunOptions

    return RunOptions(args.out, resume=args.resume, progress=not args.no_progress, stop_after=args.stop_after,
                      command=_command(), adapt_threads=args.threads == "auto" and adapts_threads("cpu"))


def _add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("images")
    g.add_argument("--data", required=True, help="photos | digits | a folder of .png/.jpg images")
    g.add_argument("--labels-file", default=None, help="folder data: CSV lines 'filename,label'")
    g.add_argument("--image-size", type=int, default=None, help="square side in pixels (photos 64, digits 32)")
    g.add_argument("--channels", type=int, choices=[1, 3], default=None, help="1 (grey) or 3 (RGB)")
    g.add_argument("--num-samples", type=int, default=None, help="training images (photos: crops; default 20000)")
    g.add_argument("--eval-samples", type=int, default=None, help="held-out images (photos default 2000)")
    g.add_argument("--data-seed", type=int, default=0, help="seed of the crops (photos)")


def _datasets(args: argparse.Namespace) -> tuple[Any, Any]:
    from lantern.data import load_dataset
    from lantern.data.base import MAX_IMAGE_SIDE
    from lantern.validate import check_count

    # named by their flags here (the data sets know them as num_samples, image_size)
    for flag, value in (("--num-samples", args.num_samples), ("--eval-samples", args.eval_samples),
                        ("--image-size", args.image_size)):
        if value is not None:
            check_count(value, flag)
    check(args.image_size is None or args.image_size <= MAX_IMAGE_SIDE,
          f"--image-size must be at most {MAX_IMAGE_SIDE} pixels, got {args.image_size}")
    common = dict(image_size=args.image_size, seed=args.data_seed, labels_file=args.labels_file,
                  channels=args.channels)
    train = load_dataset(args.data, "train", num_samples=args.num_samples, **common)
    test = load_dataset(args.data, "test", num_samples=args.eval_samples, **common)
    return train, test


def _report(kind: str, result: Any) -> int:
    if not result.main_process:  # data-parallel: process 0 reports for all
        return 0
    if result.nothing_to_do:
        print(f"nothing to do: {result.out} holds a finished {kind} run of {result.resumed_from} steps; it was left "
              "untouched (choose a new --out to train again)")
        return 0
    if not result.finished:
        print(f"stopped after {result.steps_run} steps; continue with --resume")
        return 0
    metrics = ", ".join(f"{k} {v:.4g}" for k, v in result.metrics.items())
    print(f"wrote {kind} to {result.out} | {metrics}")
    return 0


# ----------------------------------------------------------------------------------------------


def _add_train_tokenizer(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-tokenizer", help="train a VQ tokenizer on images",
                       description="Train a LlamaGen-architecture VQ tokenizer; reports held-out PSNR.")
    _add_data_args(p)
    p.add_argument("--out", required=True, help="output folder (VQ tokenizer folder + checkpoints)")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--codebook-size", type=int, default=1024)
    g.add_argument("--codebook-dim", type=int, default=8)
    g.add_argument("--ch", type=int, default=64, help="base channel width (default 64)")
    g.add_argument("--ch-mult", type=_int_tuple, default=(1, 2, 2),
                   help="channel multipliers; len-1 halvings (default 1,2,2 -> 4x downsampling)")
    g.add_argument("--z-channels", type=int, default=64)
    g.add_argument("--num-res-blocks", type=int, default=1)
    g.add_argument("--norm-groups", type=int, default=16)
    g.add_argument("--recon-loss", choices=["l1", "l2"], default="l2")
    g.add_argument("--restart-every", type=int, default=50, help="dead-code restart period in steps; 0 = off")
    g.add_argument("--eval-images", type=int, default=512)
    _add_loop_args(p, steps=2000, batch_size=32, lr=1e-3, warmup=50, checkpoint_every=200)
    p.set_defaults(func=cmd_train_tokenizer)


def cmd_train_tokenizer(args: argparse.Namespace) -> int:
    from lantern.models.vq import VQConfig
    from lantern.train.tokenizer import TokenizerRecipe, train_tokenizer
    from lantern.validate import check_count, check_host_memory

    check_count(args.codebook_size, "--codebook-size")
    check_count(args.codebook_dim, "--codebook-dim")
    # The codebook with its gradient and AdamW's two moments, float32: the one part of the
    # tokenizer whose size a flag sets without bound.
    check_host_memory(args.codebook_size * args.codebook_dim * 4 * 4, "the codebook (with its gradient and optimiser "
                      "state)", "--codebook-size")
    loop = _loop(args)
    recipe = TokenizerRecipe(recon_loss=args.recon_loss, restart_every=args.restart_every,
                             eval_images=args.eval_images)
    train, test = _datasets(args)
    config = VQConfig(codebook_size=args.codebook_size, codebook_embed_dim=args.codebook_dim, ch=args.ch,
                      ch_mult=args.ch_mult, z_channels=args.z_channels, num_res_blocks=args.num_res_blocks,
                      norm_groups=args.norm_groups, in_channels=train.channels)
    result = train_tokenizer(config, train, test, recipe, loop, _run_options(args))
    return _report("tokenizer", result)


def _add_extract_codes(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("extract-codes", help="encode a data set's images into code grids",
                       description="Write OUT/train.safetensors and OUT/test.safetensors (codes + labels).")
    p.add_argument("--tokenizer", required=True, help="VQ tokenizer folder (or a Hugging Face repo id of one)")
    _add_data_args(p)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--overwrite", action="store_true", help="replace an existing non-empty --out folder")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_extract_codes)


def cmd_extract_codes(args: argparse.Namespace) -> int:
    from pathlib import Path

    from lantern.hub import resolve_location
    from lantern.io import write_json
    from lantern.models.vq import VQModel
    from lantern.outputs import OutputFolder
    from lantern.train.codes import extract_code_dir
    from lantern.validate import check_count

    check_count(args.batch_size, "--batch-size")
    out = OutputFolder.check(args.out, "--out", args.overwrite, reads={"--tokenizer": args.tokenizer,
                                                                       "--data": args.data})
    folder = Path(resolve_location(args.tokenizer, "--tokenizer"))  # a Hub repo id too, as generate's --tokenizer
    if not folder.is_dir():
        raise LanternError(f"--tokenizer: no such folder {args.tokenizer} (make one with `lantern train-tokenizer`)")
    if not (folder / "config.json").is_file():
        raise LanternError(f"--tokenizer: {args.tokenizer} has no config.json: not a VQ tokenizer folder (make one "
                           "with `lantern train-tokenizer`)")
    tokenizer = VQModel.from_pretrained(folder)
    train, test = _datasets(args)
    _note_other_image_size(folder, train.image_size)
    with out.write() as staged:
        sets = extract_code_dir(tokenizer, train, test, staged, args.batch_size, progress=not args.no_progress)
        write_json(staged / "extract_config.json", {"command": _command(), "tokenizer": str(args.tokenizer),
                                                    "train": sets["train"].meta, "test": sets["test"].meta})
    s = sets["train"]
    print(f"wrote {len(s)} train / {len(sets['test'])} test code grids ({s.seq_len} tokens, vocab {s.vocab_size}, "
          f"{s.num_classes} classes) to {args.out}")
    return 0


def _note_other_image_size(tokenizer: Path, image_size: int) -> None:
    """A note when the images are not the size a lantern-trained tokenizer learned on: its
    convolutions encode any multiple of the downsampling, so this is allowed (LlamaGen encodes
    384-pixel images with a VQ trained at 256), but a forgotten --image-size gives a target for
    other images than meant, found out only after train-target."""
    from lantern.io import TRAIN_CONFIG_FILE

    try:
        trained = json.loads((tokenizer / TRAIN_CONFIG_FILE).read_text(encoding="utf-8"))["task"]["data"]["image_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # not trained by lantern (or its record is unreadable): nothing to compare with
    if isinstance(trained, int) and trained != image_size:
        print(f"lantern: note: --tokenizer was trained on {trained}-pixel images; these codes are of "
              f"{image_size}-pixel images (pass --image-size {trained} for the tokenizer's own size)", file=sys.stderr)


def _add_train_target(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-target", help="train a class-conditional LlamaGen target on code grids",
                       description="Next-token training with class dropout (for CFG); reports held-out "
                                   "bits per token against a unigram baseline.")
    p.add_argument("--codes", required=True, help="folder written by `lantern extract-codes`")
    p.add_argument("--out", required=True, help="output folder (LlamaGen model folder + checkpoints)")
    g = p.add_argument_group("model")
    g.add_argument("--dim", type=int, default=256)
    g.add_argument("--n-layer", type=int, default=8)
    g.add_argument("--n-head", type=int, default=8)
    g.add_argument("--multiple-of", type=int, default=64, help="FFN width rounding (LlamaGen: 256)")
    g.add_argument("--dropout", type=float, default=0.1, help="token/residual/FFN dropout (default 0.1)")
    g.add_argument("--class-dropout", type=float, default=0.1, help="label -> null class rate, for CFG (0.1)")
    g.add_argument("--init-std", type=float, default=0.02)
    _add_loop_args(p, steps=3000, batch_size=32, lr=1e-3, warmup=100, checkpoint_every=250, weight_decay=0.05)
    p.set_defaults(func=cmd_train_target)


def _check_dropout(value: float, arg: str) -> None:
    """A dropout rate in [0, 1): nan passes torch's own check and trains a model of NaNs, and 1
    zeroes every activation."""
    import math

    if not (math.isfinite(value) and 0.0 <= value < 1.0):
        raise LanternError(f"{arg} must be a rate in [0, 1), got {value!r}")


def cmd_train_target(args: argparse.Namespace) -> int:
    from lantern.train.codes import load_code_dir
    from lantern.train.llamagen import TargetRecipe, target_config_for, train_target

    _check_dropout(args.dropout, "--dropout")
    loop = _loop(args)
    recipe = TargetRecipe(class_dropout=args.class_dropout)
    train, test = load_code_dir(args.codes, "train"), load_code_dir(args.codes, "test")
    config = target_config_for(train, dim=args.dim, n_layer=args.n_layer, n_head=args.n_head,
                               multiple_of=args.multiple_of, class_dropout_prob=args.class_dropout,
                               token_dropout_p=args.dropout, resid_dropout_p=args.dropout, ffn_dropout_p=args.dropout)
    result = train_target(config, train, test, recipe, loop, _run_options(args), init_std=args.init_std)
    return _report("target", result)


def _add_make_drafter_data(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-drafter-data", help="teacher-forced target features for drafter training",
                       description="Run the target over real code grids (the paper's recipe) and store its "
                                   "final-norm hidden states: OUT/train and OUT/test. A text-to-image target "
                                   "takes real captioned images (--images, LANTERN's recipe) or --prompts: it "
                                   "samples its own images of them (self-distillation).")
    p.add_argument("--target", required=True, help="target model folder (or stack folder)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--codes", help="folder written by `lantern extract-codes` (class-conditional targets)")
    source.add_argument("--prompts", metavar="FILE",
                        help="text-to-image stacks: the prompts (one per line; a .tsv's Prompt column; a .json of "
                             "captions) whose self-generated images the features are made of")
    source.add_argument("--images", metavar="DIR",
                        help="text-to-image stacks: real images, each with its caption in a .txt beside it "
                             "(img2dataset's layout, sub-folders included), encoded by the stack's tokenizer")
    t2i = p.add_argument_group("with --prompts or --images")
    t2i.add_argument("--num-per-prompt", type=int, default=None,
                     help="--prompts: images sampled per prompt (default 1)")
    t2i.add_argument("--eval-prompts", type=int, default=None,
                     help="the last N prompts (--images: images) are held out as OUT/test (default a tenth, at "
                          "least 1)")
    t2i.add_argument("--t5", default=None, metavar="DIR", help="T5 encoder folder (default: t5/ in the stack)")
    add_sampling_args(p)
    p.add_argument("--out", required=True, help="output folder (OUT/train, OUT/test)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing non-empty --out folder")
    p.add_argument("--cond-dropout", type=float, default=0.1, help="rate of rows run unconditionally (0.1)")
    p.add_argument("--source", choices=["real", "generated"], default="real",
                   help="real codes only, or also self-distilled sequences sampled from the target")
    p.add_argument("--num-generated", type=int, default=0, help="with --source generated: sequences to sample")
    p.add_argument("--max-sequences", type=int, default=None, help="use at most this many training code grids")
    p.add_argument("--max-test-sequences", type=int, default=1000, help="held-out grids kept (default 1000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_make_drafter_data)


def _load_target(path: str) -> Any:
    from pathlib import Path

    from lantern.models.llamagen import LlamaGen

    root = Path(path)
    if not root.is_dir():
        raise LanternError(f"--target: no such folder {root}")
    return LlamaGen.from_pretrained(root / "target" if (root / "target").is_dir() else root).eval()


def cmd_make_drafter_data(args: argparse.Namespace) -> int:

    from lantern.outputs import OutputFolder
    from lantern.train.codes import CodeSet, load_code_dir
    from lantern.train.drafter import make_drafter_data

    out = OutputFolder.check(args.out, "--out", args.overwrite, reads={"--target": args.target,
                                                                       "--codes": args.codes, "--images": args.images})
    for name, value in (("--max-sequences", args.max_sequences), ("--max-test-sequences", args.max_test_sequences)):
        if value is not None and value < 1:
            raise LanternError(f"{name} must be >= 1, got {value}")
    if args.prompts is not None or args.images is not None:
        return _make_caption_drafter_data(args, out)
    given = [flag for flag in PROMPT_ONLY if getattr(args, flag[2:].replace("-", "_")) is not None]
    check(not given, f"{given[0] if given else ''} is used with --prompts (a text-to-image target's self-generated "
                     "images); --codes' features are of real code grids")
    target = _load_target(args.target)
    splits = {split: load_code_dir(args.codes, split) for split in ("train", "test")}
    with out.write() as folder:
        for split, codes in splits.items():
            limit = args.max_sequences if split == "train" else args.max_test_sequences
            if limit is not None and limit < len(codes):  # the first rows: classes stay balanced (i % classes)
                codes = CodeSet(codes.codes[:limit], codes.labels[:limit], codes.meta)
            make_drafter_data(target, codes, folder / split, cond_dropout=args.cond_dropout, seed=args.seed,
                              batch_size=args.batch_size, progress=not args.no_progress,
                              source=args.source if split == "train" else "real",
                              num_generated=args.num_generated if split == "train" else 0)
    print(f"wrote drafter data to {out.path}/train and {out.path}/test")
    return 0


# flags of `make-drafter-data --prompts` only
PROMPT_ONLY = ("--num-per-prompt", "--eval-prompts", "--t5", "--temperature", "--top-k", "--top-p", "--cfg-scale")


def _make_caption_drafter_data(args: argparse.Namespace, out: Any) -> int:
    """``make-drafter-data --prompts`` (a text-to-image stack's self-distilled features) or
    ``--images`` (real captioned images'), the last ``--eval-prompts`` prompts or images held out
    (OUT/test), so that no test image shares a prompt with training."""
    from lantern.api import load_model_stack, sampling_from
    from lantern.data.captions import caption_folder
    from lantern.targets.text import read_prompts
    from lantern.train.drafter import EvalConfig, make_caption_drafter_data, make_prompt_drafter_data

    flag, unit = ("--prompts", "prompt") if args.prompts is not None else ("--images", "image")
    codes_only = [name for name, value in (("--source", args.source != "real"), ("--num-generated", args.num_generated),
                                           ("--max-sequences", args.max_sequences is not None)) if value]
    rows_are = ("self-generated (--num-per-prompt sets how many)" if flag == "--prompts"
                else "one of the folder's images")
    check(not codes_only, f"{codes_only[0] if codes_only else ''} is used with --codes; with {flag} every row is "
                          f"{rows_are}")
    if flag == "--images":  # real images: nothing is sampled
        sampled = [name for name in PROMPT_ONLY if name not in ("--eval-prompts", "--t5")
                   and getattr(args, name[2:].replace("-", "_")) is not None]
        check(not sampled, f"{sampled[0] if sampled else ''} is used with --prompts, whose images the target samples; "
                           "--images are real")
    rows: list[Any] = read_prompts(args.prompts) if flag == "--prompts" else caption_folder(args.images)
    source = args.prompts if flag == "--prompts" else args.images
    check(len(rows) >= 2, f"{flag}: {source} holds 1 {unit}; drafter data needs at least 2 (one is held out for the "
                          "evaluation)")
    held = args.eval_prompts if args.eval_prompts is not None else max(1, len(rows) // 10)
    check(1 <= held < len(rows), f"--eval-prompts must be in 1..{len(rows) - 1} ({source}'s {len(rows)} {unit}s "
                                 f"less at least one to train on), got {held}")
    stack = load_model_stack(args.target)
    check(getattr(stack, "kind", None) == "t2i", f"{flag}: {args.target} is not a text-to-image LlamaGen stack "
                                                 "(class-conditional targets take --codes; Chameleon-family, Janus "
                                                 "and Emu3 models train with `lantern train-chameleon-drafter`)")
    sampling = sampling_from(stack, args) if flag == "--prompts" else None
    per_prompt = 1 if args.num_per_prompt is None else args.num_per_prompt
    splits = {"train": rows[:-held], "test": rows[-held:]}
    with out.write() as folder:
        for split, part in splits.items():
            common = {"cond_dropout": args.cond_dropout, "seed": args.seed + (split == "test"),
                      "batch_size": args.batch_size, "t5": args.t5, "progress": not args.no_progress,
                      "keep_captions": EvalConfig().num_rows if split == "test" else 0}
            if flag == "--prompts":
                make_prompt_drafter_data(stack, part, folder / split, num_per_prompt=per_prompt, sampling=sampling,
                                         **common)
            else:
                make_caption_drafter_data(stack, part, folder / split, **common)
    each = f", {per_prompt} image(s) each" if flag == "--prompts" else ""
    print(f"wrote drafter data to {out.path}/train ({len(splits['train'])} {unit}s) and {out.path}/test "
          f"({held} {unit}s){each}")
    return 0


def _add_drafter_loss_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("loss")
    g.add_argument("--p-weight", type=float, default=0.1, help="soft cross-entropy weight (default 0.1)")
    g.add_argument("--v-weight", type=float, default=1.0, help="feature regression weight (default 1.0)")
    g.add_argument("--noise-width", type=float, default=0.2, help="uniform input-feature noise width (0.2)")


def _recipe(args: argparse.Namespace) -> Any:
    from lantern.train.drafter import DrafterRecipe

    return DrafterRecipe(p_weight=args.p_weight, v_weight=args.v_weight, noise_width=args.noise_width)


def _add_train_drafter(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-drafter", help="train an EAGLE drafter for a target",
                       description="SmoothL1(features) + w * soft-CE(logits) with input-feature noise (EAGLE/LANTERN); "
                                   "reports held-out top-1/top-3 agreement and the mean accepted length.")
    p.add_argument("--target", required=True, help="target model folder (or stack folder)")
    p.add_argument("--data", required=True, help="folder written by `lantern make-drafter-data`")
    p.add_argument("--out", required=True)
    _add_drafter_loss_args(p)
    p.add_argument("--no-eval-generation", action="store_true", help="skip the short speculative generation")
    _add_loop_args(p, steps=3000, batch_size=32, lr=1e-3, warmup=100, checkpoint_every=250, clip_mode="value",
                   grad_clip=0.5)
    p.set_defaults(func=cmd_train_drafter)


def cmd_train_drafter(args: argparse.Namespace) -> int:
    from pathlib import Path

    from lantern.train.drafter import DrafterData, train_drafter

    loop = _loop(args)
    recipe = _recipe(args)
    target = _load_target(args.target)
    data = Path(args.data)
    if not data.is_dir():
        raise LanternError(f"--data: no such folder {data} (make it with `lantern make-drafter-data`)")
    result = train_drafter(target, DrafterData.load(data / "train"), DrafterData.load(data / "test"), recipe, loop,
                           _run_options(args), eval_generation=not args.no_eval_generation)
    return _report("drafter", result)


def _add_train_chameleon_drafter(sub: argparse._SubParsersAction) -> None:
    from lantern.cli.common import add_prompt_width_arg

    p = sub.add_parser(
        "train-chameleon-drafter", help="train an EAGLE drafter for an Anole / Lumina-mGPT / Janus / Emu3 model",
        description="The target generates images for the prompts (AR, the sampling settings below), its "
                    "teacher-forced features (conditional and unconditional streams) train the drafter with "
                    "the same loss as train-drafter; the last --eval-prompts prompts are held out.")
    p.add_argument("--model", required=True, help="Chameleon-family, Janus or Emu3 model folder (as for generate)")
    p.add_argument("--layout", default=None, choices=["anole", "lumina-mgpt"],
                   help="image layout (default: \"layout\" in the folder's generation.json)")
    p.add_argument("--image-size", type=int, default=None,
                   help="image height in pixels, and width unless --image-width is given (lumina-mgpt: 768; emu3: "
                        "generation.json's, else 720)")
    p.add_argument("--image-width", type=int, default=None, metavar="PIXELS",
                   help="lumina-mgpt and emu3: image width in pixels (default: as high)")
    p.add_argument("--vq", default=None, metavar="CKPT", help="vqgan.ckpt, if not inside --model")
    add_prompt_width_arg(p)
    p.add_argument("--prompts", required=True, metavar="FILE", help="UTF-8 text file, one prompt per line")
    p.add_argument("--num-per-prompt", type=int, default=1, help="images generated per prompt (default 1)")
    p.add_argument("--eval-prompts", type=int, default=1, help="prompts held out for evaluation (default 1)")
    p.add_argument("--gen-batch-size", type=int, default=8, help="images generated / encoded together (8)")
    p.add_argument("--out", required=True, help="output drafter folder (+ checkpoints)")
    p.add_argument("--feature-dir", default=None, metavar="DIR",
                   help="where the teacher-forced features are kept while training (a temporary folder, removed "
                        "at the end; about 38 MB per Lumina-mGPT-768 image at 7B size; default: beside --out)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", help="target precision (auto: bf16 where native)")
    from lantern.cli.common import add_sampling_args

    add_sampling_args(p)  # of the training images (default: the model's generation.json, Lumina's)
    _add_drafter_loss_args(p)
    _add_loop_args(p, steps=3000, batch_size=8, lr=1e-4, warmup=100, checkpoint_every=250, clip_mode="value",
                   grad_clip=0.5)
    p.set_defaults(func=cmd_train_chameleon_drafter)


def cmd_train_chameleon_drafter(args: argparse.Namespace) -> int:
    from pathlib import Path

    from lantern.api import load_model_stack, sampling_from
    from lantern.cli.common import check_chameleon_model
    from lantern.errors import check
    from lantern.targets.text import read_prompts
    from lantern.train.chameleon_drafter import ChameleonDrafterTask, train_chameleon_drafter
    from lantern.train.loop import check_out_kind, process_device
    from lantern.validate import check_count, check_device

    loop = _loop(args)
    recipe = _recipe(args)
    check_device(args.device)
    check_count(args.gen_batch_size, "--gen-batch-size")  # (the generator would name it --batch-size)
    device = process_device(args.device)
    prompts = read_prompts(args.prompts)
    check_chameleon_model(Path(args.model))
    # before the model loads (a 7B model takes minutes); the rest of --out's checks need the drafter
    check(0 <= args.eval_prompts < len(prompts),
          f"--eval-prompts must be in [0, {len(prompts)}) for {len(prompts)} prompts, got {args.eval_prompts}")
    check_out_kind(args.out, ChameleonDrafterTask.kind)
    stack = load_model_stack(args.model, device=str(device), dtype=args.dtype, layout=args.layout,
                             image_size=args.image_size, image_width=args.image_width, vq=args.vq,
                             prompt_width=args.prompt_width)
    result = train_chameleon_drafter(
        stack, prompts, loop, _run_options(args), sampling=sampling_from(stack, args),
        num_per_prompt=args.num_per_prompt, eval_prompts=args.eval_prompts, recipe=recipe,
        batch_size=args.gen_batch_size, feature_dir=args.feature_dir,
    )
    return _report("drafter", result)


def _add_train_features(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-features", help="train the feature network used by lantern.eval.metrics",
                       description="Train a small CNN classifier on a data set's real images; its embedding is the "
                                   "feature space of lantern's FID/KID/precision/recall (not Inception: numbers are "
                                   "not comparable with published FIDs). Reports held-out test accuracy.")
    _add_data_args(p)
    p.add_argument("--out", required=True, help="output folder (feature net folder + checkpoints)")
    g = p.add_argument_group("feature net")
    g.add_argument("--widths", type=_int_tuple, default=(32, 64, 128, 128),
                   help="stem width, then one stride-2 stage per further width (default 32,64,128,128)")
    g.add_argument("--blocks-per-stage", type=int, default=0, help="extra stride-1 convs per stage (default 0)")
    g.add_argument("--feature-dim", type=int, default=128, help="embedding size used by the metrics (default 128)")
    g.add_argument("--norm-groups", type=int, default=8)
    g.add_argument("--max-shift", type=int, default=2, help="random shift augmentation in pixels (default 2)")
    g.add_argument("--flip", action="store_true", help="random left-right flips (photos; not for digits)")
    g.add_argument("--zoom", type=float, default=1.0, help="random zoom-in up to this factor (default 1 = off)")
    g.add_argument("--blur", type=float, default=0.0, help="probability of a random Gaussian blur (default 0)")
    g.add_argument("--blur-sigma", type=float, default=2.0, help="largest blur sigma in pixels (default 2)")
    g.add_argument("--label-smoothing", type=float, default=0.0)
    _add_loop_args(p, steps=600, batch_size=64, lr=2e-3, warmup=50, checkpoint_every=200, weight_decay=0.05)
    p.set_defaults(func=cmd_train_features)


def cmd_train_features(args: argparse.Namespace) -> int:
    from lantern.train.features import FeatureRecipe, feature_config_for, train_features

    loop = _loop(args)
    recipe = FeatureRecipe(max_shift=args.max_shift, flip=args.flip, zoom=args.zoom, blur=args.blur,
                           blur_sigma=args.blur_sigma, label_smoothing=args.label_smoothing)
    train, test = _datasets(args)
    extra = {}
    if train.name == "photos":
        # The photos test split crops disjoint regions (other content); also report accuracy on
        # fresh crops of the training regions, the distribution generated images come from.
        from lantern.data import load_dataset

        extra["fresh_crops"] = load_dataset("photos", "train", image_size=args.image_size, channels=args.channels,
                                            seed=args.data_seed + 1, num_samples=len(test))
    config = feature_config_for(train, widths=args.widths, blocks_per_stage=args.blocks_per_stage,
                                feature_dim=args.feature_dim, norm_groups=args.norm_groups)
    result = train_features(config, train, test, recipe, loop, _run_options(args), extra_eval=extra)
    return _report("feature net", result)


def add_train_commands(sub: argparse._SubParsersAction) -> None:
    _add_train_tokenizer(sub)
    _add_extract_codes(sub)
    _add_train_target(sub)
    _add_make_drafter_data(sub)
    _add_train_drafter(sub)
    _add_train_chameleon_drafter(sub)
    _add_train_features(sub)
