"""The HTTP API of ``lantern serve`` (lantern.serve.app) on the digits preset: every refusal is a
4xx naming its field, a request gives the codes ``lantern.load(...)(...)`` gives, streams carry
previews then the same image, the metrics count what was served, a full queue answers 429, and a
client that leaves frees its rows."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch
from conftest import served
from fastapi.testclient import TestClient
from PIL import Image

import lantern
from lantern.api import SAMPLING_SETTINGS
from lantern.errors import LanternError
from lantern.methods import METHOD_SETTINGS
from lantern.serve import scheduler as scheduler_module
from lantern.serve.app import TicketEvents, create_app, fill_unknown, image_events, wait_results
from lantern.serve.plan import runnable_methods
from lantern.serve.scheduler import Scheduler
from lantern.serve.schema import GenerationRequest
from lantern.targets.base import PRESETS_DIR

GENERATE = "/v1/images/generations"
STATIC = Path(lantern.__file__).parent / "serve" / "static"


@pytest.fixture(scope="module")
def pipe() -> lantern.Pipeline:
    return lantern.load("digits", deterministic=True)  # codes equal alone and in any batch, on any CPU


@pytest.fixture(scope="module")
def client(pipe: lantern.Pipeline) -> Iterator[TestClient]:
    """A started server: batches of up to 2 rows, default method sjd-coupled, at most 4 images a request."""
    scheduler = Scheduler(pipe, max_batch=2, max_queue=8)
    scheduler.start()
    app = create_app(scheduler, pipeline=pipe, default_method="sjd-coupled", max_images_per_request=4,
                     max_prompt_chars=50)
    with TestClient(app) as c:  # the lifespan: leaving the block shuts the scheduler down
        yield c


def _png(b64: str) -> Image.Image:
    data = base64.b64decode(b64)
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    return Image.open(io.BytesIO(data))


def _metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name{labels}: value}; every sample line must parse."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        match = re.fullmatch(r'([a-z_]+(?:\{[a-z]+="[^"]*"\})?) (\S+)', line)
        assert match, line
        out[match.group(1)] = float(match.group(2))
    return out


def _events_of(text: str) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((lines["event"], json.loads(lines["data"])))
    return events


# --------------------------------------------------------------------------------------------------
# Refusals, with their status and field
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        ({"label": 1, "colour": "red"}, 400, "colour"),  # unknown field
        ({"label": "3"}, 400, "label"),  # wrong type: no coercion
        ({"label": 1, "n": 2.0}, 400, "n"),
        ({"label": 1, "return_codes": "yes"}, 400, "return_codes"),
        ({"label": 10}, 400, "label"),  # digits has classes 0..9
        ({"label": -1}, 400, "label"),
        ({}, 400, "label"),  # a c2i model needs its label
        ({"label": 1, "n": 5}, 400, "n"),  # the server's --max-images-per-request is 4
        ({"label": 1, "n": 0}, 400, "n"),
        ({"prompt": "x" * 60}, 400, "prompt"),  # over-long, and the wrong field for a c2i model
        ({"label": 1, "prompt": "a cat"}, 400, "prompt"),
        ({"label": 1, "method": "nope"}, 400, "method"),
        ({"label": 1, "top_k": -1}, 400, "top_k"),
        ({"label": 1, "top_k": 5000}, 400, "top_k"),  # past the 1024 codes
        ({"label": 1, "temperature": float("nan")}, 400, "temperature"),
        ({"label": 1, "method": "lantern++", "lantern_delta": 0.2}, 400, "lantern_delta"),  # lantern's, not ++'s
        ({"label": 1, "method": "lantern++", "tree": "../../etc/passwd"}, 400, "tree"),
        ({"label": 1, "method": "lantern++", "tree": "/tmp/tree.json"}, 400, "tree"),
        ({"label": 1, "method": "lantern++", "tree": "auto"}, 400, "tree"),
        ({"label": 1, "method": "lantern++", "tree": "static:nope"}, 400, "tree"),
        ({"label": 1, "response_format": "url"}, 400, "response_format"),
        ({"label": 1, "sjd_window": 1000}, 400, "sjd_window"),  # refused by the scheduler's check
        ({"label": 1, "method": "lantern++", "lantern_k": 1000}, 400, "lantern_k"),  # the table holds 128
        ({"label": 1, "method": "lantern++", "tree": "chain:100"}, 400, "tree"),  # deeper than the image
        # these three were answered as "method" (a probe, 2026-11-29); the last also named the server's table path
        ({"label": 1, "method": "lantern++", "tree": "chain:0"}, 400, "tree"),
        ({"label": 1, "method": "gsd", "gsd_group": 2000}, 400, "gsd_group"),
        ({"label": 1, "method": "lantern", "lantern_residual": "official", "lantern_k": 128}, 400, "lantern_residual"),
        ({"label": 1, "first_index": -1}, 400, "first_index"),
        ({"label": 1, "first_index": 999_999, "n": 2}, 400, "first_index"),  # image indices stay below 10^6
    ],
)
def test_a_bad_request_is_refused_naming_its_field(client: TestClient, body: dict[str, Any], status: int,
                                                   field: str) -> None:
    before = client.app.state.serve.scheduler.metrics()["queue_depth"]  # type: ignore[attr-defined]
    r = client.post(GENERATE, content=json.dumps(body, allow_nan=True), headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["field"] == field, error
    assert "\n" not in error["message"] and error["message"].startswith(f"{field}: "), error
    assert str(PRESETS_DIR) not in error["message"] and "safetensors" not in error["message"], error  # no server path
    assert client.app.state.serve.scheduler.metrics()["queue_depth"] == before  # type: ignore[attr-defined]


def test_a_label_outside_the_classes_gets_one_message_either_side(client: TestClient) -> None:
    """-1 got pydantic's "Input should be greater than or equal to 0" and 10 the server's own (an audit,
    2026-11-30): both now name the model's classes."""
    for label in (-1, 10):
        r = client.post(GENERATE, json={"label": label})
        assert r.status_code == 400 and r.json()["error"]["message"] == f"label: must be in 0..9, got {label}"


