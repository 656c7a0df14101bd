"""``lantern calibrate``: measure every method on this device for ``--method auto`` (lantern.calibration)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from lantern.cli.common import (
    MODEL_HELP,
    add_cache_arg,
    add_chameleon_args,
    add_compile_arg,
    add_deterministic_arg,
    add_threads_arg,
    add_trust_checkpoint_arg,
    cache_folder,
    chameleon_options,
    check_feature_net_early,
    command_line,
)
from lantern.errors import LanternError, check


def batch_sizes(spec: str) -> tuple[int, ...]:
    """``--batch-sizes 1,8``: distinct sizes >= 1, in the order given."""
    from lantern.eval.methods_grammar import parse_batch_sizes

    return tuple(parse_batch_sizes(spec, "--batch-sizes"))


# The quality pass's flags (their defaults are calibration_config's): --quick runs no quality pass,
# so one of them with --quick is refused rather than silently unused.
QUALITY_FLAGS = {"num_images": "--num-images", "ar_seeds": "--ar-seeds", "batch_size": "--batch-size",
                 "num_real": "--num-real", "feature_net": "--feature-net"}


def quality_settings(args: argparse.Namespace) -> dict[str, int]:
    """The quality flags given (None: the default), refused with ``--quick``."""
    given = {key: getattr(args, key) for key in QUALITY_FLAGS if getattr(args, key) is not None}
    if args.quick and given:
        raise LanternError(f"{QUALITY_FLAGS[next(iter(given))]} sets the quality pass, and --quick runs none: "
                           "drop one of them")
    return {key: value for key, value in given.items() if key != "feature_net"}


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Load the model as ``generate`` would (device, precision, compile mode, batch invariance),
    bench every method it can run at its defaults, and write the calibration."""

    from lantern.api import load, resolve_sampling
    from lantern.calibration import Setup, choose_method
    from lantern.decoding.compiling import resolve_compile
    from lantern.eval.bench import BenchRunner, QualityScorer, run_bench
    from lantern.eval.calibrate import calibration_config, calibration_from_bench, runnable_methods
    from lantern.eval.decode_cache import CachedRunner, DecodeCache
    from lantern.io import ensure_writable_dir
    from lantern.validate import check_device

    t0 = time.perf_counter()
    sizes = batch_sizes(args.batch_sizes)
    check_device(args.device)
    compile_mode = resolve_compile(args.compile, args.device)
    quality = quality_settings(args)
    if not args.quick:  # before the model loads and the methods run
        check_feature_net_early(args, "--quick")
    cache_dir = cache_folder(args, Path(args.out) if args.out else None, "--quick" if args.quick else None)
    if args.out:  # before the model loads and the methods run (a full calibration takes its while)
        check(not Path(args.out).is_dir(), f"--out {args.out} is a folder; expected the calibration file to write "
                                           "(a .json path)")
        ensure_writable_dir(Path(args.out).parent, "--out")
    pipe = load(args.model, device=args.device, dtype=args.dtype, compile=args.compile,
                deterministic=args.deterministic, **chameleon_options(args))
    stack = pipe.stack
    setup = Setup.of(args.model, stack.root, args.device, stack.dtype, compile_mode, args.deterministic)
    runnable = runnable_methods(pipe.parts)
    methods = runnable if args.methods is None else _methods(args.methods, runnable)
    config = calibration_config(methods, sizes, args.quick, speed_images=args.speed_images, repeats=args.repeats,
                                seed=args.seed, compile=compile_mode, **quality)
    out = Path(args.out) if args.out else setup.user_file
    ensure_writable_dir(out.parent, "--out" if args.out else "the calibration folder ($LANTERN_CALIBRATION_DIR)")
    progress = not args.no_progress
    sampling = resolve_sampling(stack)  # the model's generation.json: what a run without sampling flags uses
    scorer = None if args.quick else QualityScorer.build(stack, args.feature_net, config.num_real, progress=progress,
                                                         sampling=sampling, seed=config.seed,
                                                         batch_size=config.batch_size, speed_only="--quick")
    print(f"calibrate {setup.model} on {setup.key} | {len(methods)} methods at batch {', '.join(map(str, sizes))} | "
          + ("speed only (--quick)" if args.quick else f"quality on {config.num_images} images, AR at "
             f"{config.ar_seeds} seeds") + f" | writes {out}")
    runner: Any = BenchRunner(pipe.parts)
    store = None if cache_dir is None else DecodeCache.for_stack(cache_dir, stack, extra=chameleon_options(args))
    if store is not None:
        runner = CachedRunner(runner, store)
    result = run_bench(stack, sampling, config, scorer, progress=progress, runner=runner)
    if store is not None:
        print(f"--cache {cache_dir}: {store.reused} decodes reused, {store.written} written"
              + (f", {store.failed} not written (see the notes above)" if store.failed else ""))
    command = command_line(args)
    calibration, _ = calibration_from_bench(result, stack, setup, command)
    _, replaced = calibration.write(out)
    if replaced:
        print(f"lantern: note: {replaced}")
    if result.meta.get("busy_warning"):
        print("the machine was busy while timing (above): --method auto takes these timings as they are; calibrate "
              "again on a quiet machine")
    for level in ("lossless", "ar"):  # (`quality` above: the quality pass's settings)
        choice = choose_method(calibration, level, sizes[0], str(out))
        print(f"--method auto --quality {level} at batch {sizes[0]}: {choice.explanation}")
    print(f"wrote {out} | total {time.perf_counter() - t0:.0f} s")
    return 0


