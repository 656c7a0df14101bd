"""The busy-machine watch (``lantern.machine``): what other processes took while a command timed
its methods, and the warning demo / bench / profile (its --trace too) print and record when it was too
much."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import needs_libgomp, threads_left_by

from lantern import machine
from lantern.cli.main import main
from lantern.eval.bench import QUALITY_SETTINGS
from lantern.machine import BUSY_SHARE, MachineLoad, Reading, read_machine


def reading(wall: float, machine_cpu: float | None, own_cpu: float, load1: float = 0.5) -> Reading:
    return Reading(wall=wall, load1=load1, cpus=2, machine_cpu=machine_cpu, own_cpu=own_cpu)


def test_others_share_is_machine_cpu_minus_our_own() -> None:
    # 10 s on 2 cores: all processes 17 CPU-s, this one 12 => others 5 of 20 = 0.25 (not busy: > is busy)
    load = MachineLoad(reading(100.0, 1000.0, 3.0), reading(110.0, 1017.0, 15.0))
    assert load.others_share == pytest.approx(0.25) and not load.busy and load.warning() is None
    busier = MachineLoad(reading(100.0, 1000.0, 3.0), reading(110.0, 1018.0, 15.0))  # others 6 / 20
    assert busier.others_share == pytest.approx(0.30) and busier.busy
    assert busier.warning() == ("WARNING: busy machine (other processes used 30% of the 2 cores while timing): "
                                "speed-ups measured now can be far off; rerun on a quiet machine")
    assert busier.to_dict() == {"cpus": 2, "load1_start": 0.5, "load1_end": 0.5, "others_share": 0.3, "busy": True}


def test_without_proc_stat_the_load_average_decides() -> None:
    quiet = MachineLoad(reading(0.0, None, 0.0, load1=1.5), reading(5.0, None, 4.0, load1=2.5))
    assert quiet.others_share is None and not quiet.busy  # our own 2 threads make a load of ~2
    busy = MachineLoad(reading(0.0, None, 0.0, load1=3.1), reading(5.0, None, 4.0, load1=4.0))
    assert busy.busy and "load average 3.1 -> 4.0 on 2 cores" in str(busy.warning())


def test_a_real_reading_sees_our_own_work() -> None:
    start = read_machine()
    x = 0
    for i in range(3_000_000):  # ~0.2 s of this process's CPU
        x += i
    end = read_machine()
    assert start.cpus >= 1 and start.machine_cpu is not None and end.machine_cpu is not None
    assert end.own_cpu > start.own_cpu and end.machine_cpu >= start.machine_cpu
    # what all processes spent includes ours (up to the clock ticks' rounding, 10 ms per reading)
    assert (end.machine_cpu - start.machine_cpu) >= (end.own_cpu - start.own_cpu) - 0.05


def test_tests_never_read_the_real_load() -> None:
    """conftest's ``_quiet_machine``: with another process spinning on a core, what a command under
    test watches is still a quiet machine (the real reading would call this busy on 2 cores)."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with machine.watch_load() as watch:
            time.sleep(0.5)
    finally:
        spinner.kill()
        spinner.wait()
    assert watch.result is not None
    assert watch.result.others_share == 0.0 and not watch.result.busy and watch.result.warning() is None


def fake_readings(monkeypatch: pytest.MonkeyPatch, others_per_second: float) -> None:
    """Every reading advances 10 s; other processes spend ``others_per_second`` CPU-s per second."""
    state = {"t": 0.0}

    def fake() -> Reading:
        state["t"] += 10.0
        t = state["t"]
        return reading(t, 1000.0 + others_per_second * t, 0.0)

    monkeypatch.setattr(machine, "read_machine", fake)


@pytest.fixture
def mpl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path / "mpl"))
    yield


BENCH = ["bench", "--model", "digits", "--methods", "ar", "--no-quality", "--speed-images", "1",
         "--curve-images", "0", "--no-progress", "--dtype", "float32"]


