"""What the sub-command modules share: argument groups, their checks, and settings resolved from flags."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lantern.decoding.config import PJD_COUPLINGS
from lantern.errors import LanternError, check

if TYPE_CHECKING:
    from lantern.outputs import OutputFolder


def window_arg(text: str) -> int | str:
    """``--sjd-window``: a window length, or ``auto`` (measured on this device). Anything else is
    passed on as text, for ``JacobiConfig`` to refuse in one line."""
    try:
        return int(text)
    except ValueError:
        return text.strip()


def add_pjd_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pjd-window", type=window_arg, default=None,
                   help="pjd*: guesses per open image row and round, 1 .. the row length (default 4), or auto; "
                        "a window runs on into the next row while that row is not open")
    p.add_argument("--pjd-context", type=window_arg, default=None,
                   help="pjd*: known tokens row r needs before row r + 1 opens, 1 .. the row length (default 8; the "
                        "row length decodes one row at a time, losslessly, with windows running across row ends "
                        "as SJD's do). A quality knob: smaller is faster and further from the model, so it has no "
                        "auto")
    p.add_argument("--pjd-init", default=None, choices=["random", "row_above", "above_mode"],
                   help="pjd*: a cell's first guess: uniform noise, the token of the cell above (a new row "
                        "continues the one above it; else the cell to the left), or above_mode: the most likely "
                        "token of the target's last prediction for that cell (default row_above)")
    p.add_argument("--pjd-coupling", default=None, choices=list(PJD_COUPLINGS),
                   help="pjd*: how a guess still open is redrawn from the next forward: independently (the PJD "
                        "paper's rule; default) or maximal: kept with probability min(1, p/q), else drawn from "
                        "the residual (SCD's coupling, as sjd-coupled; lossless at --pjd-context = the row length)")


_LABEL_RANGE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")


def int_list(text: str, what: str = "label", many: str = "labels") -> list[int]:
    """``--labels``: comma-separated class ids and inclusive ranges, ``0-999,5`` (an FID run over
    every ImageNet class is ``--labels 0-999 --num-per-label 50``, not a 3,890-character list)."""
    from lantern.validate import MAX_IMAGES

    items = text.split(",")
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected at least one {what}")
    if any(item.strip() == "" for item in items):  # "0,,3": a label was meant there, or a typo
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r} (an empty item)")
    labels: list[int] = []
    for item in items:
        span = _LABEL_RANGE.match(item)
        if span is None:
            try:
                labels.append(int(item))
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"expected comma-separated integers or ranges (0-999), got {item.strip()!r}") from None
            continue
        lo, hi = int(span[1]), int(span[2])
        if hi < lo:
            raise argparse.ArgumentTypeError(f"the range {item.strip()!r} runs downward; write {hi}-{lo}")
        if len(labels) + hi - lo + 1 > MAX_IMAGES:
            raise argparse.ArgumentTypeError(f"{item.strip()!r} makes more than {MAX_IMAGES} {many}")
        labels.extend(range(lo, hi + 1))
    return labels


def index_list(text: str) -> list[int]:
    """``--indices``: image indices of a run, written as ``--labels`` is (``37`` or ``0-7,40``)."""
    return int_list(text, "image index", "images")


SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "cfg_scale")  # --temperature, --top-k, ...


def check_sampling_flags(args: argparse.Namespace) -> None:
    """Each sampling flag given, checked on its own before anything is loaded (``main`` leads the
    error, ``top_p must be in (0, 1]``, with its flag, as every setting's)."""
    from lantern.decoding.config import SamplingConfig

    for name in SAMPLING_FLAGS:
        value = getattr(args, name, None)
        if value is not None:
            SamplingConfig(**{name: value})


def command_line(args: argparse.Namespace) -> str:
    """The command as typed, for a result's provenance (``main`` keeps the argv it parsed)."""
    import shlex
    import sys

    return "lantern " + " ".join(shlex.quote(a) for a in getattr(args, "argv", sys.argv[1:]))


SEED_FLAGS = ("seed", "data_seed")  # the commands' seed options (generate, bench, profile, train ...)


def check_seed_flags(args: argparse.Namespace) -> None:
    """Each seed flag the command has, in [0, 2^63) (``lantern.validate.check_seed``), before anything is loaded."""
    from lantern.validate import check_seed

    for name in SEED_FLAGS:
        value = getattr(args, name, None)
        if value is not None:
            check_seed(value, f"--{name.replace('_', '-')}")


def method_from_args(args: argparse.Namespace, stack: Any, tree: Any = None) -> Any:
    """``--method`` with its flags, resolved by the library. ``tree``: auto's choice; with --tree auto
    and no choice yet, the method's own default tree (what choose_tree starts from)."""
    from lantern.methods import METHOD_SETTINGS, resolve_method

    settings = {name: getattr(args, name) for name in METHOD_SETTINGS}
    settings["tree"] = tree if tree is not None else None if args.tree == "auto" else args.tree
    for name in ("sjd_window", "pjd_window"):
        if settings[name] == "auto":  # measured later (choose_auto_window); resolve with the default first
            settings[name] = None
    return resolve_method(args.method, None if args.tree == "auto" and tree is None else stack, **settings)


def window_as_tree(args: argparse.Namespace) -> None:
    """``--tree auto`` on a Jacobi method (sjd*, gsd, pjd*) means its window: ``--sjd-window auto`` /
    ``--pjd-window auto`` (the window is what these methods' verify chain is made of)."""
    from lantern.methods import METHOD_TABLE

    name = METHOD_TABLE[args.method].window_setting
    if args.tree != "auto" or name is None:
        return
    if getattr(args, name) is not None and getattr(args, name) != "auto":
        raise LanternError(f"--tree auto chooses {args.method}'s window; it cannot be combined with "
                           f"--{name.replace('_', '-')} {getattr(args, name)}")
    setattr(args, name, "auto")
    args.tree = None


def check_auto_tree(tree: str | None, methods: Sequence[str], profile: str | None) -> bool:
    """True for ``--tree auto``; refuses it for methods without a drafter tree, and --profile without it."""
    if tree != "auto":
        if profile is not None:
            raise LanternError("--profile is only used with --tree auto")
        return False
    from lantern.autotree.model import SPECULATIVE_METHODS

    if not any(m in SPECULATIVE_METHODS for m in methods):
        raise LanternError(
            f"--tree auto needs a speculative --method ({', '.join(SPECULATIVE_METHODS)}), got {', '.join(methods)}"
        )
    return True


def choose_auto_tree(
    stack: Any, method: Any, sampling: Any, batch_size: int, profile: Any, seed: int,
    parts: Any = None, progress: bool = True, compile: str | None = None,
) -> Any:
    """``--tree auto``: choose_tree for one method (on ``parts``, a ``lantern.parts.ModelParts``: the
    loaded drafter and table; ``compile``: the run's compile mode), with its explanation printed."""
    from lantern.autotree.choose import choose_tree

    choice = choose_tree(stack, method, sampling, profile=profile, seed=seed, batch_size=batch_size,
                         parts=parts, progress=progress, compile=compile)
    print(f"--tree auto [{choice.method}]: {choice.explanation} (profile {choice.profile_seconds:.1f} s, "
          f"calibration {choice.calibration_seconds:.1f} s)")
    return choice


def check_auto_window(args: argparse.Namespace) -> bool:
    """True for ``--sjd-window auto`` / ``--pjd-window auto``; refuses it for methods without such a
    window."""
    from lantern.methods import family_methods

    auto = False
    for flag, window, methods in (("--sjd-window", args.sjd_window, family_methods("sjd")),
                                  ("--pjd-window", args.pjd_window, family_methods("pjd"))):
        if window != "auto":
            continue
        if args.method not in methods:
            raise LanternError(f"{flag} auto needs a --method with that window ({', '.join(methods)}), "
                               f"got {args.method}")
        auto = True
    return auto


def choose_auto_window(stack: Any, method: Any, sampling: Any, args: argparse.Namespace, parts: Any = None,
                       batch_size: int | None = None, compile: str | None = None) -> Any:
    """``--sjd-window auto``: choose_window at ``batch_size`` rows (default ``--batch-size``), timed
    in the run's ``compile`` mode, with its explanation printed."""
    from lantern.autotree.window import choose_window

    rows = args.batch_size if batch_size is None else batch_size
    choice = choose_window(stack, method, sampling, seed=args.seed, batch_size=rows, parts=parts, compile=compile,
                           progress=not args.no_progress)
    flag = "--pjd-window" if method.pjd is not None else "--sjd-window"
    print(f"{flag} auto [{choice.method}]: {choice.explanation} (calibration {choice.seconds:.1f} s)")
    return choice


MODEL_HELP = ("embedded preset (digits | photos), a LlamaGen c2i / t2i stack folder, an Anole / Lumina-mGPT, "
              "Janus / Janus-Pro or Emu3 folder, or a Hugging Face repo id of one")


def add_chameleon_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Chameleon-family targets (Anole, Lumina-mGPT: an HF model folder as --model)")
    g.add_argument("--layout", default=None, choices=["anole", "lumina-mgpt"],
                   help="the model's image layout (default: \"layout\" in the folder's generation.json)")
    g.add_argument("--image-size", type=int, default=None,
                   help="the image's height in pixels, and its width unless --image-width is given. lumina-mgpt: "
                        "a multiple of 32 (default 768); anole: 512 only; Emu3: a multiple of 8 (default: "
                        "generation.json's image_size, else 720)")
    g.add_argument("--image-width", type=int, default=None, metavar="PIXELS",
                   help="lumina-mgpt and Emu3: the image's width in pixels, for a wide or tall image (default: as "
                        "high; e.g. Emu3Processor's ratio 16:9 at 720 x 720's area is --image-size 544 "
                        "--image-width 960)")
    g.add_argument("--vq", default=None, metavar="CKPT",
                   help="the Chameleon VQGAN checkpoint vqgan.ckpt, vqgan.yaml beside it, or a Hub repo id holding "
                        "them (default: vqgan.ckpt or tokenizer/vqgan.ckpt inside --model)")
    add_prompt_width_arg(g)


def add_prompt_width_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--prompt-width", type=int, default=None, metavar="TOKENS",
                   help="Chameleon family, Janus, Emu3: every prompt, in the model's template, is left-padded to "
                        "this many tokens, so a row's floats never depend on its batch-mates' prompts; a longer "
                        "prompt is refused; each token costs every row a cache column (default 256)")


