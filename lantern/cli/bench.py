"""``lantern bench``: flags to a checked BenchConfig, then the run (one process or the ranks of a torchrun job)."""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lantern.cli.common import (
    MODEL_HELP,
    add_budget_arg,
    add_cache_arg,
    add_overwrite_arg,
    add_prompt_score_args,
    add_tool_args,
    cache_folder,
    chameleon_options,
    check_feature_net_early,
    check_prompt_score_args,
    command_line,
    model_reads,
)
from lantern.errors import check

# The bench's machinery imports torch: it is read when the command runs, so that building the
# parser (``lantern --help``, a mistyped flag) stays fast.
if TYPE_CHECKING:
    from lantern.eval.bench import BenchConfig


def bench_config(args: Any) -> BenchConfig:
    """``lantern bench``'s flags as a checked :class:`BenchConfig` (nothing loaded yet)."""
    from lantern.decoding.compiling import resolve_compile
    from lantern.eval.bench import BenchConfig
    from lantern.eval.methods_grammar import parse_batch_sizes, parse_methods, parse_tree_options

    trees = parse_tree_options(args.tree)
    batch_sizes = parse_batch_sizes(args.speed_batch_size)
    config = BenchConfig(
        methods=parse_methods(args.methods, trees, args.lantern_budget),
        # --no-quality decodes only the timed images: --num-images (200 by default) must not cap them
        num_images=max(args.num_images, args.speed_images) if args.no_quality else args.num_images,
        speed_images=args.speed_images,
        seed=args.seed,
        batch_size=args.batch_size,
        speed_batch_size=batch_sizes[0],
        throughput_batch_sizes=tuple(batch_sizes[1:]),
        compile=resolve_compile(args.compile, args.device),
        repeats=args.repeats,
        num_real=args.num_real,
        curve_images=args.curve_images,
        ar_seeds=1 if args.no_ar_spread else args.ar_seeds,
        sweep=args.sweep,
        sweep_images=args.sweep_images,
    )
    check(not (args.sweep and args.no_quality), "--sweep needs quality metrics: drop --no-quality")
    check(not (args.clip_score and args.no_quality), "--clip-score is a quality metric: drop --no-quality")
    check(not (args.hps and args.no_quality), "--hps is a quality metric: drop --no-quality")
    check_prompt_score_args(args)
    check(not (args.reference_images and args.no_quality), "--reference-images is for the quality metrics: drop "
                                                          "--no-quality")
    check(args.reference_images is None or Path(args.reference_images).is_dir(),
          f"--reference-images: no such folder {args.reference_images}")
    check(args.profile is None or any(m.tree == "auto" for m in config.methods),
          "--profile is only used with auto trees (--tree auto, or a row METHOD@auto)")
    return config


