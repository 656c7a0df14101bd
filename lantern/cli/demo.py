"""``lantern demo``: every method on the same labels and seeds, a table and an image grid."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lantern.cli.common import (
    MODEL_HELP,
    add_budget_arg,
    add_overwrite_arg,
    add_tool_args,
    check_auto_tree,
    check_compile,
    load_tool_stack,
    model_reads,
    window_arg,
)
from lantern.errors import LanternError


def add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="AR vs LANTERN++ / LANTERN on an embedded model: speed-up table and image grid",
        description="Decode the same labels and seeds with every method, timed side by side in this process.",
    )
    # photos: LlamaGen Stage I's 256 tokens, where the speed-up shows (digits' 64 tokens barely gain)
    p.add_argument("--model", default="photos", help=MODEL_HELP + " (default photos)")
    p.add_argument("--methods", default="ar,lantern++,lantern,sd,sjd-coupled",
                   help="comma-separated methods, ar first (default ar,lantern++,lantern,sd,sjd-coupled: the "
                        "drafter methods and the training-free lossless one)")
    p.add_argument("--num-images", type=int, default=None, help="images per method (default: one per class)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=1,
                   help="images decoded together (default 1: the latency setting speculative decoding targets)")
    p.add_argument("--repeats", type=int, default=1, help="timed passes per method; the median is reported")
    p.add_argument("--out", default=None,
                   help="output folder (default ./lantern-demo for photos, ./lantern-demo-MODEL for another model)")
    add_overwrite_arg(p)
    p.add_argument("--dtype", default="auto",
                   help="target/drafter precision: auto (default: bf16 where native), float32 or bfloat16")
    p.add_argument("--tree", default=None,
                   help="tree for every speculative method: auto (chosen per method for this device) or a "
                        "--tree spec of `lantern generate` (default: the model's generation.json)")
    p.add_argument("--profile", default=None, help="with --tree auto: a profile.json from `lantern profile`")
    p.add_argument("--sjd-window", type=window_arg, default=None,
                   help="the Jacobi window of the sjd* / gsd methods shown, or auto (timed on this device)")
    p.add_argument("--pjd-window", type=window_arg, default=None,
                   help="the window of the pjd* methods shown, or auto (timed on this device)")
    add_budget_arg(p)
    p.add_argument("--no-progress", action="store_true")
    add_tool_args(p)
    p.set_defaults(func=cmd_demo)


def _demo_windows(stack: Any, sampling: Any, methods: Sequence[str], args: argparse.Namespace,
                  parts: Any = None) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """``lantern demo --sjd-window N|auto`` / ``--pjd-window N|auto``: the window of every SJD- or
    PJD-family method in the demo (auto: timed per method, as ``generate`` does). Returns the
    per-method settings for run_demo and the auto choices for demo.json."""
    from lantern.autotree.window import choose_window
    from lantern.methods import family_methods, resolve_method

    settings: dict[str, dict[str, Any]] = {}
    chosen: dict[str, Any] = {}
    for flag, name, family in (("--sjd-window", "sjd_window", family_methods("sjd")),
                               ("--pjd-window", "pjd_window", family_methods("pjd"))):
        value = getattr(args, name)
        if value is None:
            continue
        targets = [m for m in methods if m in family]
        if not targets:
            raise LanternError(f"{flag} needs one of {', '.join(family)} in --methods")
        for m in targets:
            window = value
            if value == "auto":
                choice = choose_window(stack, resolve_method(m, stack), sampling, seed=args.seed,
                                       batch_size=args.batch_size, parts=parts, compile=args.compile,
                                       progress=not args.no_progress)
                print(f"{flag} auto [{m}]: {choice.explanation} (calibration {choice.seconds:.1f} s)")
                chosen[m], window = choice.to_dict(), choice.window
            settings[m] = {name: window}
    return settings, chosen


def default_out(model: str) -> str:
    """``lantern-demo`` for the default model, ``lantern-demo-<name>`` for another: the README's two
    demos (photos, then digits) must not meet in one folder."""
    return "lantern-demo" if model == "photos" else f"lantern-demo-{Path(model).name or 'model'}"


def cmd_demo(args: argparse.Namespace) -> int:
    import time

    import torch

    from lantern.api import sampling_from
    from lantern.eval.demo import run_demo, save_demo
    from lantern.machine import watch_load
    from lantern.methods import METHOD_TABLE
    from lantern.outputs import OutputFolder
    from lantern.parts import ModelParts
    from lantern.version import software

    check_compile(args)
    from lantern.eval.demo import DEMO_PROMPT_IMAGES
    from lantern.validate import MAX_IMAGES, check_count

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    for m in methods:
        if m not in METHOD_TABLE:
            raise LanternError(f"--methods: unknown method {m!r} (choose from {', '.join(METHOD_TABLE)})")
    auto = check_auto_tree(args.tree, methods, args.profile)
    for name in ("num_images", "batch_size", "repeats"):
        if getattr(args, name) is not None:
            check_count(getattr(args, name), f"--{name.replace('_', '-')}", maximum=MAX_IMAGES)
    out = OutputFolder.check(args.out if args.out is not None else default_out(str(args.model)), "--out",
                             args.overwrite, reads=model_reads(args))
    torch.manual_seed(0)
    stack = load_tool_stack(args)
    sampling = sampling_from(stack, args)
    parts = ModelParts(stack)  # the drafter and table, read once for the auto choices and every method
    n = (stack.num_classes or DEMO_PROMPT_IMAGES) if args.num_images is None else args.num_images
    t0 = time.perf_counter()
    auto_trees: dict[str, Any] = {}
    trees: dict[str, Any] = {}
    if args.tree is not None:
        from lantern.autotree.choose import choose_trees

        if auto:
            auto_trees = choose_trees(stack, methods, sampling, profile=args.profile, seed=args.seed,
                                      batch_size=args.batch_size, parts=parts, progress=not args.no_progress,
                                      compile=args.compile)
            for choice in auto_trees.values():
                print(f"--tree auto [{choice.method}]: {choice.explanation}")
            trees = {m: c.tree for m, c in auto_trees.items()}
        else:
            trees = {m: args.tree for m in methods if METHOD_TABLE[m].drafts_a_tree}
    windows, auto_windows = _demo_windows(stack, sampling, methods, args, parts)
    for method, tree in trees.items():  # a method's tree rides in its settings, like its window
        windows[method] = {**windows.get(method, {}), "tree": tree}
    with watch_load() as watch:  # were other processes competing for the cores while we timed?
        rows = run_demo(stack, sampling, methods, num_images=n, seed=args.seed, batch_size=args.batch_size,
                        repeats=args.repeats, progress=not args.no_progress, budget=args.lantern_budget,
                        compile=args.compile, settings=windows, parts=parts)
    assert watch.result is not None
    meta = {**software(), "model": str(args.model), "num_images": n, "seed": args.seed, "batch_size": args.batch_size,
            "sampling": sampling.to_dict(), "threads": torch.get_num_threads(), "lantern_budget": args.lantern_budget}
    meta["machine_load"] = watch.result.to_dict()
    meta["busy_warning"] = watch.result.warning()
    if auto_trees:
        meta["auto_trees"] = {m: c.to_dict() for m, c in auto_trees.items()}
    if auto_windows:
        meta["auto_windows"] = auto_windows
    with out.write() as folder:
        save_demo(stack, rows, folder, meta)
    from lantern.eval.demo import format_table

    print(f"model {args.model} | {n} images per method, batch {args.batch_size}, same labels and seeds | "
          f"{sampling.to_dict()}")
    if watch.result.busy:
        print(watch.result.warning())
    print(format_table(rows))
    print(f"grid: {out.path / 'demo_grid.png'} | numbers: {out.path / 'demo.json'} | "
          f"total {time.perf_counter() - t0:.0f} s")
    return 0
