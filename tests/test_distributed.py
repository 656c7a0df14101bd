"""Data-parallel generate across processes (torchrun, gloo on the CPU), resumable jobs, --save-npz.

Under N processes a request gives the same images (codes, PNGs) as in one process, because the
shard rule is deterministic and every image keeps its own seed; a killed ``--resume`` job
continues with the images it had not recorded. The multi-process runs are real ``torchrun``
launches of lantern.cli's ``main`` (2 processes, one thread each; through ``tests/rank_main.py``,
which also checks the process group's threads are gone when it returns), so they are few.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import run_launcher
from PIL import Image

from lantern.cli.main import main
from lantern.distributed import DistContext, check_enough_items, shard
from lantern.errors import LanternError
from lantern.jobs import PAUSE_AFTER_ENV, RUN_LOG, _log_run, write_npz
from lantern.outputs import PAUSE_ENV
from lantern.testing import make_random_stack, make_tiny_chameleon_folder

REPO = Path(__file__).resolve().parents[1]
LABELS = "0,1,2,3,4"  # 5 images on 2 ranks: shards of 3 and 2
FINAL = ["0000_label0.png", "0001_label1.png", "0002_label2.png", "0003_label3.png", "0004_label4.png", "codes.npy",
         "grid.png", "run.json"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_stack(tmp_path_factory.mktemp("stack") / "random", seed=3)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", PAUSE_ENV)}
    return {**env, "PYTHONPATH": str(REPO)}


def torchrun(args: list[str], nproc: int = 2) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run --standalone`` (a free port per launch) of ``lantern.cli``
    (through ``tests/rank_main.py``, which also fails a rank whose gloo threads outlive main: issue 30)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(REPO / "tests" / "rank_main.py"), *args, "--no-progress"]
    return run_launcher(cmd, timeout=300, env=_env())


def generate(model: Path, out: Path, *extra: str) -> int:
    return main(["generate", "--model", str(model), "--out", str(out), "--no-progress", *extra])


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def assert_same_images(one: Path, two: Path) -> None:
    """Byte-identical PNGs, codes.npy and grid, the same conditions and seeds in run.json."""
    a, b = files(one), files(two)
    assert sorted(a) == sorted(b)
    for name in a:
        if name != "run.json":
            assert a[name] == b[name], name
    ra, rb = json.loads(a["run.json"]), json.loads(b["run.json"])
    for key in ("labels", "prompts", "seeds", "method", "sampling", "job"):
        assert ra.get(key) == rb.get(key), key
    for key in ("num_images", "target_forwards", "mean_accepted"):
        assert ra["stats"][key] == rb["stats"][key], key


# ---- the shard rule ------------------------------------------------------------------------


@pytest.mark.parametrize("n,world", [(5, 2), (8, 8), (7, 3), (50_000, 8), (3, 1)])
def test_shards_cover_the_request_once_in_order_and_balanced(n: int, world: int) -> None:
    parts = [shard(n, r, world) for r in range(world)]
    assert [i for p in parts for i in p] == list(range(n))  # concatenation in rank order = request order
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert len(parts[0]) == max(map(len, parts))  # the round count follows from rank 0's shard


def test_rank_environment_is_read_and_checked() -> None:
    ctx = DistContext.from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert (ctx.rank, ctx.world_size, ctx.enabled, ctx.is_main) == (1, 2, True, False)
    assert ctx.device("cuda") == "cuda:1" and ctx.device("cpu") == "cpu"
    assert DistContext.from_env({}) == DistContext(0, 1, 0) and DistContext().device("cuda") == "cuda"
    with pytest.raises(LanternError, match="RANK=2 / WORLD_SIZE=2"):
        DistContext.from_env({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(LanternError, match="WORLD_SIZE must be an integer, got 'two'"):
        DistContext.from_env({"WORLD_SIZE": "two"})
    with pytest.raises(LanternError, match="3 images cannot be shared by 4 processes"):
        check_enough_items(3, DistContext(0, 4, 0))


def test_more_processes_than_images_is_refused_before_loading(
    stack: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert generate(stack, tmp_path / "out", "--labels", "0,1") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "2 images cannot be shared by 3 processes (WORLD_SIZE)" in err
    assert list(tmp_path.iterdir()) == []
    bench = ["bench", "--model", "digits", "--num-images", "2", "--speed-images", "1", "--out", str(tmp_path / "b")]
    assert main([*bench, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "2 --num-images images cannot be shared by 3 processes" in err
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main([*bench, "--num-images", "4", "--tree", "lantern++=auto", "--no-progress"]) == 2
    assert "--tree auto times this process alone" in capsys.readouterr().err
    assert main([*bench, "--num-images", "4", "--methods", "ar,sjd/window=auto", "--no-progress"]) == 2
    err = capsys.readouterr().err  # each rank would time its own window and could choose another one
    assert err.count("\n") == 1 and "window=auto (sjd/window=auto) times this process alone" in err, err
    assert list(tmp_path.iterdir()) == []


# ---- two processes give the images of one ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ar", "lantern++"])
def test_two_processes_give_the_images_of_one(stack: Path, tmp_path: Path, method: str) -> None:
    args = ["--labels", LABELS, "--method", method, "--batch-size", "2", "--seed", "4"]
    assert generate(stack, tmp_path / "one", *args, "--save-npz") == 0
    proc = torchrun(["generate", "--model", str(stack), "--out", str(tmp_path / "two"), *args, "--save-npz"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_images(tmp_path / "one", tmp_path / "two")
    run = json.loads((tmp_path / "two" / "run.json").read_text())
    ranks = run["stats"]["ranks"]
    assert [(r["rank"], r["images"]) for r in ranks] == [(0, 3), (1, 2)]  # uneven shards, both used
    assert sum(r["target_forwards"] for r in ranks) == run["stats"]["target_forwards"]
    # samples.npz: the ADM evaluator's layout, in request order, equal to the PNGs.
    with np.load(tmp_path / "two" / "samples.npz") as z:
        arr = z["arr_0"]
    names = [f"{i:04d}_label{i}.png" for i in range(5)]
    assert arr.dtype == np.uint8 and arr.shape == (5, 32, 32, 3) and list(z.files) == ["arr_0"]
    for i, name in enumerate(names):
        assert np.array_equal(arr[i], np.asarray(Image.open(tmp_path / "two" / name).convert("RGB")))
    assert not np.array_equal(arr[0], arr[1])  # distinct images: the order is checked, not a constant


@pytest.mark.slow
@pytest.mark.invariance
def test_two_processes_give_a_one_process_runs_chosen_images(stack: Path, tmp_path: Path) -> None:
    """``--indices`` across ranks: each rank's images keep their places' seeds and names, so the job
    holds what one process writes for the whole run (deterministic: the batches differ)."""
    args = ["--labels", LABELS, "--method", "lantern++", "--batch-size", "2", "--seed", "4", "--deterministic"]
    assert generate(stack, tmp_path / "one", *args) == 0
    proc = torchrun(["generate", "--model", str(stack), "--out", str(tmp_path / "two"), *args, "--indices", "4,0,2"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = ["0004_label4.png", "0000_label0.png", "0002_label2.png"]
    for name in names:
        assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name
    assert np.array_equal(np.load(tmp_path / "two" / "codes.npy"), np.load(tmp_path / "one" / "codes.npy")[[4, 0, 2]])
    run = json.loads((tmp_path / "two" / "run.json").read_text())
    assert run["indices"] == [4, 0, 2] and [r["images"] for r in run["stats"]["ranks"]] == [2, 1]


@pytest.mark.slow
def test_two_processes_give_the_images_of_one_from_prompts(t2i_stack: Path, tmp_path: Path) -> None:
    args = ["--prompt", "a red car", "--prompt", "dog on the beach", "--num-per-prompt", "2", "--method",
            "lantern++", "--batch-size", "3", "--seed", "1"]
    assert generate(t2i_stack, tmp_path / "one", *args) == 0
    proc = torchrun(["generate", "--model", str(t2i_stack), "--out", str(tmp_path / "two"), *args])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_images(tmp_path / "one", tmp_path / "two")
    assert json.loads((tmp_path / "two" / "run.json").read_text())["prompt_index"] == [0, 0, 1, 1]


@pytest.mark.slow
def test_two_processes_give_the_images_of_one_on_a_chameleon_folder(tmp_path: Path) -> None:
    """The job path is the Stack's: a Lumina-layout folder (row-end tokens, its own prompt
    tokenizer and VQGAN) shards like a LlamaGen stack, and its npz holds the same pixels."""
    model = make_tiny_chameleon_folder(tmp_path / "lumina", "lumina-mgpt", 64)
    args = ["--image-size", "64", "--prompt", "a red car", "--prompt", "a dog", "--prompt", "a lake",
            "--method", "sjd-coupled", "--sjd-window", "4", "--batch-size", "2", "--seed", "4", "--save-npz"]
    assert generate(model, tmp_path / "one", *args) == 0
    proc = torchrun(["generate", "--model", str(model), "--out", str(tmp_path / "two"), *args])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_images(tmp_path / "one", tmp_path / "two")
    run = json.loads((tmp_path / "two" / "run.json").read_text())
    assert [r["images"] for r in run["stats"]["ranks"]] == [2, 1] and run["layout"]["name"] == "lumina-mgpt"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["janus", "emu3"])
def test_two_processes_give_the_images_of_one_on_janus_and_emu3(tmp_path: Path, family: str) -> None:
    """Janus's guidance rows (pad-token prompts) and Emu3's (its negative prompt, end-of-line tokens)
    shard like any stack: two processes write the images one writes."""
    from lantern.testing import make_tiny_emu3_folder, make_tiny_janus_folder

    build = make_tiny_janus_folder if family == "janus" else make_tiny_emu3_folder
    model = build(tmp_path / family)
    args = ["--prompt", "a red car", "--prompt", "a dog", "--prompt", "a lake", "--method", "sjd-coupled",
            "--sjd-window", "4", "--batch-size", "2", "--seed", "4"]
    assert generate(model, tmp_path / "one", *args) == 0
    proc = torchrun(["generate", "--model", str(model), "--out", str(tmp_path / "two"), *args])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_images(tmp_path / "one", tmp_path / "two")
    run = json.loads((tmp_path / "two" / "run.json").read_text())
    assert [r["images"] for r in run["stats"]["ranks"]] == [2, 1]


# ---- resumable jobs -------------------------------------------------------------------------


def _killed_after(stack: Path, out: Path, images: int, *extra: str) -> None:
    """A ``--resume`` generate in a subprocess, SIGKILLed once ``images`` images are recorded."""
    marker = out.parent / "paused"
    env = {**_env(), PAUSE_ENV: str(marker), PAUSE_AFTER_ENV: str(images)}
    proc = subprocess.Popen([sys.executable, "-m", "lantern.cli", "generate", "--model", str(stack), "--out", str(out),
                             "--no-progress", "--resume", *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the job never recorded its images"
        time.sleep(0.05)
    marker.unlink()
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)


@pytest.mark.slow
def test_a_killed_job_resumes_without_redoing_finished_images(
    stack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--labels", LABELS, "--method", "lantern++", "--batch-size", "1", "--seed", "4"]
    assert generate(stack, tmp_path / "whole", *args) == 0
    out = tmp_path / "out"
    _killed_after(stack, out, 2, *args)
    job = tmp_path / ".out.resume"
    assert not out.exists() and job.is_dir()
    done = sorted((job / "out").glob("*.png"))
    assert [p.name for p in done] == FINAL[:2]  # two images recorded, each with its PNG
    stamps = {p.name: p.stat().st_mtime_ns for p in done}
    before = files(job / "records")

    # A resume with other seeds or other settings is refused; the job is untouched.
    for extra, message in ((["--seed", "5"], "was started with --seed 4 (its images' seeds); this run has --seed 5"),
                           (["--method", "ar"], "was started with a different method"),
                           (["--labels", "0,1,2,3,5"], "was started with a different labels")):
        changed = [*args, *extra]
        assert generate(stack, out, *changed, "--resume") == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err and str(job) in err, err
        assert files(job / "records") == before and not out.exists()

    # A job that another run is writing (it holds JOB/lock) is not touched.
    with open(job / "lock") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert generate(stack, out, *args, "--resume") == 2
        assert "another run is writing the job in" in capsys.readouterr().err
    assert files(job / "records") == before and not out.exists()

    # Resumed under 2 processes: the same final folder as the uninterrupted run.
    proc = torchrun(["generate", "--model", str(stack), "--out", str(out), *args, "--resume"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_images(tmp_path / "whole", out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "whole"]  # the job folder is gone
    stats = json.loads((out / "run.json").read_text())["stats"]
    assert (stats["resumed_images"], stats["generated_this_run"]) == (2, 3)
    assert sum(r["images"] for r in stats["ranks"]) == 3  # only the missing images were decoded
    # run.json lists both runs of the job (the refused ones above are not runs of it)
    runs = json.loads((out / "run.json").read_text())["runs"]
    assert [(r["processes"], r["images_already_recorded"], r["batch_size"]) for r in runs] == [(1, 0, 1), (2, 2, 1)]
    assert runs[1]["command"].startswith("lantern generate") and "--resume" in runs[1]["command"]
    assert {name: (out / name).stat().st_mtime_ns for name in stamps} == stamps  # finished PNGs kept as written

    # --resume into the finished folder: nothing to do with the same settings, refused with others.
    assert generate(stack, out, *args, "--resume") == 0
    assert "complete: nothing to do" in capsys.readouterr().out
    assert generate(stack, out, *args, "--seed", "7", "--resume") == 2
    assert "the finished job in" in capsys.readouterr().err
    assert generate(stack, out, *args, "--resume", "--overwrite") == 2
    assert "cannot be combined with --overwrite" in capsys.readouterr().err
    assert_same_images(tmp_path / "whole", out)


# ---- bench across ranks ---------------------------------------------------------------------


# slow (~32 s): bench in one process, then under a 2-process torchrun; the only check that sharded bench = 1 process
@pytest.mark.slow
def test_bench_under_two_processes_gives_the_quality_numbers_of_one(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path / "mpl"))
    # 5 quality images (shards 3 + 2), 1 timed image (rank 1 times nothing), 2 curve images (1 + 1); AR's
    # spread at 2 seeds (not the default 5: each seed decodes 5 more AR images, and 2 seeds test the
    # sharded spread as well as 5).
    args = ["bench", "--model", "digits", "--methods", "ar,lantern++", "--num-images", "5", "--speed-images", "1",
            "--batch-size", "4", "--num-real", "20", "--curve-images", "2", "--dtype", "float32", "--ar-seeds", "2"]
    assert main([*args, "--out", str(tmp_path / "one"), "--no-progress"]) == 0
    proc = torchrun([*args, "--out", str(tmp_path / "two")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = (json.loads((tmp_path / d / "bench.json").read_text()) for d in ("one", "two"))
    same = ("method", "tree", "mean_accepted", "target_forwards", "num_images", "fid", "kid", "kid_std", "precision",
            "recall", "class_accuracy")
    assert [{k: r[k] for k in same} for r in one] == [{k: r[k] for k in same} for r in two]
    assert one[0]["fid"] is not None and one[1]["mean_accepted"] > 1.0  # real numbers, not empty rows
    run_one, run_two = (json.loads((tmp_path / d / "run.json").read_text()) for d in ("one", "two"))
    assert (run_one["processes"], run_two["processes"]) == (1, 2)
    assert run_one["ar_spread"]["seeds"] == [0, 1]  # a real spread, not an empty one
    assert run_one["ar_spread"] == run_two["ar_spread"] and run_one["curves"] == run_two["curves"]
    assert (tmp_path / "two" / "grid_ar.png").read_bytes() == (tmp_path / "one" / "grid_ar.png").read_bytes()


@pytest.mark.parametrize("damage", [b'{"runs": 1}', b'[{"command": "lantern gen', b""])
def test_a_damaged_run_log_is_started_again_not_a_stop(tmp_path: Path, damage: bytes,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """runs.json is only a record of a job's runs: damaged, it is begun again with a note."""
    record = {"command": "lantern generate --resume", "date": "d", "batch_size": 4, "device": "cpu",
              "deterministic": True, "seeds": [1, 2]}
    (tmp_path / RUN_LOG).write_bytes(damage)
    _log_run(tmp_path, record, 1, 3)
    assert str(tmp_path / RUN_LOG) in capsys.readouterr().out
    assert json.loads((tmp_path / RUN_LOG).read_text()) == [
        {"command": "lantern generate --resume", "date": "d", "batch_size": 4, "device": "cpu",
         "deterministic": True, "processes": 1, "images_already_recorded": 3}]
    _log_run(tmp_path, {**record, "batch_size": 8}, 2, 5)  # a sound log is appended to
    assert [r["batch_size"] for r in json.loads((tmp_path / RUN_LOG).read_text())] == [4, 8]


