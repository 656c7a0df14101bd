"""Regressions of the bad-input probe of Janus / Emu3 folders (2026-11-29).

Damaged transformers folders (Janus, Emu3) end in one line naming the file and what is wrong,
before a model is built from a config that cannot be the weights'. Old behaviour (a bad-input
probe, 2026-11-29): a config.json without ``text_config`` built a default-size language model
(17 GB of memory on a CPU, killed after 90 s); a vocabulary size that does not fit the weights
printed transformers' loading report (10+ lines) and "look at the above report!"; a malformed or
unknown config was reported as a missing ``tokenizer/`` folder."""

from __future__ import annotations

import io
import json
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from lantern.cli.main import main  # noqa: E402
from lantern.errors import LanternError  # noqa: E402
from lantern.testing import make_tiny_emu3_folder, make_tiny_janus_folder  # noqa: E402

BUILDERS = {"janus": make_tiny_janus_folder, "emu3": make_tiny_emu3_folder}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {name: build(root / name) for name, build in BUILDERS.items()}


def _edit(config: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        path = folder / "config.json"
        raw = json.loads(path.read_text())
        config(raw)
        path.write_text(json.dumps(raw))
    return damage


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "no text_config": (_edit(lambda c: c.pop("text_config")), r"config\.json has no text_config \(a .* config holds"),
    "no vq_config": (_edit(lambda c: c.pop("vq_config")), r"config\.json has no vq_config"),
    "vocabulary of another size": (_edit(lambda c: c["text_config"].update(vocab_size=9999)),
                                   r"the weights do not fit config\.json \(\S+\.weight MISMATCH .*9999"),
    "malformed JSON": (lambda f: (f / "config.json").write_text('{"model_type": "janus", '),
                       r"config\.json is not valid JSON"),
    "unknown model_type": (_edit(lambda c: c.update(model_type="foo")),
                           r"unsupported architecture in .*config\.json \(model_type 'foo'.*'janus' or 'emu3'"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_a_damaged_folder_is_one_line_naming_its_config(folders: dict[str, Path], tmp_path: Path, family: str,
                                                        damage: str, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / family
    shutil.copytree(folders[family], folder)
    apply, message = DAMAGE[damage]
    apply(folder)
    out = tmp_path / "out"
    assert main(["generate", "--model", str(folder), "--prompt", "a red car", "--no-progress", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    last = err.rstrip("\n").split("\n")[-1]  # (transformers' own "Loading weights" bar may come first)
    assert last.startswith("lantern: error: ") and "LOAD REPORT" not in err and "Traceback" not in err, err
    assert re.search(message, last), last
    assert not out.exists()


def test_the_undamaged_folders_load(folders: dict[str, Path], tmp_path: Path) -> None:
    """Power: the same command on the folders as built succeeds, so each refusal above is the damage's."""
    for family, folder in folders.items():
        assert main(["generate", "--model", str(folder), "--prompt", "a red car", "--no-progress",
                     "--out", str(tmp_path / family)]) == 0


def test_a_bad_image_size_in_generation_json_names_the_file(folders: dict[str, Path], tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Old behaviour: ``--image-size must be a positive multiple of 8``, a flag the user never passed."""
    folder = tmp_path / "emu3"
    shutil.copytree(folders["emu3"], folder)
    (folder / "generation.json").write_text('{"image_size": 30}')
    assert main(["generate", "--model", str(folder), "--prompt", "a red car", "--no-progress",
                 "--out", str(tmp_path / "out")]) == 2
    last = capsys.readouterr().err.rstrip("\n").split("\n")[-1]
    assert last == (f"lantern: error: {folder / 'generation.json'}: image_size: expected a positive multiple of 8 "
                    "(pixels), got 30"), last
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("family", "settings", "message"), [
    # Janus images are 384 px (the model's own); old behaviour: the key was silently ignored
    ("janus", {"image_size": 256}, "unknown key 'image_size' (this model family reads cfg_scale, temperature, "
                                   "top_k, top_p, trees)"),
    ("emu3", {"negativ_prompt": "blurry"}, "unknown key 'negativ_prompt' (this model family reads cfg_scale, "
                                           "image_size, image_width, negative_image_header, negative_prompt, "
                                           "temperature, top_k, top_p, trees)"),
])
def test_a_key_the_family_does_not_read_is_refused(folders: dict[str, Path], tmp_path: Path, family: str,
                                                   settings: dict, message: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / family
    shutil.copytree(folders[family], folder)
    path = folder / "generation.json"
    kept = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps(kept | settings))
    assert main(["generate", "--model", str(folder), "--prompt", "a red car", "--no-progress",
                 "--out", str(tmp_path / "out")]) == 2
    last = capsys.readouterr().err.rstrip("\n").split("\n")[-1]
    assert last == f"lantern: error: {path}: {message}", last
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("flag", "method", "message"), [
    ("--drafter", "ar", r"--drafter is only used with the drafter methods \(sd, sd-static, lantern, lantern\+\+\), "
                        r"not ar$"),
    ("--proximity", "sjd-coupled", r"--proximity is only used with LANTERN's relaxed methods .*, not sjd-coupled$"),
])
def test_a_part_the_method_never_reads_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str,
                                                  method: str, message: str) -> None:
    """Old behaviour: ignored (rc 0), so a wrong path there went unnoticed; ``--tree`` was already
    refused for methods without a tree. Refused before anything loads (the path does not exist)."""
    out = tmp_path / "out"
    assert main(["generate", "--model", "digits", "--labels", "1", "--method", method, flag, str(tmp_path / "nope"),
                 "--no-progress", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lantern: error: ") and err.count("\n") == 1 and re.search(message, err.strip()), err
    assert not out.exists()
    assert main(["generate", "--model", "digits", "--labels", "1", "--method", "lantern", flag, str(tmp_path / "nope"),
                 "--no-progress", "--out", str(out)]) == 2  # power: a method that reads it goes on to the path
    assert "nope" in capsys.readouterr().err


def test_a_load_that_succeeds_still_passes_on_transformers_report(folders: dict[str, Path], tmp_path: Path) -> None:
    """The loading report is held back only to make a failure one line: a folder whose weights lack
    a tensor of a module lantern never runs (transformers initialises it) and hold one the model
    does not use loads, and transformers' report of both still reaches its log's stream handlers (a
    stream of our own here: pytest's capture replaced the one transformers made at import)."""
    from safetensors.torch import load_file, save_file

    from lantern.models.janus import load_janus

    folder = tmp_path / "janus"
    shutil.copytree(folders["janus"], folder)
    weights = sorted(folder.glob("*.safetensors"))[0]
    tensors = load_file(weights)
    tensors["model.spare.weight"] = torch.zeros(2)
    tensors.pop(next(k for k in sorted(tensors) if k.startswith("model.vision_model.")))
    save_file(tensors, weights, metadata={"format": "pt"})
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    log = logging.getLogger("transformers")
    log.addHandler(handler)
    try:
        load_janus(folder)
    finally:
        log.removeHandler(handler)
    text = stream.getvalue()
    assert "model.spare.weight" in text and "UNEXPECTED" in text and "MISSING" in text, text[-2000:]
    assert handler not in log.handlers and any(isinstance(h, logging.StreamHandler) for h in log.handlers)


def test_no_progress_also_hides_transformers_loading_bar(folders: dict[str, Path], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Old behaviour: ``--no-progress`` left transformers' own "Loading weights" bar on stderr (a log
    of a batch job read it as lantern's). Power: without the flag the bar is drawn."""
    folder = folders["janus"]
    assert main(["generate", "--model", str(folder), "--prompt", "a red car", "--out", str(tmp_path / "shown")]) == 0
    assert "Loading weights" in capsys.readouterr().err
    assert main(["generate", "--model", str(folder), "--prompt", "a red car", "--no-progress",
                 "--out", str(tmp_path / "quiet")]) == 0
    err = capsys.readouterr().err
    assert "Loading weights" not in err and "it/s" not in err, err
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()  # left as it was found


@pytest.mark.parametrize(("family", "message"), [
    # old behaviour: transformers built an empty GPT-2 tokenizer from no files, and the error was about
    # the size header's token ids ("got ids [0]"), not the missing file
    ("emu3", "no tokenizer for the prompts (expected tokenizer.json, or vocab.json and merges.txt in the folder)"),
    # old behaviour: transformers' first line only, "... from one of:", the list cut off; then that text after
    # the cause, cut off mid-sentence (2026-11-30)
    ("janus", "no tokenizer for the prompts (expected tokenizer.json in the folder)"),
])
def test_a_folder_without_its_tokenizer_says_so(folders: dict[str, Path], tmp_path: Path, family: str,
                                                message: str, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / family
    shutil.copytree(folders[family], folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink(missing_ok=True)
    assert main(["generate", "--model", str(folder), "--prompt", "a red car", "--no-progress",
                 "--out", str(tmp_path / "out")]) == 2
    last = capsys.readouterr().err.rstrip("\n").split("\n")[-1]
    assert last.startswith(f"lantern: error: --model {folder}: {message}"), last
    assert not (tmp_path / "out").exists()


def _drop(folder: Path, key: str) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / "model.safetensors"))
    assert key in weights, sorted(weights)[:5]
    del weights[key]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(("family", "key", "named"), [
    ("janus", "model.language_model.layers.0.mlp.down_proj.weight",
     "model.language_model.layers.0.mlp.down_proj.weight"),
    ("emu3", "text_model.model.layers.0.mlp.down_proj.weight", "model.text_model.layers.0.mlp.down_proj.weight"),
])
def test_a_folder_lacking_a_weight_is_refused(folders: dict[str, Path], tmp_path: Path, family: str, key: str,
                                             named: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Old behaviour: transformers started the missing weight at random, printed its report as a
    warning, and the run drew images from a damaged model (exit 0)."""
    folder = tmp_path / family
    shutil.copytree(folders[family], folder)
    _drop(folder, key)
    assert main(["generate", "--model", str(folder), "--prompt", "a red car", "--no-progress",
                 "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"lantern: error: --model {folder}: the folder's weights lack 1 tensor(s) of the "
                           f"{FAMILY[family]} model, e.g. {named} (transformers' name for it; transformers would start "
                           "them at random)"), err
    assert not (tmp_path / "out").exists()


FAMILY = {"janus": "Janus", "emu3": "Emu3", "chameleon": "Chameleon"}


def test_a_module_lantern_never_runs_may_be_missing(folders: dict[str, Path], tmp_path: Path) -> None:
    """Janus' understanding tower (SigLIP) and a Chameleon folder's transformers VQ model (images
    come from vqgan.ckpt) are spare: a folder without them loads; one without a decoder weight does
    not (the check above, on the same loader)."""
    from lantern.models.chameleon import load_chameleon
    from lantern.models.janus import load_janus
    from lantern.testing import make_tiny_chameleon_folder

    janus = tmp_path / "janus"
    shutil.copytree(folders["janus"], janus)
    _drop(janus, next(k for k in _keys(janus) if k.startswith("model.vision_model.")))
    assert load_janus(janus).num_codes > 0
    chameleon = make_tiny_chameleon_folder(tmp_path / "chameleon")
    _drop(chameleon, "model.vqmodel.quantize.embedding.weight")
    assert load_chameleon(chameleon).num_codes > 0
    _drop(chameleon, "model.layers.0.mlp.down_proj.weight")
    with pytest.raises(LanternError, match=r"lack 1 tensor\(s\) of the Chameleon model, e\.g\. "
                                           r"model\.layers\.0\.mlp\.down_proj\.weight"):
        load_chameleon(chameleon)


def _keys(folder: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return sorted(f.keys())
