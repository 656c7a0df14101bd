"""``lantern bench --cache``: a stopped bench decodes only what is missing, and gives the rows of
an uninterrupted run; a decode is reused only when everything that decides its codes matches; a
bad entry is decoded again, never trusted."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from lantern.cli.main import main
from lantern.decoding.config import SamplingConfig
from lantern.eval.bench import BenchConfig, BenchRunner, run_bench
from lantern.eval.decode_cache import CachedRunner, DecodeCache, folder_fingerprint, lantern_source_digest
from lantern.eval.methods_grammar import parse_methods
from lantern.io import read_safetensors, save_safetensors
from lantern.methods import MethodConfig
from lantern.targets.llamagen_stack import load_stack

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def stack() -> Any:
    return load_stack("digits", dtype=torch.float32)


def _quality(codes: torch.Tensor, labels: list[Any]) -> dict[str, Any]:
    """A metric of the codes themselves: equal rows mean equal codes."""
    return {"fid": float(codes.double().mean()), "precision": float((codes % 7 == 0).double().mean())}


CONFIG = BenchConfig(methods=parse_methods("ar,lantern,sjd"), num_images=4, speed_images=1, batch_size=2,
                     curve_images=0, ar_seeds=2)
DECODES = 4  # ar, lantern, sjd, and AR's second seed


class Counting(BenchRunner):
    """A bench runner that counts its decodes and, with ``stop_after``, fails at that one (a kill)."""

    def __init__(self, stop_after: int | None = None) -> None:
        super().__init__()
        self.decoded = 0
        self.stop_after = stop_after

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        if self.stop_after is not None and self.decoded == self.stop_after:
            raise KeyboardInterrupt
        self.decoded += 1
        return super().generate(*args, **kwargs)


def _bench(stack: Any, runner: Any) -> Any:
    sampling = SamplingConfig(**stack.default_sampling())
    return run_bench(stack, sampling, CONFIG, _quality, progress=False, log=lambda _: None, runner=runner)


def test_a_stopped_bench_decodes_only_what_is_missing_and_gives_the_same_rows(stack: Any, tmp_path: Path) -> None:
    """Stopped at its third decode, then run again: the second run decodes the two missing ones
    and reuses two, and every row (codes, tau, metrics) and AR's spread equal an uncached run's.
    Power: the first run's two entries are really there, and an uncached rerun decodes all four."""
    reference = _bench(stack, Counting())

    logs: list[str] = []
    store = DecodeCache.for_stack(tmp_path / "cache", stack, log=logs.append)
    with pytest.raises(KeyboardInterrupt):
        _bench(stack, CachedRunner(Counting(stop_after=2), store))
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 2 and store.written == 2

    again = Counting()
    store = DecodeCache.for_stack(tmp_path / "cache", stack, log=logs.append)
    result = _bench(stack, CachedRunner(again, store))
    assert again.decoded == DECODES - 2 and store.reused == 2 and store.written == 2
    assert sum("--cache: reused" in line for line in logs) == 2
    for name in reference.codes:
        assert torch.equal(result.codes[name], reference.codes[name]), name
    for old, new in zip(reference.rows, result.rows, strict=True):
        assert (new.method, new.quality, new.mean_accepted, new.target_forwards) == \
               (old.method, old.quality, old.mean_accepted, old.target_forwards)
    assert result.ar_spread is not None and reference.ar_spread is not None
    assert result.ar_spread.values == reference.ar_spread.values

    third = Counting()  # everything is stored now
    _bench(stack, CachedRunner(third, DecodeCache.for_stack(tmp_path / "cache", stack, log=logs.append)))
    assert third.decoded == 0


