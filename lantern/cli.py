"""``lantern`` command line: one entry point, one sub-command per job.

Every run writes its resolved configuration next to its outputs. Bad arguments end with a one-line
``lantern: error: ...`` naming the argument, and exit code 2; no partial output files are left.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lantern.errors import LanternError

if TYPE_CHECKING:
    from lantern.outputs import OutputFolder


def _window_arg(text: str) -> int | str:
    """``--sjd-window``: a window length, or ``auto`` (measured on this device). Anything else is
    passed on as text, for ``JacobiConfig`` to refuse in one line."""
    try:
        return int(text)
    except ValueError:
        return text.strip()


def _add_pjd_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pjd-window", type=_window_arg, default=None,
                   help="pjd*: guesses per open image row and round, 1 .. the row length (default 4), or auto")
    p.add_argument("--pjd-context", type=_window_arg, default=None,
                   help="pjd*: known tokens row r needs before row r + 1 opens, 1 .. the row length (default 8; the "
                        "row length decodes one row at a time, losslessly). A quality knob: smaller is faster and "
                        "further from the model, so it has no auto")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one label")
    return values


def add_trust_checkpoint_arg(p: argparse._ActionsContainer) -> None:
    """``--trust-checkpoint``, on every command that may read a pickled checkpoint (.pt/.bin/.ckpt)."""
    p.add_argument(
        "--trust-checkpoint", action="store_true",
        help="fully unpickle .pt/.bin/.ckpt files that hold classes besides tensors and the allowed ones: "
             "this can run code from the file, so only for files you trust (see README: Loading checkpoints safely)",
    )


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (defaults: the model's generation.json, else the values shown)")
    g.add_argument(
        "--temperature", type=float, default=None, help="sampling temperature; 0 = greedy argmax (default 1.0)"
    )
    g.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens; 0 = off (default 0)")
    g.add_argument("--top-p", type=float, default=None, help="nucleus threshold in (0, 1]; 1 = off (default 1.0)")
    g.add_argument("--cfg-scale", type=float, default=None, help="classifier-free guidance scale; 1 = off (default 1)")


_SAMPLING_FLAGS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
                   "cfg_scale": "--cfg-scale"}


def _check_sampling_flags(args: argparse.Namespace) -> None:
    """Each sampling flag given, checked on its own before anything is loaded; the error names the flag."""
    from lantern.config import SamplingConfig

    for name, flag in _SAMPLING_FLAGS.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        try:
            SamplingConfig(**{name: value})
        except LanternError as e:
            raise LanternError(f"{flag}: {e}") from None


def _method(args: argparse.Namespace, stack: Any, tree: str | None = None) -> Any:
    """``--method`` with its flags, resolved by the library. ``tree``: auto's choice; with --tree auto
    and no choice yet, the method's own default tree (what choose_tree starts from)."""
    from lantern.api import METHOD_SETTINGS, resolve_method

    settings = {name: getattr(args, name) for name in METHOD_SETTINGS}
    settings["tree"] = tree if tree is not None else None if args.tree == "auto" else args.tree
    for name in ("sjd_window", "pjd_window"):
        if settings[name] == "auto":  # measured later (_auto_window); resolve with the default first
            settings[name] = None
    return resolve_method(None if args.tree == "auto" and tree is None else stack, args.method, **settings)


def _check_auto_tree(tree: str | None, methods: Sequence[str], profile: str | None) -> bool:
    """True for ``--tree auto``; refuses it for methods without a drafter tree, and --profile without it."""
    if tree != "auto":
        if profile is not None:
            raise LanternError("--profile is only used with --tree auto")
        return False
    from lantern.autotree import SPECULATIVE_METHODS

    if not any(m in SPECULATIVE_METHODS for m in methods):
        raise LanternError(
            f"--tree auto needs a speculative --method ({', '.join(SPECULATIVE_METHODS)}), got {', '.join(methods)}"
        )
    return True


def _auto_tree(
    stack: Any, method: Any, sampling: Any, batch_size: int, profile: Any, seed: int,
    drafter: str | None = None, proximity: str | None = None, progress: bool = True,
) -> Any:
    """``--tree auto``: choose_tree for one method, with its explanation printed."""
    from lantern.autotree import choose_tree

    choice = choose_tree(stack, method, sampling, profile=profile, seed=seed, batch_size=batch_size,
                         drafter_dir=drafter, proximity=proximity, progress=progress)
    print(f"--tree auto [{choice.method}]: {choice.explanation} (profile {choice.profile_seconds:.1f} s, "
          f"calibration {choice.calibration_seconds:.1f} s)")
    return choice


def _check_auto_window(args: argparse.Namespace, unsupported: str | None) -> bool:
    """True for ``--sjd-window auto`` / ``--pjd-window auto``; refuses it for methods without such a
    window, and for models it cannot calibrate (``unsupported``: what kind of model this is)."""
    from lantern.pipeline import PJD_METHODS, SJD_METHODS

    auto = False
    for flag, window, methods in (("--sjd-window", args.sjd_window, SJD_METHODS),
                                  ("--pjd-window", args.pjd_window, PJD_METHODS)):
        if window != "auto":
            continue
        if args.method not in methods:
            raise LanternError(f"{flag} auto needs a --method with that window ({', '.join(methods)}), "
                               f"got {args.method}")
        if unsupported is not None:
            raise LanternError(f"{flag} auto calibrates on class labels; pass a number for {unsupported} models")
        auto = True
    return auto


