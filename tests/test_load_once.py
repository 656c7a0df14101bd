"""Load once: a Pipeline reads its drafter, proximity table and T5 at most once, on first need,
and keeps its prepared methods, so a second call reads nothing from disk (issue 37).

Reads are counted where every safetensors file is opened (``safetensors.safe_open``, which
``lantern.io.read_safetensors`` imports at each call) and where a stack reads a drafter folder
(``Stack.load_drafter``).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import safetensors
import torch

import lantern
from lantern import api as api_module
from lantern.targets.llamagen_stack import ModelStack

LABELS = [1, 7]


class Reads:
    """Files opened, by kind: ``drafter`` (its weights), ``proximity`` (the table), ``other``."""

    def __init__(self) -> None:
        self.files: Counter[str] = Counter()
        self.drafter_loads = 0

    def kind(self, path: str) -> str:
        name = Path(path).name
        if name.startswith("proximity"):
            return "proximity"
        return "drafter" if "drafter" in Path(path).parts[-2] else "other"

    def clear(self) -> None:
        self.files.clear()
        self.drafter_loads = 0

    def total(self) -> int:
        return sum(self.files.values()) + self.drafter_loads


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Reads:
    counted = Reads()
    real_open, real_load = safetensors.safe_open, ModelStack.load_drafter

    def safe_open(path: str, *args: Any, **kwargs: Any) -> Any:
        counted.files[counted.kind(path)] += 1
        return real_open(path, *args, **kwargs)

    def load_drafter(self: ModelStack, path: Any) -> torch.nn.Module:
        counted.drafter_loads += 1
        return real_load(self, path)

    monkeypatch.setattr(safetensors, "safe_open", safe_open)
    monkeypatch.setattr(ModelStack, "load_drafter", load_drafter)
    return counted


def _call(pipe: lantern.Pipeline, method: str, **settings: Any) -> torch.Tensor:
    return pipe(labels=LABELS, method=method, seed=5, batch_size=2, **settings).codes


def test_the_counter_sees_a_read(reads: Reads) -> None:
    """The counting itself: a fresh pipeline's lantern++ call reads the drafter and the table."""
    pipe = lantern.load("digits")
    reads.clear()
    _call(pipe, "lantern++")
    assert reads.drafter_loads == 1 and reads.files["drafter"] == 1 and reads.files["proximity"] == 1


def test_a_second_call_reads_nothing_and_gives_the_same_codes(reads: Reads) -> None:
    pipe = lantern.load("digits")
    first = _call(pipe, "lantern++")
    reads.clear()
    second = _call(pipe, "lantern++")
    assert reads.total() == 0, (reads.files, reads.drafter_loads)
    assert torch.equal(second, first)
    assert torch.equal(second, _call(lantern.load("digits"), "lantern++"))  # a fresh pipeline's codes


def test_a_new_method_reads_only_what_it_needs(reads: Reads) -> None:
    pipe = lantern.load("digits")
    reads.clear()
    _call(pipe, "ar")
    assert reads.total() == 0  # AR needs neither the drafter nor the table
    _call(pipe, "sd")
    assert reads.drafter_loads == 1 and reads.files["proximity"] == 0
    reads.clear()
    lantern_pp = _call(pipe, "lantern++")
    assert reads.drafter_loads == 0 and reads.files == Counter({"proximity": 1})  # the drafter is kept
    reads.clear()
    _call(pipe, "sjd-lantern++")  # another method on the same table
    _call(pipe, "lantern++", lantern_lambda=3.0)  # other settings: prepared anew, from the loaded parts
    assert reads.total() == 0
    assert torch.equal(_call(pipe, "lantern++"), lantern_pp)


