"""The busy-machine watch (``lantern.machine``): what other processes took while a command timed
its methods, and the warning demo / bench / profile (its --trace too) print and record when it was too
much."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

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
