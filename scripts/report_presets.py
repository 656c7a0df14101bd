"""Measure the embedded presets on held-out images and write docs/presets.md (+ docs/presets.json).

    .venv/bin/python scripts/report_presets.py [--test-images N] [--train-images N]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from lantern.decoding.config import SamplingConfig
from lantern.io import write_json
from lantern.models.drafter import EagleDrafterModel
from lantern.targets.base import PRESETS, PRESETS_DIR
from lantern.targets.llamagen_stack import load_stack
from lantern.train.heldout import drafter_agreement, encode_dataset, stack_dataset, target_statistics, unigram_bits

ROOT = Path(__file__).resolve().parents[1]


STEP_ORDER = ("tokenizer", "extract-codes", "target", "make-drafter-data", "drafter")  # each reads the one before


def _flag(command: str, flag: str) -> str:
    """The value of ``flag`` in a recorded command line."""
    words = command.split()
    return words[words.index(flag) + 1]


def training_commands(prov: dict) -> list[str]:
    """The preset's commands in the order they can run, then its proximity table's. A step whose
    command was not recorded (make-drafter-data) is written from its record: its inputs are the
    other steps' folders, and ``--max-sequences`` its example count (the rest were defaults)."""
    steps = prov["steps"]
    lines = []
    for name in STEP_ORDER:
        step = steps.get(name)
        if not isinstance(step, dict):
            continue
        if "command" in step:
            lines.append(step["command"])
        elif name == "make-drafter-data":
            drafter = steps["drafter"]["command"]
            defaults = step["source"] == "real" and step["cond_dropout"] == 0.1 and step["seed"] == 0
            assert defaults, f"make-drafter-data ran with non-default settings: {step}"
            lines.append(f"lantern make-drafter-data --target {_flag(drafter, '--target')} "
                         f"--codes {_flag(steps['extract-codes']['command'], '--out')} "
                         f"--max-sequences {step['num_real']} --out {_flag(drafter, '--data')}"
                         "  # not recorded by the run; rebuilt from its record")
    assert not set(steps) - set(STEP_ORDER), f"steps this report does not order: {set(steps) - set(STEP_ORDER)}"
    if "command" in prov.get("proximity", {}):
        command = prov["proximity"]["command"]
        if "--out" not in command.split():  # the assembly recorded the command without its (required) --out
            folder = _flag(command, "--tokenizer").rsplit("/", 1)[0]
            command += f" --out {folder}/proximity.safetensors  # --out not recorded by the run"
        lines.append(command)
    return lines


def measure(name: str, test_images: int, train_images: int) -> dict:
    stack = load_stack(name)
    test = stack_dataset(stack, "test", num_samples=min(test_images, len(stack_dataset(stack, "test"))))
    train = stack_dataset(stack, "train", num_samples=train_images)
    codes, labels, psnr = encode_dataset(stack.tokenizer, test)
    train_codes, _, _ = encode_dataset(stack.tokenizer, train)
    vocab = stack.target.config.vocab_size
    used = torch.unique(torch.cat([codes.reshape(-1), train_codes.reshape(-1)])).numel() / vocab
    sampling = SamplingConfig(**stack.default_sampling())
    stats = target_statistics(stack.target, codes, labels, sampling)
    drafter = EagleDrafterModel.from_pretrained(stack.drafter_dir).float()
    agree = drafter_agreement(drafter, stack.target, codes, labels)
    size = sum(f.stat().st_size for f in (PRESETS_DIR / name).rglob("*") if f.is_file())
    prov = json.loads((PRESETS_DIR / name / "provenance.json").read_text())
    return {
        "preset": name,
        "held_out_images": len(test),
        "train_images_for_unigram": len(train),
        "tokenizer_psnr_db": float(psnr.mean()),
        "codebook_usage": used,
        "target_bits_per_token": stats["bits_per_token"],
        "unigram_bits_per_token": unigram_bits(train_codes, codes, vocab),
        "mean_top1_prob_t1": stats["mean_top1_prob_t1"],
        "mean_top1_prob_default_sampling": stats["mean_top1_prob_sampling"],
        "default_sampling": sampling.to_dict(),
        "drafter_top1": agree["top1"],
        "drafter_top3": agree["top3"],
        "drafter_accept_prob": agree["accept_prob"],
        "size_mb": size / 1e6,
        "commands": training_commands(prov),
        "target": {k: stack.target.config.__dict__[k] for k in ("dim", "n_layer", "n_head", "vocab_size",
                                                                  "block_size", "num_classes")},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--test-images", type=int, default=500)
    ap.add_argument("--train-images", type=int, default=2000)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = [measure(n, args.test_images, args.train_images) for n in PRESETS]
    write_json(ROOT / "docs" / "presets.json", rows)
    lines = ["# Embedded presets: measured statistics", "",
             f"Measured by `scripts/report_presets.py` on {time.strftime('%Y-%m-%d')} (CPU), on held-out images "
             "(test split, disjoint from training) encoded with each preset's own tokenizer.", "",
             "| | " + " | ".join(r["preset"] for r in rows) + " |", "|---|" + "---|" * len(rows)]
    fields = [
        ("target (dim / layers / heads)", lambda r: f"{r['target']['dim']} / {r['target']['n_layer']} / "
                                                    f"{r['target']['n_head']}"),
        ("tokens per image, codebook", lambda r: f"{r['target']['block_size']}, {r['target']['vocab_size']}"),
        ("held-out images", lambda r: str(r["held_out_images"])),
        ("tokenizer PSNR (dB)", lambda r: f"{r['tokenizer_psnr_db']:.2f}"),
        ("codebook entries used", lambda r: f"{100 * r['codebook_usage']:.1f}%"),
        ("target bits / token", lambda r: f"{r['target_bits_per_token']:.3f}"),
        ("unigram bits / token", lambda r: f"{r['unigram_bits_per_token']:.3f}"),
        ("mean top-1 prob (T=1, no CFG)", lambda r: f"{r['mean_top1_prob_t1']:.3f}"),
        ("mean top-1 prob (default sampling)", lambda r: f"{r['mean_top1_prob_default_sampling']:.3f}"),
        ("default sampling", lambda r: ", ".join(f"{k} {v}" for k, v in r["default_sampling"].items())),
        ("drafter top-1 / top-3", lambda r: f"{r['drafter_top1']:.3f} / {r['drafter_top3']:.3f}"),
        ("drafter single-draft acceptance", lambda r: f"{r['drafter_accept_prob']:.3f}"),
        ("folder size (MB)", lambda r: f"{r['size_mb']:.1f}"),
    ]
    for label, fn in fields:
        lines.append(f"| {label} | " + " | ".join(fn(r) for r in rows) + " |")
    lines += ["", "Mean top-1 probability is the average, over held-out positions, of the largest probability "
              "of the distribution a token is drawn from: the lower it is, the flatter the distributions "
              "(LANTERN's token selection ambiguity) and the less exact speculative decoding accepts.", "",
              "## Training commands", ""]
    for r in rows:
        lines += [f"### {r['preset']}", "", "```"] + r["commands"] + ["```", ""]
    (ROOT / "docs" / "presets.md").write_text("\n".join(lines))
    print("\n".join(lines[:len(fields) + 6]))


if __name__ == "__main__":
    main()