def test_a_body_that_is_not_json_names_the_body(client: TestClient) -> None:
    r = client.post(GENERATE, content=b"{label: 1", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["field"] == "body"


def test_a_refusals_field_comes_from_the_error_object(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """The field answered is the one the resolver's LanternError carries, not one read from its
    message (this message names another setting, and no setting at all is named "x")."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise LanternError("top_k and tree are both wrong, says this text", field="x")

    monkeypatch.setattr(scheduler_module, "resolve_settings", refuse)
    r = client.post(GENERATE, json={"label": 1, "top_k": 3, "tree": "dynamic", "method": "lantern++"})
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "x: top_k and tree are both wrong, says this text", "field": "x"}


def test_a_request_is_resolved_once(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """One resolution per request (plain or streamed), settings never seen before included: the
    scheduler takes the resolved record and never resolves or checks again."""
    calls: list[str] = []
    real = scheduler_module.resolve_settings

    def counting(stack: Any, method: str, **settings: Any) -> Any:
        calls.append(method)
        return real(stack, method, **settings)

    monkeypatch.setattr(scheduler_module, "resolve_settings", counting)
    for i, stream in enumerate((False, True)):
        calls.clear()
        body = {"label": 2, "method": "ar", "temperature": 0.81 + 0.01 * i, "stream": stream}
        r = client.post(GENERATE, json=body)
        assert r.status_code == 200, r.text
        assert calls == ["ar"], (stream, calls)


def test_the_schema_takes_every_setting_of_the_vocabulary() -> None:
    """A setting added to lantern.methods / lantern.api is a request field too (or this fails)."""
    assert set(SAMPLING_SETTINGS + METHOD_SETTINGS) <= set(GenerationRequest.model_fields)


def test_a_text_model_takes_a_prompt_and_gives_the_apis_codes(t2i_stack: Path) -> None:
    """A text-to-image stack (tiny T5): a label is the wrong field, the prompt is bounded, and a
    prompt gives the codes of ``lantern.load(stack)(prompts=[...])``."""
    text_pipe = lantern.load(t2i_stack)
    scheduler = Scheduler(text_pipe, max_batch=2, max_queue=4)
    scheduler.start()
    app = create_app(scheduler, pipeline=text_pipe, default_method="sjd-coupled", max_prompt_chars=20)
    with TestClient(app) as c:
        for body, field in (({"label": 1}, "label"), ({"prompt": "a red car " * 3}, "prompt"), ({}, "prompt"),
                            ({"prompt": "   "}, "prompt")):
            r = c.post(GENERATE, json=body)
            assert r.status_code == 400 and r.json()["error"]["field"] == field, r.text
        r = c.post(GENERATE, json={"prompt": "a red car", "n": 2, "seed": 4, "return_codes": True})
        assert r.status_code == 200, r.text
    expected = text_pipe(prompts=["a red car"], num_per_label=2, seed=4, method="sjd-coupled")
    assert [d["codes"] for d in r.json()["data"]] == expected.codes.tolist()


# --------------------------------------------------------------------------------------------------
# The same codes as the Python API
# --------------------------------------------------------------------------------------------------


@pytest.mark.invariance
def test_a_request_twice_gives_the_same_png_and_the_apis_codes(client: TestClient, pipe: lantern.Pipeline) -> None:
    body = {"label": 3, "n": 2, "seed": 7, "return_codes": True}  # the default method: sjd-coupled
    first, second = client.post(GENERATE, json=body), client.post(GENERATE, json=body)
    assert first.status_code == second.status_code == 200, first.text
    a, b = first.json(), second.json()
    assert [d["b64_json"] for d in a["data"]] == [d["b64_json"] for d in b["data"]]
    assert [d["codes"] for d in a["data"]] == [d["codes"] for d in b["data"]]
    expected = pipe(labels=[3], num_per_label=2, seed=7, method="sjd-coupled")
    assert [d["codes"] for d in a["data"]] == expected.codes.tolist()
    assert a["method"] == "sjd-coupled"
    assert a["settings"] == {**expected.config["sampling"], "sjd_window": 16,  # no tree: SJD takes none
                             "sjd_init": "repeat_horizon", "sjd_coupling": "maximal"}
    for item, image in zip(a["data"], expected.images, strict=True):
        assert _png(item["b64_json"]).tobytes() == image.tobytes()  # the decoded pixels too
        stats = item["stats"]
        assert stats["tokens_per_forward"] == pytest.approx(64 / stats["target_forwards"])
        assert 0 <= stats["queue_seconds"] <= stats["latency_seconds"]
    assert [d["index"] for d in a["data"]] == [0, 1]


@pytest.mark.invariance
def test_first_index_answers_later_images_of_a_request_alone(client: TestClient) -> None:
    """``"first_index": i, "n": 1`` is image ``i`` of a request of more images, alone (its own
    stream), in plain and streamed answers, each item numbered by its image."""
    whole = client.post(GENERATE, json={"label": 3, "n": 4, "seed": 7, "return_codes": True}).json()["data"]
    some = client.post(GENERATE, json={"label": 3, "n": 2, "seed": 7, "first_index": 2, "return_codes": True})
    assert some.status_code == 200, some.text
    assert [(d["index"], d["codes"], d["b64_json"]) for d in some.json()["data"]] == [
        (d["index"], d["codes"], d["b64_json"]) for d in whole[2:]]
    assert whole[2]["codes"] != whole[0]["codes"]  # power: another stream is another image
    streamed = client.post(GENERATE, json={"label": 3, "seed": 7, "first_index": 3, "return_codes": True,
                                           "stream": True, "preview_every": 1})
    events = _events_of(streamed.text)
    assert {data["index"] for name, data in events if name in ("preview", "image")} == {3}
    assert [data["codes"] for name, data in events if name == "image"] == [whole[3]["codes"]]


def test_null_is_the_default_for_every_field(client: TestClient) -> None:
    """The docs: ``null`` means the default. It did for the settings, but ``"n": null`` and
    ``"seed": null`` were refused (a probe, 2026-11-29)."""
    nulls = {"n": None, "seed": None, "stream": None, "response_format": None, "method": None, "top_k": None}
    given, default = (client.post(GENERATE, json={"label": 3, "return_codes": True, **extra})
                      for extra in (nulls, {}))
    assert given.status_code == default.status_code == 200, given.text
    assert [d["codes"] for d in given.json()["data"]] == [d["codes"] for d in default.json()["data"]]
    assert len(given.json()["data"]) == 1  # n's default
    # lantern_k 0 (exact acceptance) is taken as the API takes it (it was refused: ge=1)
    exact = client.post(GENERATE, json={"label": 3, "method": "lantern", "lantern_k": 0, "return_codes": True})
    assert exact.status_code == 200 and exact.json()["settings"]["lantern_k"] == 0, exact.text


@pytest.mark.invariance
@pytest.mark.parametrize("method", ["ar", "lantern++"])
def test_a_method_gives_the_apis_codes(client: TestClient, pipe: lantern.Pipeline, method: str) -> None:
    body = {"label": 5, "seed": 3, "method": method, "return_codes": True, "temperature": 0.9}
    r = client.post(GENERATE, json=body)
    assert r.status_code == 200, r.text
    expected = pipe(labels=[5], num_per_label=1, seed=3, method=method, temperature=0.9)
    assert r.json()["data"][0]["codes"] == expected.codes[0].tolist()
    assert r.json()["settings"]["temperature"] == 0.9
    assert "codes" not in client.post(GENERATE, json={**body, "return_codes": False}).json()["data"][0]


@pytest.mark.invariance
@pytest.mark.parametrize("method", ["lantern", "sjd-pac", "pjd-lantern", "sjd-coupled-lantern-sv", "sjd-lantern"])
def test_the_answers_settings_sent_back_give_the_same_images(client: TestClient, method: str) -> None:
    """The answer's ``settings`` are the run's, and a request may send them back. Old behaviour (a
    probe, 2026-11-29): ``lantern_k`` read 1000 where the run used the table's 128 (sent back:
    400), the Jacobi and PJD methods reported the chain they verify as a ``tree`` (sent back: 400,
    they take none), and SJD-PAC its tree's internal name (400: unknown static tree); sjd,
    sjd-lantern(++) and the -sv methods said ``sjd_coupling: independent``, which they refuse (an
    audit, 2026-11-30)."""
    body = {"label": 2, "seed": 5, "method": method, "return_codes": True}
    first = client.post(GENERATE, json=body)
    assert first.status_code == 200, first.text
    settings = first.json()["settings"]
    again = client.post(GENERATE, json={**body, **settings})
    assert again.status_code == 200, again.text
    assert again.json()["data"][0]["codes"] == first.json()["data"][0]["codes"]
    assert again.json()["settings"] == settings
    assert ("tree" in settings) == (method == "lantern") and settings.get("lantern_k", 0) <= 128


# --------------------------------------------------------------------------------------------------
# Streaming
# --------------------------------------------------------------------------------------------------


def test_a_stream_sends_previews_then_the_image_then_done(client: TestClient) -> None:
    body = {"label": 3, "n": 2, "seed": 7, "return_codes": True}
    plain = client.post(GENERATE, json=body).json()
    r = client.post(GENERATE, json={**body, "stream": True, "preview_every": 1})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events_of(r.text)
    assert events[-1][0] == "done" and events[-1][1]["settings"] == plain["settings"]
    for index in (0, 1):
        mine = [(name, data) for name, data in events if data.get("index") == index]
        names = [name for name, _ in mine]
        assert names.count("image") == 1 and names[-1] == "image" and names.count("preview") >= 1, names
        done = [data["tokens_done"] for name, data in mine if name == "preview"]
        assert done == sorted(done) and 0 < done[0] and done[-1] <= 64
        assert _png(mine[0][1]["b64_json"]).size == (32, 32)  # a preview is a whole picture
        assert mine[-1][1]["codes"] == plain["data"][index]["codes"]


def test_a_stream_waits_on_events_not_on_a_timer(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing polls (docs/DESIGN.md): during a streamed request no coroutine sleeps on a timer, and
    the stream wakes once per batch of events from the decode thread (previews and finished images),
    never more often than the rounds that made them."""
    sleeps: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay: float, *args: Any, **kwargs: Any) -> Any:
        if delay > 0:
            sleeps.append(delay)
        return await real_sleep(delay, *args, **kwargs)

    wakeups = []
    real_next = TicketEvents.next

    async def counting_next(self: TicketEvents) -> Any:
        happened = await real_next(self)
        wakeups.append(len(happened))
        return happened

    monkeypatch.setattr(asyncio, "sleep", sleep)
    monkeypatch.setattr(TicketEvents, "next", counting_next)
    r = client.post(GENERATE, json={"label": 4, "seed": 2, "method": "ar", "stream": True, "preview_every": 8})
    assert r.status_code == 200 and _events_of(r.text)[-1][0] == "done", r.text
    assert sleeps == []
    assert 1 <= len(wakeups) <= 64 // 8 + 1 and sum(wakeups) <= 64 // 8 + 1  # 7 previews at most, then the image


