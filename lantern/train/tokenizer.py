"""VQ tokenizer training: reconstruction + codebook + commitment losses, dead-code restarts.

The model is lantern's LlamaGen-compatible :class:`~lantern.models.vq.VQModel`; the losses are
the ones its ``forward`` returns (VQ-VAE codebook loss and beta-weighted commitment loss on
l2-normalised vectors) plus a pixel reconstruction loss. Perceptual and adversarial losses are
not used: their pretrained feature networks cannot be downloaded here.

Small codebooks trained from scratch collapse onto a few entries; codes unused for
``restart_every`` steps are re-seeded from encoder outputs of the current global batch (the
standard k-means-style restart), which keeps utilisation high. Restarts draw from the step
generator so resume stays exact, and the usage counts are checkpointed. Under data parallelism
the usage counts are summed over the processes every step and the encoder outputs gathered, so
every process computes the restart a single process would; process 0's codebook is then
broadcast, so the processes cannot drift apart by a rounding difference.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lantern.errors import check
from lantern.models.vq import VQConfig, VQModel
from lantern.train.loop import BatchPart, LoopConfig, RunOptions, TrainResult, TrainTask, step_generator, train


@dataclass(frozen=True)
class TokenizerRecipe:
    recon_loss: str = "l2"  # l2 | l1
    codebook_weight: float = 1.0
    commit_beta: float = 0.25
    restart_every: int = 50  # steps; 0 disables dead-code restarts
    eval_images: int = 512

    def __post_init__(self) -> None:
        check(self.recon_loss in ("l1", "l2"), f"--recon-loss must be l1 or l2, got {self.recon_loss!r}")
        check(self.restart_every >= 0, f"--restart-every must be >= 0, got {self.restart_every!r}")
        check(self.eval_images >= 1, f"--eval-images must be >= 1, got {self.eval_images!r}")


class _Usage:
    """Per-code hit counts since the last restart (checkpointed with the model)."""

    def __init__(self, size: int) -> None:
        self.counts = torch.zeros(size, dtype=torch.long)

    def state_dict(self) -> dict[str, Tensor]:
        return {"counts": self.counts.clone()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.counts = state["counts"].clone()


def psnr(images: Tensor, recon: Tensor) -> Tensor:  # [B, C, H, W] in [-1, 1] -> [B] dB
    mse = ((recon.float().clamp(-1, 1) - images.float()) / 2).pow(2).flatten(1).mean(1)
    return 10 * torch.log10(1.0 / mse.clamp(min=1e-10))


class TokenizerTask(TrainTask):
    kind = "tokenizer"
    model: VQModel

    def __init__(self, model: VQModel, data: Any, eval_data: Any, recipe: TokenizerRecipe, seed: int) -> None:
        check(data.channels == model.config.in_channels,
              f"the tokenizer config takes {model.config.in_channels}-channel images, the data set has {data.channels}")
        check(data.image_size % model.config.downsample_factor == 0,
              f"--image-size {data.image_size} must be a multiple of the tokenizer's downsampling factor "
              f"({model.config.downsample_factor})")
        self.model, self.data, self.eval_data, self.recipe, self.seed = model, data, eval_data, recipe, seed
        self.usage = _Usage(model.config.codebook_size)

    def num_examples(self) -> int:
        return len(self.data)

    def make_batch(self, indices: Tensor, step: int, device: torch.device, part: BatchPart | None = None) -> Tensor:
        from lantern.data import batch_images

        images, _ = batch_images(self.data, indices.tolist())
        return images.to(device)

    def loss(self, model: nn.Module, batch: Tensor, step: int) -> tuple[Tensor, dict[str, float]]:
        quantize = self._unwrap(model).quantize
        window = quantize.codebook_used.clone() if self._distributed() else None
        recon, losses, codes = model(batch, beta=self.recipe.commit_beta)
        pixel = F.mse_loss(recon.float(), batch) if self.recipe.recon_loss == "l2" else F.l1_loss(recon.float(), batch)
        total = pixel + self.recipe.codebook_weight * losses["codebook"] + losses["commitment"]
        if window is not None:  # the global batch's codes, in its order: what one process would have seen
            codes = self.accelerator.gather(codes.contiguous())
            with torch.no_grad():  # the usage window (a buffer) records them instead of this slice's
                quantize.codebook_used.copy_(window)
                quantize.record_usage(codes)
        self.usage.counts += torch.bincount(codes.reshape(-1).cpu(), minlength=self.usage.counts.numel())
        return total, {"recon": float(pixel.detach()), "commit": float(losses["commitment"].detach()),
                       "used": float((self.usage.counts > 0).float().mean())}

    def _unwrap(self, model: nn.Module) -> VQModel:
        return model.module if hasattr(model, "module") else model  # type: ignore[return-value]

    def _distributed(self) -> bool:
        return getattr(self, "accelerator", None) is not None and self.accelerator.num_processes > 1

    @torch.no_grad()
    def after_step(self, model: nn.Module, batch: Any, step: int) -> dict[str, float]:
        every = self.recipe.restart_every
        if not every or (step + 1) % every:
            return {}
        dead = (self.usage.counts == 0).nonzero().squeeze(1)
        if dead.numel():
            vq = self._unwrap(model)
            z = vq.encode_latents(batch)  # the encoder outputs to re-seed dead codes from
            if self._distributed():
                z = self.accelerator.gather(z.contiguous())  # the global batch, in its order
            latents = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1]).float().cpu()
            g = step_generator(self.seed, step, stream=1)
            pick = torch.randint(latents.shape[0], (dead.numel(),), generator=g)
            fresh = latents[pick] + 0.01 * torch.randn(dead.numel(), latents.shape[1], generator=g)
            weight = vq.quantize.embedding.weight
            weight[dead.to(weight.device)] = fresh.to(weight.device, weight.dtype)
            if self._distributed():
                from accelerate.utils import broadcast

                broadcast(weight.data, from_process=0)  # bit-equal codebooks whatever the rounding
        self.usage.counts.zero_()
        return {"restarted": float(dead.numel())}

    def extra_state(self) -> _Usage:
        return self.usage

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        from lantern.data import batch_images

        vq = self._unwrap(model).eval()
        n = min(len(self.eval_data), self.recipe.eval_images)
        scores, codes = [], []
        for lo in range(0, n, 64):
            images, _ = batch_images(self.eval_data, list(range(lo, min(lo + 64, n))))
            images = images.to(vq.quant_conv.weight.device)
            c = vq.encode(images)
            scores.append(psnr(images, vq.decode(c)).cpu())
            codes.append(c.reshape(-1).cpu())
        all_codes = torch.cat(codes)
        freq = torch.bincount(all_codes, minlength=vq.config.codebook_size).double()
        p = freq[freq > 0] / freq.sum()
        return {
            "psnr": float(torch.cat(scores).mean()),
            "codebook_usage": float((freq > 0).double().mean()),
            "code_perplexity": float(torch.exp(-(p * p.log()).sum())),
            "eval_images": float(n),
        }

    def save(self, model: nn.Module, out: Path) -> None:
        self._unwrap(model).save_pretrained(out)

    def config_dict(self) -> dict[str, Any]:
        return {"data": self.data.describe(), "eval_data": self.eval_data.describe(),
                "model": self.model.config.to_dict(), "recipe": asdict(self.recipe)}

    def data_fingerprint(self) -> str:
        return self.data.fingerprint()


def train_tokenizer(
    config: VQConfig,
    data: Any,
    eval_data: Any,
    recipe: TokenizerRecipe,
    loop: LoopConfig,
    options: RunOptions,
) -> TrainResult:
    # before any step: the evaluation at the end reads the test split (a probe's one-image folder
    # trained, then failed on an empty split with --out holding checkpoints and no model)
    check(len(eval_data) > 0, f"--data: the test split is empty ({len(data)} training image(s)); a folder holds out "
                              "every 10th image, or the last of fewer than 10, so give it at least 2 images")
    torch.manual_seed(loop.seed)  # the initial weights are a function of the seed
    model = VQModel(config)
    task = TokenizerTask(model, data, eval_data, recipe, loop.seed)
    result = train(task, loop, options)
    if result.finished and result.main_process and not result.nothing_to_do:
        assert math.isfinite(result.metrics["psnr"])
    return result
