"""Emu3 (BAAI) image generation run from transformers' weights with lantern's cache.

transformers' ``Emu3ForConditionalGeneration`` holds the weights: a Llama-style decoder
(``model.text_model``), the LM head over the whole vocabulary (text, special and visual tokens)
and the VQ-VAE (``model.vqmodel``, an ``Emu3VQVAE``). Image generation in transformers is its
ordinary ``generate`` over BPE ids with a ``prefix_allowed_tokens_fn`` (the model docs' recipe, as
BAAI's ``Emu3PrefixConstrainedLogitsHelper``): visual tokens inside a row, the end-of-line token
``<|extra_200|>`` forced after every row of ``width`` codes, then end-of-frame, end-of-image and
end-of-sequence. :class:`Emu3LM` runs the same modules over lantern's
:class:`~lantern.decoding.cache.KVCache` with per-row slots, positions and tree masks, as
:class:`~lantern.models.chameleon.ChameleonLM` does for Chameleon, so the Chameleon target adapter
(new-line shadows in trees and in PJD's grid, left-padded prompts) serves Emu3
(``lantern.targets.emu3``). ``tests/test_emu3.py`` checks codes, logits and pixels against
transformers' own generation.

Codes and ids: VQ code ``c`` is the BPE token ``<|visual token{c:06d}|>`` of the config's
``vocabulary_map`` (transformers' ``Emu3ImageVocabularyMapping``); loop, acceptance rules and
proximity tables work on codes, the model on BPE ids (``code_to_bpe``).

Guidance: transformers' ``UnbatchedClassifierFreeGuidanceLogitsProcessor`` combines the
*log-softmax over the whole vocabulary* of both branches, ``u + s (c - u)``, before the prefix
constraint keeps the visual tokens; :meth:`Emu3LM.image_log_probs` gives exactly those values at
the code rows. (Restricted to the codes they differ from guided raw logits by a constant per row,
so the sampled law is the same; the values are matched so logits compare to the reference.)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from lantern.errors import check
from lantern.models.chameleon import ImageLayout
from lantern.models.hf_folder import (
    CachedDecoder,
    check_safetensors_weights,
    check_sub_configs,
    load_pretrained,
    read_model_config,
    refuse_remote_code,
)

if TYPE_CHECKING:  # transformers is an optional extra: import it only where an Emu3 is loaded
    from transformers import Emu3ForConditionalGeneration, Emu3VQVAEConfig

EMU3_MODEL_TYPE = "emu3"
EOL_TOKEN = "<|extra_200|>"  # end of each row of codes (transformers' Emu3ImageVocabularyMapping.eol_token_id)
VISUAL_TOKEN = "<|visual token{code:06d}|>"
# The codebook's key in the folder's safetensors: the converted release (and transformers' save_pretrained,
# which writes Emu3 back in that layout) keeps the VQ-VAE at the top level; the module path, in case.
CODEBOOK_KEYS = ("vqmodel.quantize.embedding.weight", "model.vqmodel.quantize.embedding.weight")
# Emu3Processor's generation size: a 1:1 image of image_area 518400 pixels (720 x 720) in codes of
# 8 x 8 pixels (its downsample_ratio), so 90 x 90 codes.
DEFAULT_IMAGE_SIZE = 720
PIXELS_PER_CODE = 8
LOG_PROB_ROWS = 128  # hidden rows per full-vocabulary head product (bounds its [rows, vocab] float32 logits)


def grid_for(image_size: int, flag: str = "--image-size") -> int:
    """Codes along a side of ``image_size`` pixels (``flag``: the option that gave it, for the error).
    A square image is what Emu3Processor's ``calculate_generate_size`` gives for ratio 1:1 and
    image_area = image_size ** 2; another ratio W:H at an area A gives round(H sqrt(A / (W H)) / 8)
    rows of round(W sqrt(A / (W H)) / 8) codes, which ``--image-size`` / ``--image-width`` name in
    pixels (rows x 8, codes x 8)."""
    check(isinstance(image_size, int) and not isinstance(image_size, bool) and image_size >= PIXELS_PER_CODE
          and image_size % PIXELS_PER_CODE == 0,
          f"{flag} must be a positive multiple of {PIXELS_PER_CODE} for Emu3 models, got {image_size!r}")
    return image_size // PIXELS_PER_CODE  # round(sqrt(area) / 8), exact for a multiple of 8


def image_token_ids(vocabulary_map: dict[str, int], num_codes: int) -> Tensor:
    """[num_codes] BPE id of each VQ code (``<|visual token{c:06d}|>`` in the config's vocabulary map)."""
    missing = [c for c in range(num_codes) if VISUAL_TOKEN.format(code=c) not in vocabulary_map]
    check(not missing, f"config.vocabulary_map has no visual token for codes {missing[:5]} (of {num_codes})")
    return torch.tensor([int(vocabulary_map[VISUAL_TOKEN.format(code=c)]) for c in range(num_codes)])


def code_rows(weight: Tensor, ids: Tensor) -> nn.Parameter:
    """The LM head's rows of the codes: a view when the visual tokens are one ascending run of ids
    (Emu3's vocabulary: no copy of a 32768 x 4096 matrix), else a copy."""
    first = int(ids[0])
    if torch.equal(ids, torch.arange(first, first + len(ids))):
        return nn.Parameter(weight[first : first + len(ids)], requires_grad=False)
    return nn.Parameter(weight[ids.to(weight.device)].clone(), requires_grad=False)


class Emu3LM(CachedDecoder):
    """A transformers Emu3 run over lantern's static KV cache, in code space (image generation)."""

    image_ids: Tensor  # a buffer [V_codes]: each code's token id

    def __init__(self, hf_model: Emu3ForConditionalGeneration) -> None:
        super().__init__()
        cfg = hf_model.config
        self.hf = hf_model.eval()
        self._set_decoder(hf_model.model.text_model, cfg.text_config)  # the decoder (no LM head)
        # transformers annotates a sub-config as its argument (dict | config | None); loaded, it is the config
        vq = cast("Emu3VQVAEConfig", cfg.vq_config)
        self.num_codes = int(vq.codebook_size)
        vocabulary = dict(cfg.vocabulary_map or {})
        check(EOL_TOKEN in vocabulary, f"config.vocabulary_map has no end-of-line token {EOL_TOKEN!r}")
        self.eol = int(vocabulary[EOL_TOKEN])
        ids = image_token_ids(vocabulary, self.num_codes)  # on the host: checked without a device sync
        check(int(ids.max()) < self.config.vocab_size,
              f"visual token ids reach {int(ids.max())}, past the vocabulary ({self.config.vocab_size})")
        # The code-space head (a Linear over the codes' rows of lm_head): what the loop reads as lm_head.
        weight = hf_model.lm_head.weight
        self.image_head = nn.Linear(self.config.hidden_size, self.num_codes, bias=False, device="meta")
        self.image_head.weight = code_rows(weight.detach(), ids)
        # on the model's device: the wrapper is built around a model already moved there (load_emu3) and
        # is not moved after, so a CPU buffer would meet CUDA tensors (code_to_bpe, image_log_probs)
        self.register_buffer("image_ids", ids.to(weight.device), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.hf.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.lm_head.weight.dtype

    @property
    def pixels_per_code(self) -> int:
        """The VQ decoder's upsampling (``2 ** (levels - 1)``; 8 for Emu3's VisionTokenizer)."""
        return int(self.hf.model.vqmodel.spatial_scale_factor)

    def code_to_bpe(self, codes: Tensor) -> Tensor:
        return self.image_ids[codes]

    def embed(self, ids: Tensor) -> Tensor:
        return self.lm.embed_tokens(ids)

    def image_logits(self, hidden: Tensor) -> Tensor:
        """hidden [..., D] (after the final norm) -> raw logits over the codes [..., V_img], float32."""
        return self.image_head(hidden).float()

    def image_log_probs(self, hidden: Tensor) -> Tensor:
        """hidden [..., D] -> the log-softmax over the *whole* vocabulary at the codes [..., V_img],
        float32: what transformers' guidance combines. Computed ``LOG_PROB_ROWS`` rows at a time."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        out = [self._code_log_probs(chunk) for chunk in flat.split(LOG_PROB_ROWS)]
        return torch.cat(out).reshape(*hidden.shape[:-1], self.num_codes)

    def _code_log_probs(self, hidden: Tensor) -> Tensor:
        logits = self.hf.lm_head(hidden).float()
        return logits.index_select(-1, self.image_ids) - logits.logsumexp(-1, keepdim=True)

    @torch.no_grad()
    def decode_codes(self, codes: Tensor, height: int, width: int) -> Tensor:
        """codes [N, height * width] -> images [N, 3, H, W] in [-1, 1], by the model's own VQ decoder
        (``Emu3VQVAE.decode``, what ``decode_image_tokens`` runs once the row tokens are dropped)."""
        return self.hf.model.vqmodel.decode(codes.reshape(-1, height, width))

    def codebook(self) -> Tensor:
        """[V, C]: the VQ codebook (its quantizer compares raw vectors: build tables without --normalize)."""
        return self.hf.model.vqmodel.quantize.embedding.weight


def read_codebook(directory: Path) -> Tensor:
    """The VQ codebook [V, C] of an Emu3 folder, read alone from its safetensors (a sharded folder:
    the file its index names), no model built: what ``build-proximity --tokenizer FOLDER`` ranks."""
    from lantern.io import read_json_object, read_safetensors

    index = directory / "model.safetensors.index.json"
    weights = directory / "model.safetensors"
    if index.is_file():
        weight_map = read_json_object(index, "safetensors index").get("weight_map") or {}
        key = next((k for k in CODEBOOK_KEYS if k in weight_map), None)
        check(key is not None, f"{index}: weight_map has none of {', '.join(CODEBOOK_KEYS)}")
        weights = directory / str(weight_map[key])
    tensors, _ = read_safetensors(weights, "Emu3 weights", CODEBOOK_KEYS)
    check(bool(tensors), f"{weights} has none of {', '.join(CODEBOOK_KEYS)}")
    return next(iter(tensors.values()))


def emu3_layout(model: Emu3LM, header: tuple[int, ...], grid: tuple[int, int]) -> ImageLayout:
    """The image's place in the sequence: after the size header ``<|image start|>H*W<|image token|>``
    (the layout's prefix; the prompt, BOS included, is tokenized whole by the stack), ``grid`` = (H,
    W): H rows of W codes, each ended by the end-of-line token."""
    rows, columns = grid
    # uncond = prefix only to satisfy ImageLayout: Emu3's guidance rows are the stack's negative prompt
    return ImageLayout(name="emu3", height=rows, width=columns, head=(), tail=(), prefix=header, uncond=header,
                       eol=model.eol, pixel_size=(rows * model.pixels_per_code, columns * model.pixels_per_code))


# ----------------------------------------------------------------------------------------------
# Loading


def load_emu3(directory: str | os.PathLike[str], dtype: torch.dtype | None = None,
              device: str | torch.device = "cpu") -> Emu3LM:
    """A transformers-format Emu3 folder (``config.json`` with ``model_type: emu3`` + safetensors;
    e.g. BAAI/Emu3-Gen-hf) through transformers, wrapped for lantern. Weights are read from
    safetensors only; no code from the folder runs."""
    directory = Path(directory)
    check_emu3_folder(directory)
    return Emu3LM(load_pretrained("Emu3ForConditionalGeneration", directory, "Emu3", dtype).to(device))


def check_emu3_folder(directory: Path) -> None:
    """A one-line error for a folder lantern will not read as Emu3: remote code, no config, another
    model type, no safetensors (pickles are never read), an unreadable safetensors header."""
    refuse_remote_code(directory)
    raw = read_model_config(directory)
    check(raw is not None, f"--model: {directory} has no readable config.json: not a model folder")
    assert raw is not None
    check(raw.get("model_type") == EMU3_MODEL_TYPE,
          f"--model: {directory}/config.json is not an Emu3 config (model_type {EMU3_MODEL_TYPE!r} expected)")
    check_sub_configs(directory, raw, "Emu3", ("text_config", "vq_config"))
    check(isinstance(raw.get("vocabulary_map"), dict),
          f"--model: {directory}/config.json has no vocabulary_map (Emu3's visual tokens are named there)")
    check_safetensors_weights(directory, "Emu3")


def is_emu3_folder(directory: str | os.PathLike[str]) -> bool:
    """True when ``directory/config.json`` declares ``model_type: emu3``."""
    raw: dict[str, Any] | None = read_model_config(Path(directory))
    return raw is not None and raw.get("model_type") == EMU3_MODEL_TYPE
