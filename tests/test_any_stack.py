"""``demo``, ``bench``, ``profile`` and ``generate --tree auto`` on every model family: a tiny
Lumina-mGPT folder (row-end tokens), a tiny Anole folder and a tiny text-to-image LlamaGen stack
(prompts instead of labels), built offline, and Janus / Emu3 folders for `profile --trace`. They
write the files they write for the presets
(``digits``): the same names, the same row fields, the chosen tree in run.json."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lantern.cli.main import main
from lantern.decoding.config import TreeConfig
from lantern.testing import make_tiny_chameleon_folder, make_tiny_emu3_folder, make_tiny_janus_folder

pytest.importorskip("transformers")
pytest.importorskip("yaml")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# What the commands write for a preset (lantern.eval.demo.save_demo, lantern.eval.report.save_bench with the
# tau curves off, lantern.autotree.profile.save_profile).
DEMO_FILES = {"demo.json", "demo.md", "demo_grid.png"}
PROFILE_FILES = {"profile.json", "verify_cost.png"}
BENCH_FILES = {"bench.json", "bench.md", "run.json", "grid_ar.png", "grid_sd.png", "frontier.png"}
# A preset's bench.json row, less class accuracy (these models have no classes).
BENCH_ROW_FIELDS = {"method", "base_method", "tree", "relaxation", "mean_accepted", "target_forwards", "wall_seconds",
                    "seconds_per_image", "speedup_vs_ar", "speedup_ci", "num_images", "speed_images",
                    "wall_seconds_repeats", "chunk_seconds", "startup_seconds", "fid", "kid", "precision", "recall",
                    "kid_std", "feature_net", "outside_ar_spread", "better_than_ar"}
CHAIN_2 = TreeConfig.parse("chain:2").to_dict()  # as run.json records it
TOKENS = {"lumina": 16, "anole": 1024, "t2i": 64}  # image tokens of each tiny model
PIXELS = {"lumina": 8, "t2i": 32}  # image side of each tiny model


def _feature_net(out: Path, size: int) -> Path:
    """A random lantern feature net for ``size``-pixel RGB images (the metrics need only a fixed map)."""
    import torch

    from lantern.models.features import FeatureNet, FeatureNetConfig

    torch.manual_seed(0)
    FeatureNet(FeatureNetConfig(image_size=size, num_classes=2, widths=(8, 16), feature_dim=16,
                                norm_groups=4)).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def lumina(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_chameleon_folder(tmp_path_factory.mktemp("lumina") / "model", "lumina-mgpt", 64)


@pytest.fixture(scope="module")
def anole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_chameleon_folder(tmp_path_factory.mktemp("anole") / "model", "anole", None)


def _model(request: pytest.FixtureRequest, kind: str) -> list[str]:
    """``--model`` (with the layout's image size) of the tiny model of ``kind``."""
    if kind == "lumina":
        return ["--model", str(request.getfixturevalue("lumina")), "--image-size", "64"]
    if kind == "anole":
        return ["--model", str(request.getfixturevalue("anole"))]
    return ["--model", str(request.getfixturevalue("t2i_stack"))]


def _json(path: Path) -> Any:
    return json.loads(path.read_text())


@pytest.mark.parametrize("kind", [*(pytest.param(k, marks=pytest.mark.slow) for k in ("lumina", "anole")), "t2i"])
def test_demo(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """The preset's files; AR is the baseline (one token per forward); the drafted method ran its
    tree over the same number of images."""
    out = tmp_path / "demo"
    images = 1 if kind == "anole" else 2
    assert main(["demo", *_model(request, kind), "--methods", "ar,sd", "--tree", "chain:2", "--temperature", "0",
                 "--num-images", str(images), "--dtype", "float32", "--out", str(out), "--no-progress"]) == 0
    assert {p.name for p in out.iterdir()} == DEMO_FILES
    demo = _json(out / "demo.json")
    rows = {r["method"]: r for r in demo["results"]}
    assert list(rows) == ["ar", "sd"] and demo["num_images"] == images
    assert rows["ar"]["mean_accepted"] == 1.0 and rows["ar"]["target_forwards"] == images * TOKENS[kind]
    assert rows["sd"]["resolved"]["tree"] == CHAIN_2
    # a drafted forward accepts at least its root: never more forwards than AR
    assert rows["sd"]["mean_accepted"] >= 1.0 and rows["sd"]["target_forwards"] <= rows["ar"]["target_forwards"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lumina", "t2i"])
def test_bench(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """bench.json has one row per method with a preset's fields (no class accuracy: no classes);
    FID / KID / precision / recall are computed against AR images at other seeds (run.json says
    so)."""
    out, features = tmp_path / "bench", _feature_net(tmp_path / "features", PIXELS[kind])
    assert main(["bench", *_model(request, kind), "--methods", "ar,sd", "--tree", "sd=chain:2",
                 "--num-images", "4", "--speed-images", "2", "--batch-size", "4", "--num-real", "4",
                 "--curve-images", "0", "--no-ar-spread", "--feature-net", str(features), "--dtype", "float32",
                 "--out", str(out), "--no-progress"]) == 0
    assert {p.name for p in out.iterdir()} == BENCH_FILES
    rows = {r["method"]: r for r in _json(out / "bench.json")}
    assert list(rows) == ["ar", "sd"]
    for row in rows.values():
        assert set(row) == BENCH_ROW_FIELDS
        assert all(math.isfinite(row[k]) for k in ("fid", "kid", "precision", "recall"))
        assert row["num_images"] == 4 and row["speed_images"] == 2
    assert rows["sd"]["tree"] == "chain:2" and rows["ar"]["speedup_vs_ar"] == 1.0
    assert rows["ar"]["speedup_ci"] == [1.0, 1.0] and 0 < rows["sd"]["speedup_ci"][0] <= rows["sd"]["speedup_ci"][1]
    assert rows["sd"]["mean_accepted"] >= 1.0 and rows["ar"]["mean_accepted"] == 1.0
    run = _json(out / "run.json")
    assert run["reference"] == "ar" and run["num_real"] == 4
    assert "against 4 AR samples (the model has no data set" in (out / "bench.md").read_text()  # not "real images"
    assert run["methods"]["sd"]["tree"] == CHAIN_2


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lumina", "t2i"])
def test_profile(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """A quick device profile: verify costs from 1 token up to --max-tokens, drafter costs, an
    overhead fit per acceptance rule the folder supports (it has a proximity table)."""
    out = tmp_path / "profile"
    assert main(["profile", *_model(request, kind), "--quick", "--max-tokens", "4", "--repeats", "1",
                 "--dtype", "float32", "--out", str(out), "--no-progress"]) == 0
    assert {p.name for p in out.iterdir()} == PROFILE_FILES
    profile = _json(out / "profile.json")
    assert profile["verify"]["tokens"][0] == 1 and profile["verify"]["tokens"][-1] == 4
    assert all(ms > 0 for ms in profile["verify"]["ms"] + profile["drafter"]["feed_ms"])
    assert set(profile["overhead"]) == {"exact", "lantern", "lantern++"}
    assert profile["model_shape"]["block_size"] == TOKENS[kind]
    assert profile["prefix_tokens"] == TOKENS[kind] // 2


def test_trace_on_prompt_models(tmp_path: Path) -> None:
    """``profile --trace`` on Janus and Emu3 folders (prompts, guidance rows, Emu3's row ends): every
    round of every image is accounted for (AR: one per token after the prefill's), and a Janus
    forward adds no host sync to the decoder both families share (its image embedding once read
    the ids on the host: a sync per round, a graph break when compiled)."""
    folders = {"janus": make_tiny_janus_folder(tmp_path / "janus"), "emu3": make_tiny_emu3_folder(tmp_path / "emu3")}
    traces = {}
    for name, folder in folders.items():
        out = tmp_path / f"trace-{name}"
        assert main(["profile", "--model", str(folder), "--trace", "ar,sjd-coupled/window=4", "--trace-images", "2",
                     "--batch-size", "2", "--out", str(out), "--no-progress"]) == 0
        traces[name] = {m["method"]: m for m in _json(out / "trace.json")["methods"]}
        ar, sjd = traces[name]["ar"], traces[name]["sjd-coupled/window=4"]
        assert ar["tau"] == 1.0 and ar["rounds"] == 16 - 1  # both tiny folders: 4 x 4 codes, one batch of 2
        assert sjd["tau"] >= 1.0 and sjd["rounds"] <= ar["rounds"]
    # eager: one read of the forward's window (the longest row, the least padding; Emu3 also how many
    # row ends a row reaches this round)
    assert traces["janus"]["ar"]["syncs"]["verify"] == 1 and traces["emu3"]["ar"]["syncs"]["verify"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lumina", "t2i"])
def test_generate_tree_auto(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """``--tree auto`` measures, calibrates on the model's own prompts and decodes with the tree it
    chose: run.json records the choice, and the method ran with that tree (or plain AR when the
    choice is AR)."""
    out = tmp_path / "gen"
    assert main(["generate", *_model(request, kind), "--prompt", "a red car", "--method", "lantern++",
                 "--tree", "auto", "--dtype", "float32", "--out", str(out), "--no-progress"]) == 0
    run = _json(out / "run.json")
    choice = run["auto_tree"]
    assert choice["method"] == "lantern++"
    if choice["tree"] == "ar":  # speculation predicted to lose on this machine: plain AR
        assert run["method"]["method"] == "ar"
    else:
        assert run["method"]["method"] == "lantern++"
        # A tree the search built (static:auto_<hash>, picked when the measured costs favour it: on a
        # busy machine, say) is recorded by its choices; a chain or named tree by its spec.
        built = choice["tree"].startswith("static:auto_")
        chosen = TreeConfig.from_choices(choice["choices"]) if built else TreeConfig.parse(choice["tree"])
        assert run["method"]["tree"] == chosen.to_dict()  # the fields its kind reads (a chain: its depth)
        assert not built or choice["tree"] == f"static:{chosen.name}"  # the name is the shape's hash
    assert np.load(out / "codes.npy").shape == (1, TOKENS[kind])


@pytest.mark.parametrize("tree", ["chain:1", "static:cpu_6", "built"])
def test_each_kind_of_auto_choice_is_recorded_as_the_test_above_reads_it(tree: str) -> None:
    """Which tree ``--tree auto`` picks depends on the machine's measured costs (a busy machine
    picked chain:1 once, whose record is the chain's fields only): the comparison above must hold
    for every kind it can meet, whichever one this machine's timing gives it."""
    from lantern.methods import MethodConfig

    chosen = TreeConfig.from_choices([[0], [1], [0, 0]]) if tree == "built" else TreeConfig.parse(tree)
    assert MethodConfig.resolve("lantern++", tree=chosen).to_dict()["tree"] == chosen.to_dict()


def test_conditions_of_the_wrong_kind_are_refused(lumina: Path, tmp_path: Path) -> None:
    """Every stack's ``encode`` takes its own kind of condition and names the other in one line."""
    import lantern
    from lantern.errors import LanternError
    from lantern.testing import make_random_stack

    chameleon = lantern.load(lumina, image_size=64).stack
    c2i = lantern.load(make_random_stack(tmp_path / "c2i", grid=2)).stack
    assert chameleon.encode(["a cat"], repeats=2).cond.shape[0] == 2
    assert c2i.encode([np.int64(3), 1]).cond.tolist() == [3, 1]
    with pytest.raises(LanternError, match="is a text-to-image model; pass prompts"):
        chameleon.encode([1])
    with pytest.raises(LanternError, match="is a class-conditional model; pass labels"):
        c2i.encode(["a cat"])