def chameleon_options(args: argparse.Namespace) -> dict[str, Any]:
    """The Chameleon-family flags of ``add_chameleon_args`` as ``lantern.load`` keywords."""
    return {"layout": args.layout, "image_size": args.image_size, "image_width": args.image_width, "vq": args.vq,
            "prompt_width": args.prompt_width}


def load_tool_stack(args: argparse.Namespace, device: str = "cpu") -> Any:
    """demo / bench / profile: the stack of any family (``lantern.load``) for ``--model``."""
    from lantern.api import load_model_stack

    return load_model_stack(args.model, device=device, dtype=args.dtype, **chameleon_options(args))


def add_budget_arg(p: argparse.ArgumentParser) -> None:
    from lantern.methods import BUDGETS, DEFAULT_BUDGET

    p.add_argument(
        "--lantern-budget", default=None, choices=BUDGETS,
        help="what delta / lambda bound: each acceptance test (test, the paper's) or every emitted token "
        f"(token: TV(token, p) <= delta, or token(x) <= lambda p(x), at every tree level) (default {DEFAULT_BUDGET})",
    )


def add_compile_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile", nargs="?", const="auto", default="off", metavar="MODE",
                   help="compile the decode step (target, drafter, acceptance; AR too) with torch.compile: "
                        "--compile alone = auto (CUDA graphs on a GPU, inductor kernels on a CPU), or a mode: "
                        "default, reduce-overhead, max-autotune. Costs start-up time (docs/benchmarking.md); "
                        "default off")


