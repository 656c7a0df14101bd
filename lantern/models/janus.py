"""Janus / Janus-Pro targets (DeepSeek) run from transformers' weights with lantern's cache.

transformers' ``JanusForConditionalGeneration`` holds the weights: a Llama decoder
(``model.language_model``), the image-generation input path (``generation_embeddings`` then
``generation_aligner``: code -> VQ embedding -> the decoder's width), the image-generation head
(``generation_head``: ``proj_out``, GELU, ``vision_head`` over the VQ codes) and the VQ-VAE
(``vqmodel``). Its image ``generate`` (``generation_mode="image"``) runs one token per step over a
static cache with one length for the whole batch; :class:`JanusLM` runs the same modules over
lantern's :class:`~lantern.decoding.cache.KVCache` with explicit per-row slots, positions and tree
masks, as :class:`~lantern.models.chameleon.ChameleonLM` does for Chameleon, so the Chameleon
target adapter (tree verification, PJD's grid, left-padded prompts) serves Janus unchanged
(``lantern.targets.janus``). ``tests/test_janus.py`` checks codes, logits and pixels against
transformers' own image generation.

Model ids: prompt tokens keep their ids ``0 .. V_text - 1``; image code ``c`` is id
``V_text + c`` (``code_to_bpe``). :meth:`JanusLM.embed` sends each id down its own path (the text
embedding, or the generation embedding and aligner), which is exactly what transformers' loop
feeds: the prompt through ``get_input_embeddings()``, each sampled code through
``prepare_embeddings_for_image_generation``.

Sequence (transformers' ``JanusProcessor`` with ``generation_mode="image"``, DeepSeek's
``generation_inference.py``): the chat template around the prompt (``<|User|>: {prompt}\\n\\n
<|Assistant|>:``), the image-start token ``<begin_of_image>``, tokenized with BOS; then
``num_patches ** 2`` codes in raster order, no row tokens. Guidance rows are the same ids with
every token but BOS and image-start replaced by the pad token, attended like the prompt.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, cast

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

if TYPE_CHECKING:  # transformers is an optional extra: import it only where a Janus is loaded
    from transformers import JanusForConditionalGeneration, JanusVQVAEConfig, PreTrainedConfig
    from transformers.models.janus.modeling_janus import JanusVQVAEHead

JANUS_MODEL_TYPE = "janus"
BOI_TOKEN = "<begin_of_image>"  # the image-start token of DeepSeek's tokenizer (``tokenizer.boi_token``)
CODEBOOK_KEY = "model.vqmodel.quantize.embedding.weight"  # in the folder's safetensors


def codebook_file(directory: Path) -> Path:
    """The safetensors file of a Janus folder that holds the VQ codebook (sharded: by the index)."""
    from lantern.io import read_json_object

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index, "safetensors index").get("weight_map") or {}
        check(CODEBOOK_KEY in weight_map, f"{index}: weight_map has no {CODEBOOK_KEY!r}")
        return directory / str(weight_map[CODEBOOK_KEY])
    return directory / "model.safetensors"


class GenerationHead(nn.Module):
    """Janus's image-generation head (``proj_out``, GELU, ``vision_head``) behind the one member
    of ``nn.Linear`` that the drafting code reads besides the call: ``weight``, whose dtype and
    device the drafter casts its features to. The loop, the drafters and their training call it
    on final-norm hidden states exactly as they call Chameleon's Linear code head."""

    def __init__(self, head: JanusVQVAEHead) -> None:
        super().__init__()
        self.head = head

    @property
    def weight(self) -> Tensor:
        """The first layer's weight: the dtype / device inputs must have (all layers share them)."""
        weight = self.head.proj_out.weight
        assert isinstance(weight, Tensor)
        return weight

    def forward(self, hidden: Tensor) -> Tensor:
        return self.head(hidden)


