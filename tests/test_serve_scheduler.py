"""The serving engine (lantern.serve.scheduler): continuous batching gives every image the codes
``lantern.load(...)(...)`` gives it; static batches, cancellation, a full queue, shutdown and a
failing request behave as documented."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

import lantern
from lantern import api as api_module
from lantern.decoding import compiling
from lantern.errors import LanternError
from lantern.serve import scheduler as scheduler_module
from lantern.serve.scheduler import Cancelled, QueueFull, Scheduler, Ticket, batch_conditions
from lantern.targets.base import Conditions


@pytest.fixture(scope="module")
def pipe() -> lantern.Pipeline:
    return lantern.load("digits", deterministic=True)  # codes equal alone and in any batch, on any CPU


def _submit(sched: Scheduler, condition: int | str, seed: int, method: str, indices: Sequence[int] = (0,),
            **settings: Any) -> list[Ticket]:
    """Images ``indices`` of one request, resolved once and queued."""
    return sched.submit(sched.resolve(condition, seed, method, settings, indices))


def _expected(pipe: lantern.Pipeline, ticket: Ticket, n: int) -> torch.Tensor:
    """Image ``ticket.index`` of the same request through the Python API."""
    r = ticket.request
    out = pipe(labels=[r.condition], num_per_label=n, seed=r.seed, method=r.method, **dict(r.settings))
    return out.codes[ticket.index]


@pytest.mark.invariance
@pytest.mark.parametrize("method", ["ar", "lantern++", "sjd-coupled"])
def test_rows_join_a_running_batch_and_keep_their_codes(pipe: lantern.Pipeline, method: str) -> None:
    """Two images start; after three rounds two more join the same batch (it grows from 2 to 4 rows)
    while the first two run on; a fifth waits for a free row. Each equals the API's image."""
    sched = Scheduler(pipe, max_batch=4)
    first = _submit(sched, 2, 11, method, (0, 1))
    with torch.inference_mode():
        sched._admit()
        lane = sched._lane(first[0].request)
        for _ in range(3):
            sched._step(lane)
        assert lane.busy == 2 and not any(t.future.done() for t in first)
        later = _submit(sched, 7, 5, method, (0, 1, 2))
        sched._admit()
    assert lane.decode is not None and lane.decode.batch == 4 and lane.busy == 4  # joined mid-batch
    assert len(sched._queue) == 1  # the fifth waits for a row
    sched.run_until_idle()
    for t in first:
        assert torch.equal(t.future.result(0).codes, _expected(pipe, t, 2))
    for t in later:
        assert torch.equal(t.future.result(0).codes, _expected(pipe, t, 3))
    assert first[0].future.result(0).queue_seconds < later[0].future.result(0).latency_seconds
    m = sched.metrics()
    assert m["images_total"] == 5 and m["tokens_total"] == 5 * pipe.stack.num_tokens
    assert 0 < m["batch_occupancy"] <= 1 and m["queue_depth"] == 0


@pytest.mark.invariance
def test_settings_decode_in_their_own_batch_and_match_the_api(pipe: lantern.Pipeline) -> None:
    sched = Scheduler(pipe, max_batch=2)
    tickets = [*_submit(sched, 4, 3, "lantern++", temperature=0.7, top_k=20), *_submit(sched, 4, 3, "lantern++")]
    sched.run_until_idle()
    a, b = (t.future.result(0).codes for t in tickets)
    assert torch.equal(a, _expected(pipe, tickets[0], 1)) and torch.equal(b, _expected(pipe, tickets[1], 1))
    assert not torch.equal(a, b)  # power: the settings reached the decode
    assert len(sched._lanes) == 2


@pytest.mark.invariance
def test_lanes_together_decode_at_most_max_batch_rows(pipe: lantern.Pipeline) -> None:
    """Requests of other settings open other lanes; all lanes together decode at most ``max_batch``
    rows, the rest wait in the queue in order. Old behaviour (a probe, 2026-11-29): every lane took
    rows at once, so 24 clients with settings of their own had 192 rows decoding at ``max_batch`` 8
    and every request slowed 45-fold. Here the old code peaks at 6 rows."""
    sched = Scheduler(pipe, max_batch=2)
    tickets = [t for i in range(3) for t in _submit(sched, 1, i, "ar", (0, 1), temperature=0.6 + 0.1 * i)]
    peak, first_admitted = 0, None
    with torch.inference_mode():
        while sched._queue or sched._busy_lanes():
            sched._admit()
            busy = sum(lane.busy for lane in sched._lanes.values())
            peak = max(peak, busy)
            if first_admitted is None:
                first_admitted = [t for t in tickets if t not in sched._queue]
            for lane in sched._busy_lanes():
                sched._step(lane)
    assert peak == 2 and first_admitted == tickets[:2]  # the first request's two images, in queue order
    for t in tickets:
        assert torch.equal(t.future.result(0).codes, _expected(pipe, t, 2))