def test_a_job_holds_one_rounds_pixels_not_every_images(stack: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A 50,000-image FID job must not keep every decoded image in memory (at 384 x 384 that is 22 GB):
    a round's pixels are dropped once its PNGs are written. Decoded here as 512 x 512 images (0.79 MB
    of pixels each), 48 images in rounds of 4 may raise the traced peak by a few rounds' worth, not by
    the 38 MB of all 48; numpy's arrays are traced by tracemalloc, the PNG encoder's buffers are not."""
    import tracemalloc

    from lantern.targets.llamagen_stack import ModelStack

    def large(self: ModelStack, codes: object) -> list[Image.Image]:
        return [Image.new("RGB", (512, 512), (int(c[0]) % 256, 7, 9)) for c in codes]  # type: ignore[attr-defined]

    monkeypatch.setattr(ModelStack, "to_pil", large)
    monkeypatch.setattr("lantern.jobs.GRID_MAX_IMAGES", 4)  # grid.png's images are held: bounded, not measured here
    labels = ",".join(str(i % 10) for i in range(48))
    assert generate(stack, tmp_path / "warm", "--labels", "1,2", "--batch-size", "2") == 0  # the imports, not traced
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        assert generate(stack, tmp_path / "out", "--labels", labels, "--batch-size", "4") == 0
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert len(list((tmp_path / "out").glob("*_label*.png"))) == 48
    assert Image.open(tmp_path / "out" / "0047_label7.png").size == (512, 512)
    assert peak < 12 * 2**20, f"the job's traced peak grew by {peak / 2**20:.1f} MB"


def test_npz_holds_grayscale_as_three_equal_channels_and_refuses_mixed_sizes(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    grays = [rng.integers(0, 256, (6, 5), dtype=np.uint8) for _ in range(3)]
    paths = []
    for i, g in enumerate(grays):
        Image.fromarray(g).save(tmp_path / f"{i}.png")
        paths.append(tmp_path / f"{i}.png")
    write_npz(tmp_path / "s.npz", paths)
    with np.load(tmp_path / "s.npz") as z:
        arr = z["arr_0"]
    assert arr.shape == (3, 6, 5, 3) and arr.dtype == np.uint8
    assert all(np.array_equal(arr[i, :, :, c], grays[i]) for i in range(3) for c in range(3))
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(tmp_path / "small.png")
    with pytest.raises(LanternError, match=r"small.png is \(4, 4, 3\), the first image \(6, 5, 3\)"):
        write_npz(tmp_path / "bad.npz", [*paths, tmp_path / "small.png"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.png", "1.png", "2.png", "s.npz", "small.png"]  # no temp


def test_a_launch_past_its_timeout_takes_its_ranks_with_it(tmp_path: Path) -> None:
    """``run_launcher`` (what the torchrun tests use): a launcher whose child hangs is killed with the
    child at the timeout. ``subprocess.run`` killed only the launcher, and a rank hung in torch
    2.6's gloo teardown stayed alive after the test (power: the child is alive before the timeout)."""
    pid_file = tmp_path / "child.pid"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    launcher = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(120)"
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_launcher([sys.executable, "-c", launcher], timeout=5)
    assert time.monotonic() - start < 60
    pid = int(pid_file.read_text())  # the child ran (written before the timeout)
    for _ in range(100):  # SIGKILL is delivered at once; reaping by init may take a moment
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        if Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            break  # a zombie: dead, not yet reaped
        time.sleep(0.1)
    else:
        pytest.fail(f"the launcher's child {pid} outlived the timeout")
