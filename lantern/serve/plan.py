"""From a checked request body to the scheduler's :class:`~lantern.serve.scheduler.Resolved` record:
the checks that need the loaded model (its kind, classes and methods, the server's limits), then
the request resolved once (:meth:`Scheduler.resolve`: the settings as ``lantern.load(...)`` resolves
them, the method prepared, the condition encoded). A refusal names its field: the resolvers' errors
carry it (``LanternError.field``), so no message is parsed.

The body itself is parsed and checked here too (:func:`parse_body`), so that the app can run it
in a worker thread: a large body must not hold up the event loop.

Nothing here imports FastAPI: the app (:mod:`lantern.serve.app`) turns a :class:`RequestError`
into its HTTP answer.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import ValidationError

from lantern.api import SAMPLING_SETTINGS, Pipeline, resolve_settings
from lantern.calibration import AUTO, MethodChoice
from lantern.errors import LanternError, python_names
from lantern.methods import METHOD_SETTINGS, METHOD_TABLE, MethodConfig, method_settings
from lantern.run import verify_nodes
from lantern.serve.limits import MIN_ROUND_NODES, ROUND_FACTOR
from lantern.serve.scheduler import Resolved, Scheduler
from lantern.serve.schema import GenerationRequest
from lantern.validate import MAX_IMAGES

SETTINGS = (*SAMPLING_SETTINGS, *METHOD_SETTINGS)  # every field passed on as a setting
DEFAULT_PREVIEW_EVERY = 4  # rounds between previews of a stream
TREE_FIELDS = ("pac_width", "pac_depth", "sjd_window", "pjd_window", "pjd_context", "tree")  # what sizes a round
MAX_ECHO = 64  # characters of a request's own text an error repeats (a 100 kB key must not make a 200 kB error)


class RequestError(LanternError):
    """A request the server refuses: the HTTP status, and the request field it is about."""

    def __init__(self, message: str, field: str | None, status: int = 400) -> None:
        super().__init__(message, field=field)
        self.message, self.status = message, status


@dataclass(frozen=True)
class Limits:
    max_images_per_request: int = 8
    max_prompt_chars: int = 1000
    round_nodes: Mapping[str, int] = field(default_factory=dict)  # method -> most nodes a round verifies


def round_limits(pipeline: Pipeline, max_tree_nodes: int | None = None) -> dict[str, int]:
    """Per method this model runs, the most nodes one round may verify: ``max_tree_nodes``, else
    ROUND_FACTOR times the method's default round (at least MIN_ROUND_NODES). From the settings
    alone: nothing is built."""
    if max_tree_nodes is not None:
        return dict.fromkeys(runnable_methods(pipeline), max_tree_nodes)
    return {m: max(ROUND_FACTOR * default_round(pipeline, m), MIN_ROUND_NODES) for m in runnable_methods(pipeline)}


def default_round(pipeline: Pipeline, method: str) -> int:
    """Nodes of ``method``'s round with its defaults on this model."""
    return verify_nodes(resolve_settings(pipeline.stack, method)[0], pipeline.stack)


def round_bound(pipeline: Pipeline, method: str, limit: int | None, given: Mapping[str, Any]
                ) -> Callable[[MethodConfig], None]:
    """The check :meth:`Scheduler.resolve` makes before preparing anything: the request's round
    within ``limit`` nodes, else an error naming the setting that sized it."""
    def check(method_cfg: MethodConfig) -> None:
        nodes = verify_nodes(method_cfg, pipeline.stack)
        if limit is not None and nodes > limit:
            named = next((name for name in TREE_FIELDS if name in given), None)
            raise LanternError(f"a round of {nodes} nodes is over this server's limit of {limit} for {method} "
                               "(lantern serve --max-tree-nodes)", field=named or "method")

    return check


def parse_body(raw: bytes) -> GenerationRequest:
    """The body as a request (called in a worker thread), or a :class:`RequestError` naming the
    field, ``"body"`` when it is not a JSON object."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise RequestError(f"body: invalid JSON ({e.msg} at character {e.pos})", "body") from None
    except UnicodeDecodeError:
        raise RequestError("body: not UTF-8 text", "body") from None
    except RecursionError:
        raise RequestError("body: JSON nested too deeply", "body") from None
    if not isinstance(data, dict):
        raise RequestError("body: expected a JSON object of the request's fields", "body")
    try:
        return GenerationRequest.model_validate(data)
    except ValidationError as e:
        raise RequestError(*validation_message(e.errors()[0])) from None


def validation_message(error: Mapping[str, Any]) -> tuple[str, str]:
    """One line naming the field, from pydantic's first error (loc: (field, ...), or ("body", field,
    ...) from FastAPI)."""
    loc = [echo(str(part)) for part in error.get("loc", ()) if part != "body"]
    kind = error.get("type", "")
    if kind == "json_invalid" or not loc:
        return ("body: expected a JSON object of the request's fields" if kind != "json_invalid"
                else f"body: invalid JSON ({error.get('ctx', {}).get('error', 'parse error')})"), "body"
    name = loc[0]
    if kind == "extra_forbidden":
        return f"{name}: unknown field (see GET /openapi.json for the request's fields)", name
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{'.'.join(loc)}: {message}", name


def echo(text: str) -> str:
    """A request's own text, as an error repeats it: at most MAX_ECHO characters."""
    return text if len(text) <= MAX_ECHO else f"{text[:MAX_ECHO]}..."


