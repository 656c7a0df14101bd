"""The Python API (``lantern.load(...)(...)``): the same request gives the same codes and the same
resolved configuration as ``lantern generate``; any model folder (c2i preset, t2i stack, Anole,
Lumina-mGPT, a Hugging Face repo id in an offline cache) loads through the one call."""

from __future__ import annotations

import inspect
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import lantern
from lantern.cli.main import main
from lantern.errors import LanternError
from lantern.methods import METHOD_SETTINGS, METHOD_TABLE
from lantern.targets.llamagen_stack import preset_dir
from lantern.testing import make_tiny_chameleon_folder

CONFIG_KEYS = ("seed", "batch_size", "device", "deterministic", "hardware", "sampling", "method")


@pytest.fixture(scope="module")
def digits() -> lantern.Pipeline:
    return lantern.load("digits")


def _cli(model: str, out: Path, *extra: str) -> tuple[np.ndarray, dict]:
    assert main(["generate", "--model", model, "--out", str(out), "--no-progress", *extra]) == 0
    return np.load(out / "codes.npy"), json.loads((out / "run.json").read_text())


def test_import_is_light_and_exports_the_building_blocks() -> None:
    code = ("import sys, lantern; print([m for m in ('torch', 'transformers', 'huggingface_hub') "
            "if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
    from lantern.decoding.loop import GenerationOutput, SpecStats, generate

    assert lantern.GenerationOutput is GenerationOutput and lantern.SpecStats is SpecStats
    assert callable(lantern.generate) and lantern.decoding.loop.__name__ in ("generate", "lantern.decoding.loop")
    assert generate.__module__ == "lantern.decoding.loop"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        lantern.nope  # noqa: B018


@pytest.mark.invariance
@pytest.mark.parametrize("method", [m if m == "sd" else pytest.param(m, marks=pytest.mark.slow)
                                    for m in METHOD_TABLE])
def test_python_call_equals_cli_generate(digits: lantern.Pipeline, method: str, tmp_path: Path) -> None:
    out = digits(labels=[3, 7], method=method, seed=0)
    codes, run = _cli("digits", tmp_path / "run", "--labels", "3,7", "--method", method)
    assert torch.equal(out.codes, torch.from_numpy(codes))
    assert out.config == {k: run[k] for k in CONFIG_KEYS}
    assert out.stats["target_forwards"] == run["stats"]["target_forwards"]
    # the stack's generation.json is applied in the library: cfg 3, top-k 100, and chain:3 for drafter methods
    assert out.config["sampling"]["cfg_scale"] == 3.0 and out.config["sampling"]["top_k"] == 100
    if method in ("sd", "lantern", "lantern++"):
        assert out.config["method"]["tree"] == {"kind": "chain", "depth": 3}
    png = Image.open(tmp_path / "run" / "0001_label7.png")
    assert len(out.images) == 2 and np.array_equal(np.asarray(out.images[1]), np.asarray(png))


@pytest.mark.slow
def test_overrides_match_the_cli_flags(digits: lantern.Pipeline, tmp_path: Path) -> None:
    settings = dict(temperature=0.5, top_k=7, cfg_scale=1.5, tree="chain:2", lantern_delta=0.2, lantern_k=5)
    out = digits(labels=[1], method="lantern", seed=4, batch_size=1, num_per_label=2, **settings)
    codes, run = _cli("digits", tmp_path / "run", "--labels", "1", "--method", "lantern", "--seed", "4",
                      "--batch-size", "1", "--num-per-label", "2", "--temperature", "0.5", "--top-k", "7",
                      "--cfg-scale", "1.5", "--tree", "chain:2", "--lantern-delta", "0.2", "--lantern-k", "5")
    assert torch.equal(out.codes, torch.from_numpy(codes))
    assert out.config == {k: run[k] for k in CONFIG_KEYS}
    assert out.config["method"]["relaxation"]["delta"] == 0.2 and out.config["method"]["tree"]["depth"] == 2
    assert out.codes.shape == (2, 64) and len(out.images) == 2


def test_bad_calls_name_the_argument(digits: lantern.Pipeline) -> None:
    with pytest.raises(LanternError, match=r"^unknown setting 'temprature' \(did you mean 'temperature'\?\); a call "
                                           r"takes labels, prompts, method, seed, batch_size, num_per_label, progress, "
                                           r"quality, indices, negative_prompt and the settings tree, "):
        digits(labels=[1], temprature=0.5)
    with pytest.raises(LanternError,
                       match=r"^unknown setting 'num_per_prompt' \(did you mean 'num_per_label'\?\); a call takes "):
        digits(labels=[1], num_per_prompt=2)  # the call's own arguments are listed (they were not: an audit)
    with pytest.raises(LanternError, match="class-conditional model; pass labels"):
        digits(prompts=["a cat"])
    with pytest.raises(LanternError, match="prompts=.*: neither was given$"):
        digits()
    with pytest.raises(LanternError, match="prompts=.*: not both$"):
        digits(labels=[1], prompts=["a cat"])
    with pytest.raises(LanternError, match="^top_k must be"):
        digits(labels=[1], top_k=-1)
    with pytest.raises(LanternError, match="^lantern_lambda belongs to"):
        digits(labels=[1], method="lantern", lantern_lambda=2.0)


def test_python_errors_name_the_arguments_and_the_cli_its_flags(digits: lantern.Pipeline, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A check names the command-line flag; a Python caller passed a keyword and reads that back
    (before: ``pipe(sjd_window=0)`` said "--sjd-window must be ..."). The command line keeps its
    flags, also when main() runs in the same process, before and after Python calls."""
    def message(call: Any) -> str:
        with pytest.raises(LanternError) as refused:
            call()
        return str(refused.value)

    window = "sjd_window must be an integer >= 1, got 0"
    assert message(lambda: digits(labels=[1], method="sjd", sjd_window=0)) == window
    assert message(lambda: digits(labels=[1], method="ar", gsd_group=2)) == "gsd_group needs method gsd, got method ar"
    assert message(lambda: lantern.load("digits", dtype="float13")).startswith("dtype must be auto, bf16,")
    assert message(lambda: lantern.load("digits", image_size=64)).startswith("image_size is only used with")
    assert main(["generate", "--model", "digits", "--labels", "1", "--method", "sjd", "--sjd-window", "0",
                 "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert capsys.readouterr().err == "lantern: error: --sjd-window must be an integer >= 1, got 0\n"
    assert message(lambda: digits(labels=[1], method="sjd", sjd_window=0)).startswith("sjd_window must")


def test_python_names_rewrites_flags_of_arguments_only() -> None:
    from lantern.errors import python_names

    names = {"sjd_window", "drafter", "batch_size", "method"}
    assert python_names("--sjd-window must be >= 1; pass --drafter DIR, --out X or --lantern-* options; "
                        "see `lantern profile --batch-size 2` (lantern serve --max-tree-nodes), --method sd",
                        names) == ("sjd_window must be >= 1; pass drafter=DIR, --out X or --lantern-* options; "
                                   "see `lantern profile --batch-size 2` (lantern serve --max-tree-nodes), method sd")
    assert python_names("--sjd-windows and x--method stay", names) == "--sjd-windows and x--method stay"


# ---- other model families through the same call -------------------------------------------------


def test_t2i_stack_from_prompts_equals_cli(t2i_stack: Path, tmp_path: Path) -> None:
    out = lantern.load(t2i_stack)(prompts=["a red car", "dog"], seed=2)
    codes, run = _cli(str(t2i_stack), tmp_path / "run", "--prompt", "a red car", "--prompt", "dog", "--seed", "2")
    assert torch.equal(out.codes, torch.from_numpy(codes))
    assert out.config == {k: run[k] for k in CONFIG_KEYS}
    assert len(out.images) == 2
    with pytest.raises(LanternError, match="text-to-image model; pass prompts"):
        lantern.load(t2i_stack)(labels=[1])


@pytest.mark.parametrize("layout, size", [("lumina-mgpt", 64), pytest.param("anole", None, marks=pytest.mark.slow)])
def test_chameleon_folders_from_prompts_equal_cli(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path,
                                                  layout: str, size: int | None) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("yaml")
    folder = make_tiny_chameleon_folder(tmp_path_factory.mktemp(layout) / "model", layout, size)
    pipe = lantern.load(folder, image_size=size)
    assert pipe.kind == "chameleon" and pipe.stack.layout.name == layout
    out = pipe(prompts=["a red car"], seed=1, temperature=0)
    extra = ["--image-size", str(size)] if size is not None else []
    codes, run = _cli(str(folder), tmp_path / "run", "--prompt", "a red car", "--seed", "1", "--temperature", "0",
                      *extra)
    assert torch.equal(out.codes, torch.from_numpy(codes))
    assert out.config == {k: run[k] for k in CONFIG_KEYS}
    assert out.codes.shape == (1, pipe.stack.layout.num_tokens)
    assert out.config["sampling"]["top_k"] == 8  # the folder's generation.json
    png = Image.open(tmp_path / "run" / "0000_prompt0.png")
    assert np.array_equal(np.asarray(out.images[0]), np.asarray(png))


# ---- Hugging Face repo ids, from an offline cache built here ------------------------------------


def _cache_repo(cache: Path, repo_id: str, source: Path) -> Path:
    """``source`` copied into the Hub cache layout: models--org--name/snapshots/<rev>/ + refs/main."""
    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(source, repo / "snapshots" / rev)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    return repo / "snapshots" / rev


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pytest.importorskip("huggingface_hub")
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


@pytest.mark.slow
def test_repo_ids_resolve_from_the_offline_cache(hub_cache: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    digits = preset_dir("digits")
    snap = _cache_repo(hub_cache, "lantern-test/digits", digits)
    drafter = _cache_repo(hub_cache, "lantern-test/digits_drafter", digits / "drafter")
    pipe = lantern.load("lantern-test/digits", drafter="lantern-test/digits_drafter")
    assert pipe.stack.root == snap and pipe.parts.drafter_source == str(drafter)
    out = pipe(labels=[5], method="sd", seed=3)
    codes, run = _cli("digits", tmp_path / "run", "--labels", "5", "--method", "sd", "--seed", "3",
                      "--drafter", "lantern-test/digits_drafter")
    assert torch.equal(out.codes, torch.from_numpy(codes)) and out.config == {k: run[k] for k in CONFIG_KEYS}

    with pytest.raises(LanternError, match="lantern-test/missing") as e:
        lantern.load("lantern-test/missing")
    assert "\n" not in str(e.value) and "HF_HUB_OFFLINE" in str(e.value)
    capsys.readouterr()
    assert main(["generate", "--model", "digits", "--labels", "1", "--method", "sd", "--out", str(tmp_path / "x"),
                 "--drafter", "lantern-test/missing"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--drafter lantern-test/missing" in err
    assert not (tmp_path / "x").exists()


def test_a_tokenizer_is_taken_by_its_repo_id_too(hub_cache: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``tokenizer=`` / ``generate --tokenizer`` / ``build-proximity --tokenizer`` / ``extract-codes
    --tokenizer`` read a repo id as ``--model`` and ``--drafter`` do (before: "no such folder
    lantern-test/tok")."""
    tokenizer = preset_dir("digits") / "tokenizer"
    _cache_repo(hub_cache, "lantern-test/tok", tokenizer)
    by_id = lantern.load("digits", tokenizer="lantern-test/tok")(labels=[3], seed=1)
    local = lantern.load("digits", tokenizer=tokenizer)(labels=[3], seed=1)
    assert np.array_equal(np.asarray(by_id.images[0]), np.asarray(local.images[0]))
    assert main(["generate", "--model", "digits", "--tokenizer", "lantern-test/tok", "--labels", "3", "--seed", "1",
                 "--out", str(tmp_path / "g"), "--no-progress"]) == 0
    assert np.array_equal(np.asarray(Image.open(tmp_path / "g" / "0000_label3.png")), np.asarray(local.images[0]))
    tables = {}
    for name, given in (("id", "lantern-test/tok"), ("local", str(tokenizer))):
        assert main(["build-proximity", "--tokenizer", given, "--k-max", "8", "--out", str(tmp_path / f"{name}.st"),
                     "--no-progress"]) == 0
        tables[name] = load_file(tmp_path / f"{name}.st")
    assert tables["id"].keys() == tables["local"].keys()
    assert all(torch.equal(tables["id"][k], tables["local"][k]) for k in tables["id"])
    codes = {}
    for name, given in (("id", "lantern-test/tok"), ("local", str(tokenizer))):  # extract-codes too
        assert main(["extract-codes", "--tokenizer", given, "--data", "digits", "--num-samples", "8",
                     "--eval-samples", "4", "--out", str(tmp_path / f"codes-{name}"), "--no-progress"]) == 0
        codes[name] = load_file(tmp_path / f"codes-{name}" / "train.safetensors")
    assert codes["id"].keys() == codes["local"].keys() and all(codes["id"][k].numel() for k in codes["id"])
    assert all(torch.equal(codes["id"][k], codes["local"][k]) for k in codes["id"])
    capsys.readouterr()
    assert main(["build-proximity", "--tokenizer", "lantern-test/none", "--out", str(tmp_path / "n.st")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("lantern: error: --tokenizer lantern-test/none: no such local folder")


def test_a_local_folder_wins_over_a_repo_id(hub_cache: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    local = tmp_path / "org" / "name"
    shutil.copytree(preset_dir("digits"), local)
    monkeypatch.chdir(tmp_path)  # "org/name" is now an existing relative folder, and no repo is cached
    assert lantern.load("org/name").stack.root == Path("org/name")


def test_api_probe_findings_are_one_line_errors_or_accepted(digits: lantern.Pipeline, tmp_path: Path) -> None:
    """A probe of the Python API (2026-11-29). Before: a string lantern_delta and an integer tree
    ended in a TypeError / AttributeError from deep inside; numpy integers were refused for
    batch_size, num_per_label, top_k and sjd_window (accepted for labels and seed); a missing
    tokenizer= was blamed on the model; a missing drafter= or proximity= loaded and failed at the
    first call that needed it (never, for AR); t5= on a class-conditional model was ignored; a
    torch integer dtype failed inside torch."""
    def message(call: Any) -> str:
        with pytest.raises(LanternError) as refused:
            call()
        return str(refused.value)

    assert message(lambda: digits(labels=[1], method="lantern", lantern_delta="0.1")) == \
        "lantern_delta must be a number, got '0.1' (str)"
    assert message(lambda: digits(labels=[1], method="lantern++", lantern_lambda="2")).startswith(
        "lantern_lambda must be a number")
    assert message(lambda: digits(labels=[1], method="sd", tree=3)).startswith("tree must be a string (none, dynamic")
    numpy = digits(labels=np.array([1, 2]), method="sjd-coupled", batch_size=np.int64(2), num_per_label=np.int32(1),
                   top_k=np.int64(50), sjd_window=np.int64(8), temperature=np.float32(0.5), seed=np.int64(3))
    python = digits(labels=[1, 2], method="sjd-coupled", batch_size=2, top_k=50, sjd_window=8, temperature=0.5, seed=3)
    assert torch.equal(numpy.codes, python.codes) and numpy.config == python.config
    json.dumps(numpy.config)  # plain Python numbers: run.json-ready
    missing = tmp_path / "missing"
    assert message(lambda: lantern.load("digits", tokenizer=missing)) == \
        f"tokenizer: no such folder {missing} (a VQ tokenizer folder)"
    assert message(lambda: lantern.load("digits", missing)) == \
        f"drafter: no such folder {missing} (a drafter folder, or a Hub repo id)"
    assert message(lambda: lantern.load("digits", proximity=missing)) == \
        f"proximity: no such file {missing} (a proximity table)"
    assert message(lambda: lantern.load("digits", t5=missing)).startswith("t5 is only used by text-to-image models")
    assert message(lambda: lantern.load("digits", dtype=torch.int64)) == \
        "dtype must be float32, bfloat16 or float16 (or a name, or auto), got torch.int64"
    assert message(lambda: lantern.load("digits", compile=True)) == \
        "compile takes a mode name, not True: 'auto' compiles for this device, 'off' (or None) does not"
    # power: what exists loads
    assert lantern.load("digits", preset_dir("digits") / "drafter", tokenizer=preset_dir("digits") / "tokenizer",
                        dtype=torch.float32).stack.kind == "c2i"


def test_submodules_are_attributes_of_the_package() -> None:
    """The README names ``lantern.methods.METHOD_SETTINGS``: after ``import lantern`` alone that
    was an AttributeError (the lazy exports knew no submodule)."""
    code = "import lantern; print(len(lantern.methods.METHOD_SETTINGS) > 10, hasattr(lantern, 'nope'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "False"], out.stderr


@pytest.mark.parametrize("method", sorted(METHOD_TABLE))
def test_an_outputs_settings_passed_back_give_its_codes(digits: lantern.Pipeline, method: str) -> None:
    """``out.config`` is the run's record (nested, with keys no call takes: a probe, 2026-11-29,
    found ``pipe(**out.config)`` refused); ``out.settings`` is the call's keywords with every
    default filled in (the prepared method's: lantern's K capped at the table's), which a call
    takes back as they are. Every method: the settings of sjd, sjd-lantern(++) and the -sv ones
    held sjd_coupling="independent", which they refuse (an audit, 2026-11-30)."""
    first = digits(labels=[1, 2], method=method, seed=3, batch_size=2, num_per_label=2)
    assert first.settings["method"] == method and first.settings["seed"] == 3 and first.settings["num_per_label"] == 2
    assert set(first.settings) - {"method", "seed", "batch_size", "num_per_label"} <= set(METHOD_SETTINGS) | {
        "temperature", "top_k", "top_p", "cfg_scale"}
    again = digits(labels=[1, 2], **first.settings)
    assert again.codes.shape[0] == 4  # num_per_label is passed back too (before: a replay gave 2 images, not 4)
    assert torch.equal(again.codes, first.codes) and again.settings == first.settings
    # the same run but for k_explicit: passed back, the default K is given explicitly
    assert {**again.config, "method": {**again.config["method"], "k_explicit": None}} == \
        {**first.config, "method": {**first.config["method"], "k_explicit": None}}


def test_outputs_compare_print_and_take_what_their_types_say(digits: lantern.Pipeline) -> None:
    """From an audit (2026-11-30): ``out == other`` raised (the generated equality compared
    tensors), ``repr(out)`` printed 94 lines of per-batch records for 8 digits, ``labels=range(3)``
    passed the type (a Sequence) but was refused, and ``load(device=torch.device("cpu"))`` ran
    but was typed ``str`` and printed as ``device(type='cpu')``."""
    a = digits(labels=range(3), method="sd", seed=1)
    b = digits(labels=[0, 1, 2], method="sd", seed=1)
    assert torch.equal(a.codes, b.codes) and a.settings == b.settings
    assert a == a and a != b  # identity, never a tensor comparison
    # what decided the floats besides the settings (an audit: two runs.json of the same command, one
    # under forced AVX2 kernels, differed in an image and in nothing they recorded)
    assert a.config["hardware"]["cpu_kernels"] == torch.backends.cpu.get_cpu_capability()
    assert a.config["hardware"]["torch"] == torch.__version__ and a.config["hardware"]["name"]
    text = repr(a)
    assert "\n" not in text, text
    assert text.startswith("PipelineOutput(3 images 32x32, codes [3, 64], method='sd', seed=1, "), text
    with pytest.raises(LanternError, match=r"^lantern_delta needs a relaxed method \(.*\), got method ar$"):
        digits(labels=[3], method="ar", lantern_delta=0.2)  # was "--lantern-* options need ...", a flag and a glob
    pipe = lantern.load("digits", device=torch.device("cpu"))
    assert pipe.device == "cpu" and "device='cpu', dtype='float32'" in repr(pipe)
    assert "deterministic=False" in repr(pipe)
    # diffusers' indexing (an audit, 2026-11-30: pipe(...)[0] raised "not subscriptable")
    assert a[0] is a.images and a["codes"] is a.codes and a.to_tuple()[:2] == (a.images, a.codes)
    images, *_ = a.to_tuple()
    assert images is a.images and a[-1] is a.settings
    with pytest.raises(KeyError, match="'image': a PipelineOutput holds images, codes, stats, config, outputs, "
                                       "settings"):
        a["image"]
    with pytest.raises(TypeError, match="iterate out.images"):
        list(a)  # not the fields, where a loop over an output means its images
    # numbers of float settings are floats, as the CLI's: run.json said "cfg_scale": 4 from Python, 4.0 from the CLI
    whole = digits(labels=[1], cfg_scale=4, temperature=1, top_p=1)
    assert json.dumps(whole.config["sampling"]) == '{"temperature": 1.0, "top_k": 100, "top_p": 1.0, "cfg_scale": 4.0}'
    assert [type(whole.settings[k]) for k in ("temperature", "top_p", "cfg_scale")] == [float] * 3


def test_wrong_arguments_are_named_with_what_was_meant(digits: lantern.Pipeline, tmp_path: Path) -> None:
    """From an audit (2026-11-30): a file given as the drafter folder was "no such folder", None as the
    model "no such model folder None", and diffusers' keywords got no suggestion (generator: "did you
    mean 'temperature'?")."""
    (tmp_path / "file").write_text("x")
    for kwargs, message in (
            ({"model": None}, "model must be a preset name, a folder or a Hub repo id (a string or a path), got "
                              "NoneType None"),
            ({"model": 3}, "model must be a preset name, a folder or a Hub repo id (a string or a path), got int 3"),
            ({"model": "digits", "drafter": str(tmp_path / "file")}, f"drafter: {tmp_path / 'file'} is a file, not a "
                                                                     "folder"),
            ({"model": "digits", "proximity": str(tmp_path)}, f"proximity: {tmp_path} is a folder, not a file"),
            ({"model": "digits", "proximity": str(tmp_path / "none")}, f"proximity: no such file {tmp_path / 'none'}")):
        with pytest.raises(LanternError, match=f"^{re.escape(message)}"):
            lantern.load(**kwargs)
    for given, meant in (("generator", "seed"), ("num_images_per_prompt", "num_per_label"),
                         ("guidance_scale", "cfg_scale")):
        with pytest.raises(LanternError, match=rf"^unknown setting '{given}' \(did you mean '{meant}'\?\)"):
            digits(labels=[1], **{given: 1})
    # load()'s own arguments under diffusers' names, and misspelt: one line naming the right one
    for given, meant in (("torch_dtype", "dtype"), ("device_map", "device"), ("determinstic", "deterministic")):
        with pytest.raises(LanternError, match=rf"^load\(\) has no argument '{given}' \(did you mean '{meant}'\?\); "
                                               "it takes model, drafter, device, dtype"):
            lantern.load("digits", **{given: torch.bfloat16})


def test_an_output_saves_as_generate_writes_and_its_codes_decode_to_its_images(digits: lantern.Pipeline,
                                                                                tmp_path: Path) -> None:
    """``out.save(dir)``: the images, codes.npy, grid.png and run.json the command line writes, all or
    nothing; ``pipe.decode(codes)``: a run's codes (``codes.npy`` read back) as the same images, byte
    for byte. Both were missing (an audit, 2026-11-30: decoding saved codes needed the internal
    ``pipe.stack.to_pil``)."""
    out = digits(labels=[2, 5, 7], method="sjd-coupled", seed=4)
    folder = out.save(tmp_path / "run")
    assert sorted(p.name for p in folder.iterdir()) == ["0000.png", "0001.png", "0002.png", "codes.npy", "grid.png",
                                                        "run.json"]
    codes = np.load(folder / "codes.npy")
    assert codes.dtype == np.int64 and np.array_equal(codes, out.codes.numpy())
    assert json.loads((folder / "run.json").read_text())["settings"] == out.settings
    for i, image in enumerate(digits.decode(codes)):
        assert image.tobytes() == out.images[i].tobytes()
        with Image.open(folder / f"{i:04d}.png") as png:
            assert png.tobytes() == image.tobytes()
    assert not torch.equal(out.codes[0], out.codes[1])  # power: the rows differ, so order is checked
    with pytest.raises(LanternError, match=r"^directory: .* is not empty; pass overwrite to replace it"):
        out.save(folder)
    out.save(folder, grid=False, overwrite=True)
    assert not (folder / "grid.png").exists() and (folder / "0002.png").exists()
    for codes_in, message in ((codes[:, :10], r"codes must be an \[N, 64\] integer array"),
                              (codes.astype(np.float32), r"codes must be an \[N, 64\] integer array"),
                              (codes + 100_000, r"codes must be image tokens 0\.\.")):
        with pytest.raises(LanternError, match=message):
            digits.decode(codes_in)


def test_a_tree_is_also_given_by_its_choices(digits: lantern.Pipeline) -> None:
    """``tree=[[0], [1], [0, 0]]``: a static tree of that shape (what ``tree="auto"`` may choose, which
    no name spells: its settings record the choices so that a call can take them back). A chain
    given as choices is that chain; a bad shape is refused in one line naming ``tree``."""
    named = digits(labels=[1, 2], method="sd", tree="chain:2", seed=3)
    assert torch.equal(digits(labels=[1, 2], method="sd", tree=[[0], [0, 0]], seed=3).codes, named.codes)
    custom = digits(labels=[1, 2], method="lantern++", tree=([0, 0], [1], [0]), seed=3)  # any order, tuples too
    assert custom.config["method"]["tree"]["choices"] == [[0], [1], [0, 0]]
    assert custom.settings["tree"] == [[0], [1], [0, 0]]
    assert torch.equal(digits(labels=[1, 2], **custom.settings).codes, custom.codes)
    for tree, message in (([[1]], "sibling ranks must be contiguous"), ([[0], [0, 0, 0]], "has no parent"),
                          ([], "non-empty list of lists"), ([[0], [0]], "appears twice")):
        with pytest.raises(LanternError, match=rf"^tree: .*{re.escape(message)}"):
            digits(labels=[1], method="sd", tree=tree)


def test_the_command_line_takes_a_tree_as_its_choices(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--tree '[[0], [1], [0, 0]]'``: run.json records a ``--tree auto`` pick that no name spells as
    its choices (``static:auto_<hash>`` was refused as an unknown tree), which ``--tree`` now takes."""
    from lantern.cli.main import main

    base = ["generate", "--model", "digits", "--labels", "1,2", "--method", "sd", "--seed", "3", "--no-progress"]
    assert main([*base, "--tree", "[[0], [1], [0, 0]]", "--out", str(tmp_path / "a")]) == 0
    run = json.loads((tmp_path / "a" / "run.json").read_text())
    assert run["method"]["tree"]["choices"] == [[0], [1], [0, 0]]
    again = ["--tree", json.dumps(run["method"]["tree"]["choices"]), "--out", str(tmp_path / "b")]
    assert main([*base, *again]) == 0
    assert np.array_equal(np.load(tmp_path / "a" / "codes.npy"), np.load(tmp_path / "b" / "codes.npy"))
    capsys.readouterr()
    assert main([*base, "--tree", "[[0],", "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lantern: error: --tree [[0],: expected a JSON list of choices") and err.count("\n") == 1


def test_a_jacobi_window_of_auto_is_measured_as_tree_auto(digits: lantern.Pipeline) -> None:
    """``sjd_window="auto"`` was refused ("must be an integer >= 1") though ``--sjd-window auto``
    works and the docs give every setting one name (a probe, 2026-11-30)."""
    by_window = digits(labels=[1, 2], method="sjd-coupled", sjd_window="auto", seed=4, batch_size=2)
    by_tree = digits(labels=[1, 2], method="sjd-coupled", tree="auto", seed=4, batch_size=2)
    assert "auto_window" in by_window.config and by_window.config["auto_window"] == by_tree.config["auto_window"]
    assert torch.equal(by_window.codes, by_tree.codes)
    with pytest.raises(LanternError, match=r"^sjd_window='auto' chooses sjd-coupled's window; it cannot be combined "
                                           r"with tree='chain:3'$"):
        digits(labels=[1], method="sjd-coupled", sjd_window="auto", tree="chain:3")


@pytest.mark.parametrize("locked", [True, False])
def test_calls_from_two_threads_take_turns(locked: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads calling one pipeline at once: the second call's decode starts only after the
    first's has ended (they share the prepared method's caches), and each gets the codes it gets
    alone. The first call waits inside its decode until the second enters one, so without the lock
    (power: ``locked=False``) the two decodes are seen overlapping at their start; the test then
    runs them one after the other itself (run at once, they overflowed the shared KV cache with an
    IndexError). The wait: 2 s with the lock (the second cannot enter; any wait gives the same
    count), 60 s without (it returns when the second enters: a busy machine cannot make the power
    check miss)."""
    import contextlib
    import threading

    from lantern import api

    pipe = lantern.load("digits")
    if not locked:
        monkeypatch.setattr(pipe, "_call_lock", contextlib.nullcontext())
    run, inside, most, lock, decoding = api.Pipeline._run, [0], [0], threading.Lock(), threading.Lock()
    first_in, second_in = threading.Event(), threading.Event()

    def handshake(self: api.Pipeline, *args: Any) -> Any:
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            is_first = not first_in.is_set()
            (first_in if is_first else second_in).set()
        try:
            if is_first:
                second_in.wait(2.0 if locked else 60.0)  # the second call's decode, if it can start now
            with decoding:  # the overlap is seen at entry; two decodes on one cache must not really run
                return run(self, *args)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(api.Pipeline, "_run", handshake)
    results: dict[int, Any] = {}

    def call(label: int) -> None:
        results[label] = pipe(labels=[label], seed=label, method="sjd-coupled").codes

    first = threading.Thread(target=call, args=(3,))
    first.start()
    assert first_in.wait(60)
    second = threading.Thread(target=call, args=(5,))
    second.start()
    first.join()
    second.join()
    assert most[0] == (1 if locked else 2)
    monkeypatch.undo()
    for label in (3, 5):
        assert torch.equal(results[label], pipe(labels=[label], seed=label, method="sjd-coupled").codes)


def test_every_argument_and_setting_is_in_the_calls_help() -> None:
    """``help(pipe)`` / ``pipe.__call__.__doc__`` names every keyword a call takes, each in ``name``
    form; before, the settings were "temperature, top_k, tree, lantern_lambda, ..." (an audit,
    2026-11-30), so the rest were found only in the CLI's --help under other names."""
    from lantern.api import SAMPLING_SETTINGS

    doc = lantern.Pipeline.__call__.__doc__ or ""
    own = [name for name in inspect.signature(lantern.Pipeline.__call__).parameters if name not in ("self", "settings")]
    missing = [name for name in (*own, *METHOD_SETTINGS, *SAMPLING_SETTINGS) if f"``{name}``" not in doc]
    assert not missing, missing