def cmd_bench(args: Any) -> int:
    """``lantern bench``: in one process, or across the ranks of a ``torchrun`` job
    (:mod:`lantern.eval.ranks`: the images are shared out, rank 0 scores and writes)."""

    import torch

    from lantern.api import load_model_stack, sampling_from
    from lantern.distributed import DistContext, process_group
    from lantern.eval.bench import BenchRunner, QualityScorer, resolve_auto_trees, resolve_auto_windows, run_bench
    from lantern.eval.decode_cache import CachedRunner, DecodeCache
    from lantern.eval.ranks import RankRunner, check_bench_ranks, no_metrics
    from lantern.eval.report import format_table, save_bench, throughput_table
    from lantern.outputs import OutputFolder
    from lantern.parts import ModelParts
    from lantern.targets.text import read_prompts
    from lantern.validate import check_device

    t0 = time.perf_counter()
    config = bench_config(args)
    prompts = read_prompts(args.prompts) if args.prompts is not None else []  # before anything is loaded
    check_device(args.device)
    ctx = DistContext.from_env()
    check_bench_ranks(config, ctx)
    args.device = ctx.device(args.device)
    out = OutputFolder.check(args.out or f"bench-{Path(str(args.model)).name}", "--out", args.overwrite,
                             reads=model_reads(args))
    if not args.no_quality:
        check_feature_net_early(args, "--no-quality")
    cache_dir = cache_folder(args, out.path, "--no-quality" if args.no_quality else None)
    progress = not args.no_progress and ctx.is_main
    torch.manual_seed(0)
    stack = load_model_stack(args.model, device=args.device, dtype=args.dtype, **chameleon_options(args))
    check(args.clip_score is None or stack.num_classes is None,
          f"--clip-score: {args.model} is class-conditional: a CLIP score needs prompts")
    check(args.hps is None or stack.num_classes is None,
          f"--hps: {args.model} is class-conditional: a preference score needs prompts")
    if prompts:
        check(stack.num_classes is None, f"--prompts: {args.model} is class-conditional: bench draws its labels "
                                         "from its classes")
        stack.measure_with(prompts)
    clip: Any = None  # read before the (long) reference images, so that a bad folder fails at once
    if args.clip_score is not None and ctx.is_main:
        from lantern.eval.metrics import ClipScorer

        clip = ClipScorer(args.clip_score, device=args.device, prefix=args.clip_prefix)
    hps: Any = None
    if args.hps is not None and ctx.is_main:
        from lantern.eval.hps import HpsScorer

        hps = HpsScorer(args.hps, args.hps_clip, device=args.device)
    sampling = sampling_from(stack, args)
    parts = ModelParts(stack)  # the drafter and table, read once for every choice and run below
    given = config
    config, auto_trees = resolve_auto_trees(stack, sampling, config, args.profile, log=print, parts=parts)
    config, auto_windows = resolve_auto_windows(stack, sampling, config, log=print, parts=parts, progress=progress)
    throughput_methods = {}
    for batch in config.throughput_batch_sizes if auto_trees else ():  # auto trees are chosen per batch size
        at_batch, chosen = resolve_auto_trees(stack, sampling, replace(given, speed_batch_size=batch), None, log=print,
                                              parts=parts)
        throughput_methods[batch] = {m.name: m.resolve(stack) for m in at_batch.methods}
        auto_trees[f"batch {batch}"] = chosen
    with process_group(ctx, args.device):
        scorer: Any = None
        if not args.no_quality:  # metrics are computed once, on rank 0
            scorer = QualityScorer.build(stack, args.feature_net, config.num_real, progress=progress,
                                         reference_dir=args.reference_images,
                                         sampling=sampling, seed=config.seed,
                                         batch_size=config.batch_size) if ctx.is_main else no_metrics
        if ctx.is_main:
            quality = "no quality (the rows describe the timed images)" if args.no_quality else \
                f"quality on {config.num_images} images"
            print(f"bench {args.model} | {len(config.methods)} methods | {quality}, "
                  f"speed on {config.speed_images} at batch {config.speed_batch_size} | {sampling.to_dict()} | "
                  f"{str(stack.dtype).replace('torch.', '')} on {args.device}"
                  + (f" | {ctx.world_size} processes" if ctx.enabled else ""))
        if isinstance(scorer, QualityScorer):
            scorer.clip, scorer.hps = clip, hps
            print(f"feature network: {scorer.description}; real set: {scorer.num_real} real images"
                  + "".join(f"; {s.name}" for s in (clip, hps) if s is not None))
        runner: Any = RankRunner(ctx, parts) if ctx.enabled else BenchRunner(parts)
        store = None
        if cache_dir is not None:
            store = DecodeCache.for_stack(cache_dir, stack, ctx.world_size, chameleon_options(args),
                                          log=print if ctx.is_main else _quiet)
            runner = CachedRunner(runner, store, ctx)
        result = run_bench(stack, sampling, config, scorer, progress=progress, throughput_methods=throughput_methods,
                           runner=runner, log=print if ctx.is_main else _quiet)
    if not ctx.is_main:
        return 0
    if isinstance(scorer, QualityScorer):
        result.meta.update(scorer.meta())
    result.meta["auto_trees"] = auto_trees
    if auto_windows:
        result.meta["auto_windows"] = auto_windows
    result.meta["processes"] = ctx.world_size
    if prompts:
        result.meta["prompts"] = {"file": str(args.prompts), "count": len(prompts)}
    if store is not None:
        result.meta["cache"] = store.summary()
    command = command_line(args)
    with out.write() as folder:
        save_bench(stack, result, folder, command)
    if result.meta.get("busy_warning"):
        print(result.meta["busy_warning"])
    print(format_table(result.rows))
    if result.throughput:
        print(throughput_table(result.throughput))
    if result.ar_spread is not None:
        print(result.ar_spread.summary())
    if args.save_calibration:
        _save_calibration(args, stack, config, result, command)
    if store is not None:
        print(f"--cache {cache_dir}: {store.reused} decodes reused, {store.written} written"
              + (f", {store.failed} not written (see the notes above)" if store.failed else ""))
    print(f"wrote {out.path}/bench.json, bench.md, run.json and PNGs | total {time.perf_counter() - t0:.0f} s")
    return 0