def _methods(spec: str, runnable: tuple[str, ...]) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(m.strip() for m in spec.split(",") if m.strip()))
    for name in names:
        if name not in runnable:
            raise LanternError(f"--methods: {name!r} is not a method this model can run ({', '.join(runnable)})")
    check("ar" in names, "--methods must include ar (every calibration has it: it is always lossless)")
    return names


def add_calibrate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure every method on this device for --method auto",
        description=(
            "Time every method this model can run at its defaults, at each --batch-sizes, and (unless --quick) judge "
            "its quality against AR's spread, as `lantern bench` does; write the calibration `generate --method auto` "
            "and `pipe(method=\"auto\")` read: $LANTERN_CALIBRATION_DIR, else ~/.cache/lantern/calibration, "
            "<model-id>/<device-key>.json."
        ),
    )
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--dtype", default="float32", help="float32 (default, as generate) | bfloat16 | auto")
    add_compile_arg(p)
    add_threads_arg(p)
    add_deterministic_arg(p, default=False)
    p.add_argument("--batch-sizes", default="1,8", help="batch sizes timed (default 1,8)")
    p.add_argument("--quick", action="store_true",
                   help="speed only, no quality images: --quality lossless works, --quality ar picks among lossless "
                        "methods only")
    p.add_argument("--methods", default=None,
                   help="comma-separated methods, ar included (default: every method this model can run)")
    p.add_argument("--num-images", type=int, default=None, help="quality images per method (default 200)")
    p.add_argument("--ar-seeds", type=int, default=None, help="AR's quality at this many seeds: the spread (default 5)")
    p.add_argument("--speed-images", type=int, default=8,
                   help="images timed per method at the first batch size (default 8)")
    p.add_argument("--repeats", type=int, default=1, help="timed passes per method; the median is kept (default 1)")
    p.add_argument("--batch-size", type=int, default=None, help="batch for the quality images (default 25)")
    p.add_argument("--num-real", type=int, default=None, help="held-out real images to compare with (default 1000)")
    p.add_argument("--feature-net", default=None,
                   help="feature extractor, as for bench (default: the model's features/)")
    add_cache_arg(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="the calibration file (default: the user's calibration folder)")
    p.add_argument("--no-progress", action="store_true")
    add_trust_checkpoint_arg(p)
    add_chameleon_args(p)
    p.set_defaults(func=cmd_calibrate)