def test_static_batches_take_no_job_while_running(pipe: lantern.Pipeline) -> None:
    sched = Scheduler(pipe, max_batch=4, continuous=False)
    first = _submit(sched, 1, 0, "ar")
    with torch.inference_mode():
        sched._admit()
        lane = sched._lane(first[0].request)
        sched._step(lane)
        _submit(sched, 1, 0, "ar", (1,))
        sched._admit()
    assert lane.busy == 1 and len(sched._queue) == 1 and lane.capacity_for_new() == 0
    sched.run_until_idle()
    assert torch.equal(first[0].future.result(0).codes, _expected(pipe, first[0], 1))


def test_cancel_frees_the_row_and_fails_the_future(pipe: lantern.Pipeline) -> None:
    sched = Scheduler(pipe, max_batch=2)
    keep, gone = _submit(sched, 1, 0, "ar", (0, 1))
    with torch.inference_mode():
        sched._admit()
        lane = sched._lane(keep.request)
        sched._step(lane)
        gone.cancel()
        sched._step(lane)
    assert lane.busy == 1 and lane.decode is not None and lane.decode.batch == 1  # freed, then the batch shrank
    with pytest.raises(Cancelled):
        gone.future.result(0)
    sched.run_until_idle()
    assert torch.equal(keep.future.result(0).codes, _expected(pipe, keep, 2))


def test_full_queue_refuses_at_once_and_bad_requests_are_refused_when_resolved(pipe: lantern.Pipeline) -> None:
    """A full queue refuses at once; a bad label or setting is refused where the request is resolved,
    naming its field, before anything is queued; a request that fails in its round fails alone."""
    sched = Scheduler(pipe, max_batch=1, max_queue=2)
    (ok,) = _submit(sched, 1, 0, "ar")
    with pytest.raises(LanternError, match="99") as bad_label:  # digits has 10 classes
        sched.resolve(99, 0, "ar")
    assert bad_label.value.field == "label"
    with pytest.raises(LanternError, match="must be one of") as bad_method:
        sched.resolve(1, 0, "nope")
    assert bad_method.value.field == "method"
    with pytest.raises(LanternError, match="delta must be in") as bad_delta:
        sched.resolve(1, 0, "lantern", {"lantern_delta": -1.0})
    assert bad_delta.value.field == "lantern_delta"
    (failing,) = _submit(sched, 2, 0, "ar")
    t0 = time.perf_counter()
    with pytest.raises(QueueFull, match="queue is full"):
        _submit(sched, 1, 0, "ar", (1,))
    assert time.perf_counter() - t0 < 1.0
    assert len(sched._queue) == 2
    # The second request's prefill fails (a broken condition): it fails alone, the server goes on.
    object.__setattr__(failing.request, "conditions", Conditions(torch.tensor([99])))
    sched.run_until_idle()
    assert torch.equal(ok.future.result(0).codes, _expected(pipe, ok, 1))
    with pytest.raises(LanternError):
        failing.future.result(0)
    later = _submit(sched, 2, 0, "ar")  # the server goes on
    sched.run_until_idle()
    assert torch.equal(later[0].future.result(0).codes, _expected(pipe, later[0], 1))


def test_threaded_server_shuts_down_finishing_running_jobs(pipe: lantern.Pipeline) -> None:
    sched = Scheduler(pipe, max_batch=2)
    sched.start()
    tickets = _submit(sched, 3, 1, "sjd-coupled", range(3))
    sched.shutdown(timeout=60.0)
    for t in tickets:
        assert torch.equal(t.future.result(0).codes, _expected(pipe, t, 3))
    with pytest.raises(LanternError, match="shutting down"):
        _submit(sched, 3, 1, "ar")
    results = concurrent.futures.wait([t.future for t in tickets], timeout=0)
    assert not results.not_done