def _save_calibration(args: Any, stack: Any, config: BenchConfig, result: Any, command: str) -> None:
    """``--save-calibration``: the rows at a method's defaults, as ``--method auto``'s calibration."""
    from lantern.calibration import Setup
    from lantern.eval.calibrate import calibration_from_bench

    setup = Setup.of(args.model, stack.root, args.device, stack.dtype, config.compile)
    calibration, skipped = calibration_from_bench(result, stack, setup, command)
    path, replaced = calibration.write(setup.user_file)
    print(f"wrote the calibration --method auto reads: {path}"
          + (f" (rows not at their method's defaults left out: {', '.join(skipped)})" if skipped else ""))
    if replaced:
        print(f"lantern: note: {replaced}")


def _quiet(message: str) -> None:
    """The log of ranks other than 0: rank 0 speaks for the job."""


def add_bench(sub: argparse._SubParsersAction) -> None:
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
                        "METHOD/KEY=VALUE... a row with those settings (KEY a setting's name, e.g. lantern_delta, "
                        "or its short form: k, delta, lambda, residual, budget, credit; window, init, coupling, "
                        "group, alpha; width, depth for sjd-pac; window, context, init for pjd), e.g. "
                        "lantern/delta=0.2/budget=token or sjd-coupled/coupling=gumbel "
                        "(default ar,sd,sd-static,lantern,lantern++,sjd,sjd-lantern)")
    p.add_argument("--tree", action="append", default=[], metavar="METHOD=TREE",
                   help="tree for one method, e.g. lantern++=chain:5 or sd=dynamic (repeatable); "
                        "METHOD=auto picks it from this device's verify-cost curve (default: the stack's trees)")
    p.add_argument("--num-images", type=int, default=200, help="images per method for quality metrics (default 200)")
    p.add_argument("--reference-images", default=None, metavar="DIR",
                   help="compare with a folder of real images (the first --num-real, centre-cropped and resized "
                        "to the model's size), e.g. COCO val2017 for a text model, instead of the model's data "
                        "set or AR samples")
    add_prompt_score_args(p)
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="prompt-conditioned models: the evaluation's prompts, cycled over the images (a text file, "
                        "one per line; a .tsv's Prompt column; a .json of captions). Default: 4 fixed prompts")
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
                        "torchscript:FILE (e.g. clean-fid's Inception), inception:FILE (pytorch-fid's "
                        "pt_inception-2015-12-05-6726825d.pth: pytorch-fid's and torchmetrics' FID, no code run), "
                        "clip:DIR (a local CLIP vision model) or vgg16:FILE (torchvision's vgg16-397923af.pth: the "
                        "fc2 features of LANTERN's precision and recall)")
    p.add_argument("--curve-images", type=int, default=16,
                   help="images per point of the tau-vs-delta/lambda curves (0 = skip; default 16)")
    p.add_argument("--ar-seeds", type=int, default=5,
                   help="AR's quality at this many seeds (--seed, --seed + 1, ...): each row is out when a metric is "
                        "worse than AR's one-sided bound (a 5 %% false-alarm rate over the metrics; default 5; "
                        "1 = no spread)")
    p.add_argument("--no-ar-spread", action="store_true", help="the same as --ar-seeds 1: AR at one seed only")
    p.add_argument("--no-quality", action="store_true",
                   help="speed only: no quality images or metrics (rows describe the timed images)")
    p.add_argument("--sweep", action="store_true", help="also sweep (k, delta) and (k, lambda) for the frontier")
    p.add_argument("--sweep-images", type=int, default=100, help="quality images per sweep point (default 100)")
    p.add_argument("--profile", default=None, help="with auto trees: a profile.json from `lantern profile`")
    add_cache_arg(p)
    p.add_argument("--save-calibration", action="store_true",
                   help="also write the rows run at their method's defaults as the calibration `--method auto` reads "
                        "(as `lantern calibrate` does; the speed batch sizes are its batch sizes)")
    add_budget_arg(p)
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 (default auto: bf16 where native)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="output folder (default bench-<model>)")
    add_overwrite_arg(p)
    p.add_argument("--no-progress", action="store_true")
    add_tool_args(p)
    p.set_defaults(func=cmd_bench)
