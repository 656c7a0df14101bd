"""The HTTP API's request and response bodies (pydantic v2): what ``POST /v1/images/generations``
takes and answers, checked field by field before anything reaches the scheduler.

The models are strict and closed (``extra="forbid"``): ``"n": "2"`` or a misspelt setting is an
error naming the field, not a silent coercion or a default. Checks that need the loaded model (a
label inside its classes, the server's ``n`` and prompt limits, the methods it can run) are made
by :mod:`lantern.serve.plan`.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lantern.decoding.config import (
    COUPLINGS,
    CREDITS,
    JACOBI_INITS,
    MAX_CFG_SCALE,
    PJD_COUPLINGS,
    PJD_INITS,
    RESIDUALS,
)
from lantern.decoding.trees import STATIC_TREES
from lantern.methods import BUDGETS
from lantern.validate import MAX_IMAGES

INT64 = 2**63
MAX_CHAIN = 4096  # far above any model's image length; the method's own checks refuse what does not fit
# A tree spec of the method table: never a file path (nothing from a request names a file).
# Matched whole (fullmatch: "$" would let "chain:16\n" through). Not "none" or "ar": the CLI's
# "--tree ar" turns a speculative method into AR, which an answer naming the method would misreport.
TREE_SPEC = re.compile(r"dynamic|chain:[0-9]{1,4}|static:[A-Za-z0-9_]{1,64}")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class GenerationRequest(Strict):
    """One request: ``n`` images of one label (class-conditional models) or one prompt
    (text-to-image and Chameleon-family models), image ``i`` seeded as ``lantern generate``
    seeds image ``i`` of ``--seed seed --num-per-label n``."""

    prompt: str | None = Field(None, description="text-to-image and Chameleon-family models: the prompt")
    negative_prompt: str | None = Field(None, description="Emu3 models: what guidance steers the images away "
                                                          "from (default: the model's own negative prompt)")
    # no ge=0 here: the plan refuses any label outside the model's classes with one message
    label: int | None = Field(None, description="class-conditional models: the class id")
    n: int = Field(1, ge=1, description="images (at most the server's --max-images-per-request)")
    seed: int = Field(0, ge=0, lt=INT64, description="base seed in [0, 2^63): image i uses image_seed(seed, i)")
    first_index: int = Field(0, ge=0, lt=MAX_IMAGES, description="the images are images first_index .. "
                             "first_index + n - 1 of this seed (each its own stream): first_index 5 with n 1 is "
                             "image 5 of a request with n >= 6, alone")
    method: str | None = Field(None, description="a method of GET /v1/methods, or auto (what the server's "
                                                  "--method auto chose; default: the server's --method)")
    # Sampling (null: the model's generation.json, then lantern's defaults)
    temperature: float | None = Field(None, ge=0)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    cfg_scale: float | None = Field(None, ge=1, le=MAX_CFG_SCALE)
    # Method settings (lantern.methods.METHOD_SETTINGS; null: the method's default)
    tree: str | None = Field(None, max_length=80, description="dynamic, chain:N or static:NAME (not auto)")
    lantern_k: int | None = Field(None, ge=0)  # 0: no neighbour credited (exact acceptance), as the API takes it
    lantern_delta: float | None = Field(None, ge=0, le=1)
    lantern_lambda: float | None = Field(None, ge=1)
    lantern_residual: Literal[RESIDUALS] | None = None  # type: ignore[valid-type]
    lantern_budget: Literal[BUDGETS] | None = None  # type: ignore[valid-type]
    lantern_credit: Literal[CREDITS] | None = None  # type: ignore[valid-type]
    sjd_window: int | None = Field(None, ge=1, le=MAX_CHAIN)
    sjd_init: Literal[JACOBI_INITS] | None = None  # type: ignore[valid-type]
    sjd_coupling: Literal[COUPLINGS] | None = None  # type: ignore[valid-type]
    gsd_group: int | None = Field(None, ge=1)
    pjd_window: int | None = Field(None, ge=1, le=MAX_CHAIN)
    pjd_context: int | None = Field(None, ge=1, le=MAX_CHAIN)
    pjd_init: Literal[PJD_INITS] | None = None  # type: ignore[valid-type]
    pjd_coupling: Literal[PJD_COUPLINGS] | None = None  # type: ignore[valid-type]
    pac_width: int | None = Field(None, ge=1, le=64)
    pac_depth: int | None = Field(None, ge=1, le=64)
    sv_alpha: float | None = Field(None, gt=0, le=1)
    # Response
    response_format: Literal["b64_json"] = "b64_json"
    return_codes: bool = False
    stream: bool = False
    preview_every: int | None = Field(None, ge=0, le=100_000,
                                      description="stream: a preview every this many rounds (default 4; 0: none)")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """``null`` reads as the field's default for every field, as it does for the settings (a
        client that writes ``"seed": null`` for "no seed" means the default, 0)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in _DEFAULTED_FIELDS)}
        return data

    @field_validator("tree")
    @classmethod
    def _tree_spec(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if value == "auto":
            raise ValueError("auto measures the device on every call; pass dynamic, chain:N or static:NAME")
        if not TREE_SPEC.fullmatch(value):
            raise ValueError(f"expected dynamic, chain:N or static:NAME (a name of the tree table), got {value[:40]!r}")
        if value.startswith("static:") and value.split(":", 1)[1] not in STATIC_TREES:
            raise ValueError(f"unknown static tree {value[7:]!r}; known: {', '.join(sorted(STATIC_TREES))}")
        return value


# fields whose default is not null: null stands for that default
_DEFAULTED_FIELDS = frozenset(name for name, field in GenerationRequest.model_fields.items()
                              if field.default is not None)


class ImageStats(BaseModel):
    tokens_per_forward: float  # the method's tau for this image
    target_forwards: int
    latency_seconds: float  # submitted -> finished
    queue_seconds: float  # submitted -> its row started


class ImageData(BaseModel):
    index: int
    b64_json: str  # a PNG, base64
    codes: list[int] | None = None
    stats: ImageStats


class GenerationResponse(BaseModel):
    created: int  # unix time
    data: list[ImageData]
    method: str
    settings: dict[str, Any]  # resolved: sampling and the method's own settings


class ErrorBody(BaseModel):
    message: str
    field: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class MethodInfo(BaseModel):
    name: str
    lossless: bool
    drafter: bool  # needs a trained drafter
    default: bool


class MethodsResponse(BaseModel):
    methods: list[MethodInfo]
    default: str
    auto: dict[str, Any] | None = None  # what --method auto chose from the calibration (None: --method named one)


class ModelResponse(BaseModel):
    model: str
    kind: str  # c2i, t2i, chameleon, janus or emu3
    num_classes: int | None
    image_tokens: int
    max_images_per_request: int
    max_prompt_chars: int
    deterministic: bool  # batch-invariant matmuls (lantern serve --deterministic, the default)
    # the model's own negative prompt (Emu3), which a request's negative_prompt replaces; None: it takes none
    negative_prompt: str | None = None