def threads_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a whole number of threads >= 1, got {text!r}")
    return value


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=threads_arg, default="auto", metavar="N",
                   help="torch's CPU threads for this command. Default auto: torch's own count (or "
                        "OMP_NUM_THREADS), lowered to the cores other processes leave free, looked at when the "
                        "command starts (serve and training: every 10 s while they run). A "
                        "thread on a busy core stalls every op: on 2 cores beside a 2-thread torch job, 2 threads "
                        "took 14x as long as 1")


def adapts_threads(device: str) -> bool:
    """Whether ``--threads auto`` may lower torch's count: on a CPU, unless ``OMP_NUM_THREADS`` chose it."""
    import os

    return str(device).startswith("cpu") and not os.environ.get("OMP_NUM_THREADS")


def choose_threads(choice: int | str, device: str, current: int, since: Any = None) -> int:
    """The intra-op thread count for ``--threads``: a number as given; ``auto`` on a CPU, the
    cores other processes leave free (measured over at least a quarter of a second, from the
    :class:`lantern.machine.Reading` ``since`` when given; said in one line when it lowers
    ``current``); otherwise, or when ``OMP_NUM_THREADS`` chose the count, ``current``."""
    if isinstance(choice, int):
        return choice
    if current <= 1 or not adapts_threads(device):
        return current
    from lantern import machine

    seen = machine.busy_cores(since=since)
    if seen is None:
        return current
    busy, cpus = seen
    threads = machine.threads_beside(busy, cpus, current)
    if threads < current:
        import sys

        print(f"lantern: other processes keep {busy:.1f} of the {cpus} cores busy: running on {threads} thread"
              f"{'s' if threads > 1 else ''}, not {current} (a thread on a busy core stalls every op); "
              f"--threads {current} uses them all", file=sys.stderr)
    return threads