def test_prepared_methods_are_kept_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same settings give the same prepared method (its caches, its compiled round); ever new
    settings cannot grow memory past MAX_PREPARED."""
    monkeypatch.setattr(api_module, "MAX_PREPARED", 2)
    pipe = lantern.load("digits")
    first = pipe.prepare(*api_module.resolve_settings(pipe.stack, "sd"))
    assert pipe.prepare(*api_module.resolve_settings(pipe.stack, "sd")) is first
    for t in (0.5, 0.6, 0.7):
        pipe.prepare(*api_module.resolve_settings(pipe.stack, "sd", temperature=t))
    assert len(pipe._prepared) == 2
    assert pipe.prepare(*api_module.resolve_settings(pipe.stack, "sd")) is not first  # dropped, prepared again
    assert pipe.prepare(*api_module.resolve_settings(pipe.stack, "sd")).drafter is first.drafter  # one drafter


def test_tree_auto_reads_the_drafter_once_and_measures_once(reads: Reads, monkeypatch: pytest.MonkeyPatch) -> None:
    """``tree="auto"``: the profile, the calibration and the run share one drafter read; a later
    call with the same method, settings, sampling and rows per call runs the kept choice (no
    measurement, no read), another batch size or sampling measures anew."""
    from lantern.autotree import choose

    pipe = lantern.load("digits")
    reads.clear()
    out = pipe(labels=[3], method="lantern++", seed=1, batch_size=1, tree="auto")
    assert "auto_tree" in out.config
    assert reads.drafter_loads == 1 and reads.files["drafter"] == 1 and reads.files["proximity"] == 1
    reads.clear()
    measured: list[int] = []

    def not_again(*args: Any, **kwargs: Any) -> Any:
        measured.append(kwargs["batch_size"])
        raise RuntimeError("measured again")

    monkeypatch.setattr(choose, "choose_auto", not_again)
    again = pipe(labels=[5], method="lantern++", seed=2, batch_size=1, tree="auto")
    assert reads.total() == 0 and measured == []
    assert again.config["auto_tree"] == out.config["auto_tree"]
    assert again.config["auto_tree"] is not out.config["auto_tree"]  # a copy: one call's record cannot edit another's
    pipe(labels=[3], method="lantern++", seed=1, tree="auto", batch_size=2)  # one image: still a batch of 1
    assert measured == []
    # The defaults given explicitly are the same choice (they were keyed apart: measured again)
    pipe(labels=[3], method="lantern++", seed=1, batch_size=1, tree="auto", lantern_k=10, lantern_lambda=5.0)
    assert measured == []
    # The settings hold the tree auto chose, not "auto": sent back, the same codes, nothing measured
    # (an audit, 2026-11-30: the replay measured again, chose another tree and gave other codes)
    chosen = out.config["auto_tree"]
    if out.settings["method"] == "ar":  # this machine's timing found AR fastest: the run decoded as AR
        assert "tree" not in out.settings
    else:
        assert out.settings["tree"] in (chosen["tree"], chosen["choices"]) and out.settings["tree"] != "auto"
    replay = pipe(labels=[3], **out.settings)
    assert measured == [] and torch.equal(replay.codes, out.codes) and replay.settings == out.settings
    for other in ({"batch_size": 2}, {"batch_size": 1, "temperature": 0.5}):
        with pytest.raises(RuntimeError, match="measured again"):
            pipe(labels=[3, 4], method="lantern++", seed=1, tree="auto", **other)
    assert measured == [2, 1]


def test_cli_tree_auto_reads_the_drafter_once(reads: Reads, tmp_path: Path) -> None:
    from lantern.cli.main import main

    reads.clear()
    main(["generate", "--model", "digits", "--labels", "3", "--method", "sd", "--tree", "auto", "--batch-size",
          "1", "--out", str(tmp_path / "out"), "--no-progress"])
    assert reads.drafter_loads == 1 and reads.files["drafter"] == 1
    assert (tmp_path / "out" / "run.json").is_file()


def test_generation_json_is_read_at_load_and_kept(tmp_path: Path) -> None:
    """A loaded pipeline read ``generation.json`` at every call, so an edit to the file changed
    the sampling of a loaded model silently, and a broken one failed a loaded pipe (a probe,
    2026-11-29). It is read when the pipeline is made; the next load reads the new file."""
    import shutil

    from lantern.errors import LanternError
    from lantern.targets.llamagen_stack import preset_dir

    folder = tmp_path / "digits"
    shutil.copytree(preset_dir("digits"), folder)
    pipe = lantern.load(folder)
    first = pipe(labels=LABELS, method="lantern++", seed=5, batch_size=2)
    (folder / "generation.json").write_text('{"top_k": 5, "cfg_scale": 1.0}')
    edited = pipe(labels=LABELS, method="lantern++", seed=5, batch_size=2)
    assert torch.equal(edited.codes, first.codes) and edited.config == first.config
    assert lantern.load(folder)(labels=LABELS, method="lantern++", seed=5).config["sampling"]["top_k"] == 5  # power
    (folder / "generation.json").write_text("{broken")
    assert torch.equal(pipe(labels=LABELS, method="lantern++", seed=5, batch_size=2).codes, first.codes)
    with pytest.raises(LanternError, match="generation.json is not valid JSON"):
        lantern.load(folder)