def test_the_key_changes_with_whatever_decides_the_codes(stack: Any, tmp_path: Path) -> None:
    """Each input of a decode, changed alone, gives another key; the same inputs give the same key."""
    store = DecodeCache.for_stack(tmp_path / "c", stack)
    sampling = SamplingConfig(**stack.default_sampling())
    cond = stack.encode([0, 1, 2])
    lantern = MethodConfig.resolve("lantern", tree="chain:3")
    base = store.key(cond, 0, sampling, lantern, 2)
    assert base == DecodeCache.for_stack(tmp_path / "c", stack).key(stack.encode([0, 1, 2]), 0, sampling, lantern, 2)
    others = [
        store.key(stack.encode([0, 1, 3]), 0, sampling, lantern, 2),  # the conditions
        store.key(cond, 1, sampling, lantern, 2),  # the seed
        store.key(cond, 0, SamplingConfig(**{**stack.default_sampling(), "top_k": 50}), lantern, 2),
        store.key(cond, 0, sampling, MethodConfig.resolve("lantern", tree="chain:3", lantern_k=5), 2),
        store.key(cond, 0, sampling, MethodConfig.resolve("lantern", tree="chain:4"), 2),
        store.key(cond, 0, sampling, lantern, 3),  # the batch size
        DecodeCache.for_stack(tmp_path / "c", stack, world_size=2).key(cond, 0, sampling, lantern, 2),
        DecodeCache.for_stack(tmp_path / "c", stack, extra={"image_size": 64}).key(cond, 0, sampling, lantern, 2),
    ]
    assert len({base, *others}) == len(others) + 1
    # the model's files: a weight file rewritten in place (same size, new time) is another model
    model = tmp_path / "model"
    shutil.copytree(stack.root, model)
    before = folder_fingerprint(model)
    weights = next(model.rglob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1_000_000_000))
    assert folder_fingerprint(model) != before
    assert lantern_source_digest() == lantern_source_digest() and len(lantern_source_digest()) == 64