def add_deterministic_arg(p: argparse.ArgumentParser, default: bool) -> None:
    state = "on" if default else "off"
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=default,
                   help="batch-invariant matmuls and attention: an image's codes never depend on the batch it runs "
                        "in, whatever the kernel library, and a lossless method at --temperature 0 gives AR's codes "
                        "in any dtype (slower; other samples than without it). Default " + state)


def check_compile(args: argparse.Namespace) -> None:
    """Refuse a bad --compile before anything is loaded or written."""
    from lantern.decoding.compiling import resolve_compile

    resolve_compile(args.compile, getattr(args, "device", "cpu"))


def read_prompt_args(args: argparse.Namespace) -> list[str] | None:
    """The prompts of --prompt / --prompts (checked before anything is loaded), or None for --labels."""
    from lantern.targets.text import check_prompts, read_prompts

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


def check_model_condition(stack: Any, model: str, text: bool) -> None:
    """Labels need a class-conditional target, prompts a text-to-image one (LlamaGen t2i, Chameleon)."""
    kind = stack.kind
    if text and kind == "c2i":
        raise LanternError(f"--prompt/--prompts: {model} is a class-conditional model; pass --labels")
    if not text and kind != "c2i":
        raise LanternError(f"--labels: {model} is a text-to-image model; pass --prompt TEXT or --prompts FILE")


def resolve_hub_args(args: argparse.Namespace, names: Sequence[str]) -> None:
    """Each of these flags given as a Hugging Face ``org/name`` (and not an existing local path)
    becomes the local snapshot folder of that repo."""
    from lantern.hub import resolve_location

    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            setattr(args, name, resolve_location(value, f"--{name}"))


