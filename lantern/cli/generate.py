"""``lantern generate``: one process or a rank of a torchrun job, written image by image."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lantern.calibration import AUTO, QUALITY_CLASSES
from lantern.cli.common import (
    add_budget_arg,
    add_chameleon_args,
    add_compile_arg,
    add_deterministic_arg,
    add_overwrite_arg,
    add_pjd_args,
    add_threads_arg,
    chameleon_options,
    check_auto_tree,
    check_auto_window,
    check_compile,
    check_model_condition,
    check_run_args,
    choose_auto_tree,
    choose_auto_window,
    index_list,
    int_list,
    method_from_args,
    read_prompt_args,
    resolve_hub_args,
    window_arg,
    window_as_tree,
)
from lantern.errors import LanternError, check
from lantern.methods import METHOD_TABLE

if TYPE_CHECKING:
    from lantern.api import Pipeline
    from lantern.calibration import MethodChoice
    from lantern.outputs import OutputFolder
from lantern.cli.common import MODEL_HELP, add_sampling_args, add_trust_checkpoint_arg


def add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate images from class labels or text prompts",
        description="Generate images with AR or speculative decoding.",
    )
    p.add_argument(
        "--model", required=True, help=MODEL_HELP + " (a LlamaGen stack: target/, tokenizer/, optional drafter/ and "
        "proximity table)"
    )
    p.add_argument("--tokenizer", default=None, help="VQ tokenizer folder (or Hub repo id), if not inside --model")
    cond = p.add_mutually_exclusive_group()
    cond.add_argument(
        "--labels", type=int_list, default=None,
        help="class-conditional models: comma-separated class ids and inclusive ranges, e.g. 0,3,7 or 0-999",
    )
    cond.add_argument(
        "--prompt", action="append", default=None, metavar="TEXT",
        help='text-to-image models: a prompt (repeat for several: --prompt "a red car" --prompt "a cat")',
    )
    cond.add_argument(
        "--prompts", default=None, metavar="FILE",
        help="text-to-image models: a UTF-8 text file, one prompt per line (blank lines are skipped); a .tsv "
             "by its Prompt column (PartiPrompts), a .json list of prompts or captions (COCO's caption files)",
    )
    p.add_argument(
        "--t5", default=None, metavar="DIR",
        help="text-to-image models: T5 encoder folder or Hub repo id (google/flan-t5-xl; default: t5/ inside "
             "--model)",
    )
    p.add_argument(
        "--negative-prompt", default=None, metavar="TEXT",
        help="Emu3 models: what guidance steers every image away from (default: the folder's generation.json "
             "negative_prompt, else BAAI's; Python: negative_prompt=, also one per prompt)",
    )
    add_chameleon_args(p)
    p.add_argument(
        "--num-per-label", "--num-per-prompt", dest="num_per_label", type=int, default=1,
        help="images per label or prompt (default 1)",
    )
    p.add_argument("--seed", type=int, default=0, help="base seed; image i uses its own generator (default 0)")
    p.add_argument(
        "--indices", type=index_list, default=None, metavar="LIST",
        help="generate only these images of the run (as its file names number them, e.g. 37 or 32-39,40): each "
             "from its own place's random stream, so it is the image the whole run makes there (bit for bit with "
             "--deterministic), under the same file name",
    )
    p.add_argument("--out", required=True, help="output directory (written all-or-nothing: it appears complete or "
                                                "not at all)")
    add_overwrite_arg(p)
    p.add_argument("--resume", action="store_true",
                   help="keep this job's finished images if it stops (in .OUT.resume beside --out), and continue "
                        "an interrupted --resume job with the same settings: only the missing images are decoded")
    p.add_argument("--save-npz", action="store_true",
                   help="also write OUT/samples.npz: arr_0, uint8 [N, H, W, 3] in request order (the layout of "
                        "the guided-diffusion / ADM FID evaluator and LlamaGen's evaluation scripts)")
    p.add_argument("--no-grid", action="store_true",
                   help="write no grid.png: for a folder an evaluation reads (clean-fid and LANTERN's HPS script "
                        "take every PNG in it for a sample)")
    p.add_argument(
        "--method",
        default="ar",
        choices=[*METHOD_TABLE, AUTO],
        help="auto: the fastest method of --quality's class for this model, device and --batch-size, from its "
        "calibration (`lantern calibrate`); ar: plain decoding; sd: exact speculative decoding, dynamic tree; "
        "sd-static: exact, static tree; "
        "lantern: relaxed (absolute delta), dynamic tree; lantern++: relaxed (relative lambda), static tree; "
        "sjd: speculative Jacobi decoding (no drafter), exact; sjd-lantern / sjd-lantern++: SJD with "
        "lantern's / lantern++'s relaxed acceptance; sjd-coupled: SJD with coupled redraws (SCD), exact; "
        "sjd-coupled-lantern / sjd-coupled-lantern++: the same, relaxed; gsd: SJD with grouped speculative "
        "decoding's relaxed acceptance (no table); sjd-pac: SJD-PAC, coupled SJD (adaptive continuation) that "
        "also verifies K candidates at the first D - 1 positions (proactive drafting), exact; pjd: parallel "
        "Jacobi decoding (several image rows per "
        "forward; lossy unless --pjd-context is the row length); pjd-lantern / pjd-lantern++: the same, relaxed",
    )
    p.add_argument("--quality", default=None, choices=list(QUALITY_CLASSES),
                   help="with --method auto: lossless (methods that keep the model's distribution) or ar (also "
                        "relaxed methods the calibration judged within AR's spread; default)")
    p.add_argument("--drafter", default=None,
                   help="EAGLE drafter folder or Hub repo id (default: drafter/ inside --model)")
    p.add_argument(
        "--tree",
        default=None,
        help="draft tree: dynamic | static:NAME (e.g. static:naive_extend_57) | chain:N | auto (default per method) "
        "| its choices as JSON, '[[0], [1], [0, 0]]' (run.json's method.tree.choices); auto measures this device "
        "and the drafter's acceptance, then picks the fastest static tree",
    )
    p.add_argument(
        "--profile", default=None, help="with --tree auto: a profile.json from `lantern profile` (default: measure now)"
    )
    p.add_argument(
        "--proximity", default=None, help="latent proximity table (default: proximity.safetensors in --model)"
    )
    p.add_argument(
        "--lantern-k", type=int, default=None, help="neighbours per token (lantern 1000 capped at K_max; lantern++ 10)"
    )
    p.add_argument(
        "--lantern-delta",
        type=float,
        default=None,
        help="lantern, sjd-lantern: neighbour mass bound delta in [0, 1] (0.1)",
    )
    p.add_argument(
        "--lantern-lambda", type=float, default=None, help="lantern++, sjd-lantern++: relative bound lambda >= 1 (5.0)"
    )
    p.add_argument(
        "--lantern-residual", default=None, choices=["paper", "official", "official-lumina"],
        help="relaxed methods, after a rejection: the paper's residual (default), or the released LlamaGen "
             "(official) / Lumina-mGPT (official-lumina) code's, for comparisons",
    )
    add_budget_arg(p)
    p.add_argument("--lantern-credit", default=None, choices=["drawn", "clean"],
                   help="relaxed methods: which drafts the relaxed test credits: every drawn one (default), or only "
                        "those whose context the test sees (clean: Jacobi redraws after an unseen guess are tested "
                        "exactly)")
    p.add_argument("--sjd-window", type=window_arg, default=None,
                   help="sjd*, gsd: Jacobi window length L >= 1 (16), or auto: the fastest of 4-32 on this device, "
                        "measured on a few calibration images")
    p.add_argument(
        "--sjd-init",
        default=None,
        choices=["random", "repeat_horizon"],
        help="sjd*, gsd: new guesses are uniform random tokens, or repeat the token to their left (default random; "
        "sjd-coupled*, sjd-pac and the relaxed sjd-lantern*: repeat_horizon)",
    )
    p.add_argument(
        "--sjd-coupling",
        default=None,
        choices=["independent", "maximal", "gumbel"],
        help="sjd-coupled*: redraw each open guess coupled with the one it replaces: maximal coupling, or the "
        "same Gumbel noise per position (default maximal); gsd: also independent (its default); sjd-pac: any "
        "(default maximal, its adaptive continuation)",
    )
    p.add_argument("--pac-width", type=int, default=None,
                   help="sjd-pac: proactive drafting's K, candidates at each tree position (default 4)")
    p.add_argument("--pac-depth", type=int, default=None,
                   help="sjd-pac: proactive drafting's tree depth D counting its root: K candidates at the D - 1 "
                        "positions after it (default 3); the round verifies the window's chain plus "
                        "K + ... + K^(D-1) - (D - 1) more nodes")
    p.add_argument(
        "--gsd-group", type=int, default=None,
        help="gsd: a draft is credited with the tokens ranked within G places of it in the target's distribution "
        "(and close in probability); G >= 1 (default 7)",
    )
    p.add_argument("--sv-alpha", type=float, default=None,
                   help="sjd-sv, sjd-coupled-sv, sjd-lantern-sv, sjd-coupled-lantern-sv, gsd-sv (SJD-SV): a run of "
                        "drafts is tested on its tail holding this share of the run's target probability, in (0, 1] "
                        "(default 0.8)")
    add_pjd_args(p)
    p.add_argument("--batch-size", type=int, default=8, help="images generated together (default 8)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--dtype", default="float32",
                   help="target/drafter precision: float32 (default; bit-reproducible), bfloat16, or auto "
                        "(bf16 where the hardware computes it natively: faster at batch 1)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_trust_checkpoint_arg(p)
    add_compile_arg(p)
    add_threads_arg(p)
    add_deterministic_arg(p, default=False)
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    """``generate``: one process, or one rank of a ``torchrun`` / ``accelerate launch`` job
    (:mod:`lantern.distributed`), written image by image (:mod:`lantern.jobs`)."""
    from lantern.distributed import DistContext, check_enough_items
    from lantern.jobs import finished_job
    from lantern.validate import check_image_indices, check_image_total

    check_compile(args)
    ctx = DistContext.from_env()
    if args.resume and args.overwrite:
        raise LanternError("--resume continues the job of --out; it cannot be combined with --overwrite")
    # Rank 0 alone reads and writes --out (on several nodes the others may not even see it).
    finished = finished_job(args.out) if args.resume and ctx.is_main else None
    out = check_run_args(args, check_out=ctx.is_main and finished is None)
    prompts = read_prompt_args(args)
    check_image_total(len(prompts if prompts is not None else args.labels), args.num_per_label,
                      "--num-per-label / --num-per-prompt")
    num_images = len(prompts if prompts is not None else args.labels) * args.num_per_label
    if args.indices is not None:  # the run's images to generate; each keeps its place's seed and name
        args.indices = check_image_indices(args.indices, num_images)
        num_images = len(args.indices)
    check_enough_items(num_images, ctx)
    # The rows a call decodes: what --method auto, --tree auto and the auto windows choose for (two
    # images at --batch-size 8 decode as a batch of 2, whose fastest method may be another).
    args.call_batch = min(args.batch_size, -(-num_images // ctx.world_size))
    resolve_hub_args(args, ("model", "drafter", "t5", "vq", "tokenizer"))
    args.auto_method = _auto_method(args, ctx)
    _refuse_unused_parts(args)
    window_as_tree(args)
    auto = check_auto_tree(args.tree, [args.method], args.profile)
    auto_window = check_auto_window(args)
    method_from_args(args, None)  # every method setting (a tree's size too) from the flags alone, before loading
    if ctx.enabled and (auto or auto_window):
        raise LanternError("--tree auto / --sjd-window auto / --pjd-window auto time this process alone; under "
                           "several processes pass the tree or window to use (e.g. the one a single-process run chose)")
    args.device = ctx.device(args.device)
    pipe = _load_generate_pipeline(args, prompts)
    return _generate_job(args, pipe, prompts, out, finished, ctx, auto, auto_window)


def _generate_job(args: argparse.Namespace, pipe: Pipeline, prompts: list[str] | None, out: OutputFolder | None,
                  finished: dict[str, Any] | None, ctx: Any, auto: bool, auto_window: bool) -> int:
    """``generate`` on any stack (labels or prompts), as a job across the ranks of ``ctx``; the
    pipeline's parts (drafter, proximity table, T5) are read once for the auto choices and the run."""
    import torch

    from lantern.api import sampling_from
    from lantern.distributed import all_gather, process_group
    from lantern.jobs import JobRequest, check_same_job, run_job
    from lantern.run import prepare_run

    stack = pipe.stack
    sampling = sampling_from(stack, args)
    t5_dir = pipe.t5_dir() if stack.kind == "t2i" else None
    with process_group(ctx, args.device):
        finished = all_gather(finished, ctx)[0]  # rank 0's finding
        given, repeats = prompts if prompts is not None else args.labels, args.num_per_label
        if args.indices is not None:  # only the chosen images' conditions (a t2i prompt's T5 pass)
            given, repeats = [given[i // repeats] for i in args.indices], 1
        encoded = pipe.parts.encode(given, repeats, args.batch_size, progress=not args.no_progress and ctx.is_main,
                                    negative=args.negative_prompt)
        method, extra = _generate_method(args, pipe, sampling, auto, auto_window)
        names, conditions = _condition_record(stack, args, prompts, t5_dir)
        parts = prepare_run(stack, sampling, method, args.batch_size, encoded,
                            prepared=pipe.prepare(method, sampling))
        record = {**_run_record(args, len(names), sampling, parts.method, conditions),
                  **_parts_record(pipe, parts.method), **extra}
        identity = {"model": str(args.model), "seed": args.seed, **conditions,
                    "sampling": sampling.to_dict(), "method": parts.method.to_dict(),
                    "dtype": str(stack.dtype).replace("torch.", ""),
                    "device_type": torch.device(args.device).type}
        if finished is not None:  # every rank checks rank 0's finding: the same error everywhere
            check_same_job(finished, identity, f"--resume: the finished job in {args.out}")
            if ctx.is_main:
                print(f"{args.out} already holds this job, complete: nothing to do")
            return 0
        # grid.png: a row per label or prompt; a selection of images, a square
        ncol = args.num_per_label if args.indices is None else math.ceil(math.sqrt(len(names)))
        request = JobRequest(names, args.seed, encoded, identity, args.batch_size, ncol, save_npz=args.save_npz,
                             grid=not args.no_grid, resume=args.resume, progress=not args.no_progress,
                             num_tokens=stack.num_tokens,
                             vocab_size=stack.vocab_size, indices=args.indices)
        run = run_job(parts, request, out, ctx, stack.to_pil, record)
    if run is None:  # ranks other than 0 write nothing
        return 0
    assert out is not None  # rank 0 checked it
    stats = run["stats"]
    print(
        f"wrote {len(names)} images to {out.path} | mean accepted {stats['mean_accepted']:.2f} tokens/forward | "
        f"{stats['target_forwards']} target forwards | {stats['wall_seconds']:.2f} s decoding"
        + (f" ({stats['compile_seconds']:.2f} s of it compiling)" if stats["compile_seconds"] else "")
        + f", {stats['elapsed_seconds']:.2f} s in all"
        + (f" | {ctx.world_size} processes" if ctx.enabled else "")
        + (f" | {stats['resumed_images']} images from the interrupted run" if stats["resumed_images"] else "")
    )
    return 0


def _generate_method(args: argparse.Namespace, pipe: Pipeline, sampling: Any, auto: bool,
                     auto_window: bool) -> tuple[Any, dict[str, Any]]:
    """The method, with an auto tree or window resolved (on the pipeline's loaded drafter and
    table), and run.json's record of that choice."""
    from lantern.autotree.window import with_window

    stack = pipe.stack
    method = method_from_args(args, stack)
    extra: dict[str, Any] = {}
    if getattr(args, "auto_method", None) is not None:  # chosen before loading; sampling known now
        extra["auto_method"] = args.auto_method.with_sampling(sampling.to_dict()).to_dict()
    if auto:  # measure, calibrate, pick; then resolve the method again with the chosen tree
        choice = choose_auto_tree(stack, method, sampling, args.call_batch, args.profile, args.seed,
                                  pipe.parts, not args.no_progress, compile=pipe.compile)
        method, extra["auto_tree"] = method_from_args(args, stack, choice.tree), choice.to_dict()
    if auto_window:  # time the candidate windows, then run with the fastest
        window = choose_auto_window(stack, method, sampling, args, pipe.parts, args.call_batch, compile=pipe.compile)
        method, extra["auto_window"] = with_window(method, window.window), window.to_dict()
    return method, extra


def _refuse_unused_parts(args: argparse.Namespace) -> None:
    """``--drafter`` / ``--proximity`` with a method that never reads them: refused, as ``--tree``
    is, rather than silently ignored (a wrong path there would otherwise go unnoticed)."""
    from lantern.methods import METHOD_TABLE, method_names

    record = METHOD_TABLE[args.method]
    if args.drafter is not None and not record.needs_drafter:
        users = ", ".join(method_names(lambda r: r.needs_drafter))
        raise LanternError(f"--drafter is only used with the drafter methods ({users}), not {args.method}")
    if args.proximity is not None and not record.needs_proximity:
        raise LanternError(f"--proximity is only used with LANTERN's relaxed methods (lantern, lantern++ and the "
                           f"-lantern / -lantern++ variants), not {args.method}")


def _auto_method(args: argparse.Namespace, ctx: Any) -> MethodChoice | None:
    """``--method auto``: the calibrated choice (before anything loads: no calibration is a
    one-line error naming the command that makes one), which replaces ``args.method``."""
    from lantern.calibration import Setup, auto_method, check_quality
    from lantern.decoding.compiling import resolve_compile
    from lantern.methods import METHOD_SETTINGS
    from lantern.targets.base import inference_dtype
    from lantern.targets.llamagen_stack import resolve_model_dir

    check_quality(args.quality, args.method)
    if args.method != AUTO:
        return None
    for flag in ("drafter", "proximity"):
        if getattr(args, flag) is not None:
            raise LanternError(f"--method auto reads a calibration of the model's own drafter and proximity table; "
                               f"drop --{flag} or name a --method")
    device = ctx.device(args.device)
    setup = Setup.of(args.model, resolve_model_dir(args.model), device, inference_dtype(args.dtype, device),
                     resolve_compile(args.compile, device), args.deterministic)
    choice = auto_method(setup, args.quality, args.call_batch, {k: getattr(args, k) for k in METHOD_SETTINGS})
    if ctx.is_main:
        print(f"--method auto --quality {choice.quality}: {choice.explanation}")
    args.method = choice.method
    return choice


def _load_generate_pipeline(args: argparse.Namespace, prompts: list[str] | None) -> Pipeline:
    """generate's pipeline (any family) for ``--model``: ``lantern.load``'s, whose drafter, table and
    T5 are read on first need. A Chameleon-family model's prompts are measured against
    ``--prompt-width`` first, with the folder's tokenizer: a 7B model takes minutes to read."""
    from lantern.api import load, read_prompter
    from lantern.hub import resolve_location
    from lantern.models.chameleon import is_chameleon_folder
    from lantern.models.emu3 import is_emu3_folder
    from lantern.models.janus import is_janus_folder
    from lantern.targets.chameleon import DEFAULT_PROMPT_WIDTH
    from lantern.targets.emu3 import Emu3Prompter
    from lantern.targets.text import check_text

    model = resolve_location(args.model, "--model")  # a Hub repo id: its snapshot folder
    for family, found in (("Chameleon", is_chameleon_folder), ("Janus", is_janus_folder), ("Emu3", is_emu3_folder)):
        if found(model) and prompts is None:  # refused before the (large) model is read
            raise LanternError(f"--labels: {args.model} is a text-to-image {family} model; pass --prompt TEXT "
                               "or --prompts FILE")
    negative = args.negative_prompt
    if negative is not None:  # before the model is read: only Emu3 guides with a prompt
        check(is_emu3_folder(model), f"--negative-prompt: {args.model} is not an Emu3 model; only Emu3's "
                                     "unconditional rows are a prompt (other families guide with none)")
        check_text(negative, "--negative-prompt")
    width = DEFAULT_PROMPT_WIDTH if args.prompt_width is None else args.prompt_width
    prompter = (read_prompter(model, args.layout, args.image_size, args.image_width)
                if prompts is not None and width > 0 else None)
    if isinstance(prompter, Emu3Prompter) and negative is not None:
        prompter = prompter.with_negative(negative)  # its width is checked with the prompts'
    if prompts is not None and prompter is not None:  # a bad width is refused by load, naming the flag
        prompter.check_fits(prompts, width)
    pipe = load(model, args.drafter, device=args.device, dtype=args.dtype, compile=args.compile,
                tokenizer=args.tokenizer, t5=args.t5, proximity=args.proximity, deterministic=args.deterministic,
                **chameleon_options(args))
    check_model_condition(pipe.stack, args.model, prompts is not None)
    return pipe


def _index_digits(count: int) -> int:
    """Digits of the image index in file names: 4, or as many as the last index needs, so that the
    names sort in request order (10000_... would sort between 1000_... and 1001_...)."""
    return max(4, len(str(count - 1)))


def _condition_record(stack: Any, args: argparse.Namespace, prompts: list[str] | None,
                      t5_dir: Path | None) -> tuple[list[str], dict[str, Any]]:
    """The images' file names and what run.json records of their conditions (labels, or prompts with
    the T5 folder / the Chameleon layout); with ``--indices``, of those images of the run, named as
    the whole run names them, and the indices themselves."""
    count = len(prompts if prompts is not None else args.labels) * args.num_per_label
    chosen = list(range(count)) if args.indices is None else args.indices
    which = {} if args.indices is None else {"indices": chosen}
    digits = _index_digits(count)
    if prompts is None:
        labels = [args.labels[i // args.num_per_label] for i in chosen]
        return [f"{i:0{digits}d}_label{lab}.png" for i, lab in zip(chosen, labels, strict=True)], {
            "labels": labels, **which}
    index = [i // args.num_per_label for i in chosen]
    names = [f"{i:0{digits}d}_prompt{j}.png" for i, j in zip(chosen, index, strict=True)]
    if stack.kind in ("chameleon", "janus", "emu3"):
        layout = stack.layout
        info = {"name": layout.name, "height": layout.height, "width": layout.width,
                "pixel_size": list(layout.pixel_size)}
        negative = {} if args.negative_prompt is None else {"negative_prompt": args.negative_prompt}
        return names, {"layout": info, "prompts": prompts, "prompt_index": index, **negative, **which}
    return names, {"prompts": prompts, "prompt_index": index, "t5": str(t5_dir),
                   "t5_max_length": stack.target.config.cls_token_num, **which}


def _parts_record(pipe: Pipeline, method: Any) -> dict[str, Any]:
    """What ``run.json`` records of the parts a run read besides the model: the drafter's folder and
    format (a drafter in ``DIR/drafter/`` is named by no flag) and the proximity table's file."""
    record: dict[str, Any] = {}
    if method.record.needs_drafter:
        from lantern.models.chameleon_drafter import ReleasedChameleonDrafter

        released = isinstance(pipe.drafter, ReleasedChameleonDrafter)
        record["drafter"] = {"path": pipe.parts.drafter_source,
                             "format": "LANTERN's released Chameleon drafter" if released else "lantern EAGLE drafter"}
    if method.record.needs_proximity:
        record["proximity"] = pipe.parts.proximity_source
    return record


def _run_record(args: argparse.Namespace, num_images: int, sampling: Any, method: Any,
                conditions: dict[str, Any]) -> dict[str, Any]:
    """What ``run.json`` records of a generate run: the conditions, seeds and settings (the
    statistics are added by the run)."""
    import shlex

    from lantern.api import run_config
    from lantern.run import image_seed
    from lantern.version import software

    return {
        "command": "lantern " + shlex.join(getattr(args, "argv", ["generate"])),
        **software(),
        "model": str(args.model),
        **conditions,
        "seeds": [image_seed(args.seed, i) for i in (range(num_images) if args.indices is None else args.indices)],
        **run_config(args.seed, args.batch_size, args.device, sampling, method, deterministic=args.deterministic),
    }