def _auto_window(stack: Any, method: Any, sampling: Any, args: argparse.Namespace) -> Any:
    """``--sjd-window auto``: choose_window, with its explanation printed."""
    from lantern.autowindow import choose_window

    choice = choose_window(stack, method, sampling, seed=args.seed, batch_size=args.batch_size)
    flag = "--pjd-window" if method.pjd is not None else "--sjd-window"
    print(f"{flag} auto [{choice.method}]: {choice.explanation} (calibration {choice.seconds:.1f} s)")
    return choice


MODEL_HELP = ("embedded preset (digits | photos), a LlamaGen c2i / t2i stack folder, an Anole / Lumina-mGPT "
              "folder, or a Hugging Face repo id of one")


def _add_chameleon_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Chameleon-family targets (Anole, Lumina-mGPT: an HF model folder as --model)")
    g.add_argument("--layout", default=None, choices=["anole", "lumina-mgpt"],
                   help="the model's image layout (default: \"layout\" in the folder's generation.json)")
    g.add_argument("--image-size", type=int, default=None,
                   help="lumina-mgpt: image side in pixels, a multiple of 32 (default 768); anole: 512 only")
    g.add_argument("--vq", default=None, metavar="CKPT",
                   help="the Chameleon VQGAN checkpoint vqgan.ckpt, vqgan.yaml beside it "
                        "(default: vqgan.ckpt or tokenizer/vqgan.ckpt inside --model)")


def _load_tool_stack(args: argparse.Namespace, device: str = "cpu") -> Any:
    """demo / bench / profile: the stack of any family (``lantern.load``) for ``--model``."""
    from lantern.api import load_model_stack

    return load_model_stack(args.model, device=device, dtype=args.dtype, layout=args.layout,
                            image_size=args.image_size, vq=args.vq)