def add_overwrite_arg(p: argparse.ArgumentParser, what: str = "folder") -> None:
    p.add_argument("--overwrite", action="store_true",
                   help=f"replace an existing non-empty --out {what} (default: refuse to touch it)")


def check_run_args(args: argparse.Namespace, check_out: bool = True) -> OutputFolder | None:
    """generate's counts and device, checked before anything is loaded; the --out folder to write
    (None when not ``check_out``: a rank other than 0, or a finished job to resume)."""
    from lantern.outputs import OutputFolder
    from lantern.validate import check_count, check_device

    check_count(args.num_per_label, "--num-per-label / --num-per-prompt")
    check_count(args.batch_size, "--batch-size")
    check_device(args.device)
    return OutputFolder.check(args.out, "--out", args.overwrite, reads=model_reads(args)) if check_out else None


def model_reads(args: argparse.Namespace) -> dict[str, Any]:
    """The paths a model command reads, by flag: what its ``--out`` must not be or hold
    (``--overwrite`` replaces the folder whole). A preset name is not a path."""
    from lantern.targets.base import PRESETS

    reads = {f"--{name.replace('_', '-')}": getattr(args, name, None)
             for name in ("model", "drafter", "proximity", "t5", "vq", "prompts", "tokenizer")}
    if getattr(args, "model", None) in PRESETS:
        reads["--model"] = None
    return reads


def add_cache_arg(p: argparse.ArgumentParser) -> None:
    """``--cache DIR`` of bench and calibrate (:mod:`lantern.eval.decode_cache`)."""
    p.add_argument("--cache", default=None, metavar="DIR",
                   help="keep each quality decode (codes and forward counts) in DIR as it finishes, and reuse the ones "
                        "whose model, code, machine, conditions, seed, sampling, method and batch size all match: a "
                        "stopped run, started again, decodes only what is missing, and a run that adds methods "
                        "reuses AR's seeds (speed is always timed anew)")


def cache_folder(args: argparse.Namespace, out: Path | None, speed_only: str | None) -> Path | None:
    """``--cache``'s folder, checked before anything loads: a folder (or a new name), outside
    ``out`` (an ``--out`` folder, replaced whole when the run is written) and outside the model's own files
    (they key the cache: writing there would change every entry's key). ``speed_only``: the flag
    given that makes no quality decodes (then ``--cache`` is refused), or None."""
    from lantern.outputs import check_location
    from lantern.targets.base import PRESETS, PRESETS_DIR

    if args.cache is None:
        return None
    check(speed_only is None, f"--cache keeps the quality decodes; {speed_only} makes none (drop one of them)")
    folder = Path(args.cache).expanduser().resolve()
    check(not folder.is_file(), f"--cache: {folder} is a file; expected a folder (new or one a run wrote)")
    # resolved as the cache is: a relative --out (OutputFolder keeps it as given) would never hold it
    check(out is None or not folder.is_relative_to(out.resolve()),
          f"--cache: {folder} is inside --out {out}, which the run replaces whole; pass a folder outside it")
    reads = {**model_reads(args), **({"--model": PRESETS_DIR / args.model} if args.model in PRESETS else {})}
    for flag, path in reads.items():
        if path is None or str(path) == "":
            continue
        read = Path(str(path)).expanduser().resolve()
        check(not (read.is_dir() and folder.is_relative_to(read)),
              f"--cache: {folder} is inside {flag} {read}, whose files key the cache; pass a folder outside it")
    check_location(folder / "entry", "--cache")  # the folder itself when it exists
    return folder