def test_compiled_server_compiles_at_warm_up_only(pipe: lantern.Pipeline, eager_backend: list[int]) -> None:
    """With --compile, warm-up compiles every batch size; then rows joining a running batch, the
    batch growing and shrinking, compile nothing (dynamo's eager backend: guards as in a real
    compile), and the codes equal the eager API's."""
    compiled = lantern.load("digits", compile="default")
    sched = Scheduler(compiled, max_batch=2)
    sched.warm_up(["lantern++"], 0)
    graphs, copies = counters["stats"]["unique_graphs"], len(compiling._rounds)
    assert graphs > 0
    first = _submit(sched, 3, 4, "lantern++")
    deadline = time.perf_counter() + 60
    while first[0].rounds < 2 and time.perf_counter() < deadline:  # the decode thread runs it
        time.sleep(0.001)
    later = _submit(sched, 5, 4, "lantern++", (1,))
    a, b = first[0].future.result(60), later[0].future.result(60)
    sched.shutdown(10)
    assert later[0].started < first[0].submitted + a.latency_seconds  # it joined while the first ran
    assert counters["stats"]["unique_graphs"] == graphs and len(compiling._rounds) == copies
    assert torch.equal(a.codes, _expected(pipe, first[0], 1))
    assert torch.equal(b.codes, _expected(pipe, later[0], 2))


def test_a_compiled_server_runs_settings_it_did_not_warm_up_eagerly(pipe: lantern.Pipeline,
                                                                    eager_backend: list[int]) -> None:
    """After a warm-up of lantern++, a request for another method or another tree would compile on
    the decode thread, holding every other request for seconds to minutes: it runs eagerly instead
    (no graph is made; the codes are the eager API's), and the warmed method stays compiled.
    Power: the same server without a warm-up compiles what a request asks for."""
    compiled = lantern.load("digits", compile="default")
    sched = Scheduler(compiled, max_batch=2)
    sched.warm_up(["lantern++"], 0)
    graphs, copies = counters["stats"]["unique_graphs"], len(compiling._rounds)
    others = [*_submit(sched, 3, 4, "sjd-coupled"), *_submit(sched, 5, 1, "lantern++", tree="chain:5")]
    warmed = _submit(sched, 2, 6, "lantern++")
    sched.start()
    for t in (*others, *warmed):
        t.future.result(120)
    sched.shutdown(10)
    assert counters["stats"]["unique_graphs"] == graphs and len(compiling._rounds) == copies
    assert [t.request.prepared.compile for t in (*others, *warmed)] == [None, None, "default"]
    for t in (*others, *warmed):
        assert torch.equal(t.future.result(0).codes, _expected(pipe, t, 1))
    cold = Scheduler(compiled, max_batch=2)
    request = cold.resolve(3, 4, "sjd-coupled")
    assert request.prepared.compile == "default"
    cold.submit(request)
    cold.run_until_idle()
    assert len(compiling._rounds) > copies
    both = Scheduler(compiled, max_batch=2)  # --warm-up-methods: more methods compiled at start-up
    both.warm_up(["lantern++", "sjd-coupled"], 0)
    assert both.resolve(3, 4, "sjd-coupled").prepared.compile == "default"
    assert both.resolve(3, 4, "sjd").prepared.compile is None
    both.shutdown(10)


