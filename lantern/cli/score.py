"""``lantern score``: FID, KID, precision / recall, class accuracy, CLIP score and HPS of folders of
images already generated (``lantern.eval.score``)."""

from __future__ import annotations

import argparse
from typing import Any

from lantern.cli.common import (
    add_overwrite_arg,
    add_prompt_score_args,
    add_threads_arg,
    add_trust_checkpoint_arg,
    check_prompt_score_args,
)
from lantern.errors import check


def add_score(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "score", help="FID, precision / recall, CLIP score and HPS of folders of generated images",
        description="Score folders of generated images against real ones, as LANTERN's eval_fid_clip.py, "
                    "eval_prec_recall.py and eval_hpsv2.py do: a lantern generate run's folder (its classes and "
                    "prompts read from its own record), any folder of images (prompts from --prompts FILE by "
                    "the number in each file name), or an ADM sample batch .npz.")
    p.add_argument("folders", nargs="+", metavar="FOLDER",
                   help="folders of generated images, one row each, or .npz files in the layout of ADM's sample "
                        "batches (arr_0: uint8 [N, H, W, 3]; arr_1: class ids if any), as lantern generate "
                        "--save-npz (classes or prompts from the run.json beside it) and LlamaGen's sampling scripts "
                        "write them")
    p.add_argument("--ar", nargs="+", default=None, metavar="FOLDER",
                   help="AR's images of the same conditions at 2 or more seeds, one folder each: every FOLDER is "
                        "then judged against AR's spread as bench judges its rows (out when a metric is worse than "
                        "AR's one-sided prediction bound; a method that is AR is called out at most 5%% of the time)")
    p.add_argument("--model", default=None,
                   help="the model the images came from, an embedded preset (digits | photos) or a stack folder: "
                        "its data set (data.json) is the reference and its features/ the feature net, unless "
                        "--reference-images / --feature-net say otherwise")
    p.add_argument("--reference-images", default=None, metavar="DIR",
                   help="a folder of real images to compare with (the first --num-real, centre-cropped and resized "
                        "with Lanczos to the generated images' size), e.g. COCO val2017, or an ADM reference batch "
                        ".npz (its arr_0 images as they are, e.g. VIRTUAL_imagenet256_labeled.npz)")
    p.add_argument("--num-real", type=int, default=1000, help="real images to compare with (default 1000)")
    p.add_argument("--feature-net", default=None,
                   help="feature extractor, as for bench: a lantern feature-net folder (default: --model's "
                        "features/), inception:FILE (pytorch-fid's weights), torchscript:FILE, clip:DIR or vgg16:FILE")
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="for folders lantern did not write: the prompt file of their generation (a text file, one "
                        "per line; a .tsv's Prompt column; a .json list); image N (prompt_N.png, image_N.png or "
                        "N.png) is prompt N")
    add_prompt_score_args(p)
    p.add_argument("--batch-size", type=int, default=100, help="images read and scored at a time (default 100)")
    p.add_argument("--device", default="cpu", help="torch device for the feature networks (default cpu)")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="also write the rows as JSON to FILE (written whole or not at all)")
    add_overwrite_arg(p, "file")
    add_trust_checkpoint_arg(p)
    add_threads_arg(p)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    p.set_defaults(func=cmd_score)


def cmd_score(args: argparse.Namespace) -> int:
    """Every check before the first network loads, then the reference once and each folder in turn."""
    from lantern.outputs import OutputFile
    from lantern.validate import check_count, check_device

    check_count(args.num_real, "--num-real", minimum=2)
    check_count(args.batch_size, "--batch-size")
    check_device(args.device)
    check(args.model is not None or args.reference_images is not None,
          "score needs real images to compare with: --reference-images DIR, or --model NAME (its data set)")
    check(args.model is not None or args.feature_net is not None,
          "score needs a feature network: --feature-net SPEC, or --model NAME (its features/)")
    check_prompt_score_args(args)
    if args.reference_images is None:  # the model's data set: named now, not after the networks load
        from lantern.data.datasets import DATA_FILE
        from lantern.targets.llamagen_stack import resolve_model_dir

        root = resolve_model_dir(args.model)
        check((root / DATA_FILE).is_file(), f"score: --model {args.model} has no data set ({DATA_FILE}) to compare "
                                            "with; pass --reference-images DIR (real images)")
    out = None if args.out is None else OutputFile.check(args.out, "--out", args.overwrite)
    check(args.ar is None or len(args.ar) >= 2, f"--ar needs AR's folders at 2 seeds or more (a spread), got "
                                                f"{len(args.ar or [])}")
    folders = _read_folders(args)
    for folder in folders:  # before any network loads (a CLIP or HPS model takes a while)
        check(folder.prompts is not None or (args.clip_score is None and args.hps is None),
              f"score: {folder.path} has no prompts for {'clip_score' if args.clip_score else 'hps'}: it is not a "
              "prompted lantern generate run; pass --prompts FILE (LANTERN's scripts' prompt file)")
    rows, ar_rows, meta = _score(args, folders)
    _print(rows, ar_rows, meta)
    if out is not None:
        from lantern.io import write_json

        with out.write() as tmp:
            write_json(tmp, {**meta, "rows": [row.__dict__ for row in rows],
                             **({"ar_rows": [row.__dict__ for row in ar_rows]} if ar_rows else {})})
        print(f"wrote {out.path}")
    return 0