def test_unknown_codes_of_a_preview_take_the_last_known_one() -> None:
    codes = torch.tensor([-1, -1, 5, 7, -1, -1, 9, -1])
    assert fill_unknown(codes).tolist() == [0, 0, 5, 7, 7, 7, 9, 9]


def test_a_preview_is_filled_on_the_codes_device() -> None:
    """The scheduler hands a preview the decode's codes on their device (CUDA on a GPU): every tensor
    fill_unknown makes must be made there (a meta tensor stands in for a CUDA one here)."""
    codes = torch.tensor([-1, -1, 5, 7, -1, -1, 9, -1], device="meta")
    filled = fill_unknown(codes)
    assert filled.device.type == "meta" and filled.shape == codes.shape


# --------------------------------------------------------------------------------------------------
# Health, methods, metrics, the page
# --------------------------------------------------------------------------------------------------


def test_health_and_the_methods_of_this_model(client: TestClient) -> None:
    assert client.get("/health").json() == {"status": "ok", "model": "digits", "kind": "c2i", "queue_depth": 0}
    methods = client.get("/v1/methods").json()
    names = [m["name"] for m in methods["methods"]]
    assert methods["default"] == "sjd-coupled" and {"ar", "lantern++", "sjd-coupled", "pjd"} <= set(names)
    assert [m["name"] for m in methods["methods"] if m["default"]] == ["sjd-coupled"]
    lossless = {m["name"] for m in methods["methods"] if m["lossless"]}
    assert {"ar", "sd", "sjd-coupled"} <= lossless and not {"lantern++", "pjd", "gsd"} & lossless
    assert client.get("/v1/model").json() == {"model": "digits", "kind": "c2i", "num_classes": 10,
                                              "image_tokens": 64, "max_images_per_request": 4,
                                              "max_prompt_chars": 50, "deterministic": True,
                                              "negative_prompt": None}


