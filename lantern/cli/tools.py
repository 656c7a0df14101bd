"""``lantern make-random-stack`` and ``lantern build-proximity``."""

from __future__ import annotations

import argparse

from lantern.cli.common import add_overwrite_arg, add_trust_checkpoint_arg, resolve_hub_args


def add_make_random_stack(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "make-random-stack",
        help="write a tiny randomly initialised model stack (for smoke tests)",
        description="Build a small random LlamaGen target + VQ tokenizer stack; no training involved.",
    )
    p.add_argument("--out", required=True, help="output stack folder")
    add_overwrite_arg(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--grid", type=int, default=8,
                   help=f"image tokens per side, at most {MAX_RANDOM_GRID} (default 8 -> 64 tokens)")
    p.add_argument("--vocab", type=int, default=256, help=f"codebook size, at most {MAX_RANDOM_VOCAB} (default 256)")
    p.set_defaults(func=cmd_make_random_stack)


# Bounds of a random smoke-test stack: past LlamaGen's largest (16384 codes, a 32x32 grid) with
# room to spare, while a typo (--vocab 1000000000) would otherwise allocate until memory runs out.
MAX_RANDOM_VOCAB = 1 << 17
MAX_RANDOM_GRID = 128


def cmd_make_random_stack(args: argparse.Namespace) -> int:
    from lantern.errors import check
    from lantern.outputs import OutputFolder
    from lantern.testing import make_random_stack

    bounds = (("--vocab", args.vocab, 2, MAX_RANDOM_VOCAB), ("--grid", args.grid, 1, MAX_RANDOM_GRID),
              ("--num-classes", args.num_classes, 1, MAX_RANDOM_VOCAB))
    for arg, value, low, high in bounds:
        check(low <= value <= high, f"{arg} must be in {low}..{high} for a random smoke-test stack, got {value}")
    out = OutputFolder.check(args.out, "--out", args.overwrite)
    with out.write() as folder:
        make_random_stack(folder, seed=args.seed, num_classes=args.num_classes, grid=args.grid, vocab=args.vocab)
    print(f"wrote random stack to {out.path}")
    return 0


def add_build_proximity(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "build-proximity",
        help="build the latent proximity table (k nearest codebook neighbours) for LANTERN",
        description="For every codebook entry, its K_max nearest other entries in distance order.",
    )
    p.add_argument("--tokenizer", required=True,
                   help="VQ tokenizer folder, official vq_ds16_*.pt file, or a Janus / Emu3 model folder or Hub "
                        "repo id (its VQ codebook)")
    p.add_argument("--k-max", type=int, default=None,
                   help="neighbours stored per entry (default 1024, or every other code of a smaller codebook)")
    p.add_argument("--out", required=True, help="output file (.safetensors)")
    add_overwrite_arg(p, "file")
    p.add_argument(
        "--metric", choices=["l2", "cosine"], default="l2", help="distance (default l2, as the official code)"
    )
    p.add_argument("--normalize", action="store_true", help="use the l2-normalised codebook (what the decoder sees)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_trust_checkpoint_arg(p)
    p.set_defaults(func=cmd_build_proximity)


def cmd_build_proximity(args: argparse.Namespace) -> int:
    from lantern.targets.proximity import build_proximity_file

    resolve_hub_args(args, ("tokenizer",))  # a Janus / Emu3 model by its repo id
    table = build_proximity_file(args.tokenizer, args.k_max, args.out, metric=args.metric, normalize=args.normalize,
                                 progress=not args.no_progress, overwrite=args.overwrite)
    print(
        f"wrote {args.out}: {table.vocab_size} entries x {table.k_max} neighbours "
        f"({table.metric}, normalized={table.normalized}, codebook sha256 {table.codebook_sha256[:12]})"
    )
    return 0
