"""The HTTP face of ``lantern serve``: a FastAPI app over a :class:`~lantern.serve.scheduler.Scheduler`.

``POST /v1/images/generations`` (OpenAI-images-like, optionally streamed as server-sent events),
``GET /v1/methods``, ``GET /v1/model``, ``GET /health``, ``GET /metrics`` (Prometheus text), the web
page at ``/`` and ``/openapi.json``. Every refusal is one JSON line, ``{"error": {"message",
"field"}}``, naming the request field it is about. The API reference is docs/serving.md.

This module, ``lantern.serve.guards`` and ``lantern.cli.serve``'s run function are the only ones
that import FastAPI or uvicorn, so that ``import lantern`` works without the ``serve`` extra.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import io
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match
from starlette.types import Message, Receive, Scope, Send

from lantern.api import Pipeline
from lantern.calibration import MethodChoice
from lantern.errors import LanternError
from lantern.methods import METHOD_TABLE
from lantern.serve.guards import AbsoluteTarget, HostCheck
from lantern.serve.limits import HttpLimits
from lantern.serve.metrics import Metrics
from lantern.serve.plan import (
    Limits,
    RequestError,
    answer_settings,
    parse_body,
    plan_request,
    round_limits,
    runnable_methods,
    validation_message,
)
from lantern.serve.scheduler import (
    Cancelled,
    ImageResult,
    PreviewSink,
    QueueFull,
    Resolved,
    Scheduler,
    Ticket,
    side_thread,
)
from lantern.serve.schema import (
    ErrorResponse,
    GenerationRequest,
    GenerationResponse,
    MethodsResponse,
    ModelResponse,
)

STATIC = Path(__file__).resolve().parent / "static"
GENERATIONS = "/v1/images/generations"
CLIENT_GONE = 499  # nginx's "client closed request": counted, never seen by the client
OUTCOME = "lantern.outcome"  # scope key: a stream's status as counted (its HTTP status is 200 from the start)
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in ((400, "a field the server refuses (named in error.field)"), (429, "the queue is full"),
                       (500, "the engine failed"), (503, "the server is shutting down"))}


class ServeState:
    """What the routes share: the scheduler, the model, the server's limits and its counters."""

    def __init__(self, scheduler: Scheduler, pipeline: Pipeline, default_method: str, limits: Limits,
                 http: HttpLimits, drain_timeout: float, model: str, auto: MethodChoice | None = None) -> None:
        self.scheduler, self.pipeline, self.default_method = scheduler, pipeline, default_method
        self.auto = auto  # what --method auto chose at start (default_method is its method)
        self.limits, self.http, self.drain_timeout, self.model = limits, http, drain_timeout, model
        self.metrics = Metrics()
        self.closing = False
        self._drain: threading.Thread | None = None
        self._drain_lock = threading.Lock()

    def drain(self) -> threading.Thread:
        """Start stopping (once; from any thread): no new images; the running and queued ones get
        ``drain_timeout`` s, then the scheduler fails the rest with ``Cancelled``, which their
        requests answer as a JSON 503 and their streams as an ``error`` event. The app's own
        clock, so that uvicorn never has to cancel a request (that answers a plain-text 500 and
        logs a CancelledError traceback)."""
        with self._drain_lock:
            if self._drain is None:
                self.closing = True
                self._drain = threading.Thread(target=self.scheduler.shutdown, args=(self.drain_timeout,),
                                               name="lantern-drain", daemon=True)
                self._drain.start()
            return self._drain