def test_lanes_and_loaded_methods_stay_bounded(pipe: lantern.Pipeline, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client sending ever new settings cannot grow the server's memory: idle lanes and loaded
    methods past their caps are dropped, least recently used first; the images stay right."""
    monkeypatch.setattr(scheduler_module, "MAX_LANES", 2)
    monkeypatch.setattr(api_module, "MAX_PREPARED", 3)  # the pipeline keeps the prepared methods
    sched = Scheduler(pipe, max_batch=1)
    tickets = [t for i in range(5) for t in _submit(sched, 1, 0, "ar", temperature=0.5 + 0.1 * i)]
    sched.run_until_idle()
    assert len(sched._lanes) <= 2 and len(pipe._prepared) <= 3
    assert list(sched._lanes)[-1] == tickets[-1].request.key  # the most recent stays
    for t in tickets:
        assert torch.equal(t.future.result(0).codes, _expected(pipe, t, 1))


def test_a_text_model_loads_its_prompt_encoder_once(t2i_stack: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of a text-to-image model join one by one: the T5 encoder is loaded once, not per join,
    and the images are the API's."""
    from lantern.targets import text

    loads = []
    real = text.load_t5
    monkeypatch.setattr(text, "load_t5", lambda *a, **k: loads.append(a) or real(*a, **k))
    text_pipe = lantern.load(t2i_stack)
    sched = Scheduler(text_pipe, max_batch=2)
    first = _submit(sched, "a red car", 4, "sjd-coupled")
    with torch.inference_mode():
        sched._admit()
        lane = sched._lane(first[0].request)
        sched._step(lane)
        later = _submit(sched, "a blue boat", 4, "sjd-coupled", (1,))
        sched._admit()
        assert lane.busy == 2  # joined the running batch
    sched.run_until_idle()
    assert len(loads) == 1
    monkeypatch.setattr(text, "load_t5", real)
    for t, prompt in ((first[0], "a red car"), (later[0], "a blue boat")):
        expected = text_pipe(prompts=[prompt], num_per_label=2, seed=4, method="sjd-coupled").codes[t.index]
        assert torch.equal(t.future.result(0).codes, expected)


def test_a_method_whose_rows_cannot_move_runs_static_batches(pipe: lantern.Pipeline) -> None:
    """PJD's grid drafter lists no row state: its lane takes new jobs only between batches, and
    each batch is exactly its jobs (no placeholder rows); the images are the API's."""
    sched = Scheduler(pipe, max_batch=4)
    first = _submit(sched, 2, 1, "pjd", range(3))
    with torch.inference_mode():
        sched._admit()
        lane = sched._lane(first[0].request)
        assert not lane.continuous and lane.decode is not None and lane.decode.batch == 3
        sched._step(lane)
        later = _submit(sched, 2, 1, "pjd", (3,))
        sched._admit()
        assert lane.busy == 3 and len(sched._queue) == 1
    sched.run_until_idle()
    for t in [*first, *later]:
        assert torch.equal(t.future.result(0).codes, _expected(pipe, t, 4))


def test_a_compiled_static_lane_warms_every_batch_size(pipe: lantern.Pipeline, eager_backend: list[int]) -> None:
    """PJD's lane runs static batches of exactly its jobs, so warm-up compiles every size up to
    max_batch (not only the powers of two 1 and 2), and a batch of 3 then compiles nothing."""
    compiled = lantern.load("digits", compile="default")
    sched = Scheduler(compiled, max_batch=3)
    sched.warm_up(["pjd"], 0)
    graphs, copies = counters["stats"]["unique_graphs"], len(compiling._rounds)
    tickets = _submit(sched, 4, 2, "pjd", range(3))
    results = [t.future.result(120) for t in tickets]
    sched.shutdown(10)
    assert counters["stats"]["unique_graphs"] == graphs and len(compiling._rounds) == copies
    for t, r in zip(tickets, results, strict=True):
        assert torch.equal(r.codes, _expected(pipe, t, 3))


def test_a_text_model_encodes_prompts_where_requests_resolve_not_on_the_decode_thread(
        t2i_stack: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """T5 runs when a request is resolved (the request's worker thread); the decode thread only
    decodes: no encoder call, and no other condition encoding, happens on it."""
    from lantern.targets import text

    threads: list[str] = []
    real = text.T5Encoder.encode

    def encode(self: Any, *a: Any, **k: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(self, *a, **k)

    monkeypatch.setattr(text.T5Encoder, "encode", encode)
    text_pipe = lantern.load(t2i_stack)
    captions: list[str] = []  # captions made into conditions (the device copy), thread by thread
    from_captions = text_pipe.stack.from_captions
    monkeypatch.setattr(text_pipe.stack, "from_captions",
                        lambda c: captions.append(threading.current_thread().name) or from_captions(c))
    sched = Scheduler(text_pipe, max_batch=2)
    sched.start()
    tickets = [*_submit(sched, "a red car", 4, "sjd-coupled"), *_submit(sched, "a blue boat", 4, "sjd-coupled", (1,))]
    results = [t.future.result(120) for t in tickets]
    sched.shutdown(10)
    assert threads == ["MainThread", "MainThread"]  # once per request, in the resolving thread
    assert captions == ["MainThread", "MainThread"]
    for t, r, prompt in zip(tickets, results, ("a red car", "a blue boat"), strict=True):
        expected = text_pipe(prompts=[prompt], num_per_label=2, seed=4, method="sjd-coupled").codes[t.index]
        assert torch.equal(r.codes, expected)


def test_conditions_encoded_per_request_batch_as_one_encoding_would() -> None:
    """Prompts of different lengths (Chameleon's token ids) are left-padded to the longest, mask
    False there, as ``Stack.encode`` pads a batch; labels are concatenated."""
    short = Conditions(torch.tensor([[7, 8]]), torch.tensor([[True, True]]))
    long = Conditions(torch.tensor([[1, 2, 3]]), torch.tensor([[True, True, True]]))
    both = batch_conditions([short, long])
    assert both.cond.tolist() == [[0, 7, 8], [1, 2, 3]]
    assert both.mask is not None and both.mask.tolist() == [[False, True, True], [True, True, True]]
    captions = Conditions(torch.ones(1, 3, 2), torch.tensor([[False, True, True]]))
    assert batch_conditions([captions, captions]).cond.shape == (2, 3, 2)
    assert batch_conditions([Conditions(torch.tensor([3])), Conditions(torch.tensor([4]))]).cond.tolist() == [3, 4]


def test_the_decode_thread_keeps_its_threads_whatever_other_threads_set(pipe: lantern.Pipeline,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """torch sets a thread's intra-op count from the process-wide one at the thread's first op, and
    every set_num_threads writes that one: a decode thread that set 2 and then waited for work once
    decoded on 1 when a web worker called side_thread() meanwhile (its 1 won at the first op)."""
    import threading

    seen: list[int] = []
    step = scheduler_module.Lane.step

    def spy(lane: scheduler_module.Lane) -> None:
        seen.append(torch.get_num_threads())
        step(lane)

    monkeypatch.setattr(scheduler_module.Lane, "step", spy)
    fixed_way = scheduler_module.own_threads

    def plain(threads: int) -> None:  # what the decode thread did before: set, with no read first
        torch.set_num_threads(threads)

    for fixed in (True, False):  # the fix, then (power) the old way
        decode_thread_set = threading.Event()

        def own(threads: int, way: Any = fixed_way if fixed else plain,
                done: threading.Event = decode_thread_set) -> None:
            way(threads)
            if threading.current_thread().name == "lantern-decode":
                done.set()

        monkeypatch.setattr(scheduler_module, "own_threads", own)
        seen.clear()
        sched = Scheduler(pipe, max_batch=2, threads=2)
        sched.start()
        assert decode_thread_set.wait(60)  # the decode thread has set its count; it waits for work
        worker = threading.Thread(target=scheduler_module.side_thread)  # then a web worker's first call
        worker.start()
        worker.join()
        tickets = _submit(sched, 3, 1, "ar")
        sched.shutdown(timeout=60.0)
        assert tickets[0].future.result(0) is not None
        assert set(seen) == ({2} if fixed else {1}), (fixed, seen)
        assert sched.metrics()["decode_threads"] == 2  # what the scheduler set (the old way: not what ran)


@pytest.mark.parametrize("method", ["ar", "sjd-coupled"])
def test_a_pipeline_call_between_rounds_leaves_a_lanes_batch_alone(method: str) -> None:
    """A process that embeds a scheduler may call its pipeline too: a lane decodes on caches of its
    own, so a ``pipe(...)`` of the same method and batch size, run between two of the lane's rounds,
    leaves the lane's image as it would have been (they shared the prepared method's caches)."""
    pipe = lantern.load("digits", deterministic=True)  # its own: the pool starts empty
    sched = Scheduler(pipe, max_batch=1)
    expected = pipe(labels=[3], seed=1, method=method).codes[0]
    other = pipe(labels=[7], seed=2, method=method).codes
    tickets = _submit(sched, 3, 1, method)
    with torch.inference_mode():
        for _ in range(3):
            sched._cycle()  # the lane's prefill and its first rounds
    assert not tickets[0].future.done()
    assert torch.equal(pipe(labels=[7], seed=2, method=method).codes, other)  # the call between rounds
    sched.run_until_idle()
    assert torch.equal(tickets[0].future.result(0).codes, expected)