def test_a_model_without_drafter_or_table_offers_only_what_it_can_run() -> None:
    bare = SimpleNamespace(parts=SimpleNamespace(has_drafter=False, has_table=False))
    names = runnable_methods(bare)  # type: ignore[arg-type]
    assert {"ar", "sjd", "sjd-coupled", "gsd", "pjd", "sjd-pac", "sjd-sv", "sjd-coupled-sv", "gsd-sv"} == set(names)


def test_metrics_count_what_was_served(client: TestClient) -> None:
    before = _metrics(client.get("/metrics").text)
    assert client.post(GENERATE, json={"label": 2, "n": 2, "seed": 1}).status_code == 200
    assert client.post(GENERATE, json={"label": 99}).status_code == 400
    after = _metrics(client.get("/metrics").text)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta('lantern_requests_total{status="200"}') == 1
    assert delta('lantern_requests_total{status="400"}') == 1
    assert delta("lantern_images_total") == 2 and delta("lantern_tokens_total") == 128
    assert delta("lantern_request_latency_seconds_count") == 1
    assert delta('lantern_request_latency_seconds_bucket{le="+Inf"}') == 1
    assert after["lantern_request_latency_seconds_sum"] > before.get("lantern_request_latency_seconds_sum", 0)
    assert delta("lantern_rounds_total") > 0 and delta("lantern_forwards_total") >= 2
    assert 0 < delta("lantern_busy_row_rounds_total") <= delta("lantern_row_rounds_total")
    assert after["lantern_mean_tokens_per_forward"] >= 1 and after["lantern_tokens_per_second"] > 0
    assert 0 < after["lantern_batch_occupancy"] <= 1 and after["lantern_queue_depth"] == 0
    assert after["lantern_decode_threads"] == client.app.state.serve.scheduler.threads  # type: ignore[attr-defined]