class JanusLM(CachedDecoder):
    """A transformers Janus run over lantern's static KV cache, in code space (image generation)."""

    def __init__(self, hf_model: JanusForConditionalGeneration) -> None:
        super().__init__()
        cfg = hf_model.config
        self.hf = hf_model.eval()
        self._set_decoder(hf_model.model.language_model, cfg.text_config)  # the Llama decoder (no LM head)
        # transformers annotates a sub-config as its argument (dict | config | None); loaded, it is the config
        self.num_codes = int(cast("JanusVQVAEConfig", cfg.vq_config).num_embeddings)
        self.text_vocab = int(cast("PreTrainedConfig", cfg.text_config).vocab_size)
        # The code-space head: generation_head (an MLP), wrapped so a drafter can share it as it
        # shares Chameleon's Linear head.
        self.image_head = GenerationHead(hf_model.model.generation_head)

    @property
    def device(self) -> torch.device:
        return self.lm.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm.embed_tokens.weight.dtype

    @property
    def grid(self) -> int:
        """Codes per image side (``vq_config.num_patches``: the vision tower's image size / patch size)."""
        return int(self.hf.config.vq_config.num_patches)

    def code_to_bpe(self, codes: Tensor) -> Tensor:
        """Model ids of image codes (``V_text + code``; the name is the Chameleon adapter's)."""
        return codes + self.text_vocab

    def embed(self, ids: Tensor) -> Tensor:
        """ids [N, T] (text ids, or ``V_text + code``) -> input embeddings [N, T, D]."""
        is_code = ids >= self.text_vocab
        text = self.lm.embed_tokens(torch.where(is_code, 0, ids))
        # Both paths for every position, then a select: skipping the image path when no id is a code
        # would read the ids on the host, a sync in every round and a graph break when compiled.
        image = self.hf.prepare_embeddings_for_image_generation(torch.where(is_code, ids - self.text_vocab, 0))
        return torch.where(is_code[..., None], image.to(text.dtype), text)

    def image_logits(self, hidden: Tensor) -> Tensor:
        """hidden [..., D] (after the final norm) -> logits over the VQ codes [..., V], float32."""
        return self.image_head(hidden).float()

    @torch.no_grad()
    def decode_codes(self, codes: Tensor) -> Tensor:
        """codes [N, grid * grid] -> images [N, 3, H, W] in [-1, 1], by the model's own VQ decoder."""
        return self.hf.model.vqmodel.decode(codes)

    def codebook(self) -> Tensor:
        """[V, D]: the raw VQ codebook (proximity tables are checked against it; the decoder reads
        it L2-normalised, which ``build-proximity --normalize`` ranks by)."""
        return self.hf.model.vqmodel.quantize.embedding.weight

    def pixel_size(self) -> tuple[int, int]:
        """(height, width) of a decoded image: the grid times the VQ decoder's upsampling."""
        side = self.grid * 2 ** (len(self.hf.config.vq_config.channel_multiplier) - 1)
        return side, side


def janus_layout(model: JanusLM, boi_id: int) -> ImageLayout:
    """The image's place in the sequence: a square grid of codes after the image-start token, no
    row tokens. (The prompt, template and BOS included, is tokenized whole by the stack.)"""
    g = model.grid
    return ImageLayout(name="janus", height=g, width=g, head=(), tail=(), prefix=(boi_id,), uncond=(boi_id,),
                       pixel_size=model.pixel_size())


# ----------------------------------------------------------------------------------------------
# Loading


def load_janus(directory: str | os.PathLike[str], dtype: torch.dtype | None = None,
               device: str | torch.device = "cpu") -> JanusLM:
    """A transformers-format Janus / Janus-Pro folder (``config.json`` with ``model_type: janus`` +
    safetensors; e.g. deepseek-community/Janus-Pro-7B) through transformers, wrapped for lantern.
    Weights are read from safetensors only; no code from the folder runs."""
    directory = Path(directory)
    check_janus_folder(directory)
    # the understanding path (SigLIP tower and its aligner) never runs here: a folder may lack it
    model = load_pretrained("JanusForConditionalGeneration", directory, "Janus", dtype,
                            spare=("model.vision_model.", "model.aligner."))
    num_patches = int(model.config.vq_config.num_patches)
    tokens = int(model.config.vision_config.num_image_tokens)
    check(num_patches * num_patches == tokens,
          f"--model {directory}/config.json: vision_config.num_image_tokens {tokens} is not a square grid of "
          f"{num_patches} x {num_patches} codes (image_size / patch_size)")
    return JanusLM(model.to(device))


def check_janus_folder(directory: Path) -> None:
    refuse_remote_code(directory)
    raw = read_model_config(directory)
    check(raw is not None, f"--model: {directory} has no readable config.json: not a model folder")
    assert raw is not None
    check(raw.get("model_type") == JANUS_MODEL_TYPE,
          f"--model: {directory}/config.json is not a Janus config (model_type {JANUS_MODEL_TYPE!r} expected)")
    check_sub_configs(directory, raw, "Janus", ("text_config", "vq_config"))
    text = raw["text_config"]
    check(text.get("model_type", "llama") == "llama",
          f"--model: {directory}/config.json: text_config.model_type {text.get('model_type')!r}; lantern runs Janus "
          "models whose language model is a Llama (every Janus / Janus-Pro release)")
    check_safetensors_weights(directory, "Janus")


def is_janus_folder(directory: str | os.PathLike[str]) -> bool:
    """True when ``directory/config.json`` declares ``model_type: janus``."""
    raw = read_model_config(Path(directory))
    return raw is not None and raw.get("model_type") == JANUS_MODEL_TYPE
