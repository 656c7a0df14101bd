"""Outputs are all-or-nothing: complete or absent, through failures, full disks and kills."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import lantern.targets.llamagen_stack
from lantern.cli.main import main
from lantern.errors import LanternError
from lantern.outputs import PAUSE_ENV, OutputFolder, staging_name
from lantern.testing import make_random_stack

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_stack(tmp_path_factory.mktemp("stack") / "random", seed=3)


def generate(stack: Path, out: Path, labels: str = "0,1", *extra: str) -> int:
    return main(["generate", "--model", str(stack), "--labels", labels, "--out", str(out), "--no-progress", *extra])


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def used_out(stack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Path, dict[str, bytes]]:
    """``tmp_path/out`` holding a finished run of labels 0, 1, 2, and its files' contents."""
    out = tmp_path / "out"
    assert generate(stack, out, "0,1,2") == 0
    capsys.readouterr()
    return out, snapshot(out)


def test_second_run_is_refused_and_overwrite_replaces_the_folder_whole(
    stack: Path, tmp_path: Path, used_out: tuple[Path, dict[str, bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    out, first = used_out
    assert generate(stack, out, "5") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already exists and is not empty; pass --overwrite" in err
    assert snapshot(out) == first  # untouched
    assert generate(stack, out, "5", "--overwrite") == 0
    # Only the second run's files: no PNG of the first run mixed with the second run's run.json.
    assert listing(out) == ["0000_label5.png", "codes.npy", "grid.png", "run.json"]
    assert json.loads((out / "run.json").read_text())["labels"] == [5]
    assert np.load(out / "codes.npy").shape == (1, 64)
    assert listing(tmp_path) == ["out"]  # no staging or set-aside folder left


def test_an_existing_empty_folder_is_filled(stack: Path, tmp_path: Path) -> None:
    out = tmp_path / "made-by-user"
    out.mkdir()
    assert generate(stack, out, "1") == 0
    assert listing(out) == ["0000_label1.png", "codes.npy", "grid.png", "run.json"]


@pytest.mark.parametrize("made", [True, False], ids=["existing", "not-yet-made"])
def test_a_symlinked_out_fills_the_folder_it_points_to(stack: Path, tmp_path: Path, made: bool) -> None:
    """Also a link to a folder not made yet: resolved without error (on Python 3.13 the loop check
    resolves strictly first, which fails on a missing target)."""
    real = tmp_path / "real"
    if made:
        real.mkdir()
    (tmp_path / "link").symlink_to(real)
    assert generate(stack, tmp_path / "link", "1") == 0
    assert (tmp_path / "link").is_symlink() and listing(real) == ["0000_label1.png", "codes.npy", "grid.png",
                                                                 "run.json"]


@pytest.mark.parametrize("extra", [["--labels", "0,99"], ["--labels", "0", "--top-k", "9999"],
                                   ["--labels", "0", "--tree", "chain:3"], ["--prompt", "a cat"]])
def test_failing_commands_leave_no_folder(stack: Path, tmp_path: Path, extra: list[str]) -> None:
    out = tmp_path / "new" / "deeper" / "out"
    rc = main(["generate", "--model", str(stack), "--out", str(out), "--no-progress", *extra])
    assert rc == 2
    assert listing(tmp_path) == []  # neither --out nor the parents it would have needed


def test_full_disk_gives_one_line_and_leaves_nothing(
    stack: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(np, "save", full)  # codes.npy: written after the PNGs
    out = tmp_path / "sub" / "out"
    assert generate(stack, out, "0,1") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err and str(out) in err
    assert listing(tmp_path) == []


def test_build_proximity_refuses_to_overwrite_and_survives_a_full_disk(
    stack: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import safetensors.torch

    out = tmp_path / "table.safetensors"
    out.write_bytes(b"keep me")
    argv = ["build-proximity", "--tokenizer", str(stack / "tokenizer"), "--k-max", "8", "--out", str(out)]
    assert main(argv) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert out.read_bytes() == b"keep me"

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_file", full)
        assert main([*argv, "--overwrite"]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert out.read_bytes() == b"keep me" and listing(tmp_path) == ["table.safetensors"]
    stale = tmp_path / staging_name(out.name, "tmp", dead_pid())  # a build-proximity killed mid-write
    stale.write_bytes(b"half")
    assert main([*argv, "--overwrite"]) == 0
    assert out.read_bytes()[:8] != b"keep me" and listing(tmp_path) == ["table.safetensors"]


def _forbid_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    def load_stack(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(lantern.targets.llamagen_stack, "load_stack", load_stack)


@pytest.mark.parametrize("command", [
    ["generate", "--model", "digits", "--labels", "0"],
    ["demo", "--model", "digits"],
    ["bench", "--model", "digits"],
    ["profile", "--model", "digits"],
])
def test_unusable_out_fails_before_the_model_is_loaded(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _forbid_loading(monkeypatch)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    used = tmp_path / "used"
    used.mkdir()
    (used / "old.png").write_text("x")
    cases = {blocker: "exists and is not a directory", blocker / "sub": "cannot create directory",
             used: "already exists and is not empty"}
    for out, message in cases.items():
        assert main([*command, "--out", str(out), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("lantern: error: --out") and message in err, err
    assert listing(tmp_path) == ["file", "used"] and listing(used) == ["old.png"]


def test_stale_staging_of_a_killed_run_is_removed_and_live_ones_are_kept(stack: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    stale = tmp_path / staging_name("out", "tmp", dead_pid())
    stale.mkdir()
    (stale / "0000_label0.png").write_text("half")
    stale_aside = tmp_path / staging_name("out", "old", dead_pid())
    stale_aside.mkdir()
    live = tmp_path / staging_name("out", "tmp", os.getppid())  # a concurrent run's: not ours to remove
    live.mkdir()
    other = tmp_path / staging_name("other", "tmp", dead_pid())  # another output's staging
    other.mkdir()
    assert generate(stack, out, "2") == 0
    assert listing(tmp_path) == sorted(["out", live.name, other.name])


def test_a_folder_filled_meanwhile_is_not_merged_into(tmp_path: Path) -> None:
    out = OutputFolder.check(tmp_path / "out")
    with pytest.raises(LanternError, match="filled by another run meanwhile"):
        with out.write() as folder:
            (folder / "mine.txt").write_text("new")
            (tmp_path / "out").mkdir()
            (tmp_path / "out" / "theirs.txt").write_text("other run")
    assert listing(tmp_path) == ["out"] and listing(tmp_path / "out") == ["theirs.txt"]


def _sigint_as_ctrl_c() -> None:
    """In the child before exec: SIGINT back to its default, so Python turns it into Ctrl-C even when
    pytest itself ignores it (an ignored signal stays ignored across exec, and a background job of a
    non-interactive shell, e.g. ``pytest &`` or ``nohup``, starts with SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _killed_generate(stack: Path, out: Path, sig: signal.Signals, *extra: str) -> int:
    """``lantern generate`` in a subprocess, paused mid-write (PNGs written, codes.npy not), killed with ``sig``."""
    marker = out.parent / f"paused-{sig.name}"
    env = {**os.environ, PAUSE_ENV: str(marker), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "lantern.cli", "generate", "--model", str(stack), "--labels", "0,1,2,3", "--out",
         str(out), "--no-progress", *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        preexec_fn=_sigint_as_ctrl_c)
    deadline = time.monotonic() + 240
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run never reached its write phase"
        time.sleep(0.05)
    marker.unlink()
    proc.send_signal(sig)
    proc.communicate(timeout=60)
    return proc.returncode


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_sigint_and_sigterm_during_the_write_phase_leave_nothing(
    stack: Path, tmp_path: Path, sig: signal.Signals, code: int
) -> None:
    out = tmp_path / "out"
    assert _killed_generate(stack, out, sig) == code
    assert listing(tmp_path) == []  # no --out, no staging folder


@pytest.mark.slow
def test_sigkill_during_an_overwrite_keeps_the_old_run_intact_and_the_next_run_cleans_up(
    stack: Path, tmp_path: Path, used_out: tuple[Path, dict[str, bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    out, before = used_out
    assert _killed_generate(stack, out, signal.SIGKILL, "--overwrite") == -signal.SIGKILL
    assert snapshot(out) == before  # the old run, whole and alone
    staged = [p.name for p in tmp_path.iterdir() if p.name != "out"]
    assert len(staged) == 1 and staged[0].startswith(".out.tmp-")  # recognisably incomplete
    capsys.readouterr()
    assert generate(stack, out, "8") == 2  # a used --out is still refused
    assert generate(stack, out, "8", "--overwrite") == 0
    assert listing(tmp_path) == ["out"] and json.loads((out / "run.json").read_text())["labels"] == [8]


def test_the_readmes_two_demos_write_two_folders() -> None:
    """README runs `lantern demo`, then suggests `lantern demo --model digits`: both wrote ./lantern-demo,
    so the second was refused (--out exists)."""
    from lantern.cli.demo import default_out

    assert default_out("photos") == "lantern-demo"
    assert default_out("digits") == "lantern-demo-digits"
    assert default_out("/data/models/janus-pro/") == "lantern-demo-janus-pro"


def test_a_killed_drafter_runs_feature_folder_is_removed_by_the_next_run(tmp_path: Path) -> None:
    """train-chameleon-drafter keeps its features (tens of GB) in a temporary folder beside --out; a
    SIGKILL left it behind for good (a probe, 2026-11-30). The next run on this host removes a
    folder whose process is gone, never one of a live process (a concurrent rank), nor another
    run's."""
    import socket

    from lantern.train.chameleon_drafter import feature_folder

    base = f"d-features-{socket.gethostname()}"
    stale = tmp_path / staging_name(base, "tmp", dead_pid())
    live = tmp_path / staging_name(base, "tmp", os.getppid())
    other = tmp_path / staging_name(f"e-features-{socket.gethostname()}", "tmp", dead_pid())
    for folder in (stale, live, other):
        folder.mkdir()
        (folder / "train.bf16").write_bytes(b"\0" * 64)
    with feature_folder(tmp_path, tmp_path / "d") as mine:
        assert mine.is_dir() and mine.name == staging_name(base) and not stale.exists()
        assert live.is_dir() and other.is_dir()
    assert not mine.exists()


def test_files_written_from_threads_keep_the_umask(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job writes a round's PNGs from several threads. Reading the umask sets it to 0 for a
    moment; two threads doing so at once could read each other's 0 and leave it set, for every
    later file. The read is forced slow here, so unlocked reads would interleave."""
    from concurrent.futures import ThreadPoolExecutor

    import lantern.io
    from lantern.io import atomic_path

    real = os.umask

    def slow_umask(mask: int) -> int:
        old = real(mask)
        time.sleep(0.002)  # a thread switch between the set and the restore
        return old

    monkeypatch.setattr(lantern.io.os, "umask", slow_umask)
    previous = real(0o022)
    try:
        def write(i: int) -> None:
            with atomic_path(tmp_path / f"f{i}.png") as tmp:
                tmp.write_bytes(b"x")

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(write, range(64)))
        assert real(0o022) == 0o022  # the process's umask is as it was
        assert {oct(p.stat().st_mode & 0o777) for p in tmp_path.iterdir()} == {"0o644"}
    finally:
        real(previous)
