"""``lantern make-random-stack``, ``lantern build-proximity`` and ``lantern convert-llamagen``."""

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


def add_convert_llamagen(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert-llamagen",
        help="turn official LlamaGen checkpoints (c2i_*.pt / t2i_*.pt + vq_ds*.pt) into a model folder",
        description="Read an official LlamaGen GPT checkpoint and its VQ tokenizer checkpoint once (weights only, "
                    "no code runs) and write a stack folder lantern loads from safetensors: target, tokenizer, "
                    "the codebook's proximity table for LANTERN, and LlamaGen's own sampling defaults. The model's "
                    "size comes from its weights, the image size from the file (training args, else a name like "
                    "c2i_L_384.pt) unless given.",
    )
    p.add_argument("--gpt-ckpt", required=True, help="the GPT checkpoint, e.g. c2i_L_256.pt or t2i_XL_stage1_256.pt")
    p.add_argument("--vq-ckpt", required=True, help="its VQ tokenizer checkpoint, e.g. vq_ds16_c2i.pt")
    p.add_argument("--out", required=True, help="the stack folder to write")
    p.add_argument("--gpt-model", default=None,
                   help="GPT-B ... GPT-7B (default: read from the weights; given, it must match them)")
    p.add_argument("--image-size", type=int, default=None,
                   help="pixels a side the GPT was trained for (default: from the checkpoint or its name)")
    p.add_argument("--no-proximity", action="store_true",
                   help="skip the proximity table (LANTERN's relaxed acceptance needs one; seconds for "
                        "16384 codes)")
    p.add_argument("--drafter", default=None,
                   help="an EAGLE drafter folder for this model (LANTERN's jadohu/llamagen_drafter), checked against "
                        "it and copied into the stack")
    add_overwrite_arg(p)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_trust_checkpoint_arg(p)
    p.set_defaults(func=cmd_convert_llamagen)


def cmd_convert_llamagen(args: argparse.Namespace) -> int:
    from lantern.targets.convert import convert_llamagen

    out = convert_llamagen(args.gpt_ckpt, args.vq_ckpt, args.out, image_size=args.image_size,
                           gpt_model=args.gpt_model, proximity=not args.no_proximity, drafter=args.drafter,
                           overwrite=args.overwrite, progress=not args.no_progress)
    from lantern.io import read_json_object

    made = read_json_object(out / "provenance.json", "provenance")
    print(f"wrote {out}: {made['gpt_model']} {made['gpt_type']} at {made['image_size']} px "
          f"({made['image_tokens']} image tokens), {made['vq_model']} tokenizer")
    if made["gpt_type"] == "t2i":
        print(f"text-to-image: put the T5 encoder (google/flan-t5-xl) at {out / 't5'}, or pass --t5 DIR")
    return 0
