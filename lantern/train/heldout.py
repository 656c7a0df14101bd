"""Held-out statistics of a model stack: tokenizer PSNR, target bits per token against a unigram
baseline, how peaked next-token distributions are, and drafter agreement with the target.

Used by the preset tests and by ``scripts/report_presets.py`` (docs/presets.md). Images come from
the data set the stack was trained on (``data.json`` in the stack folder), test split only.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lantern.data.datasets import DATA_FILE
from lantern.decoding.config import SamplingConfig
from lantern.decoding.sampling import apply_cfg, probs_from_logits
from lantern.errors import check
from lantern.models.drafter import EagleDrafterModel
from lantern.models.llamagen import LlamaGen
from lantern.models.vq import VQModel
from lantern.targets.llamagen_stack import ModelStack


def stack_dataset(stack: ModelStack, split: str, num_samples: int | None = None) -> Any:
    from lantern.data import load_dataset
    from lantern.io import read_json_object

    spec = read_json_object(stack.root / DATA_FILE, "stack data description")
    spec.update(split=split)
    if num_samples is not None:
        spec["num_samples"] = num_samples
    return load_dataset(**spec)


@torch.no_grad()
def encode_dataset(tokenizer: VQModel, data: Any, batch_size: int = 64) -> tuple[Tensor, Tensor, Tensor]:
    """(codes [N, n], labels [N], per-image reconstruction PSNR [N] in dB)."""
    from lantern.data import batch_images
    from lantern.train.tokenizer import psnr

    codes, labels, scores = [], [], []
    for lo in range(0, len(data), batch_size):
        images, lab = batch_images(data, list(range(lo, min(lo + batch_size, len(data)))))
        c = tokenizer.encode(images)
        codes.append(c)
        labels.append(lab)
        scores.append(psnr(images, tokenizer.decode(c)))
    return torch.cat(codes), torch.cat(labels), torch.cat(scores)


def unigram_bits(train_codes: Tensor, test_codes: Tensor, vocab: int) -> float:
    """Bits per token of ``test_codes`` under the add-one-smoothed unigram of ``train_codes``."""
    counts = torch.bincount(train_codes.reshape(-1), minlength=vocab).double() + 1.0
    return float(-(counts / counts.sum()).log2()[test_codes.reshape(-1)].mean())


@torch.no_grad()
def target_statistics(target: LlamaGen, codes: Tensor, labels: Tensor, sampling: SamplingConfig,
                      batch_size: int = 32) -> dict[str, float]:
    """Held-out bits per token (conditional, temperature 1, no guidance) and the mean top-1
    probability of the distribution tokens are actually drawn from under ``sampling`` (CFG,
    temperature, top-k/p): LANTERN's token-selection-ambiguity statistic."""
    target = target.eval()
    nll, top1_raw, top1_sampling, count = 0.0, 0.0, 0.0, 0
    for lo in range(0, codes.shape[0], batch_size):
        c, lab = codes[lo : lo + batch_size], labels[lo : lo + batch_size]
        logits, _ = target(lab, c[:, :-1])  # [B, n, V]
        logp = logits.float().log_softmax(-1)
        nll -= float(logp.gather(-1, c[..., None]).sum())
        top1_raw += float(logp.max(-1).values.exp().sum())
        guided = logits
        if sampling.use_cfg:
            uncond, _ = target(target.null_condition(c.shape[0]), c[:, :-1])
            guided = apply_cfg(torch.cat([logits, uncond]), sampling.cfg_scale, 2)
        top1_sampling += float(probs_from_logits(guided.float(), sampling).max(-1).values.sum())
        count += c.numel()
    return {"bits_per_token": nll / count / math.log(2), "mean_top1_prob_t1": top1_raw / count,
            "mean_top1_prob_sampling": top1_sampling / count}


@torch.no_grad()
def drafter_agreement(drafter: EagleDrafterModel, target: LlamaGen, codes: Tensor, labels: Tensor,
                      batch_size: int = 32) -> dict[str, float]:
    """Teacher-forced next-token agreement on real codes (the trainer's held-out evaluation,
    :func:`lantern.train.drafter.evaluate_drafter`): the target's argmax among the drafter's top-1 /
    top-3, and the single-draft acceptance probability sum_v min(p_v, q_v) (temperature 1)."""
    from lantern.train.drafter import DrafterData, evaluate_drafter

    check(codes.shape[0] > 0, "drafter_agreement needs at least one sequence")
    target = target.eval()
    hidden = torch.cat([target(labels[lo : lo + batch_size], codes[lo : lo + batch_size])[1]
                        for lo in range(0, codes.shape[0], batch_size)])  # [N, cls + n, D]
    metrics = evaluate_drafter(drafter, target, DrafterData(hidden, codes, labels, {}), generation=False)
    return {k: metrics[k] for k in ("top1", "top3", "accept_prob")}