def test_the_page_and_its_assets_are_served_without_a_cdn(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    for asset in ("/static/app.js", "/static/style.css"):
        assert asset in page.text and client.get(asset).status_code == 200
    for path in STATIC.iterdir():  # everything is lantern's own: no remote script, style or font
        assert not re.search(r"(src|href)=\"https?:|url\(https?:|https?://", path.read_text()), path
    assert client.get("/docs").status_code == 404  # Swagger UI would load from a CDN
    responses = client.get("/openapi.json").json()["paths"][GENERATE]["post"]["responses"]
    assert {"200", "400", "429", "503"} <= set(responses) and "422" not in responses  # refusals are 400s


# --------------------------------------------------------------------------------------------------
# A full queue, a stopping server, a client that leaves
# --------------------------------------------------------------------------------------------------


def test_a_method_the_route_does_not_take_is_405_with_its_allow_header(client: TestClient) -> None:
    """HTTP's rule for a 405 (it had none: the JSON error answer dropped Starlette's headers)."""
    r = client.put(GENERATE, json={"label": 1})
    assert r.status_code == 405 and r.json()["error"]["field"] is None, r.text
    assert r.headers["allow"] == "POST"
    r = client.delete("/health")
    assert r.status_code == 405 and set(r.headers["allow"].replace(" ", "").split(",")) == {"GET", "HEAD"}


def test_a_full_queue_answers_429_and_a_stopping_server_503(pipe: lantern.Pipeline) -> None:
    scheduler = Scheduler(pipe, max_batch=1, max_queue=1)  # never started: what is queued stays queued
    app = create_app(scheduler, pipeline=pipe, default_method="sjd-coupled")
    with TestClient(app) as c:
        held = scheduler.submit(scheduler.resolve(0, 0, "sjd-coupled"))  # the queue is full now
        r = c.post(GENERATE, json={"label": 1})
        assert r.status_code == 429 and r.json()["error"]["field"] is None, r.text
        assert "queue" in r.json()["error"]["message"] and r.headers["retry-after"] == "1"
        assert _metrics(c.get("/metrics").text)['lantern_requests_total{status="429"}'] == 1
        scheduler.shutdown(0.0)  # the held job is cancelled; new ones are refused
        assert held[0].future.exception(0) is not None
        assert c.post(GENERATE, json={"label": 1}).status_code == 503


def test_a_request_whose_client_left_cancels_its_tickets(pipe: lantern.Pipeline) -> None:
    """Waiting on tickets that never finish (the scheduler is not started): the request sees the
    client gone and cancels every ticket; an abandoned stream cancels its tickets too."""
    scheduler = Scheduler(pipe, max_batch=2, max_queue=8)
    app = create_app(scheduler, pipeline=pipe, default_method="ar")
    state = app.state.serve
    tickets = scheduler.submit(scheduler.resolve(1, 0, "ar", indices=range(2)))

    class Gone:
        """A request whose client has left: its next message is the disconnect."""

        async def receive(self) -> dict[str, str]:
            return {"type": "http.disconnect"}

    assert asyncio.run(wait_results(state, tickets, Gone())) is None  # type: ignore[arg-type]
    assert all(t.cancelled for t in tickets)

    request = scheduler.resolve(1, 0, "ar", indices=range(2), preview_every=1)

    async def first_event_then_leave() -> str:
        events = TicketEvents(asyncio.get_running_loop())
        streamed.extend(scheduler.submit(request, events.preview))
        events.watch(streamed)
        streamed[0].on_preview(streamed[0], torch.full((64,), -1))  # type: ignore[misc]  # as the decode thread would
        stream = image_events(state, request, streamed, events, False, time.perf_counter())
        first = await anext(stream)
        await stream.aclose()  # what Starlette does when the client disconnects
        return first

    streamed: list[Any] = []
    assert asyncio.run(first_event_then_leave()).startswith("event: preview")
    assert len(streamed) == 2 and all(t.cancelled for t in streamed)
    scheduler.shutdown(0.0)


def test_a_client_that_leaves_frees_its_rows_on_a_live_server(pipe: lantern.Pipeline,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Over real sockets: a plain request whose client times out, and a stream closed after its first
    preview; the scheduler drops both rows before their images finish. The decode thread runs a
    round only when the test lets it (digits' 64 AR rounds take a fifth of a second on a fast
    machine: they used to finish before the server saw the client go, and the test failed by luck)."""
    permits, free = threading.Semaphore(0), threading.Event()
    step = scheduler_module.Lane.step

    def gated(self: scheduler_module.Lane) -> None:
        if not free.is_set():
            assert permits.acquire(timeout=30), "the test never let this round run"
        step(self)

    monkeypatch.setattr(scheduler_module.Lane, "step", gated)
    scheduler = Scheduler(pipe, max_batch=2, max_queue=8)
    submitted: list[Any] = []  # every ticket the server queued, in order
    submit = scheduler.submit

    def recording(request: Any, on_preview: Any = None) -> list[Any]:
        tickets = submit(request, on_preview)
        submitted.extend(tickets)
        return tickets

    scheduler.submit = recording  # type: ignore[method-assign]
    scheduler.start()

    def wait_cancelled(count: int) -> None:
        """The server saw the client go: the request's ``count`` tickets are cancelled, whether they were
        still queued (a slow machine: the client's timeout came first) or running (then blocked at the gate)."""
        deadline = time.monotonic() + 20
        while not (len(submitted) == count and all(t.cancelled for t in submitted)):
            assert time.monotonic() < deadline, [(t.index, t.cancelled) for t in submitted]
            time.sleep(0.01)
        submitted.clear()

    app = create_app(scheduler, pipeline=pipe, default_method="ar")
    with served(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post(GENERATE, json={"label": 1, "n": 2}, timeout=0.3)
        wait_cancelled(2)
        free.set()
        for _ in range(4):  # the blocked step, then the rounds that drop the rows
            permits.release()
        deadline = time.monotonic() + 20
        while scheduler.metrics()["busy_rows"] or scheduler.metrics()["queue_depth"]:
            assert time.monotonic() < deadline, scheduler.metrics()
            time.sleep(0.01)
        free.clear()
        with http.stream("POST", GENERATE, json={"label": 2, "stream": True, "preview_every": 1}) as r:
            permits.release()  # one round: the first preview
            assert next(r.iter_lines()) == "event: preview"
        wait_cancelled(1)
        free.set()
        for _ in range(4):
            permits.release()
        deadline = time.monotonic() + 20
        while scheduler.metrics()["busy_rows"] or scheduler.metrics()["queue_depth"]:
            assert time.monotonic() < deadline, scheduler.metrics()
            time.sleep(0.05)
        assert scheduler.metrics()["images_total"] == 0  # no image of the three ran to its end
        assert _metrics(http.get("/metrics").text)['lantern_requests_total{status="499"}'] >= 1
    scheduler.shutdown(10)


def test_serving_needs_no_fastapi_to_import_lantern() -> None:
    """``import lantern`` (and the CLI, and the scheduler) never import the serve extra."""
    code = ("import sys, lantern, lantern.cli.main, lantern.serve.scheduler; "
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'starlette', 'httpx', 'selenium') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.strip() == "[]"