def create_app(scheduler: Scheduler, *, pipeline: Pipeline, default_method: str = "lantern++",
               max_images_per_request: int = 8, max_prompt_chars: int = 1000, drain_timeout: float = 30.0,
               model: str | None = None, max_tree_nodes: int | None = None, http: HttpLimits | None = None,
               allowed_hosts: Sequence[str] | None = None, auto: MethodChoice | None = None) -> FastAPI:
    """The app. The caller starts the scheduler (and warms it up); the app shuts it down when the
    server stops: :meth:`ServeState.drain` (``lantern serve`` starts it when shutdown begins,
    the lifespan's end otherwise). ``max_tree_nodes``: the most nodes a round may verify (default:
    ``lantern.serve.plan.round_limits``'s per method); ``http``: the body's bounds (size, time);
    ``allowed_hosts``: the Host header values answered (None: any, for tests and embedding);
    ``auto``: what ``--method auto`` chose (``default_method`` must be its method)."""
    if default_method not in runnable_methods(pipeline):
        raise LanternError(f"--method {default_method}: this model cannot run it; it runs "
                           f"{', '.join(runnable_methods(pipeline))}")
    limits = Limits(max_images_per_request, max_prompt_chars, round_limits(pipeline, max_tree_nodes))
    if auto is not None and auto.method != default_method:
        raise LanternError(f"--method auto chose {auto.method}, but the default method is {default_method}")
    state = ServeState(scheduler, pipeline, default_method, limits, http or HttpLimits(), drain_timeout,
                       model or Path(str(pipeline.stack.root)).name, auto)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await in_worker(_warm_planning, state)
        yield
        await run_in_threadpool(state.drain().join)

    # /docs and /redoc load Swagger UI / ReDoc from a CDN: off (the page must work offline);
    # the schema itself stays at /openapi.json.
    app = FastAPI(title="lantern", summary="Visual autoregressive image generation with speculative decoding",
                  docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.serve = state
    _without_422(app)
    _add_error_handlers(app, state)
    _add_routes(app, state)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    if allowed_hosts is not None:
        app.add_middleware(HostCheck, allowed=allowed_hosts)  # before anything else of the app runs
    app.add_middleware(CountRequests, state=state)  # a refused Host is an answer too
    app.add_middleware(AbsoluteTarget)  # outermost: every layer sees the path and host of an absolute-form target
    return app


class CountRequests:
    """Counts the answers of the generation endpoint by status (errors raised before the route
    runs included), once each answer has ended, as a plain ASGI wrapper (Starlette's
    BaseHTTPMiddleware would hide client disconnects from the route). A stream is counted by how
    it ended: the status of its ``error`` event, or 499 when its client left before its end."""

    def __init__(self, app: Any, state: ServeState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != GENERATIONS:
            await self.app(scope, receive, send)
            return
        status, ended = CLIENT_GONE, False

        async def counting_send(message: Message) -> None:
            nonlocal status, ended
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:  # (not ended: the client left, or the server cancelled the request, before the answer's end)
            self.state.metrics.request(scope.get(OUTCOME, status) if ended else CLIENT_GONE)


def _without_422(app: FastAPI) -> None:
    """The OpenAPI schema without FastAPI's automatic 422 answers: refusals are 400s (ERRORS)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        schema = build()  # cached by FastAPI: stripping it again is a no-op
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


async def in_worker(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a worker thread at one intra-op thread (``lantern.serve.scheduler.side_thread``):
    the torch work of a request (checks, VQ decoding) must not slow the decode thread."""
    def call() -> Any:
        side_thread()
        return fn(*args)

    return await run_in_threadpool(call)


# What an answer of these statuses says besides its body: when to try again (429: the queue is
# full), and that the connection ends (408, 413: the body was not read whole, so what follows on
# the connection is not a request).
STATUS_HEADERS = {429: {"Retry-After": "1"}, 408: {"Connection": "close"}, 413: {"Connection": "close"}}


def _error(status: int, message: str, field: str | None, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message.splitlines()[0] if message else "error", "field": field}},
                        status_code=status, headers={**STATUS_HEADERS.get(status, {}), **(headers or {})})


def _add_error_handlers(app: FastAPI, state: ServeState) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        return _error(400, *validation_message(first))

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.field)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # Allow: every method of the path (Starlette names the first route's only)
            headers["Allow"] = ", ".join(_methods_of(request))
        return _error(exc.status_code, str(exc.detail), None, headers)


def _methods_of(request: Request) -> list[str]:
    """The methods the routes of ``request``'s path answer (a GET route's HEAD is a route of its own)."""
    methods = {m for route in request.app.router.routes if getattr(route, "methods", None)
               and route.matches(request.scope)[0] != Match.NONE for m in route.methods}
    return sorted(methods)