def runnable_methods(pipeline: Pipeline) -> list[str]:
    """The methods this model can run: drafter methods need a drafter, LANTERN's relaxed rules a
    proximity table (what ``lantern.run.prepare_method`` would otherwise refuse on the first request)."""
    has_drafter, has_table = pipeline.parts.has_drafter, pipeline.parts.has_table  # (reads neither)
    return [r.name for r in METHOD_TABLE.values()
            if (has_drafter or not r.needs_drafter) and (has_table or not r.needs_proximity)]


def plan_request(body: GenerationRequest, scheduler: Scheduler, default_method: str, limits: Limits,
                 auto: MethodChoice | None = None) -> Resolved:
    """The request checked against the model and the server's limits, then resolved once (in the
    request's worker thread: resolving may load a method and encodes the prompt); raises
    :class:`RequestError`. ``auto``: what the server's ``--method auto`` chose at start (it is
    ``default_method``); a request that names no method, or ``auto``, runs it and says so."""
    pipeline = scheduler.pipeline
    condition = _condition(body, pipeline, limits)
    if body.n > limits.max_images_per_request:
        raise RequestError(f"n: at most {limits.max_images_per_request} images per request, got {body.n}", "n")
    if body.first_index + body.n > MAX_IMAGES:  # image indices stay below lantern generate's cap
        raise RequestError(f"first_index: images first_index .. first_index + n - 1 must be below {MAX_IMAGES}, "
                           f"got {body.first_index} + {body.n}", "first_index")
    method = body.method if body.method is not None else default_method
    chosen = auto if body.method in (None, AUTO) else None
    if method == AUTO:
        if auto is None:
            raise RequestError(f"method: 'auto' is the method a server started with --method auto chose from its "
                               f"calibration; this one serves --method {default_method}: name a method", "method")
        method = auto.method
    runnable = runnable_methods(pipeline)
    if method not in runnable:
        why = "unknown method" if method not in METHOD_TABLE else "this model cannot run method"
        raise RequestError(f"method: {why} {method[:40]!r}; this server runs {', '.join(runnable)}", "method")
    # Only names of the settings vocabulary and validated values go on: nothing from a request is
    # ever used as a file path (the drafter and proximity table are the server's, fixed at start;
    # `tree` is a spec of the tree table, refused by the schema when it looks like anything else).
    given = {name: getattr(body, name) for name in SETTINGS if getattr(body, name) is not None}
    preview = body.preview_every if body.preview_every is not None else DEFAULT_PREVIEW_EVERY
    bound = round_bound(pipeline, method, limits.round_nodes.get(method), given)
    negative = body.negative_prompt
    if negative is not None and len(negative) > limits.max_prompt_chars:
        raise RequestError(f"negative_prompt: at most {limits.max_prompt_chars} characters, got {len(negative)}",
                           "negative_prompt")
    try:
        resolved = scheduler.resolve(condition, body.seed, method, given,
                                     range(body.first_index, body.first_index + body.n),
                                     preview if body.stream else 0, bound, negative_prompt=negative)
    except LanternError as e:
        raise setting_error(e) from None
    return resolved if chosen is None else replace(resolved, auto_method=chosen.to_dict())


def _condition(body: GenerationRequest, pipeline: Pipeline, limits: Limits) -> int | str:
    """The request's label (class-conditional models) or prompt (the others): exactly one, the right one."""
    stack = pipeline.stack
    if pipeline.kind == "c2i":
        if body.prompt is not None:
            raise RequestError("prompt: this is a class-conditional model; pass label (a class id)", "prompt")
        if body.label is None:
            raise RequestError(f"label: required (a class id in 0..{stack.num_classes - 1})", "label")
        if not 0 <= body.label < stack.num_classes:
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
    return RequestError(f"{field}: {python_names(str(error), GenerationRequest.model_fields)}", field)


def answer_settings(request: Resolved) -> dict[str, Any]:
    """Every setting of a resolved request as the run uses it (defaults filled in: the prepared
    method's, so a default ``lantern_k`` reads as capped at the proximity table's K_max), and what
    ``--method auto`` chose when it chose the method: the answer's ``settings``. Sent back as a
    request, they give the same images."""
    auto = {} if request.auto_method is None else {"auto_method": dict(request.auto_method)}
    negative = {} if request.negative_prompt is None else {"negative_prompt": request.negative_prompt}
    return {**request.sampling.to_dict(), **method_settings(request.prepared.method), **negative, **auto}
