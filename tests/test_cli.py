"""The ``lantern`` command line: outputs, run.json, errors without partial files."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from lantern.cli.main import main
from lantern.decoding.config import SamplingConfig
from lantern.decoding.loop import generate
from lantern.decoding.sampling import make_generators
from lantern.models.llamagen import LlamaGen
from lantern.run import image_seed
from lantern.targets.llamagen import LlamaGenTarget
from lantern.testing import make_random_stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_stack(tmp_path_factory.mktemp("stack") / "random", seed=1)


def test_generate_writes_images_codes_and_run_json(stack: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    rc = main(
        [
            "generate",
            "--model",
            str(stack),
            "--labels",
            "0,3,7",
            "--num-per-label",
            "2",
            "--seed",
            "5",
            "--out",
            str(out),
            "--top-k",
            "40",
            "--cfg-scale",
            "2",
            "--batch-size",
            "4",
            "--no-progress",
        ]
    )
    assert rc == 0
    pngs = sorted(p.name for p in out.glob("0*.png"))
    assert pngs == [
        "0000_label0.png",
        "0001_label0.png",
        "0002_label3.png",
        "0003_label3.png",
        "0004_label7.png",
        "0005_label7.png",
    ]
    assert Image.open(out / "0000_label0.png").size == (32, 32)
    assert Image.open(out / "grid.png").size == (2 * 34 + 2, 3 * 34 + 2)
    codes = np.load(out / "codes.npy")
    assert codes.shape == (6, 64) and codes.dtype == np.int64
    run = json.loads((out / "run.json").read_text())
    assert run["labels"] == [0, 0, 3, 3, 7, 7]
    assert run["sampling"] == {"temperature": 1.0, "top_k": 40, "top_p": 1.0, "cfg_scale": 2.0}
    # what made it (a probe, 2026-11-29: no version, and "command" was the word "generate")
    import lantern

    assert run["command"] == f"lantern generate --model {stack} --labels 0,3,7 --num-per-label 2 --seed 5 --out " \
                             f"{out} --top-k 40 --cfg-scale 2 --batch-size 4 --no-progress"
    assert (run["lantern"], run["torch"]) == (lantern.__version__, torch.__version__)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", run["date"]) and run["python"].startswith("3.")
    stats = run["stats"]
    assert stats["generated_tokens"] == 6 * 64 and stats["target_forwards"] == 6 * 64
    assert stats["mean_accepted"] == 1.0 and stats["wall_seconds"] > 0
    assert stats["elapsed_seconds"] >= stats["wall_seconds"]  # decoding, then the PNGs, records and files
    # The codes are those of the library call with the same per-image seeds, in label order.
    model = LlamaGen.from_pretrained(stack / "target")
    target = LlamaGenTarget(model, SamplingConfig(top_k=40, cfg_scale=2.0))
    gens = make_generators([image_seed(5, i) for i in range(6)])
    expect = generate(target, torch.tensor([0, 0, 3, 3, 7, 7]), generators=gens).codes
    assert np.array_equal(codes, expect.numpy())


def test_batch_size_does_not_change_images(stack: Path, tmp_path: Path) -> None:
    args = ["generate", "--model", str(stack), "--labels", "1,2,3", "--seed", "0", "--no-progress"]
    main([*args, "--out", str(tmp_path / "a"), "--batch-size", "1"])
    main([*args, "--out", str(tmp_path / "b"), "--batch-size", "3"])
    assert np.array_equal(np.load(tmp_path / "a" / "codes.npy"), np.load(tmp_path / "b" / "codes.npy"))


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--labels", "0,10"], "label 10 is out of range"),
        (["--labels", "0", "--temperature", "-1"], "temperature must be >= 0"),
        (["--labels", "0", "--top-p", "0"], r"top_p must be in \(0, 1\]"),
        (["--labels", "0", "--top-p", "1.5"], r"top_p must be in \(0, 1\]"),
        (["--labels", "0", "--top-k", "1000"], r"top_k \(1000\) is larger than the vocabulary"),
    ],
)
def test_bad_input_is_reported_without_partial_output(
    stack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    out = tmp_path / "out"
    rc = main(["generate", "--model", str(stack), "--out", str(out), "--no-progress", *extra])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("lantern: error: ")
    assert re.search(message, err)
    assert not out.exists() or list(out.iterdir()) == []


def test_unwritable_output_directory(stack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc = main(["generate", "--model", str(stack), "--labels", "0", "--out", str(blocker / "sub"), "--no-progress"])
    assert rc == 2
    assert "--out: cannot create directory" in capsys.readouterr().err
    rc = main(["generate", "--model", str(stack), "--labels", "0", "--out", "/proc/lantern-out", "--no-progress"])
    assert rc == 2
    # "/proc is not writable (No such file or directory)" before (a probe, 2026-11-30), then "cannot create
    # directory /proc", a folder that exists (an audit, 2026-11-30)
    assert capsys.readouterr().err == ("lantern: error: --out: cannot write into /proc: making a folder in /proc "
                                       "failed (No such file or directory)\n")


def test_file_names_sort_in_request_order_past_ten_thousand_images() -> None:
    """4 index digits up to 10,000 images (0000 .. 9999), 5 from 10,001: a 4-digit name 10000_...
    would sort between 1000_ and 1001_, and a sorted listing would no longer pair with codes.npy."""
    from argparse import Namespace

    from lantern.cli.generate import _condition_record

    for count, first, last in [(10_000, "0000_label3.png", "9999_label3.png"),
                               (10_001, "00000_label3.png", "10000_label3.png")]:
        names, _ = _condition_record(None, Namespace(labels=[3], num_per_label=count, indices=None), None, None)
        assert (names[0], names[-1], len(names)) == (first, last, count) and sorted(names) == names


def test_grid_is_a_row_per_label_while_short_else_square() -> None:
    from lantern.jobs import grid_columns

    assert grid_columns(6, 2) == 2 and grid_columns(16, 1) == 1  # 3 and 16 rows: a row per label
    assert grid_columns(256, 50) == 50  # 6 rows of 50
    assert grid_columns(17, 1) == 5 and grid_columns(256, 1) == 16 and grid_columns(256, 2) == 16  # square


def test_labels_take_inclusive_ranges() -> None:
    from lantern.cli.common import int_list

    assert int_list("0-3, 7,10 - 11,5-5") == [0, 1, 2, 3, 7, 10, 11, 5]
    assert int_list("0-999") == list(range(1000)) and int_list("-1") == [-1]  # -1: refused later, by the model's range


def test_missing_model_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "--model", str(tmp_path / "nope"), "--labels", "0", "--out", str(tmp_path / "o")])
    assert rc == 2
    assert "--model: no such model folder" in capsys.readouterr().err
    # named as typed (Path would print org//name as org/name, a repo id it is not), with the id's form
    assert main(["generate", "--model", "org//name", "--labels", "0", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "--model: no such model folder org//name (embedded presets: digits, photos; a Hugging Face repo id is "
        "ORG/NAME)")


@pytest.mark.slow
def test_console_script_and_core_import_without_extras() -> None:
    """``import lantern`` pulls in no optional extras (transformers, accelerate, pytest, the serve extra)."""
    code = (
        "import sys, lantern, lantern.decoding.loop, lantern.cli; "
        "bad = [m for m in ('transformers', 'accelerate', 'pytest', 'matplotlib', 'fastapi', 'uvicorn') "
        "if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    res = subprocess.run([sys.executable, "-m", "lantern.cli", "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "generate" in res.stdout


@pytest.mark.slow
def test_speculative_methods_from_the_cli(stack: Path, tmp_path: Path) -> None:
    """Greedy: every method (the stack's own drafter and proximity table) reproduces AR's codes."""
    base = [
        "generate",
        "--model",
        str(stack),
        "--labels",
        "1,4",
        "--temperature",
        "0",
        "--cfg-scale",
        "2",
        "--no-progress",
    ]
    assert main([*base, "--out", str(tmp_path / "ar")]) == 0
    ar = np.load(tmp_path / "ar" / "codes.npy")
    for method, tree in [("sd", "dynamic"), ("sd-static", "chain:3"), ("lantern", None), ("lantern++", None)]:
        out = tmp_path / method
        extra = ["--tree", tree] if tree else []
        assert main([*base, "--out", str(out), "--method", method, *extra]) == 0
        run = json.loads((out / "run.json").read_text())
        assert run["method"]["method"] == method
        if method.startswith("sd"):
            assert np.array_equal(np.load(out / "codes.npy"), ar)
            assert run["stats"]["target_forwards"] <= 2 * 64
    lantern = json.loads((tmp_path / "lantern" / "run.json").read_text())["method"]["relaxation"]
    assert lantern["k"] == 64 and lantern["delta"] == 0.1  # default k = 1000 capped at K_max = 64


@pytest.mark.slow
def test_build_proximity_cli(stack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lantern.models.vq import VQModel
    from lantern.targets.proximity import ProximityTable

    out = tmp_path / "prox.safetensors"
    assert main(["build-proximity", "--tokenizer", str(stack / "tokenizer"), "--k-max", "16", "--out", str(out)]) == 0
    table = ProximityTable.load(out)
    codebook = VQModel.from_pretrained(stack / "tokenizer").quantize.embedding.weight.detach()
    table.validate(codebook)
    d = torch.cdist(codebook.double(), codebook.double())
    d.fill_diagonal_(float("inf"))
    assert torch.equal(table.neighbours_for(16)[:, 0], d.argmin(dim=1))
    # A table for another codebook is refused with a clear message.
    rc = main(
        [
            "generate",
            "--model",
            str(stack),
            "--labels",
            "0",
            "--out",
            str(tmp_path / "g"),
            "--method",
            "lantern",
            "--proximity",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    other = tmp_path / "other"
    make_random_stack(other, seed=9)
    rc = main(
        [
            "generate",
            "--model",
            str(stack),
            "--labels",
            "0",
            "--out",
            str(tmp_path / "h"),
            "--method",
            "lantern",
            "--proximity",
            str(other / "proximity.safetensors"),
            "--no-progress",
        ]
    )
    assert rc == 2
    assert "codebook" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lantern", "lantern++", "sjd-lantern"])
def test_lantern_budget_is_recorded(stack: Path, tmp_path: Path, method: str) -> None:
    """--lantern-budget token reaches the acceptance rule's config and run.json; with an exact
    method the flag is an error (exit 2, no output)."""
    out = tmp_path / method
    argv = ["generate", "--model", str(stack), "--labels", "1", "--no-progress", "--out", str(out)]
    assert main([*argv, "--method", method, "--lantern-budget", "token"]) == 0
    run = json.loads((out / "run.json").read_text())
    assert run["method"]["relaxation"]["budget"] == "token"
    assert main([*argv[:-1], str(tmp_path / "sd"), "--method", "sd", "--lantern-budget", "token"]) == 2
    assert not (tmp_path / "sd").exists() or list((tmp_path / "sd").iterdir()) == []


def test_build_proximity_default_k_max_fits_a_small_codebook(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """The default --k-max (1024) was refused for both presets' 1024-code tokenizers ("k_max must be
    in [1, V-1 = 1023]"), a value the user never passed; without the flag every other code is kept."""
    from lantern.targets.llamagen_stack import preset_dir
    from lantern.targets.proximity import ProximityTable

    tokenizer = str(preset_dir("digits") / "tokenizer")
    out = tmp_path / "prox.safetensors"
    assert main(["build-proximity", "--tokenizer", tokenizer, "--out", str(out)]) == 0
    table = ProximityTable.load(out)
    assert table.k_max == table.vocab_size - 1 == 1023
    # an explicit value is taken as given, and refused when too large
    assert main(["build-proximity", "--tokenizer", tokenizer, "--k-max", "5000", "--out", str(tmp_path / "p2")]) == 2
    assert "--k-max must be in 1..1023 (the codebook's other entries), got 5000" in capsys.readouterr().err


def test_build_proximity_never_writes_over_its_tokenizer(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """``--out TOKENIZER/model.safetensors --overwrite`` replaced the tokenizer's weights with the
    table (a probe, 2026-11-30); the tokenizer's files, or the tokenizer file itself, are refused.
    A table may still go into the folder (a Janus / Emu3 model folder's own proximity.safetensors),
    and replace an older table there."""
    import shutil

    from lantern.targets.llamagen_stack import preset_dir
    from lantern.targets.proximity import ProximityTable

    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(preset_dir("digits") / "tokenizer", tokenizer)
    weights = (tokenizer / "model.safetensors").read_bytes()
    for name in ("model.safetensors", "config.json"):
        argv = ["build-proximity", "--tokenizer", str(tokenizer), "--k-max", "4", "--out", str(tokenizer / name),
                "--overwrite", "--no-progress"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"is a file of --tokenizer {tokenizer}, which this command reads" in err, err
    assert (tokenizer / "model.safetensors").read_bytes() == weights
    table = tokenizer / "proximity.safetensors"
    for extra in ([], ["--overwrite"]):  # a new table in the folder, then that table replaced
        assert main(["build-proximity", "--tokenizer", str(tokenizer), "--k-max", "4", "--out", str(table),
                     "--no-progress", *extra]) == 0
    assert ProximityTable.load(table).k_max == 4 and (tokenizer / "model.safetensors").read_bytes() == weights


def test_a_tokenizer_other_than_the_targets_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A target lantern trained records its tokenizer's codebook (train_config.json); another
    tokenizer of the same size decoded its codes to noise without a word (a probe, 2026-11-30)."""
    import shutil

    from lantern.io import write_json
    from lantern.models.vq import VQModel
    from lantern.targets.llamagen_stack import load_stack
    from lantern.testing import make_random_stack
    from lantern.train.codes import codebook_sha256

    stack = make_random_stack(tmp_path / "stack", seed=3)
    other = make_random_stack(tmp_path / "other", seed=4) / "tokenizer"  # same size, another codebook
    own = codebook_sha256(VQModel.from_pretrained(stack / "tokenizer"))
    assert own != codebook_sha256(VQModel.from_pretrained(other))
    write_json(stack / "target" / "train_config.json", {"kind": "target", "task": {"data": {
        "tokenizer_codebook_sha256": own}}})
    assert load_stack(stack).target is not None  # its own tokenizer: loads
    argv = ["generate", "--model", str(stack), "--labels", "1", "--out", str(tmp_path / "o"), "--no-progress"]
    assert main([*argv, "--tokenizer", str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lantern: error: --tokenizer {other} is not the tokenizer this target was trained "
                          "with: its codebook differs") and "\n" not in err
    shutil.rmtree(stack / "tokenizer")
    shutil.copytree(other, stack / "tokenizer")
    assert main(argv) == 2
    assert f"--model {stack}: its tokenizer/ is not the tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_lantern_folder_of_another_kind_is_named(tmp_path: Path) -> None:
    """A drafter given as a target passed for an HF port ("HF config is missing
    'num_hidden_layers'"), a target given as a drafter for an official drafter ("... missing
    'hidden_size'"): each is now named by what it holds (a probe, 2026-11-30)."""
    from lantern.errors import LanternError
    from lantern.models.drafter import EagleDrafterModel
    from lantern.models.llamagen import LlamaGen
    from lantern.testing import make_random_stack

    stack = make_random_stack(tmp_path / "stack", seed=3)
    with pytest.raises(LanternError, match=r"drafter holds an EAGLE drafter \(model_type 'lantern-eagle-drafter'\), "
                                           r"not a LlamaGen target$"):
        LlamaGen.from_pretrained(stack / "drafter")
    with pytest.raises(LanternError, match=r"target holds a LlamaGen target .*, not an EAGLE drafter$"):
        EagleDrafterModel.from_pretrained(stack / "target")
    with pytest.raises(LanternError, match=r"tokenizer holds a VQ tokenizer .*, not a LlamaGen target$"):
        LlamaGen.from_pretrained(stack / "tokenizer")


def test_a_drafter_trained_for_another_target_is_named(tmp_path: Path) -> None:
    """A drafter for another target of the same shape passed every check and drafted in vain (a
    probe, 2026-11-30): its record's lm_head hash now gives a warning. The hash is of the head in
    bfloat16, so a bfloat16 load of the right target matches it too."""
    import warnings

    import lantern
    from lantern.drafters.checks import HEAD_SHA_KEY, head_sha256
    from lantern.io import LanternWarning, write_json
    from lantern.testing import make_random_stack

    stack = make_random_stack(tmp_path / "stack", seed=3)
    pipe = lantern.load(stack)
    record = stack / "drafter" / "drafter_training.json"
    write_json(record, {HEAD_SHA_KEY: head_sha256(pipe.stack.target.output.weight)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for its own target, in float32 or bfloat16
        pipe.stack.load_drafter(stack / "drafter")
        lantern.load(stack, dtype="bfloat16").stack.load_drafter(stack / "drafter")
    write_json(record, {HEAD_SHA_KEY: head_sha256(torch.zeros_like(pipe.stack.target.output.weight))})
    with pytest.warns(LanternWarning, match="was trained for another target .*few drafts will be accepted"):
        pipe.stack.load_drafter(stack / "drafter")


def test_no_grid_leaves_only_the_samples_as_pngs(stack: Path, tmp_path: Path) -> None:
    """An evaluation reads every PNG of a folder as a sample (clean-fid; LANTERN's HPS script stops
    on a name without an index): ``--no-grid`` leaves the images alone, the same images."""
    argv = ["generate", "--model", str(stack), "--labels", "0,3", "--num-per-label", "2", "--no-progress",
            "--method", "sjd-coupled"]
    assert main([*argv, "--out", str(tmp_path / "grid")]) == 0
    assert main([*argv, "--out", str(tmp_path / "plain"), "--no-grid"]) == 0
    samples = ["0000_label0.png", "0001_label0.png", "0002_label3.png", "0003_label3.png"]
    assert sorted(p.name for p in (tmp_path / "grid").glob("*.png")) == [*samples, "grid.png"]
    assert sorted(p.name for p in (tmp_path / "plain").glob("*.png")) == samples
    # run.json has each image's target forwards, in codes.npy's order: their mean ratio is mean_accepted
    stats = json.loads((tmp_path / "plain" / "run.json").read_text())["stats"]
    per_image = stats["target_forwards_per_image"]
    assert len(per_image) == 4 and sum(per_image) == stats["target_forwards"] and len(set(per_image)) > 1
    assert np.isclose(np.mean([stats["tokens_per_image"] / f for f in per_image]), stats["mean_accepted"])
    for name in samples:
        assert (tmp_path / "grid" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes()