def add_trust_checkpoint_arg(p: argparse._ActionsContainer) -> None:
    """``--trust-checkpoint``, on every command that may read a pickled checkpoint (.pt/.bin/.ckpt)."""
    p.add_argument(
        "--trust-checkpoint", action="store_true",
        help="fully unpickle .pt/.bin/.ckpt files that hold classes besides tensors and the allowed ones: "
             "this can run code from the file, so only for files you trust (docs/checkpoints.md: Loading "
             "checkpoints safely)",
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (defaults: the model's generation.json, else the values shown)")
    g.add_argument(
        "--temperature", type=float, default=None, help="sampling temperature; 0 = greedy argmax (default 1.0)"
    )
    g.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens; 0 = off (default 0)")
    g.add_argument("--top-p", type=float, default=None, help="nucleus threshold in (0, 1]; 1 = off (default 1.0)")
    g.add_argument("--cfg-scale", type=float, default=None, help="classifier-free guidance scale; 1 = off (default 1)")


def check_chameleon_model(root: Path) -> None:
    """``--model`` of a command that only runs models on the Chameleon adapter (train-chameleon-drafter):
    Chameleon-family folders, Janus and Emu3 ones."""
    from lantern.models.chameleon import is_chameleon_folder
    from lantern.models.emu3 import is_emu3_folder
    from lantern.models.janus import is_janus_folder

    if not root.is_dir():  # before asking for a layout: a missing folder is not a Chameleon model
        raise LanternError(f"--model: no such folder {root}")
    if not (is_chameleon_folder(root) or is_janus_folder(root) or is_emu3_folder(root)):
        raise LanternError(f"--model {root} is not a Chameleon-family, Janus or Emu3 model folder (no config.json "
                           "with model_type 'chameleon', 'janus' or 'emu3': an Anole, Lumina-mGPT, Janus or Emu3 "
                           "folder in the transformers format)")


def add_tool_args(p: argparse.ArgumentParser) -> None:
    """What every command that loads a model for measuring takes (demo, bench, profile): checkpoint
    trust, compilation, threads, the Chameleon layout flags and the sampling overrides."""
    add_trust_checkpoint_arg(p)
    add_compile_arg(p)
    add_threads_arg(p)
    add_chameleon_args(p)
    add_sampling_args(p)


def check_feature_net_early(args: argparse.Namespace, speed_only: str) -> None:
    """bench / calibrate: a local model folder without ``features/`` and no ``--feature-net`` is
    refused before the model loads (the quality pass would need one); a preset name always has one,
    whatever folder of that name the working directory holds."""
    from lantern.targets.base import PRESETS

    model = str(args.model)
    if args.feature_net is None and model not in PRESETS and Path(model).is_dir():
        from lantern.eval.metrics import default_feature_net

        default_feature_net(model, speed_only)


def add_prompt_score_args(p: argparse.ArgumentParser) -> None:
    """bench's and score's prompt-following metrics: the CLIP score and HPS of each image against its prompt."""
    p.add_argument("--clip-score", default=None, metavar="DIR",
                   help="prompt-conditioned images: also their CLIP score against their prompts (100 x max(cosine, "
                        "0), as torchmetrics) with a local CLIP folder, e.g. openai/clip-vit-base-patch32 (LANTERN's)")
    p.add_argument("--clip-prefix", default="", metavar="TEXT",
                   help='with --clip-score: text put before every prompt (LANTERN\'s evaluation: "A photo depicts ")')
    p.add_argument("--hps", default=None, metavar="FILE",
                   help="prompt-conditioned images: also HPS v2 / v2.1, the human preference score LANTERN's "
                        "evaluation reports (HPS_v2.1_compressed.pt, read without running code); needs --hps-clip")
    p.add_argument("--hps-clip", default=None, metavar="DIR",
                   help="with --hps: a local ViT-H-14 CLIP folder in transformers' layout "
                        "(laion/CLIP-ViT-H-14-laion2B-s32B-b79K) for the config and tokenizer HPS runs on")


def check_prompt_score_args(args: argparse.Namespace) -> None:
    check((args.hps is None) == (args.hps_clip is None), "--hps FILE needs --hps-clip DIR (the ViT-H-14 CLIP folder "
                                                         "whose config and tokenizer it runs on), and back")
