"""``lantern`` command line: one entry point, one sub-command per job.

Every run writes its resolved configuration next to its outputs. Bad arguments end with a one-line
``lantern: error: ...`` naming the argument, and exit code 2; no partial output files are left.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lantern.errors import LanternError


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one label")
    return values


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (defaults: the model's generation.json, else the values shown)")
    g.add_argument(
        "--temperature", type=float, default=None, help="sampling temperature; 0 = greedy argmax (default 1.0)"
    )
    g.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens; 0 = off (default 0)")
    g.add_argument("--top-p", type=float, default=None, help="nucleus threshold in (0, 1]; 1 = off (default 1.0)")
    g.add_argument("--cfg-scale", type=float, default=None, help="classifier-free guidance scale; 1 = off (default 1)")


def _sampling(args: argparse.Namespace, stack: Any) -> Any:
    """Explicit flags, then the stack's ``generation.json``, then SamplingConfig's defaults."""
    from lantern.config import SamplingConfig

    values: dict[str, Any] = dict(stack.default_sampling())
    for name in ("temperature", "top_k", "top_p", "cfg_scale"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    return SamplingConfig(**values)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate images from class labels",
        description="Generate images with AR or speculative decoding.",
    )
    p.add_argument(
        "--model", required=True, help="model stack folder (target/, tokenizer/, optional drafter/ and proximity table)"
    )
    p.add_argument("--tokenizer", default=None, help="VQ tokenizer folder, if not inside --model")
    p.add_argument("--labels", type=_int_list, required=True, help="comma-separated class ids, e.g. 0,3,7")
    p.add_argument("--num-per-label", type=int, default=1, help="images per label (default 1)")
    p.add_argument("--seed", type=int, default=0, help="base seed; image i uses its own generator (default 0)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument(
        "--method",
        default="ar",
        choices=["ar", "sd", "sd-static", "lantern", "lantern++"],
        help="ar: plain decoding; sd: exact speculative decoding, dynamic tree; sd-static: exact, static tree; "
        "lantern: relaxed (absolute delta), dynamic tree; lantern++: relaxed (relative lambda), static tree",
    )
    p.add_argument("--drafter", default=None, help="EAGLE drafter folder (default: drafter/ inside --model)")
    p.add_argument(
        "--tree",
        default=None,
        help="draft tree: dynamic | static:NAME (e.g. static:naive_extend_57) | chain:N (default per method)",
    )
    p.add_argument(
        "--proximity", default=None, help="latent proximity table (default: proximity.safetensors in --model)"
    )
    p.add_argument(
        "--lantern-k", type=int, default=None, help="neighbours per token (lantern 1000 capped at K_max; lantern++ 10)"
    )
    p.add_argument(
        "--lantern-delta", type=float, default=None, help="lantern: neighbour mass bound delta in [0, 1] (0.1)"
    )
    p.add_argument("--lantern-lambda", type=float, default=None, help="lantern++: relative bound lambda >= 1 (5.0)")
    p.add_argument("--batch-size", type=int, default=8, help="images generated together (default 8)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    _add_sampling_args(p)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from lantern.images import image_grid, save_png
    from lantern.io import atomic_path, ensure_writable_dir, write_json
    from lantern.models.vq import to_pil
    from lantern.pipeline import MethodConfig, image_seed, run_generation
    from lantern.stack import load_stack

    if args.num_per_label < 1:
        raise LanternError(f"--num-per-label must be >= 1, got {args.num_per_label}")
    stack = load_stack(args.model, args.tokenizer)
    tree = args.tree if args.tree is not None else stack.default_tree(args.method)
    method = MethodConfig.resolve(args.method, tree, args.lantern_k, args.lantern_delta, args.lantern_lambda)
    sampling = _sampling(args, stack)
    out = ensure_writable_dir(args.out, "--out")
    stack.target.to(args.device)
    stack.tokenizer.to(args.device)
    labels = [lab for lab in args.labels for _ in range(args.num_per_label)]
    stack.target.check_labels(torch.tensor(labels))

    result = run_generation(
        stack,
        labels,
        args.seed,
        sampling,
        method,
        args.batch_size,
        progress=not args.no_progress,
        drafter_dir=args.drafter,
        proximity=args.proximity,
    )
    with torch.no_grad():
        images = to_pil(stack.tokenizer.decode(result.codes))
    for i, (img, lab) in enumerate(zip(images, labels, strict=True)):
        save_png(img, out / f"{i:04d}_label{lab}.png")
    save_png(image_grid(images, ncol=args.num_per_label), out / "grid.png")
    with atomic_path(out / "codes.npy") as tmp:
        with open(tmp, "wb") as f:
            np.save(f, result.codes.cpu().numpy().astype(np.int64))
    run = {
        "command": "generate",
        "model": str(args.model),
        "labels": labels,
        "seeds": [image_seed(args.seed, i) for i in range(len(labels))],
        "seed": args.seed,
        "batch_size": args.batch_size,
        "device": args.device,
        "sampling": sampling.to_dict(),
        "method": result.method.to_dict(),
        "stats": result.stats_dict(),
    }
    write_json(out / "run.json", run)
    stats = run["stats"]
    print(
        f"wrote {len(images)} images to {out} | mean accepted {stats['mean_accepted']:.2f} tokens/forward | "
        f"{stats['target_forwards']} target forwards | {stats['wall_seconds']:.2f} s"
    )
    return 0


def _add_make_random_stack(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "make-random-stack",
        help="write a tiny randomly initialised model stack (for smoke tests)",
        description="Build a small random LlamaGen target + VQ tokenizer stack; no training involved.",
    )
    p.add_argument("--out", required=True, help="output stack folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--grid", type=int, default=8, help="image tokens per side (default 8 -> 64 tokens)")
    p.add_argument("--vocab", type=int, default=256, help="codebook size (default 256)")
    p.set_defaults(func=cmd_make_random_stack)


def cmd_make_random_stack(args: argparse.Namespace) -> int:
    from lantern.testing import make_random_stack

    path = make_random_stack(
        Path(args.out), seed=args.seed, num_classes=args.num_classes, grid=args.grid, vocab=args.vocab
    )
    print(f"wrote random stack to {path}")
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
    p.add_argument(
        "--metric", choices=["l2", "cosine"], default="l2", help="distance (default l2, as the official code)"
    )
    p.add_argument("--normalize", action="store_true", help="use the l2-normalised codebook (what the decoder sees)")
    p.set_defaults(func=cmd_build_proximity)


def cmd_build_proximity(args: argparse.Namespace) -> int:
    from lantern.proximity import build_proximity_file

    table = build_proximity_file(args.tokenizer, args.k_max, args.out, metric=args.metric, normalize=args.normalize)
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
    p.add_argument("--model", default="digits", help="embedded preset (digits | photos) or a stack folder")
    p.add_argument("--methods", default="ar,lantern++,lantern,sd",
                   help="comma-separated methods, ar first (default ar,lantern++,lantern,sd)")
    p.add_argument("--num-images", type=int, default=None, help="images per method (default: one per class)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=1,
                   help="images decoded together (default 1: the latency setting speculative decoding targets)")
    p.add_argument("--repeats", type=int, default=1, help="timed passes per method; the median is reported")
    p.add_argument("--out", default="lantern-demo", help="output folder (default ./lantern-demo)")
    p.add_argument("--no-progress", action="store_true")
    _add_sampling_args(p)
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    import time

    import torch

    from lantern.demo import run_demo, save_demo
    from lantern.pipeline import METHODS
    from lantern.stack import load_stack

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    for m in methods:
        if m not in METHODS:
            raise LanternError(f"--methods: unknown method {m!r} (choose from {', '.join(METHODS)})")
    torch.manual_seed(0)
    stack = load_stack(args.model)
    sampling = _sampling(args, stack)
    n = args.num_images or stack.target.config.num_classes
    t0 = time.perf_counter()
    rows = run_demo(stack, sampling, methods, num_images=n, seed=args.seed, batch_size=args.batch_size,
                    repeats=args.repeats, progress=not args.no_progress)
    meta = {"model": str(args.model), "num_images": n, "seed": args.seed, "batch_size": args.batch_size,
            "sampling": sampling.to_dict(), "threads": torch.get_num_threads()}
    out = save_demo(stack, rows, args.out, meta)
    from lantern.demo import format_table

    print(f"model {args.model} | {n} images per method, batch {args.batch_size}, same labels and seeds | "
          f"{sampling.to_dict()}")
    print(format_table(rows))
    print(f"grid: {out / 'demo_grid.png'} | numbers: {out / 'demo.json'} | total {time.perf_counter() - t0:.0f} s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lantern", description="Relaxed speculative decoding for visual AR models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(sub)
    _add_build_proximity(sub)
    _add_make_random_stack(sub)
    _add_demo(sub)
    from lantern.train.cli import add_train_commands  # argparse only; trainers import lazily

    add_train_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], Any] = args.func
    try:
        return int(func(args) or 0)
    except LanternError as e:
        print(f"lantern: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lantern: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