def test_the_key_changes_with_the_transformers_version(stack: Any, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The Chameleon, Janus and Emu3 targets run transformers' own layers: a decode made under
    another transformers release is another decode. Power: the same release gives the same key."""
    import importlib.metadata

    sampling = SamplingConfig(**stack.default_sampling())
    cond, ar = stack.encode([0, 1]), MethodConfig.resolve("ar")

    def key() -> str:
        return DecodeCache.for_stack(tmp_path / "c", stack).key(cond, 0, sampling, ar, 2)

    before = key()
    assert key() == before
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.0.1-another" if name == "transformers" else real(name))
    assert key() != before


def test_the_key_changes_with_the_thread_count(stack: Any, tmp_path: Path) -> None:
    """A CPU's reductions may be split by thread count, and rounded otherwise: another count is
    another decode. Power: the same count gives the same key."""
    sampling = SamplingConfig(**stack.default_sampling())
    cond, ar = stack.encode([0, 1]), MethodConfig.resolve("ar")
    threads = torch.get_num_threads()
    before = DecodeCache.for_stack(tmp_path / "c", stack).key(cond, 0, sampling, ar, 2)
    try:
        torch.set_num_threads(threads + 1)
        other = DecodeCache.for_stack(tmp_path / "c", stack).key(cond, 0, sampling, ar, 2)
    finally:
        torch.set_num_threads(threads)
    assert other != before == DecodeCache.for_stack(tmp_path / "c", stack).key(cond, 0, sampling, ar, 2)


def test_an_entry_that_cannot_be_written_is_a_note_and_the_run_goes_on(stack: Any, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk while writing an entry: the decode is returned, a note names the folder and the
    error, no entry (or temporary file) is left, and the summary counts it. Power: without the
    failure the same decode is written."""
    import errno

    import lantern.eval.decode_cache as decode_cache

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    notes: list[str] = []
    store = DecodeCache.for_stack(tmp_path / "c", stack, log=notes.append)
    monkeypatch.setattr(decode_cache, "save_safetensors", full)
    sampling = SamplingConfig(**stack.default_sampling())
    cond, ar = stack.encode([0, 1]), MethodConfig.resolve("ar")
    run = CachedRunner(BenchRunner(), store).generate(stack, cond, 0, sampling, ar, 2)
    assert run.codes.shape == (2, stack.num_tokens) and store.failed == 1 and store.written == 0
    assert len(notes) == 1 and "No space left on device" in notes[0] and "goes on without it" in notes[0]
    assert not any((tmp_path / "c").iterdir())
    assert store.summary() == {"folder": str(tmp_path / "c"), "reused": 0, "written": 0, "failed": 1}
    monkeypatch.undo()
    CachedRunner(BenchRunner(), store).generate(stack, cond, 0, sampling, ar, 2)
    assert store.written == 1 and store.path(store.key(cond, 0, sampling, ar, 2)).is_file()


def _entry(store: DecodeCache, stack: Any) -> tuple[str, Any, Any]:
    sampling = SamplingConfig(**stack.default_sampling())
    cond = stack.encode([0, 1])
    ar = MethodConfig.resolve("ar")
    runner = CachedRunner(BenchRunner(), store)
    run = runner.generate(stack, cond, 0, sampling, ar, 2)
    return store.key(cond, 0, sampling, ar, 2), run, (stack, cond, 0, sampling, ar, 2)


@pytest.mark.parametrize("damage", ["truncated", "codes out of range", "another key", "no format", "wrong shape"])
def test_a_bad_entry_is_decoded_again_with_a_note(stack: Any, tmp_path: Path, damage: str) -> None:
    """Each kind of damage makes the entry unusable (read gives None, with a note naming the
    file), the decode is made again and the entry replaced by a good one. Power: the undamaged
    entry is read back equal to the decode."""
    notes: list[str] = []
    store = DecodeCache(tmp_path / "c", DecodeCache.for_stack(tmp_path / "c", stack).context, log=notes.append)
    key, run, call = _entry(store, stack)
    path = store.path(key)
    good = store.read(key, stack, 2, run.method)
    assert good is not None and torch.equal(good.codes, run.codes) and not notes
    assert good.stats_dict()["target_forwards"] == run.stats_dict()["target_forwards"]

    tensors, meta = read_safetensors(path)
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:50])
    elif damage == "codes out of range":
        save_safetensors({**tensors, "codes": tensors["codes"] + stack.vocab_size}, path, meta)
    elif damage == "another key":
        save_safetensors(tensors, path, {**meta, "key": meta["key"].replace('"seed":0', '"seed":1')})
    elif damage == "no format":
        save_safetensors(tensors, path, {k: v for k, v in meta.items() if k != "format"})
    else:
        save_safetensors({**tensors, "codes": tensors["codes"][:, :-1].contiguous()}, path, meta)
    assert store.read(key, stack, 2, run.method) is None
    assert len(notes) == 1 and path.name in notes[0] and "decoding it again" in notes[0]

    inner = Counting()
    again = CachedRunner(inner, store).generate(*call)
    assert inner.decoded == 1 and torch.equal(again.codes, run.codes)
    assert store.read(key, stack, 2, run.method) is not None  # replaced by a good entry


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--no-quality"], "--cache keeps the quality decodes; --no-quality makes none"),
        (["--cache-in-out"], "is inside --out"),
        (["--cache-in-model"], "is inside --model"),
        (["--cache-is-file"], "is a file; expected a folder"),
    ],
)
def test_cli_cache_refusals(extra: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Each refusal is one line naming --cache, before the model loads (nothing is written)."""
    import lantern.api

    monkeypatch.setattr(lantern.api, "load_model_stack", lambda *a, **k: pytest.fail("the model was loaded"))
    out = tmp_path / "o"
    cache = tmp_path / "cache"
    argv = ["bench", "--model", "digits", "--out", str(out), "--no-progress"]
    if extra == ["--no-quality"]:
        argv += ["--no-quality", "--cache", str(cache)]
    elif extra == ["--cache-in-out"]:
        argv += ["--cache", str(out / "cache")]
    elif extra == ["--cache-in-model"]:
        from lantern.targets.base import PRESETS_DIR

        argv += ["--cache", str(PRESETS_DIR / "digits" / "cache")]
    else:
        cache.write_text("x")
        argv += ["--cache", str(cache)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not out.exists()


def test_a_cache_inside_a_relative_out_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``--out o --cache o/cache`` from the working folder (relative, as typed): refused in one line
    before the model loads. The cache path is resolved, --out was not: the bench decoded everything
    and, with --overwrite, replaced the folder holding the cache it had just written."""
    import lantern.api

    monkeypatch.setattr(lantern.api, "load_model_stack", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--model", "digits", "--out", "o", "--cache", "o/cache", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "is inside --out o" in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_cli_bench_twice_with_a_cache_reuses_every_decode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command line end to end: the second run reuses all three decodes (ar, lantern and AR's
    second seed), decodes nothing, and writes the same quality columns."""
    os.environ.setdefault("MPLCONFIGDIR", str(tmp_path / "mpl"))
    argv = ["bench", "--model", "digits", "--methods", "ar,lantern", "--num-images", "4", "--speed-images", "1",
            "--batch-size", "2", "--num-real", "50", "--curve-images", "0", "--ar-seeds", "2", "--dtype", "float32",
            "--cache", str(tmp_path / "cache"), "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    assert "0 decodes reused, 3 written" in capsys.readouterr().out
    assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    printed = capsys.readouterr().out
    assert "3 decodes reused, 0 written" in printed
    run_b = json.loads((tmp_path / "b" / "run.json").read_text())
    assert run_b["cache"] == {"folder": str((tmp_path / "cache").resolve()), "reused": 3, "written": 0, "failed": 0}
    keys = ("fid", "precision", "recall", "class_accuracy", "mean_accepted", "target_forwards")
    a, b = (json.loads((tmp_path / d / "bench.json").read_text()) for d in ("a", "b"))
    assert [{k: r[k] for k in keys} for r in a] == [{k: r[k] for k in keys} for r in b]


@pytest.mark.parametrize(("extra", "message"), [(["--quick", "--cache", "c"], "--quick makes none"),
                                                (["--cache", "cal.json"], "is inside --out")])
def test_calibrate_refuses_a_cache_it_cannot_use(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch, extra: list[str],
                                                 message: str) -> None:
    """With --quick (no quality decodes), or at the calibration file's own path (the folder would
    take the name the calibration is written to, at the end of the run)."""
    import lantern.api

    monkeypatch.setattr(lantern.api, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.chdir(tmp_path)
    assert main(["calibrate", "--model", "digits", *extra, "--out", "cal.json", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and not (tmp_path / "cal.json").exists()


@pytest.mark.slow
def test_calibrate_with_a_cache_reuses_its_quality_decodes(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``lantern calibrate --cache``: run twice, the second decodes nothing for quality and writes
    the same verdicts and tau."""
    monkeypatch.setenv("LANTERN_CALIBRATION_DIR", str(tmp_path / "cals"))
    argv = ["calibrate", "--model", "digits", "--methods", "ar,lantern", "--batch-sizes", "1", "--speed-images", "1",
            "--num-images", "4", "--ar-seeds", "2", "--batch-size", "2", "--num-real", "50",
            "--cache", str(tmp_path / "cache"), "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "a.json")]) == 0
    assert "0 decodes reused, 3 written" in capsys.readouterr().out
    assert main([*argv, "--out", str(tmp_path / "b.json")]) == 0
    assert "3 decodes reused, 0 written" in capsys.readouterr().out
    a, b = (json.loads((tmp_path / f).read_text())["methods"] for f in ("a.json", "b.json"))
    assert {m: (e["tau"], e["verdict"]) for m, e in a.items()} == {m: (e["tau"], e["verdict"]) for m, e in b.items()}