def _get(app: FastAPI, path: str, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A GET route that answers HEAD too (HTTP's rule; a monitor's probe): the same answer without
    its body. HEAD stays out of the schema (one operation per route there)."""
    def register(endpoint: Callable[..., Any]) -> Callable[..., Any]:
        app.add_api_route(path, endpoint, methods=["HEAD"], **{**kwargs, "include_in_schema": False})
        return app.get(path, **kwargs)(endpoint)

    return register


def _add_routes(app: FastAPI, state: ServeState) -> None:
    @_get(app, "/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @_get(app, "/health")
    async def health() -> dict[str, Any]:
        return {"status": "shutting_down" if state.closing else "ok", "model": state.model,
                "kind": state.pipeline.kind, "queue_depth": int(state.scheduler.metrics().get("queue_depth", 0))}

    @_get(app, "/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        text = state.metrics.render(state.scheduler.metrics())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @_get(app, "/v1/methods", response_model=MethodsResponse)
    async def methods() -> dict[str, Any]:
        return {"methods": [{"name": m, "lossless": METHOD_TABLE[m].lossless, "drafter": METHOD_TABLE[m].needs_drafter,
                             "default": m == state.default_method} for m in runnable_methods(state.pipeline)],
                "default": state.default_method,
                "auto": None if state.auto is None else state.auto.to_dict()}

    @_get(app, "/v1/model", response_model=ModelResponse)
    async def model() -> dict[str, Any]:
        stack = state.pipeline.stack
        return {"model": state.model, "kind": state.pipeline.kind, "num_classes": stack.num_classes,
                "image_tokens": stack.num_tokens, "max_images_per_request": state.limits.max_images_per_request,
                "max_prompt_chars": state.limits.max_prompt_chars, "deterministic": state.pipeline.deterministic,
                "negative_prompt": stack.prompting.negative if stack.kind == "emu3" else None}

    @app.post(GENERATIONS, response_model=GenerationResponse, responses=ERRORS, openapi_extra=REQUEST_BODY,
              description="Generate images; with stream: true, server-sent events (preview, image, done).")
    async def generations(request: Request) -> Response:
        arrived = time.perf_counter()
        raw = await read_body(request, state.http)
        # Parsed, checked and resolved once, in a worker thread: a large body's parsing, loading a
        # method and encoding a prompt (T5) must not hold up the event loop.
        body, resolved = await in_worker(_plan, state, raw)
        if body.stream:
            events = TicketEvents(asyncio.get_running_loop())
            tickets = _submit(state, resolved, events.preview)  # before the first round: no preview is missed
            events.watch(tickets)
            stream = image_events(state, resolved, tickets, events, body.return_codes, arrived, request.scope)
            return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        tickets = _submit(state, resolved)
        results = await wait_results(state, tickets, request)
        if results is None:
            return Response(status_code=CLIENT_GONE)
        data = await in_worker(_image_items, state, results, body.return_codes, body.first_index)
        state.metrics.latency(time.perf_counter() - arrived)
        return JSONResponse({"created": int(time.time()), "data": data, "method": resolved.method,
                             "settings": answer_settings(resolved)})


# The body is read by the route itself (read_body: bounded as it streams), so FastAPI does not
# know its model: the schema names it here.
REQUEST_BODY = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": GenerationRequest.model_json_schema(ref_template="#/components/schemas/{model}")}}}}


async def read_body(request: Request, limits: HttpLimits) -> bytes:
    """The JSON body, refused as it streams (413) once past ``max_body_bytes`` (a chunked body has
    no length to check first), or (408) when it is not whole ``body_timeout`` s after the headers."""
    if not _is_json(request.headers.get("content-type", "")):
        raise RequestError("body: expected Content-Type: application/json", "body")
    too_large = RequestError(f"body: larger than this server's {limits.max_body_bytes} bytes "
                             "(lantern serve --max-body-bytes)", "body", 413)
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limits.max_body_bytes:
        raise too_large
    chunks, size = [], 0
    try:
        async with asyncio.timeout(limits.body_timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limits.max_body_bytes:
                    raise too_large
                chunks.append(chunk)
    except TimeoutError:
        raise RequestError(f"body: not received whole within {limits.body_timeout:g} s "
                           "(lantern serve --body-timeout)", "body", 408) from None
    except ClientDisconnect:
        raise RequestError("body: the client left before sending it", "body", CLIENT_GONE) from None
    return b"".join(chunks)


def _is_json(content_type: str) -> bool:
    """``application/json`` or ``application/*+json``, parameters allowed (FastAPI's rule): a
    cross-site form cannot send it without a CORS preflight, which this server never grants."""
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def _warm_planning(state: ServeState) -> None:
    """Parse and plan one request before the first client's, unsubmitted: the worker thread, the
    schema's validators and the resolver's modules are then ready, so the first refusal answers as
    fast as later ones (measured on a busy 2-core machine: 124 ms cold, 8-50 ms after)."""
    for body in ({"label": 0}, {"prompt": "a"}):  # class-conditional or text models: one plans in full
        with contextlib.suppress(RequestError, LanternError):
            _plan(state, json.dumps(body).encode())


def _plan(state: ServeState, raw: bytes) -> tuple[GenerationRequest, Resolved]:
    body = parse_body(raw)
    return body, plan_request(body, state.scheduler, state.default_method, state.limits, state.auto)


def _submit(state: ServeState, resolved: Resolved, on_preview: PreviewSink | None = None) -> list[Ticket]:
    """The resolved request's images, queued (nothing is checked again: it was resolved once)."""
    try:
        return state.scheduler.submit(resolved, on_preview)
    except QueueFull as e:
        raise RequestError(str(e), None, 429) from None
    except LanternError as e:  # shutting down
        raise RequestError(str(e), None, 503) from None


async def wait_results(state: ServeState, tickets: list[Ticket], request: Request) -> list[ImageResult] | None:
    """Every ticket's result, or None when the client went away (its rows are then freed).

    Nothing polls: the loop sleeps until a future completes or the client disconnects. A poll every
    few ms would take the GIL from the decode thread between its kernels (measured: the engine ran
    ~10 % slower in the server than in-process with a 50 ms poll)."""
    results = asyncio.gather(*(asyncio.wrap_future(t.future) for t in tickets), return_exceptions=True)
    gone = asyncio.ensure_future(_disconnect(request))
    either: set[asyncio.Future[Any]] = {results, gone}
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # cancelled: the drain timeout of a stopping server
        _cancel(tickets)
        raise
    finally:
        gone.cancel()
    if not results.done():  # (not results.cancel(): that would cancel the scheduler's futures under it)
        _cancel(tickets)
        return None
    return [_result(state, t) for t in tickets]


async def _disconnect(request: Request) -> None:
    """Returns when the client has gone (the body is read already: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _result(state: ServeState, ticket: Ticket) -> ImageResult:
    try:
        return ticket.future.result()
    except Cancelled as e:  # the server stopped before the image was done
        raise RequestError(f"image {ticket.index}: {e}", None, 503) from None
    except LanternError as e:
        raise RequestError(f"image {ticket.index}: {e}", None, 503 if state.closing else 500) from None


def _cancel(tickets: list[Ticket]) -> None:
    for t in tickets:
        if not t.future.done():
            t.cancel()


def _image_items(state: ServeState, results: list[ImageResult], return_codes: bool,
                 first_index: int = 0) -> list[dict[str, Any]]:
    """The answer's items; ``index``: each image's number in its seed's numbering (``first_index + i``)."""
    # One image at a time, as a stream decodes them (each when it finishes): the VQ decoder's
    # floats depend on its batch, and a request's PNGs must not depend on how it was answered.
    images = [state.scheduler.images(r.codes[None])[0] for r in results]
    items = []
    for i, (result, image) in enumerate(zip(results, images, strict=True)):
        state.metrics.image(result.codes.numel(), result.target_forwards)
        item: dict[str, Any] = {"index": first_index + i, "b64_json": png_base64(image)}
        if return_codes:
            item["codes"] = [int(c) for c in result.codes.tolist()]
        item["stats"] = {"tokens_per_forward": result.tokens_per_forward, "target_forwards": result.target_forwards,
                         "latency_seconds": result.latency_seconds, "queue_seconds": result.queue_seconds}
        items.append(item)
    return items


class TicketEvents:
    """What the decode thread reports about a stream's tickets, handed to the event loop: a
    ticket's codes so far (a preview), or None once its future is done. The stream awaits this
    queue, so it wakes only when there is something to send; nothing polls (docs/DESIGN.md)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[tuple[Ticket, torch.Tensor | None]] = asyncio.Queue()

    def preview(self, ticket: Ticket, codes: torch.Tensor | None) -> None:
        """From any thread (the decode thread's previews, a future's done callback)."""
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody listens any more
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (ticket, codes))

    def watch(self, tickets: list[Ticket]) -> None:
        """Report each ticket once its future is done (at once for one done already)."""
        for t in tickets:
            t.future.add_done_callback(self._reporter(t))

    def _reporter(self, ticket: Ticket) -> Callable[[concurrent.futures.Future[ImageResult]], None]:
        """The done-callback of ``ticket``'s future: it reports the ticket."""
        return lambda _: self.preview(ticket, None)

    async def next(self) -> list[tuple[Ticket, torch.Tensor | None]]:
        """What happened since the last call: waits for one event, then takes every one queued."""
        events = [await self.queue.get()]
        while not self.queue.empty():
            events.append(self.queue.get_nowait())
        return events


async def image_events(state: ServeState, resolved: Resolved, tickets: list[Ticket], events: TicketEvents,
                       return_codes: bool, arrived: float, scope: Scope | None = None
                       ) -> AsyncIterator[str]:
    """Server-sent events: ``preview`` (the codes so far, decoded) every ``preview_every`` rounds,
    ``image`` per finished image, then ``done``; ``error`` instead when the engine fails or the
    server stops first (its status is what the metrics count: ``scope[OUTCOME]``). A client that
    leaves cancels the generator (Starlette), which frees the rows of its unfinished images."""
    try:
        index = {id(t): i for i, t in enumerate(tickets)}
        finished: set[int] = set()
        while len(finished) < len(tickets):
            happened = await events.next()
            done = {index[id(t)] for t, codes in happened if codes is None} - finished
            # Only each image's newest preview, and none of an image finished meanwhile: the
            # client wants the current picture, not a backlog.
            latest = {index[id(t)]: codes for t, codes in happened if codes is not None}
            for i, codes in sorted(latest.items()):
                if i not in done and i not in finished:
                    yield _event("preview", await in_worker(_preview, state, tickets[i].index, codes))
            for i in sorted(done):
                result = _result(state, tickets[i])
                finished.add(i)
                items = await in_worker(_image_items, state, [result], return_codes, tickets[i].index)
                yield _event("image", items[0])
        state.metrics.latency(time.perf_counter() - arrived)
        yield _event("done", {"created": int(time.time()), "method": resolved.method,
                              "settings": answer_settings(resolved)})
    except RequestError as e:
        if scope is not None:
            scope[OUTCOME] = e.status
        yield _event("error", {"error": {"message": e.message, "field": e.field}})
    finally:
        _cancel(tickets)


def _preview(state: ServeState, index: int, codes: torch.Tensor) -> dict[str, Any]:
    known = codes >= 0
    image = state.scheduler.images(fill_unknown(codes)[None])[0]
    return {"index": index, "b64_json": png_base64(image), "tokens_done": int(known.sum())}


def fill_unknown(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N] with -1 where not decoded yet: each unknown code takes the last known one before
    it in raster order (0 before the first), so a preview shows smeared rows, not noise."""
    # on the codes' device: a preview's codes are a clone of the decode's buffer (CUDA on a GPU), and
    # torch.where refuses a CPU positions tensor beside them
    positions = torch.arange(codes.numel(), device=codes.device)
    last = torch.cummax(torch.where(codes >= 0, positions, -1), dim=0).values
    return torch.where(last >= 0, codes[last.clamp(min=0)], torch.zeros_like(codes))


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def png_base64(image: Any) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")
