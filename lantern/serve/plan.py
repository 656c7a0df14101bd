"""From a checked request body to the scheduler's jobs: the checks that need the loaded model (its
kind, classes and methods, the server's limits), the settings resolved as ``lantern.load(...)``
resolves them, and the field each refusal is about.

Nothing here imports FastAPI: the app (:mod:`lantern.serve.app`) turns a :class:`RequestError`
into its HTTP answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from lantern.api import SAMPLING_SETTINGS, Pipeline, resolve_settings
from lantern.decoding.sampling import validate_sampling_for_vocab
from lantern.errors import LanternError
from lantern.methods import METHOD_SETTINGS, METHOD_TABLE, MethodConfig
from lantern.serve.schema import GenerationRequest

SETTINGS = (*SAMPLING_SETTINGS, *METHOD_SETTINGS)  # every field passed on as a setting
DEFAULT_PREVIEW_EVERY = 4  # rounds between previews of a stream


class RequestError(LanternError):
    """A request the server refuses: the HTTP status, and the request field it is about."""

    def __init__(self, message: str, field: str | None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.field, self.status = message, field, status


@dataclass(frozen=True)
class Limits:
    max_images_per_request: int = 8
    max_prompt_chars: int = 1000


@dataclass(frozen=True)
class Plan:
    """One request, checked: its condition, method and settings, ready to become jobs."""

    condition: int | str
    n: int
    seed: int
    method: str
    settings: tuple[tuple[str, Any], ...]  # sorted (name, value), only those the request set
    resolved: dict[str, Any]  # every setting as the run will use it (defaults filled in)
    preview_every: int


def runnable_methods(pipeline: Pipeline) -> list[str]:
    """The methods this model can run: drafter methods need a drafter, LANTERN's relaxed rules a
    proximity table (what ``lantern.run.prepare_method`` would otherwise refuse on the first request)."""
    stack = pipeline.stack
    has_drafter = pipeline.drafter is not None or stack.drafter_dir is not None
    has_table = pipeline.proximity is not None or stack.proximity_file is not None
    return [r.name for r in METHOD_TABLE.values()
            if (has_drafter or not r.needs_drafter) and (has_table or not r.needs_proximity)]


def plan_request(body: GenerationRequest, pipeline: Pipeline, default_method: str, limits: Limits) -> Plan:
    """The request checked against the model and the server's limits; raises :class:`RequestError`."""
    condition = _condition(body, pipeline, limits)
    if body.n > limits.max_images_per_request:
        raise RequestError(f"n: at most {limits.max_images_per_request} images per request, got {body.n}", "n")
    method = body.method if body.method is not None else default_method
    runnable = runnable_methods(pipeline)
    if method not in runnable:
        why = "unknown method" if method not in METHOD_TABLE else "this model cannot run method"
        raise RequestError(f"method: {why} {method[:40]!r}; this server runs {', '.join(runnable)}", "method")
    # Only names of the settings vocabulary and validated values go on: nothing from a request is
    # ever used as a file path (the drafter and proximity table are the server's, fixed at start;
    # `tree` is a spec of the tree table, refused by the schema when it looks like anything else).
    given = {name: getattr(body, name) for name in SETTINGS if getattr(body, name) is not None}
    try:
        method_cfg, sampling = resolve_settings(pipeline.stack, method, **given)
        validate_sampling_for_vocab(sampling, pipeline.stack.vocab_size)  # else the decode round would fail
    except LanternError as e:
        raise setting_error(e, given) from None
    preview = body.preview_every if body.preview_every is not None else DEFAULT_PREVIEW_EVERY
    return Plan(condition=condition, n=body.n, seed=body.seed, method=method, settings=tuple(sorted(given.items())),
                resolved={**sampling.to_dict(), **method_settings(method_cfg)},
                preview_every=preview if body.stream else 0)


def _condition(body: GenerationRequest, pipeline: Pipeline, limits: Limits) -> int | str:
    """The request's label (class-conditional models) or prompt (the others): exactly one, the right one."""
    stack = pipeline.stack
    if pipeline.kind == "c2i":
        if body.prompt is not None:
            raise RequestError("prompt: this is a class-conditional model; pass label (a class id)", "prompt")
        if body.label is None:
            raise RequestError(f"label: required (a class id in 0..{stack.num_classes - 1})", "label")
        if body.label >= stack.num_classes:
            raise RequestError(f"label: must be in 0..{stack.num_classes - 1}, got {body.label}", "label")
        return body.label
    if body.label is not None:
        raise RequestError(f"label: this is a {pipeline.kind} model; pass prompt (text)", "label")
    if body.prompt is None or not body.prompt.strip():
        raise RequestError("prompt: required (a non-empty text)", "prompt")
    if len(body.prompt) > limits.max_prompt_chars:
        raise RequestError(f"prompt: at most {limits.max_prompt_chars} characters, got {len(body.prompt)}", "prompt")
    return body.prompt


def setting_error(error: LanternError, given: dict[str, Any]) -> RequestError:
    """A resolver's or the scheduler's refusal of the request's settings, as a field's error."""
    field = field_of(str(error), given)
    return RequestError(f"{field}: {error}", field)


def field_of(message: str, given: dict[str, Any]) -> str:
    """The request field a resolver's message is about: the first setting the request set that the
    message names (as ``name``, ``--name-with-dashes`` or ``name with spaces``), else ``method``."""
    found = []
    for name in given:
        hits = [m.start() for form in (name, "--" + name.replace("_", "-"), name.replace("_", " "))
                for m in re.finditer(rf"(?<![\w-]){re.escape(form)}(?![\w-])", message)]
        if hits:
            found.append((min(hits), name))
    return min(found)[1] if found else "method"


def method_settings(method: MethodConfig) -> dict[str, Any]:
    """A resolved method's settings under their request names (those it uses, defaults filled in)."""
    out: dict[str, Any] = {"tree": method.tree.spec} if method.tree.kind != "none" else {}
    relaxation = method.relaxation
    if relaxation is not None and relaxation.mode == "group":
        out["gsd_group"] = relaxation.k
    elif relaxation is not None:
        bound = {"lantern_delta": relaxation.delta} if relaxation.mode == "absolute" else {
            "lantern_lambda": relaxation.lam}
        out.update(lantern_k=relaxation.k, **bound, lantern_residual=relaxation.residual,
                   lantern_budget=relaxation.budget)
    if method.jacobi is not None:
        out.update(sjd_window=method.jacobi.window, sjd_init=method.jacobi.init, sjd_coupling=method.jacobi.coupling)
    if method.pjd is not None:
        out.update(pjd_window=method.pjd.window, pjd_context=method.pjd.context, pjd_init=method.pjd.init)
    if method.pac is not None:
        out.update(pac_width=method.pac.width, pac_depth=method.pac.depth)
    return out
