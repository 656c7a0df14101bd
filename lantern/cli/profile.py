"""``lantern profile``: this device's verify, drafter and loop costs, or a round trace."""

from __future__ import annotations

import argparse
from dataclasses import replace

from lantern.cli.common import (
    MODEL_HELP,
    add_overwrite_arg,
    add_tool_args,
    check_compile,
    command_line,
    load_tool_stack,
    model_reads,
)
from lantern.errors import check


def add_profile(sub: argparse._SubParsersAction) -> None:
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
    add_overwrite_arg(p)
    p.add_argument("--dtype", default="auto",
                   help="target/drafter precision: auto (default: bf16 where native), float32 or bfloat16")
    p.add_argument("--trace", default=None, metavar="METHODS",
                   help="instead of the cost profile: trace the decode round of these methods (ar included, "
                        "e.g. ar,sd,lantern,lantern++,sjd): time, dispatched ops and host syncs per round by "
                        "phase; writes OUT/trace.json and OUT/trace.md")
    p.add_argument("--trace-images", type=int, default=2, help="images per method for --trace (default 2)")
    p.add_argument("--no-progress", action="store_true")
    add_tool_args(p)
    p.set_defaults(func=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    from lantern.api import sampling_from
    from lantern.autotree.profile import ProfileSettings, format_profile, measure_profile, save_profile
    from lantern.machine import watch_load
    from lantern.outputs import OutputFolder
    from lantern.validate import MAX_IMAGES, check_count, check_device

    check_compile(args)
    # the cost profile times eager forwards (measure_profile compiles nothing): a compiled profile
    # would be a different measurement, and accepting the flag made an eager one look compiled
    check(args.trace is not None or args.compile in (None, "off"),
          "--compile is read by --trace only: the cost profile (for --tree auto) is measured eager")
    check_count(args.trace_images, "--trace-images", maximum=MAX_IMAGES)  # as generate's and bench's counts
    if args.trace is not None:  # every traced method's settings (a tree's size too), before loading
        from lantern.eval.methods_grammar import parse_methods

        for spec in parse_methods(args.trace, flag="--trace"):
            spec.resolve(None)
    settings = ProfileSettings(batch_size=args.batch_size, max_tokens=args.max_tokens, repeats=args.repeats,
                               quick=args.quick, seed=args.seed)
    check_device(args.device)
    out = OutputFolder.check(args.out, "--out", args.overwrite, reads=model_reads(args))
    stack = load_tool_stack(args, args.device)
    sampling = sampling_from(stack, args)
    if args.trace is not None:
        from lantern.eval.roundtrace import cmd_trace

        return cmd_trace(args, stack, sampling, out, command_line(args))
    with watch_load() as watch:  # were other processes competing for the cores while we timed?
        profile = measure_profile(stack, sampling, settings, model_name=str(args.model),
                                  progress=not args.no_progress)
    assert watch.result is not None
    profile = replace(profile, meta={**profile.meta, "command": command_line(args),
                                     "machine_load": watch.result.to_dict(), "busy_warning": watch.result.warning()})
    with out.write() as folder:
        json_path, png_path = save_profile(profile, folder)
    if watch.result.busy:
        print(watch.result.warning())
    print(format_profile(profile))
    print(f"wrote {out.path / json_path.name}" + (f" and {out.path / png_path.name}" if png_path is not None else ""))
    return 0