def _read_folders(args: argparse.Namespace) -> list[Any]:
    from lantern.eval.score import ImageFolder

    prompts = None
    if args.prompts is not None:
        from lantern.targets.text import read_prompts

        prompts = read_prompts(args.prompts)
    return [ImageFolder.read(folder, prompts) for folder in [*args.folders, *(args.ar or [])]]


def _score(args: argparse.Namespace, folders: list[Any]) -> tuple[list[Any], list[Any], dict[str, Any]]:
    """Every folder's row (the --ar folders' apart, the others judged against their spread) and
    what they were scored with."""
    from lantern.eval.metrics import ClipScorer, load_feature_extractor
    from lantern.eval.score import reference_features, score_folders

    progress = not args.no_progress
    spec = args.feature_net or args.model  # a preset or stack folder: its features/
    extractor = load_feature_extractor(spec, device=args.device)
    scorers: list[tuple[str, Any]] = []
    if args.clip_score is not None:
        scorers.append(("clip_score", ClipScorer(args.clip_score, device=args.device, prefix=args.clip_prefix)))
    if args.hps is not None:
        from lantern.eval.hps import HpsScorer

        scorers.append(("hps", HpsScorer(args.hps, args.hps_clip, device=args.device)))
    height, width = next(folders[0].batches(1))[1].shape[-2:]  # the generated images' shape
    real, reference = reference_features(extractor, images_dir=args.reference_images, model=args.model,
                                         num_real=args.num_real, size=(int(height), int(width)),
                                         batch_size=args.batch_size,
                                         progress=progress)
    rows = score_folders(folders, real, extractor, scorers, args.batch_size, progress)
    meta = {"feature_net": extractor.name, "feature_net_spec": str(spec), "reference": reference,
            "num_real": len(real), **{name: scorer.name for name, scorer in scorers}}
    ar_rows, rows = rows[len(args.folders):], rows[: len(args.folders)]  # --ar's folders come last
    if ar_rows:  # the others are read against their spread
        from lantern.eval.score import ar_spread, verdict

        spread = ar_spread(ar_rows, len(real), [_seed(folder, i) for i, folder in enumerate(folders[len(rows):])])
        for row in rows:
            row.vs_ar = verdict(spread, row.metrics)
        meta |= {"ar_spread": spread.to_dict(), "ar_rule": spread.rule()}
    return rows, ar_rows, meta


def _seed(folder: Any, position: int) -> int:
    """An AR folder's seed: its run.json's (a lantern generate run), else its place in --ar."""
    from lantern.io import read_json

    run = folder.path / "run.json"
    seed = read_json(run, "score: run.json").get("seed") if run.is_file() else None
    return int(seed) if isinstance(seed, int) else position


def _print(rows: list[Any], ar_rows: list[Any], meta: dict[str, Any]) -> None:
    from lantern.eval.report import format_cell, verdict_cell

    everything = [*rows, *ar_rows]
    keys = [k for k in ("fid", "kid", "precision", "recall", "class_accuracy", "clip_score", "hps")
            if any(k in row.metrics for row in everything)]
    names = {"fid": "FID", "kid": "KID", "precision": "prec", "recall": "recall", "class_accuracy": "class acc",
             "clip_score": "CLIP", "hps": "HPS"}
    digits = {"fid": 2, "kid": 4, "clip_score": 2, "hps": 4}
    runs = any(row.method is not None for row in everything)  # lantern generate's folders: their method and tau
    head = ["folder", "images", *(["method", "tau"] if runs else []), *(names[k] for k in keys),
            *(["vs AR's spread"] if ar_rows else [])]
    body = [[row.folder + (" (AR)" if i >= len(rows) else ""), str(row.images),
             *([row.method or "-", format_cell(row.tau, 2)] if runs else []),
             *(format_cell(row.metrics.get(k), digits.get(k, 3)) for k in keys),
             *([verdict_cell(row.vs_ar["out"], row.vs_ar["better"]) if row.vs_ar else "-"] if ar_rows else [])]
            for i, row in enumerate(everything)]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    print(f"feature network: {meta['feature_net']}; reference: {meta['reference']} ({meta['num_real']} images)"
          + "".join(f"; {meta[name]}" for name in ("clip_score", "hps") if name in meta))
    for line in [head, *body]:
        print("  ".join(cell.ljust(w) if name in ("folder", "method") else cell.rjust(w)
                        for name, cell, w in zip(head, line, widths, strict=True)))
    if ar_rows:
        print(f"AR's spread over {len(ar_rows)} seeds: {meta['ar_rule']}")