@pytest.mark.slow
@pytest.mark.parametrize("others", [1.5, 0.1], ids=["busy", "quiet"])
def test_bench_warns_on_a_busy_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mpl: None,
                                       capsys: pytest.CaptureFixture[str], others: float) -> None:
    fake_readings(monkeypatch, others)  # 1.5 of 2 cores: 75 % of the machine; 0.1: 5 %
    assert main([*BENCH, "--out", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    run = json.loads((tmp_path / "b" / "run.json").read_text())
    md = (tmp_path / "b" / "bench.md").read_text()
    assert run["machine_load"]["others_share"] == pytest.approx(others / 2)
    busy = others / 2 > BUSY_SHARE
    assert run["machine_load"]["busy"] is busy
    assert ("WARNING: busy machine (other processes used 75% of the 2 cores" in out) is busy
    assert ("**WARNING: busy machine" in md) is busy
    assert (run["busy_warning"] is not None) is busy
    assert "| no quality (the rows describe the timed images), speed on 1 at batch 1 |" in out  # not "200 images"
    # run.json records the settings this run used: no quality pass, so none of its settings
    assert not set(QUALITY_SETTINGS) & set(run["config"]) and run["config"]["speed_images"] == 1


@pytest.mark.slow
def test_demo_warns_on_a_busy_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    fake_readings(monkeypatch, 2.0)
    assert main(["demo", "--model", "digits", "--methods", "ar,sjd", "--num-images", "1", "--no-progress",
                 "--out", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert "WARNING: busy machine (other processes used 100% of the 2 cores" in out
    assert json.loads((tmp_path / "d" / "demo.json").read_text())["machine_load"]["busy"] is True


@pytest.fixture(scope="module")
def tiny_stack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lantern.testing import make_random_stack

    return make_random_stack(tmp_path_factory.mktemp("stack") / "random", seed=3, grid=4, vocab=64)


@pytest.mark.parametrize("others", [1.5, 0.1], ids=["busy", "quiet"])
def test_profile_trace_warns_on_a_busy_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_stack: Path,
                                               capsys: pytest.CaptureFixture[str], others: float) -> None:
    """``lantern profile --trace`` watches the machine like demo / bench / profile: ``machine_load``
    and ``busy_warning`` in trace.json, the warning printed and atop trace.md only when busy."""
    fake_readings(monkeypatch, others)  # 1.5 of 2 cores: 75 % of the machine; 0.1: 5 %
    out = tmp_path / "t"
    assert main(["profile", "--model", str(tiny_stack), "--trace", "ar", "--trace-images", "1", "--no-progress",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    trace = json.loads((out / "trace.json").read_text())
    md = (out / "trace.md").read_text()
    busy = others / 2 > BUSY_SHARE
    assert trace["machine_load"] == {"cpus": 2, "load1_start": 0.5, "load1_end": 0.5,
                                     "others_share": pytest.approx(others / 2), "busy": busy}
    assert [m["method"] for m in trace["methods"]] == ["ar"]  # the trace itself is still there
    # what made it (a probe, 2026-11-30: no command or versions, and dtype written "torch.float32")
    command = f"lantern profile --model {tiny_stack} --trace ar --trace-images 1 --no-progress --out {out}"
    assert trace["command"] == command and trace["dtype"] in ("float32", "bfloat16")
    assert {"lantern", "torch", "date"} <= set(trace)
    assert md.rstrip("\n").endswith(f"`{command}` (lantern {trace['lantern']}, torch {trace['torch']}, "
                                     f"{trace['date']})")
    if busy:
        warning = ("WARNING: busy machine (other processes used 75% of the 2 cores while timing): "
                   "speed-ups measured now can be far off; rerun on a quiet machine")
        assert trace["busy_warning"] == warning
        assert warning in printed and md.startswith(f"**{warning}**\n\n| method |")
    else:
        assert trace["busy_warning"] is None
        assert "WARNING" not in printed and "WARNING" not in md and md.startswith("| method |")


# -- --threads: an OpenMP team no larger than the cores other processes leave free ---------------


@pytest.mark.parametrize(("busy", "cpus", "threads", "expected"), [
    (0.0, 2, 2, 2), (0.4, 2, 2, 2), (0.6, 2, 2, 1), (1.0, 2, 2, 1), (2.0, 2, 2, 1),  # at least one
    (1.0, 8, 4, 4), (3.2, 8, 8, 5), (5.6, 8, 8, 2), (0.0, 8, 1, 1),  # never more than torch's own
])
def test_threads_beside_other_processes(busy: float, cpus: int, threads: int, expected: int) -> None:
    assert machine.threads_beside(busy, cpus, threads) == expected


def test_busy_cores_sees_a_spinning_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real reading (conftest fakes an idle machine for every other test): a process spinning on
    one core is at least most of a core busy (more if other tests run beside this one)."""
    monkeypatch.setattr(machine, "read_machine", read_machine)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # past the interpreter's start-up
        seen = machine.busy_cores(0.5)
    finally:
        spinner.kill()
        spinner.wait()
    assert seen is not None
    busy, cpus = seen
    assert cpus == (os.cpu_count() or 1) and 0.7 <= busy <= cpus + 0.1


def test_busy_cores_counts_from_an_earlier_reading_without_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    """``since`` (the command line's reading from before torch's import): the window is the time
    since then, so nothing is waited once it is a quarter second long, and a spinning process
    is still seen; a shorter one is waited out to the quarter second, no more."""
    monkeypatch.setattr(machine, "read_machine", read_machine)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # past the interpreter's start-up
        since = machine.read_machine()
        time.sleep(0.4)
        slept: list[float] = []
        monkeypatch.setattr(machine.time, "sleep", slept.append)
        seen = machine.busy_cores(0.25, since=since)
        assert slept == []
        machine.busy_cores(0.25, since=machine.read_machine())
        assert len(slept) == 1 and 0 < slept[0] <= 0.25  # the rest of the quarter second (less on a busy machine)
    finally:
        spinner.kill()
        spinner.wait()
    assert seen is not None and 0.7 <= seen[0] <= seen[1] + 0.1


def test_choose_threads(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from lantern.cli.common import choose_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # conftest sets 1 for the tests' subprocesses
    monkeypatch.setattr(machine, "busy_cores", lambda window=0.25, since=None: (1.0, 2))
    assert choose_threads(2, "cpu", 1) == 2 and choose_threads(1, "cpu", 2) == 1  # a number is taken as given
    assert capsys.readouterr().err == ""
    assert choose_threads("auto", "cpu", 2) == 1  # one of 2 cores busy: one thread, said in one line
    assert capsys.readouterr().err == ("lantern: other processes keep 1.0 of the 2 cores busy: running on 1 thread, "
                                       "not 2 (a thread on a busy core stalls every op); --threads 2 uses them all\n")
    assert choose_threads("auto", "cuda", 2) == 2 and choose_threads("auto", "cuda:1", 2) == 2  # the GPU computes
    monkeypatch.setattr(machine, "busy_cores", lambda window=0.25, since=None: (0.2, 2))
    assert choose_threads("auto", "cpu", 2) == 2  # quiet enough: torch's own count, nothing said
    monkeypatch.setattr(machine, "busy_cores", lambda window=0.25, since=None: None)
    assert choose_threads("auto", "cpu", 2) == 2  # no /proc/stat: nothing to go on
    assert capsys.readouterr().err == ""

    def unread(window: float = 0.25, since: object = None) -> None:
        raise AssertionError("one thread has nothing to lower: the machine is not read")

    monkeypatch.setattr(machine, "busy_cores", unread)
    assert choose_threads("auto", "cpu", 1) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's own choice of count stands
    assert choose_threads("auto", "cpu", 2) == 2


@pytest.mark.parametrize(("flag", "expected"), [("auto", 1), ("2", 2), ("1", 1)])
def test_a_command_runs_on_its_threads_and_gives_them_back(flag: str, expected: int, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``--threads`` holds while the command runs (auto: one of 2 cores busy -> 1) and torch's count
    is what it was after (main() may run inside another program)."""
    import torch

    import lantern.cli.generate as generate

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(machine, "busy_cores", lambda window=0.25, since=None: (1.0, 2))
    seen: list[int] = []
    monkeypatch.setattr(generate, "cmd_generate", lambda args: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert main(["generate", "--model", "photos", "--labels", "1", "--out", str(tmp_path / "g"),
                     "--threads", flag]) == 0
        assert seen == [expected] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_bad_threads_are_refused_in_one_line(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", "photos", "--labels", "1", "--out", "x", "--threads", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == (f"lantern generate: error: argument --threads: expected 'auto' or a whole number of threads >= 1, "
                   f"got {value!r} (see lantern generate --help)\n")


def test_adaptive_threads_follow_other_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve --threads auto``: every 10 s of readings, the count for the next stretch is what
    the cores others left free allow, down and back up; nothing is applied when nothing changed,
    between looks, or without /proc/stat."""
    readings: list[Reading] = []

    def at(t: float, others: float, own: float = 0.0, known: bool = True) -> None:
        readings.append(reading(t, 1000.0 + others + own if known else None, own))

    at(0.0, 0.0)
    at(5.0, 4.0)  # not 10 s yet: no look
    at(10.0, 10.0)  # others kept 1 of 2 cores busy since t=0 -> 1 thread
    at(20.0, 10.0, own=20.0)  # only our own work since: back to 2
    at(30.0, 10.0, own=40.0)  # unchanged: nothing applied
    at(40.0, 0.0, known=False)  # no /proc/stat: keep what we have
    monkeypatch.setattr(machine, "read_machine", lambda: readings.pop(0))
    monkeypatch.setattr(machine, "_seconds", lambda: float("inf"))  # the readings' clock decides
    applied: list[int] = []
    adapt = machine.AdaptiveThreads(2, applied.append)
    assert [adapt.check() for _ in range(5)] == [None, 1, 2, None, None]
    assert applied == [1, 2] and adapt.threads == 2


def test_a_server_on_auto_threads_follows_the_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler's decode thread looks at round boundaries: with other processes keeping one of
    2 cores busy it decodes on one thread, and its images are the API's."""
    import itertools

    import torch

    import lantern
    from lantern.serve.scheduler import Scheduler

    looks = itertools.count()

    def busy_one_core() -> Reading:  # every reading 10 s after the last (every look decides); others 1 CPU-s / s
        t = 10.0 * next(looks)
        return reading(t, 1000.0 + t, 0.0)

    monkeypatch.setattr(machine, "read_machine", busy_one_core)
    monkeypatch.setattr(machine, "_seconds", lambda: float("inf"))  # the readings' clock decides
    seen: list[int] = []
    set_threads = Scheduler._set_threads

    def spy(self: Scheduler, threads: int) -> None:
        seen.append(threads)
        set_threads(self, threads)

    monkeypatch.setattr(Scheduler, "_set_threads", spy)
    pipe = lantern.load("digits", deterministic=True)
    sched = Scheduler(pipe, max_batch=2, threads=2, adapt_threads=True)
    assert sched.metrics()["decode_threads"] == 0  # not started
    sched.start()
    tickets = sched.submit(sched.resolve(3, 1, "ar", {}, (0,)))
    sched.shutdown(timeout=60.0)
    assert seen[:1] == [1]  # others took 1 CPU-s per wall second of 2 cores: one thread
    assert sched.metrics()["decode_threads"] == seen[-1] == 1  # what /metrics says (lantern_decode_threads)
    assert torch.equal(tickets[0].future.result(0).codes, pipe(labels=[3], seed=1, method="ar").codes[0])


def test_only_the_server_follows_the_load_instead_of_deciding_at_start() -> None:
    """``serve``'s auto is adapted while it serves (main leaves torch's count alone for it); the
    commands that finish decide once, at their start."""
    from lantern.cli.main import build_parser

    parser = build_parser()
    serve = parser.parse_args(["serve", "--model", "digits"])
    assert serve.threads == "auto" and serve.threads_follow_load
    for argv in (["generate", "--model", "digits", "--labels", "1", "--out", "x"], ["bench", "--model", "digits"],
                 ["demo"], ["profile", "--model", "digits"], ["calibrate", "--model", "digits", "--out", "x.json"]):
        args = parser.parse_args(argv)
        assert args.threads == "auto" and not getattr(args, "threads_follow_load", False), argv[0]


def test_the_servers_decode_thread_takes_every_core_and_follows_the_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve --threads auto`` on a CPU: torch's count for the decode thread, following the load
    (measured faster than the cores but one once no other thread held an OpenMP team); a number,
    a GPU, or OMP_NUM_THREADS: kept as is, fixed."""
    from lantern.cli.serve import decode_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert decode_threads("auto", "cpu", 2) == (2, True)
    assert decode_threads("auto", "cpu", 16) == (16, True)
    assert decode_threads(2, "cpu", 2) == (2, False)  # --threads 2: the command line set torch's count
    assert decode_threads("auto", "cuda", 8) == (8, False)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert decode_threads("auto", "cpu", 2) == (2, False)  # the user's count stands


def test_adaptive_threads_read_the_machine_only_when_a_look_is_due(monkeypatch: pytest.MonkeyPatch) -> None:
    """check() runs every round or step: before 10 s have passed it reads a clock, not /proc/stat."""
    now = {"t": 100.0}
    monkeypatch.setattr(machine, "_seconds", lambda: now["t"])
    monkeypatch.setattr(machine, "read_machine", lambda: reading(now["t"], 1000.0 + now["t"], 0.0))
    adapt = machine.AdaptiveThreads(2, lambda threads: None)

    def unread() -> Reading:
        raise AssertionError("the machine was read between looks")

    monkeypatch.setattr(machine, "read_machine", unread)
    now["t"] = 109.9
    assert adapt.check() is None  # 9.9 s: no look
    monkeypatch.setattr(machine, "read_machine", lambda: reading(now["t"], 1000.0 + now["t"], 0.0))
    now["t"] = 110.0
    assert adapt.check() == 1  # 10 s: others kept one of 2 cores busy


def test_a_passing_thread_returns_raises_and_keeps_the_callers_modes() -> None:
    """``in_a_thread_that_ends`` hands back the value, raises the work's exception in the caller, and
    runs the work in the caller's grad / inference mode and context variables at the caller's
    intra-op thread count."""
    import contextvars
    import threading

    import torch

    def seen() -> tuple[str, bool, bool, int]:
        return (threading.current_thread().name, torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                torch.get_num_threads())

    assert machine.in_a_thread_that_ends(lambda: 7) == 7
    with torch.inference_mode():
        assert machine.in_a_thread_that_ends(seen) == ("lantern-passing", False, True, torch.get_num_threads())
    with torch.no_grad():
        assert machine.in_a_thread_that_ends(seen)[1:3] == (False, False)
    assert machine.in_a_thread_that_ends(seen)[1:3] == (True, False)
    got: list[int] = []

    def caller() -> None:  # at 3 threads, after another thread wrote 1 as the process-wide count
        torch.get_num_threads()
        torch.set_num_threads(3)
        other = threading.Thread(target=lambda: (torch.get_num_threads(), torch.set_num_threads(1)))
        other.start()
        other.join()
        got.append(machine.in_a_thread_that_ends(torch.get_num_threads))

    thread = threading.Thread(target=caller)
    thread.start()
    thread.join()
    torch.set_num_threads(1)  # (the tests' count)
    assert got == [3]  # the caller's, not the last one written
    flag: contextvars.ContextVar[str] = contextvars.ContextVar("flag", default="unset")
    token = flag.set("the caller's")  # e.g. --no-progress's hf_folder.LOADING_BARS
    try:
        assert machine.in_a_thread_that_ends(flag.get) == "the caller's"
    finally:
        flag.reset(token)

    def fails() -> None:
        raise KeyError("kernel")

    with pytest.raises(KeyError, match="kernel"):
        machine.in_a_thread_that_ends(fails)


def test_a_passing_thread_keeps_the_callers_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller that chose its GPU (``torch.cuda.set_device(rank)``, then ``load(device="cuda")``) loads
    onto that GPU in the passing thread too; where CUDA was never initialized nothing asks for it."""
    import torch

    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    machine.in_a_thread_that_ends(lambda: None)
    assert chosen == [3]

    def never() -> int:
        raise AssertionError("CUDA initialized by a CPU run")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", never)
    machine.in_a_thread_that_ends(lambda: None)
    assert chosen == [3]


@needs_libgomp
def test_a_passing_thread_takes_its_openmp_team_along() -> None:
    """A parallel op run through ``in_a_thread_that_ends`` leaves the calling thread no OpenMP
    worker; run in the calling thread (power) it leaves one for the thread's life."""
    import torch

    def parallel_op() -> None:
        torch.randn(1 << 20).exp_()  # above the grain size: one parallel region at 2 threads

    assert threads_left_by(lambda: machine.in_a_thread_that_ends(parallel_op), settle=10.0) == 0
    assert threads_left_by(parallel_op, settle=0.0) >= 1  # power


@needs_libgomp
def test_load_leaves_the_calling_thread_without_an_openmp_team() -> None:
    """``lantern.load`` runs in a thread that ends: the thread that loads keeps no team, so a decode on
    another thread (a server's, a web app's worker) runs at full speed: on 2 cores AR decoded on a
    second thread 1.8x slower while the loading thread held one (benchmarks/RESULTS.md, "OpenMP
    teams"). Power: the same load in the calling thread leaves a worker behind."""

    from lantern import api

    assert threads_left_by(lambda: api.load("photos", deterministic=True), settle=10.0) == 0
    assert threads_left_by(lambda: api._load("photos", None, device="cpu", dtype="float32", compile="off",
                                             tokenizer=None, t5=None, vq=None, layout=None, size=(None, None),
                                             proximity=None), settle=0.0) >= 1  # power