def _add_budget_arg(p: argparse.ArgumentParser) -> None:
    from lantern.pipeline import BUDGETS, DEFAULT_BUDGET

    p.add_argument(
        "--lantern-budget", default=None, choices=BUDGETS,
        help="what delta / lambda bound: each acceptance test (test, the paper's) or every emitted token "
        f"(token: TV(token, p) <= delta, or token(x) <= lambda p(x), at every tree level) (default {DEFAULT_BUDGET})",
    )


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate images from class labels or text prompts",
        description="Generate images with AR or speculative decoding.",
    )
    p.add_argument(
        "--model", required=True, help="model stack folder (target/, tokenizer/, optional drafter/ and proximity table)"
    )
    p.add_argument("--tokenizer", default=None, help="VQ tokenizer folder, if not inside --model")
    cond = p.add_mutually_exclusive_group()
    cond.add_argument(
        "--labels", type=_int_list, default=None, help="class-conditional models: comma-separated class ids, e.g. 0,3,7"
    )
    cond.add_argument(
        "--prompt", action="append", default=None, metavar="TEXT",
        help='text-to-image models: a prompt (repeat for several: --prompt "a red car" --prompt "a cat")',
    )
    cond.add_argument(
        "--prompts", default=None, metavar="FILE",
        help="text-to-image models: a UTF-8 text file, one prompt per line (blank lines are skipped)",
    )
    p.add_argument(
        "--t5", default=None, metavar="DIR",
        help="text-to-image models: local T5 encoder folder (google/flan-t5-xl; default: t5/ inside --model)",
    )
    _add_chameleon_args(p)
    p.add_argument(
        "--num-per-label", "--num-per-prompt", dest="num_per_label", type=int, default=1,
        help="images per label or prompt (default 1)",
    )
    p.add_argument("--seed", type=int, default=0, help="base seed; image i uses its own generator (default 0)")
    p.add_argument("--out", required=True, help="output directory (written all-or-nothing: it appears complete or "
                                                "not at all)")
    _add_overwrite_arg(p)
    p.add_argument("--resume", action="store_true",
                   help="keep this job's finished images if it stops (in .OUT.resume beside --out), and continue "
                        "an interrupted --resume job with the same settings: only the missing images are decoded")
    p.add_argument("--save-npz", action="store_true",
                   help="also write OUT/samples.npz: arr_0, uint8 [N, H, W, 3] in request order (the layout of "
                        "the guided-diffusion / ADM FID evaluator and LlamaGen's evaluation scripts)")
    p.add_argument(
        "--method",
        default="ar",
        choices=["ar", "sd", "sd-static", "lantern", "lantern++", "sjd", "sjd-lantern", "sjd-lantern++",
                 "sjd-coupled", "sjd-coupled-lantern", "sjd-coupled-lantern++", "gsd", "pjd", "pjd-lantern",
                 "pjd-lantern++"],
        help="ar: plain decoding; sd: exact speculative decoding, dynamic tree; sd-static: exact, static tree; "
        "lantern: relaxed (absolute delta), dynamic tree; lantern++: relaxed (relative lambda), static tree; "
        "sjd: speculative Jacobi decoding (no drafter), exact; sjd-lantern / sjd-lantern++: SJD with "
        "lantern's / lantern++'s relaxed acceptance; sjd-coupled: SJD with coupled redraws (SCD), exact; "
        "sjd-coupled-lantern / sjd-coupled-lantern++: the same, relaxed; gsd: SJD with grouped speculative "
        "decoding's relaxed acceptance (no table); pjd: parallel Jacobi decoding (several image rows per "
        "forward; lossy unless --pjd-context is the row length); pjd-lantern / pjd-lantern++: the same, relaxed",
    )
    p.add_argument("--drafter", default=None, help="EAGLE drafter folder (default: drafter/ inside --model)")
    p.add_argument(
        "--tree",
        default=None,
        help="draft tree: dynamic | static:NAME (e.g. static:naive_extend_57) | chain:N | auto (default per method); "
        "auto measures this device and the drafter's acceptance, then picks the fastest static tree",
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
    _add_budget_arg(p)
    p.add_argument("--sjd-window", type=_window_arg, default=None,
                   help="sjd*, gsd: Jacobi window length L >= 1 (16), or auto: the fastest of 4-32 on this device, "
                        "measured on a few calibration images")
    p.add_argument(
        "--sjd-init",
        default=None,
        choices=["random", "repeat_horizon"],
        help="sjd*, gsd: new guesses are uniform random tokens, or repeat the token to their left (default random; "
        "sjd-coupled*: repeat_horizon)",
    )
    p.add_argument(
        "--sjd-coupling",
        default=None,
        choices=["independent", "maximal", "gumbel"],
        help="sjd-coupled*: redraw each open guess coupled with the one it replaces: maximal coupling, or the "
        "same Gumbel noise per position (default maximal); gsd: also independent (its default)",
    )
    p.add_argument(
        "--gsd-group", type=int, default=None,
        help="gsd: a draft is credited with the tokens ranked within G places of it in the target's distribution "
        "(and close in probability); G >= 1 (default 7)",
    )
    _add_pjd_args(p)
    p.add_argument("--batch-size", type=int, default=8, help="images generated together (default 8)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--dtype", default="float32",
                   help="target/drafter precision: float32 (default; bit-reproducible), bfloat16, or auto "
                        "(bf16 where the hardware computes it natively: faster at batch 1)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_trust_checkpoint_arg(p)
    _add_compile_arg(p)
    _add_sampling_args(p)
    p.set_defaults(func=cmd_generate)


def _add_compile_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile", nargs="?", const="auto", default="off", metavar="MODE",
                   help="compile the decode step (target, drafter, acceptance; AR too) with torch.compile: "
                        "--compile alone = auto (CUDA graphs on a GPU, inductor kernels on a CPU), or a mode: "
                        "default, reduce-overhead, max-autotune. Costs start-up time (see README); default off")


def _check_compile(args: argparse.Namespace) -> None:
    """Refuse a bad --compile before anything is loaded or written."""
    from lantern.compiling import resolve_compile

    resolve_compile(args.compile, getattr(args, "device", "cpu"))


def _read_prompt_args(args: argparse.Namespace) -> list[str] | None:
    """The prompts of --prompt / --prompts (checked before anything is loaded), or None for --labels."""
    from lantern.text import check_prompts, read_prompts

    if args.prompt is not None:
        return check_prompts(args.prompt, "--prompt")
    if args.prompts is not None:
        return read_prompts(args.prompts)
    if args.labels is None:
        raise LanternError(
            "generate needs --labels (class-conditional models) or --prompt / --prompts (text-to-image models)"
        )
    if args.t5 is not None:
        raise LanternError("--t5 is only used with --prompt / --prompts (text-to-image models)")
    return None


def _check_condition_kind(stack: Any, model: str, text: bool) -> None:
    """Labels need a class-conditional target, prompts a text-to-image one."""
    kind = stack.target.config.model_type
    if text and kind != "t2i":
        raise LanternError(f"--prompt/--prompts: {model} is a class-conditional model; pass --labels")
    if not text and kind == "t2i":
        raise LanternError(f"--labels: {model} is a text-to-image model; pass --prompt TEXT or --prompts FILE")


def _resolve_hub_args(args: argparse.Namespace, names: Sequence[str]) -> None:
    """Each of these flags given as a Hugging Face ``org/name`` (and not an existing local path)
    becomes the local snapshot folder of that repo."""
    from lantern.hub import resolve_location

    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            setattr(args, name, resolve_location(value, f"--{name}"))


def _add_overwrite_arg(p: argparse.ArgumentParser, what: str = "folder") -> None:
    p.add_argument("--overwrite", action="store_true",
                   help=f"replace an existing non-empty --out {what} (default: refuse to touch it)")


def _check_run_args(args: argparse.Namespace, check_out: bool = True) -> OutputFolder | None:
    """generate's counts and device, checked before anything is loaded; the --out folder to write
    (None when not ``check_out``: a rank other than 0, or a finished job to resume)."""
    from lantern.outputs import OutputFolder
    from lantern.validate import check_count, check_device

    check_count(args.num_per_label, "--num-per-label / --num-per-prompt")
    check_count(args.batch_size, "--batch-size")
    check_device(args.device)
    return OutputFolder.check(args.out, "--out", args.overwrite) if check_out else None


def cmd_generate(args: argparse.Namespace) -> int:
    """``generate``: one process, or one rank of a ``torchrun`` / ``accelerate launch`` job
    (:mod:`lantern.distributed`), written image by image (:mod:`lantern.jobs`)."""
    from lantern.distributed import DistContext, check_enough_items
    from lantern.jobs import finished_job
    from lantern.validate import check_image_total

    _check_compile(args)
    ctx = DistContext.from_env()
    if args.resume and args.overwrite:
        raise LanternError("--resume continues the job of --out; it cannot be combined with --overwrite")
    # Rank 0 alone reads and writes --out (on several nodes the others may not even see it).
    finished = finished_job(args.out) if args.resume and ctx.is_main else None
    out = _check_run_args(args, check_out=ctx.is_main and finished is None)
    prompts = _read_prompt_args(args)
    check_image_total(len(prompts if prompts is not None else args.labels), args.num_per_label,
                      "--num-per-label / --num-per-prompt")
    check_enough_items(len(prompts if prompts is not None else args.labels) * args.num_per_label, ctx)
    _resolve_hub_args(args, ("model", "drafter", "t5", "vq"))
    auto = _check_auto_tree(args.tree, [args.method], args.profile)
    args.device = ctx.device(args.device)
    stack = _load_generate_stack(args, prompts is not None)
    auto_window = _check_auto_window(args, _auto_window_refusal(stack))
    if ctx.enabled and (auto or auto_window):
        raise LanternError("--tree auto / --sjd-window auto / --pjd-window auto time this process alone; under "
                           "several processes pass the tree or window to use (e.g. the one a single-process run chose)")
    return _generate_job(args, stack, prompts, out, finished, ctx, auto, auto_window)


def _generate_job(args: argparse.Namespace, stack: Any, prompts: list[str] | None, out: OutputFolder | None,
                  finished: dict[str, Any] | None, ctx: Any, auto: bool, auto_window: bool) -> int:
    """``generate`` on any stack (labels or prompts), as a job across the ranks of ``ctx``."""
    import torch

    from lantern.api import sampling_from
    from lantern.distributed import all_gather, process_group
    from lantern.jobs import JobRequest, check_same_job, run_job
    from lantern.pipeline import prepare_run

    sampling = sampling_from(stack, args)
    t5_dir = stack.t5_folder(args.t5) if stack.kind == "t2i" else None
    with process_group(ctx, args.device):
        finished = all_gather(finished, ctx)[0]  # rank 0's finding
        encoded = stack.encode(prompts if prompts is not None else args.labels, args.num_per_label,
                               args.batch_size, t5=t5_dir)
        method, extra = _generate_method(args, stack, sampling, auto, auto_window)
        names, conditions = _condition_record(stack, args, prompts, t5_dir)
        parts = prepare_run(stack, sampling, method, args.batch_size, encoded, args.drafter, args.proximity,
                            args.compile)
        record = {**_run_record(args, len(names), sampling, parts.method, conditions), **extra}
        identity = {"model": str(args.model), "seed": args.seed, **conditions,
                    "sampling": sampling.to_dict(), "method": parts.method.to_dict(),
                    "dtype": str(stack.dtype).replace("torch.", ""),
                    "device_type": torch.device(args.device).type}
        if finished is not None:  # every rank checks rank 0's finding: the same error everywhere
            check_same_job(finished, identity, f"--resume: the finished job in {args.out}")
            if ctx.is_main:
                print(f"{args.out} already holds this job, complete: nothing to do")
            return 0
        request = JobRequest(names, args.seed, encoded.cond, encoded.mask, identity, args.batch_size,
                             args.num_per_label, save_npz=args.save_npz, resume=args.resume,
                             progress=not args.no_progress)
        run = run_job(parts, request, out, ctx, stack.to_pil, record)
    if run is None:  # ranks other than 0 write nothing
        return 0
    assert out is not None  # rank 0 checked it
    stats = run["stats"]
    print(
        f"wrote {len(names)} images to {out.path} | mean accepted {stats['mean_accepted']:.2f} tokens/forward | "
        f"{stats['target_forwards']} target forwards | {stats['wall_seconds']:.2f} s"
        + (f" | {ctx.world_size} processes" if ctx.enabled else "")
        + (f" | {stats['resumed_images']} images from the interrupted run" if stats["resumed_images"] else "")
    )
    return 0


def _generate_method(args: argparse.Namespace, stack: Any, sampling: Any, auto: bool,
                     auto_window: bool) -> tuple[Any, dict[str, Any]]:
    """The method, with an auto tree or window resolved, and run.json's record of that choice."""
    from lantern.autowindow import with_window

    method = _method(args, stack)
    extra: dict[str, Any] = {}
    if auto:  # measure, calibrate, pick; then resolve the method again with the chosen tree
        choice = _auto_tree(stack, method, sampling, args.batch_size, args.profile, args.seed,
                            args.drafter, args.proximity, not args.no_progress)
        method, extra["auto_tree"] = _method(args, stack, choice.tree_spec), choice.to_dict()
    if auto_window:  # time the candidate windows, then run with the fastest
        window = _auto_window(stack, method, sampling, args)
        method, extra["auto_window"] = with_window(method, window.window), window.to_dict()
    return method, extra


def _auto_window_refusal(stack: Any) -> str | None:
    """What kind of model ``--sjd-window auto`` / ``--pjd-window auto`` cannot calibrate (it times
    class-label runs), or None."""
    return {"t2i": "text-to-image", "chameleon": "Chameleon-family"}.get(stack.kind)


def _load_generate_stack(args: argparse.Namespace, text: bool) -> Any:
    """generate's stack (any family) for ``--model``, with the family's flags checked first."""
    from lantern.models.chameleon import is_chameleon_folder
    from lantern.stack import inference_dtype, load_stack

    if is_chameleon_folder(args.model):
        return _load_chameleon_for_generate(args, text)
    for name in ("layout", "image_size", "vq"):
        if getattr(args, name) is not None:
            raise LanternError(f"--{name.replace('_', '-')} is only used with Chameleon-family models (Anole, "
                               "Lumina-mGPT)")
    stack = load_stack(args.model, args.tokenizer, dtype=inference_dtype(args.dtype, args.device))
    _check_condition_kind(stack, args.model, text)
    stack.target.to(args.device)
    stack.tokenizer.to(args.device)
    return stack


def _load_chameleon_for_generate(args: argparse.Namespace, text: bool) -> Any:
    """An Anole / Lumina-mGPT folder: prompts only, its own tokenizer, images through the VQGAN."""
    from lantern.chameleon import load_chameleon_stack
    from lantern.stack import inference_dtype

    root = Path(args.model)
    if args.compile != "off":
        raise LanternError("--compile is implemented for LlamaGen targets only, not Chameleon-family models")
    if not text:
        raise LanternError(f"--labels: {root} is a text-to-image Chameleon model; pass --prompt TEXT or --prompts FILE")
    for flag, value in (("--t5", args.t5), ("--tokenizer", args.tokenizer)):
        if value is not None:
            raise LanternError(f"{flag} is not used by Chameleon-family models (they read prompts with their own "
                               "tokenizer, and decode with --vq)")
    _check_auto_window(args, "Chameleon-family")
    layout = _chameleon_layout(args, root)
    return load_chameleon_stack(root, layout, args.vq, inference_dtype(args.dtype, args.device), args.device)


def _condition_record(stack: Any, args: argparse.Namespace, prompts: list[str] | None,
                      t5_dir: Path | None) -> tuple[list[str], dict[str, Any]]:
    """The images' file names and what run.json records of their conditions (labels, or prompts with
    the T5 folder / the Chameleon layout)."""
    if prompts is None:
        labels = [lab for lab in args.labels for _ in range(args.num_per_label)]
        return [f"{i:04d}_label{lab}.png" for i, lab in enumerate(labels)], {"labels": labels}
    index = [j for j in range(len(prompts)) for _ in range(args.num_per_label)]
    names = [f"{i:04d}_prompt{j}.png" for i, j in enumerate(index)]
    if stack.kind == "chameleon":
        layout = stack.layout
        info = {"name": layout.name, "height": layout.height, "width": layout.width,
                "pixel_size": list(layout.pixel_size)}
        return names, {"layout": info, "prompts": prompts, "prompt_index": index}
    return names, {"prompts": prompts, "prompt_index": index, "t5": str(t5_dir),
                   "t5_max_length": stack.target.config.cls_token_num}
def _chameleon_layout(args: argparse.Namespace, root: Path) -> Any:
    from lantern.api import chameleon_layout
    from lantern.models.chameleon import is_chameleon_folder

    if not root.is_dir():  # before asking for a layout: a missing folder is not a Chameleon model
        raise LanternError(f"--model: no such folder {root}")
    if not is_chameleon_folder(root):
        raise LanternError(f"--model {root} is not a Chameleon-family model folder (no config.json with "
                           "model_type 'chameleon': an Anole or Lumina-mGPT folder in the transformers format)")
    return chameleon_layout(root, args.layout, args.image_size)


def _run_record(args: argparse.Namespace, num_images: int, sampling: Any, method: Any,
                conditions: dict[str, Any]) -> dict[str, Any]:
    """What ``run.json`` records of a generate run: the conditions, seeds and settings (the
    statistics are added by the run)."""
    from lantern.api import run_config
    from lantern.pipeline import image_seed

    return {
        "command": "generate",
        "model": str(args.model),
        **conditions,
        "seeds": [image_seed(args.seed, i) for i in range(num_images)],
        **run_config(args.seed, args.batch_size, args.device, sampling, method),
    }


def _add_make_random_stack(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "make-random-stack",
        help="write a tiny randomly initialised model stack (for smoke tests)",
        description="Build a small random LlamaGen target + VQ tokenizer stack; no training involved.",
    )
    p.add_argument("--out", required=True, help="output stack folder")
    _add_overwrite_arg(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--grid", type=int, default=8, help="image tokens per side (default 8 -> 64 tokens)")
    p.add_argument("--vocab", type=int, default=256, help="codebook size (default 256)")
    p.set_defaults(func=cmd_make_random_stack)


def cmd_make_random_stack(args: argparse.Namespace) -> int:
    from lantern.outputs import OutputFolder
    from lantern.testing import make_random_stack

    out = OutputFolder.check(args.out, "--out", args.overwrite)
    with out.write() as folder:
        make_random_stack(folder, seed=args.seed, num_classes=args.num_classes, grid=args.grid, vocab=args.vocab)
    print(f"wrote random stack to {out.path}")
    return 0


def _add_build_proximity(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "build-proximity",
        help="build the latent proximity table (k nearest codebook neighbours) for LANTERN",
        description="For every codebook entry, its K_max nearest other entries in distance order.",
    )
    p.add_argument("--tokenizer", required=True, help="VQ tokenizer folder or official vq_ds16_*.pt file")
    p.add_argument("--k-max", type=int, default=1024, help="neighbours stored per entry (default 1024)")
    p.add_argument("--out", required=True, help="output file (.safetensors)")
    _add_overwrite_arg(p, "file")
    p.add_argument(
        "--metric", choices=["l2", "cosine"], default="l2", help="distance (default l2, as the official code)"
    )
    p.add_argument("--normalize", action="store_true", help="use the l2-normalised codebook (what the decoder sees)")
    add_trust_checkpoint_arg(p)
    p.set_defaults(func=cmd_build_proximity)


def cmd_build_proximity(args: argparse.Namespace) -> int:
    from lantern.proximity import build_proximity_file

    table = build_proximity_file(args.tokenizer, args.k_max, args.out, metric=args.metric, normalize=args.normalize,
                                 overwrite=args.overwrite)
    print(
        f"wrote {args.out}: {table.vocab_size} entries x {table.k_max} neighbours "
        f"({table.metric}, normalized={table.normalized}, codebook sha256 {table.codebook_sha256[:12]})"
    )
    return 0


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="AR vs LANTERN++ / LANTERN on an embedded model: speed-up table and image grid",
        description="Decode the same labels and seeds with every method, timed side by side in this process.",
    )
    p.add_argument("--model", default="digits", help=MODEL_HELP)
    p.add_argument("--methods", default="ar,lantern++,lantern,sd",
                   help="comma-separated methods, ar first (default ar,lantern++,lantern,sd)")
    p.add_argument("--num-images", type=int, default=None, help="images per method (default: one per class)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=1,
                   help="images decoded together (default 1: the latency setting speculative decoding targets)")
    p.add_argument("--repeats", type=int, default=1, help="timed passes per method; the median is reported")
    p.add_argument("--out", default="lantern-demo", help="output folder (default ./lantern-demo)")
    _add_overwrite_arg(p)
    p.add_argument("--dtype", default="auto",
                   help="target/drafter precision: auto (default: bf16 where native), float32 or bfloat16")
    p.add_argument("--tree", default=None,
                   help="tree for every speculative method: auto (chosen per method for this device) or a "
                        "--tree spec of `lantern generate` (default: the model's generation.json)")
    p.add_argument("--profile", default=None, help="with --tree auto: a profile.json from `lantern profile`")
    p.add_argument("--sjd-window", type=_window_arg, default=None,
                   help="the Jacobi window of the sjd* / gsd methods shown, or auto (timed on this device)")
    p.add_argument("--pjd-window", type=_window_arg, default=None,
                   help="the window of the pjd* methods shown, or auto (timed on this device)")
    _add_budget_arg(p)
    p.add_argument("--no-progress", action="store_true")
    add_trust_checkpoint_arg(p)
    _add_compile_arg(p)
    _add_chameleon_args(p)
    _add_sampling_args(p)
    p.set_defaults(func=cmd_demo)


def _demo_windows(stack: Any, sampling: Any, methods: Sequence[str],
                  args: argparse.Namespace) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """``lantern demo --sjd-window N|auto`` / ``--pjd-window N|auto``: the window of every SJD- or
    PJD-family method in the demo (auto: timed per method, as ``generate`` does). Returns the
    per-method settings for run_demo and the auto choices for demo.json."""
    from lantern.api import resolve_method
    from lantern.autowindow import choose_window
    from lantern.pipeline import PJD_METHODS, SJD_METHODS

    settings: dict[str, dict[str, Any]] = {}
    chosen: dict[str, Any] = {}
    for flag, name, family in (("--sjd-window", "sjd_window", SJD_METHODS),
                               ("--pjd-window", "pjd_window", PJD_METHODS)):
        value = getattr(args, name)
        if value is None:
            continue
        targets = [m for m in methods if m in family]
        if not targets:
            raise LanternError(f"{flag} needs one of {', '.join(family)} in --methods")
        for m in targets:
            window = value
            if value == "auto":
                choice = choose_window(stack, resolve_method(stack, m), sampling, seed=args.seed,
                                       batch_size=args.batch_size)
                print(f"{flag} auto [{m}]: {choice.explanation} (calibration {choice.seconds:.1f} s)")
                chosen[m], window = choice.to_dict(), choice.window
            settings[m] = {name: window}
    return settings, chosen


def cmd_demo(args: argparse.Namespace) -> int:
    import time

    import torch

    from lantern.api import sampling_from
    from lantern.demo import run_demo, save_demo
    from lantern.outputs import OutputFolder
    from lantern.pipeline import METHODS

    _check_compile(args)
    from lantern.demo import DEMO_PROMPT_IMAGES
    from lantern.validate import MAX_IMAGES, check_count

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    for m in methods:
        if m not in METHODS:
            raise LanternError(f"--methods: unknown method {m!r} (choose from {', '.join(METHODS)})")
    auto = _check_auto_tree(args.tree, methods, args.profile)
    for name in ("num_images", "batch_size", "repeats"):
        if getattr(args, name) is not None:
            check_count(getattr(args, name), f"--{name.replace('_', '-')}", maximum=MAX_IMAGES)
    out = OutputFolder.check(args.out, "--out", args.overwrite)
    torch.manual_seed(0)
    stack = _load_tool_stack(args)
    sampling = sampling_from(stack, args)
    n = (stack.num_classes or DEMO_PROMPT_IMAGES) if args.num_images is None else args.num_images
    t0 = time.perf_counter()
    auto_trees: dict[str, Any] = {}
    if args.tree is not None:
        from lantern.autotree import choose_trees, with_trees

        if auto:
            auto_trees = choose_trees(stack, methods, sampling, profile=args.profile, seed=args.seed,
                                      batch_size=args.batch_size, progress=not args.no_progress)
            for choice in auto_trees.values():
                print(f"--tree auto [{choice.method}]: {choice.explanation}")
            trees = {m: c.tree_spec for m, c in auto_trees.items()}
        else:
            trees = {m: args.tree for m in methods if m not in ("ar", "gsd") and not m.startswith(("sjd", "pjd"))}
        stack = with_trees(stack, trees)
    windows, auto_windows = _demo_windows(stack, sampling, methods, args)
    rows = run_demo(stack, sampling, methods, num_images=n, seed=args.seed, batch_size=args.batch_size,
                    repeats=args.repeats, progress=not args.no_progress, budget=args.lantern_budget,
                    compile=args.compile, settings=windows)
    meta = {"model": str(args.model), "num_images": n, "seed": args.seed, "batch_size": args.batch_size,
            "sampling": sampling.to_dict(), "threads": torch.get_num_threads(), "lantern_budget": args.lantern_budget}
    if auto_trees:
        meta["auto_trees"] = {m: c.to_dict() for m, c in auto_trees.items()}
    if auto_windows:
        meta["auto_windows"] = auto_windows
    with out.write() as folder:
        save_demo(stack, rows, folder, meta)
    from lantern.demo import format_table

    print(f"model {args.model} | {n} images per method, batch {args.batch_size}, same labels and seeds | "
          f"{sampling.to_dict()}")
    print(format_table(rows))
    print(f"grid: {out.path / 'demo_grid.png'} | numbers: {out.path / 'demo.json'} | "
          f"total {time.perf_counter() - t0:.0f} s")
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="speed and quality of every method side by side (tables, JSON, grids and plots)",
        description=(
            "Decode the same labels and seeds with every method: wall-clock speed-up vs AR (interleaved, "
            "warm-up excluded) and FID / KID / precision / recall / class accuracy in the feature space of a "
            "network trained by lantern on the preset's images (not Inception FIDs)."
        ),
    )
    p.add_argument("--model", default="photos", help=MODEL_HELP)
    p.add_argument("--methods", default="ar,sd,sd-static,lantern,lantern++,sjd,sjd-lantern",
                   help="comma-separated methods, ar included; METHOD@TREE adds a row with that tree, and "
                        "METHOD/KEY=VALUE... a row with those settings (keys k, delta, lambda, budget; coupling for "
                        "sjd-coupled* and gsd), e.g. lantern/delta=0.2/budget=token or sjd-coupled/coupling=gumbel "
                        "(default ar,sd,sd-static,lantern,lantern++,sjd,sjd-lantern)")
    p.add_argument("--tree", action="append", default=[], metavar="METHOD=TREE",
                   help="tree for one method, e.g. lantern++=chain:5 or sd=dynamic (repeatable); "
                        "METHOD=auto picks it from this device's verify-cost curve (default: the stack's trees)")
    p.add_argument("--num-images", type=int, default=200, help="images per method for quality metrics (default 200)")
    p.add_argument("--speed-images", type=int, default=8, help="images per method timed (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=25, help="batch for the quality images (default 25)")
    p.add_argument("--speed-batch-size", default="1",
                   help="batch for the timed images (default 1); a list like 1,4,16 adds a throughput table "
                        "(images/s of every method at each further batch size)")
    p.add_argument("--repeats", type=int, default=1, help="timed passes per method; the median is kept")
    p.add_argument("--num-real", type=int, default=1000,
                   help="held-out real images to compare with (default 1000, capped by the test split)")
    p.add_argument("--feature-net", default=None,
                   help="feature extractor: a lantern feature-net folder (default: the stack's features/), "
                        "torchscript:FILE (e.g. clean-fid's Inception) or clip:DIR (a local CLIP vision model)")
    p.add_argument("--curve-images", type=int, default=16,
                   help="images per point of the tau-vs-delta/lambda curves (0 = skip; default 16)")
    p.add_argument("--no-ar-spread", action="store_true", help="skip the second AR seed (metric spread)")
    p.add_argument("--no-quality", action="store_true",
                   help="speed only: no quality images or metrics (rows describe the timed images)")
    p.add_argument("--sweep", action="store_true", help="also sweep (k, delta) and (k, lambda) for the frontier")
    p.add_argument("--sweep-images", type=int, default=100, help="quality images per sweep point (default 100)")
    p.add_argument("--profile", default=None, help="with auto trees: a profile.json from `lantern profile`")
    _add_budget_arg(p)
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 (default auto: bf16 where native)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="output folder (default bench-<model>)")
    _add_overwrite_arg(p)
    p.add_argument("--no-progress", action="store_true")
    add_trust_checkpoint_arg(p)
    _add_compile_arg(p)
    _add_chameleon_args(p)
    _add_sampling_args(p)
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from lantern.bench import cmd_bench as run

    return run(args)


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="measure this device's verify / drafter / loop costs (for --tree auto)",
        description="Time the target's verify forward over 1..N tree tokens, the drafter's context pass and "
        "feeds, and the decoding loop's per-round overhead, with the model's sampling settings. Writes "
        "OUT/profile.json (pass it to --profile) and OUT/verify_cost.png.",
    )
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--batch-size", type=int, default=1, help="rows decoded together (default 1)")
    p.add_argument("--max-tokens", type=int, default=64, help="largest tree verified, root included (default 64)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per point; the median is kept (default 5)")
    p.add_argument("--quick", action="store_true", help="fewer tree sizes and drafter points (what --tree auto runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--out", default="lantern-profile", help="output folder (default ./lantern-profile)")
    _add_overwrite_arg(p)
    p.add_argument("--dtype", default="auto",
                   help="target/drafter precision: auto (default: bf16 where native), float32 or bfloat16")
    p.add_argument("--trace", default=None, metavar="METHODS",
                   help="instead of the cost profile: trace the decode round of these methods (ar included, "
                        "e.g. ar,sd,lantern,lantern++,sjd): time, dispatched ops and host syncs per round by "
                        "phase; writes OUT/trace.json and OUT/trace.md")
    p.add_argument("--trace-images", type=int, default=2, help="images per method for --trace (default 2)")
    p.add_argument("--no-progress", action="store_true")
    add_trust_checkpoint_arg(p)
    _add_compile_arg(p)
    _add_chameleon_args(p)
    _add_sampling_args(p)
    p.set_defaults(func=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    from lantern.api import sampling_from
    from lantern.autotree import ProfileSettings, format_profile, measure_profile, save_profile
    from lantern.outputs import OutputFolder
    from lantern.validate import check_device

    _check_compile(args)
    settings = ProfileSettings(batch_size=args.batch_size, max_tokens=args.max_tokens, repeats=args.repeats,
                               quick=args.quick, seed=args.seed)
    check_device(args.device)
    out = OutputFolder.check(args.out, "--out", args.overwrite)
    stack = _load_tool_stack(args, args.device)
    sampling = sampling_from(stack, args)
    if args.trace is not None:
        if stack.kind != "c2i":
            raise LanternError(f"--trace traces class-label runs; {args.model} is a {stack.kind} model")
        from lantern.roundtrace import cmd_trace

        return cmd_trace(args, stack, sampling, out)
    profile = measure_profile(stack, sampling, settings, model_name=str(args.model), progress=not args.no_progress)
    with out.write() as folder:
        json_path, png_path = save_profile(profile, folder)
    print(format_profile(profile))
    print(f"wrote {out.path / json_path.name}" + (f" and {out.path / png_path.name}" if png_path is not None else ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lantern", description="Relaxed speculative decoding for visual AR models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(sub)
    _add_build_proximity(sub)
    _add_make_random_stack(sub)
    _add_demo(sub)
    _add_profile(sub)
    _add_bench(sub)
    from lantern.train.cli import add_train_commands  # argparse only; trainers import lazily

    add_train_commands(sub)
    return parser


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that ``finally`` blocks (staging folders) run."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated()


def _one_line(e: BaseException) -> str:
    """A user-facing failure that is not a :class:`LanternError` (a path the OS refused, memory), in one line."""
    if isinstance(e, OSError):
        where = f": {e.filename}" if e.filename else ""
        return f"{e.strerror or e}{where}"
    return "out of memory; use a smaller --batch-size or fewer images" if _out_of_memory(e) else str(e)


def _out_of_memory(e: BaseException) -> bool:
    """MemoryError, or torch.cuda.OutOfMemoryError (a RuntimeError; matched by name so that the
    top level imports no torch)."""
    return isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError"


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Errors a user can fix (a :class:`LanternError`, an OSError on their paths,
    running out of memory) end with one ``lantern: error:`` line and exit 2; SIGINT / SIGTERM
    exit 130 / 143 once ``finally`` blocks removed partial outputs; anything else is a bug and
    keeps its traceback."""
    import signal
    import threading

    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for provenance (bench records its command)
    func: Callable[[argparse.Namespace], Any] = args.func
    from lantern.io import trusted_checkpoints

    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if in_main else None
    try:
        _check_sampling_flags(args)
        with trusted_checkpoints(getattr(args, "trust_checkpoint", False)):
            return int(func(args) or 0)
    except LanternError as e:
        print(f"lantern: error: {e}", file=sys.stderr)
        return 2
    except (OSError, MemoryError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and not _out_of_memory(e):
            raise  # any other RuntimeError is a bug: keep its traceback
        print(f"lantern: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lantern: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("lantern: terminated", file=sys.stderr)
        return 143
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
