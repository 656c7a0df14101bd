"""From a checked request body to the scheduler's :class:`~lantern.serve.scheduler.Resolved` record:
the checks that need the loaded model (its kind, classes and methods, the server's limits), then
the request resolved once (:meth:`Scheduler.resolve`: the settings as ``lantern.load(...)`` resolves
them, the method prepared, the condition encoded). A refusal names its field: the resolvers' errors
carry it (``LanternError.field``), so no message is parsed.

Nothing here imports FastAPI: the app (:mod:`lantern.serve.app`) turns a :class:`RequestError`
into its HTTP answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lantern.api import SAMPLING_SETTINGS, Pipeline
from lantern.errors import LanternError
from lantern.methods import METHOD_SETTINGS, METHOD_TABLE, MethodConfig
from lantern.serve.scheduler import Resolved, Scheduler
from lantern.serve.schema import GenerationRequest

SETTINGS = (*SAMPLING_SETTINGS, *METHOD_SETTINGS)  # every field passed on as a setting
DEFAULT_PREVIEW_EVERY = 4  # rounds between previews of a stream


class RequestError(LanternError):
    """A request the server refuses: the HTTP status, and the request field it is about."""

    def __init__(self, message: str, field: str | None, status: int = 400) -> None:
        super().__init__(message, field=field)
        self.message, self.status = message, status


@dataclass(frozen=True)
class Limits:
    max_images_per_request: int = 8
    max_prompt_chars: int = 1000


def runnable_methods(pipeline: Pipeline) -> list[str]:
    """The methods this model can run: drafter methods need a drafter, LANTERN's relaxed rules a
    proximity table (what ``lantern.run.prepare_method`` would otherwise refuse on the first request)."""
    has_drafter, has_table = pipeline.parts.has_drafter, pipeline.parts.has_table  # (reads neither)
    return [r.name for r in METHOD_TABLE.values()
            if (has_drafter or not r.needs_drafter) and (has_table or not r.needs_proximity)]


def plan_request(body: GenerationRequest, scheduler: Scheduler, default_method: str, limits: Limits) -> Resolved:
    """The request checked against the model and the server's limits, then resolved once (in the
    request's worker thread: resolving may load a method and encodes the prompt); raises
    :class:`RequestError`."""
    pipeline = scheduler.pipeline
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
    preview = body.preview_every if body.preview_every is not None else DEFAULT_PREVIEW_EVERY
    try:
        return scheduler.resolve(condition, body.seed, method, given, range(body.n),
                                 preview if body.stream else 0)
    except LanternError as e:
        raise setting_error(e) from None


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


def setting_error(error: LanternError) -> RequestError:
    """A resolver's refusal of the request, as its field's error: the field the error carries; one
    that names no setting (a drafter the method needs, say) is about the method as a whole."""
    field = error.field or "method"
    return RequestError(f"{field}: {error}", field)


def answer_settings(request: Resolved) -> dict[str, Any]:
    """Every setting of a resolved request as the run uses it (defaults filled in): the answer's ``settings``."""
    return {**request.sampling.to_dict(), **method_settings(request.method_cfg)}


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
