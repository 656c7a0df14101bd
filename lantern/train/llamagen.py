"""Class-conditional LlamaGen training on code sets, with class dropout for classifier-free guidance.

The loss is next-token cross-entropy over the image tokens (row i of the logits predicts token
i). With probability ``class_dropout`` a row's label is replaced by the null class, so the same
model also learns the unconditional distribution that CFG extrapolates from. The dropout draws
come from the step generator, drawn for the whole global batch, so resume is exact and does not
depend on the number of processes. (The model's token/residual/FFN dropout masks are drawn per
process: with those on, a data-parallel run is a different, equally valid draw of the masks.)

Held-out metrics: bits per token of the test codes (conditional) and, for scale, the bits per
token of a unigram model fitted on the training codes, plus the mean probability of the top token
(how peaked next-token distributions are: LANTERN's "token selection ambiguity").
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lantern.errors import check
from lantern.models.llamagen import LlamaGen, LlamaGenConfig
from lantern.train.codes import CodeSet
from lantern.train.loop import BatchPart, LoopConfig, RunOptions, TrainResult, TrainTask, step_generator, train


@dataclass(frozen=True)
class TargetRecipe:
    class_dropout: float = 0.1
    eval_batch_size: int = 64
    eval_max: int = 2000  # held-out sequences used for the metrics

    def __post_init__(self) -> None:
        check(0.0 <= self.class_dropout < 1.0, f"--class-dropout must be in [0, 1), got {self.class_dropout!r}")
        check(self.eval_batch_size >= 1 and self.eval_max >= 1, "eval sizes must be >= 1")


def check_codes_fit(config: LlamaGenConfig, codes: CodeSet, what: str) -> None:
    check(codes.vocab_size == config.vocab_size,
          f"{what}: the codes use a {codes.vocab_size}-entry codebook but the model's vocab_size is "
          f"{config.vocab_size}")
    check(codes.seq_len == config.block_size,
          f"{what}: the codes have {codes.seq_len} tokens per image but the model's block_size is {config.block_size}")
    check(config.model_type == "c2i", f"{what}: train-target trains class-conditional (c2i) models")
    bad = codes.labels[(codes.labels < 0) | (codes.labels >= config.num_classes)]
    check(bad.numel() == 0,
          f"{what}: label {int(bad[0]) if bad.numel() else 0} is outside the model's {config.num_classes} classes")


class TargetTask(TrainTask):
    kind = "target"
    model: LlamaGen

    def __init__(self, model: LlamaGen, data: CodeSet, eval_data: CodeSet, recipe: TargetRecipe, seed: int) -> None:
        check_codes_fit(model.config, data, "training codes")
        check_codes_fit(model.config, eval_data, "held-out codes")
        self.model, self.data, self.eval_data, self.recipe, self.seed = model, data, eval_data, recipe, seed

    def num_examples(self) -> int:
        return len(self.data)

    def make_batch(self, indices: Tensor, step: int, device: torch.device,
                   part: BatchPart | None = None) -> tuple[Tensor, Tensor]:
        labels = self.data.labels[indices].clone()
        part = part or BatchPart.whole(len(indices))
        draws = torch.rand(part.size, generator=step_generator(self.seed, step, stream=2))  # the global batch's
        drop = part.take(draws) < self.recipe.class_dropout
        labels[drop] = self.model.config.num_classes  # the null class row of the label table
        return labels.to(device), self.data.codes[indices].to(device)

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor], step: int) -> tuple[Tensor, dict[str, float]]:
        labels, codes = batch
        logits, _ = model(labels, codes[:, :-1])  # [B, n, V]: row i predicts token i
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), codes.reshape(-1))
        return loss, {"bits": float(loss.detach()) / math.log(2)}

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        unwrapped: LlamaGen = model.module if hasattr(model, "module") else model  # type: ignore[assignment]
        nll, top1, count = 0.0, 0.0, 0
        n = min(len(self.eval_data), self.recipe.eval_max)
        bs = self.recipe.eval_batch_size
        for lo in range(0, n, bs):
            labels = self.eval_data.labels[lo : min(lo + bs, n)].to(unwrapped.device)
            codes = self.eval_data.codes[lo : min(lo + bs, n)].to(unwrapped.device)
            logits, _ = unwrapped(labels, codes[:, :-1])
            logp = logits.float().log_softmax(-1)
            nll -= float(logp.gather(-1, codes[..., None]).sum())
            top1 += float(logp.max(-1).values.exp().sum())
            count += codes.numel()
        bits = nll / count / math.log(2)
        unigram = self.data.unigram_bits(self.eval_data)
        return {
            "test_bits_per_token": bits,
            "unigram_bits_per_token": unigram,
            "bits_saved_vs_unigram": unigram - bits,
            "mean_top1_prob": top1 / count,  # temperature 1, no CFG, no top-k
            "eval_sequences": float(n),
        }

    def save(self, model: nn.Module, out: Path) -> None:
        unwrapped = cast(LlamaGen, model.module if hasattr(model, "module") else model)  # (DDP wraps it)
        unwrapped.save_pretrained(out)

    def config_dict(self) -> dict[str, Any]:
        from lantern.models.llamagen import config_json

        return {"model": config_json(self.model.config), "recipe": asdict(self.recipe),
                "data": self.data.meta, "eval_data_fingerprint": self.eval_data.fingerprint()}

    def data_fingerprint(self) -> str:
        return self.data.fingerprint()


def target_config_for(codes: CodeSet, **overrides: Any) -> LlamaGenConfig:
    """A c2i LlamaGen config shaped for ``codes`` (vocab, sequence length, classes) plus overrides."""
    base: dict[str, Any] = dict(vocab_size=codes.vocab_size, block_size=codes.seq_len,
                                num_classes=codes.num_classes, cls_token_num=1, model_type="c2i")
    base.update(overrides)
    return LlamaGenConfig(**base)


def train_target(
    config: LlamaGenConfig,
    data: CodeSet,
    eval_data: CodeSet,
    recipe: TargetRecipe,
    loop: LoopConfig,
    options: RunOptions,
    *,
    init_std: float = 0.02,
) -> TrainResult:
    check(isinstance(init_std, int | float) and math.isfinite(init_std) and init_std > 0,
          f"--init-std must be a positive number, got {init_std!r}")
    model = LlamaGen(config)
    model.init_weights(std=init_std, zero_output=True, seed=loop.seed)
    task = TargetTask(model, data, eval_data, recipe, loop.seed)
    return train(task, loop, options)
