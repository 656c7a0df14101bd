"""``lantern generate``, ``demo``, ``bench``, ``serve`` and ``build-proximity`` on a tiny Emu3 folder
(transformers' classes and ``save_pretrained``, laid out like a converted download): they run, give
the codes of ``lantern.load(folder)(prompts=...)``, and refuse what Emu3 models do not take in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("transformers")

import lantern  # noqa: E402
from lantern.cli.main import main  # noqa: E402
from lantern.testing import make_tiny_emu3_folder  # noqa: E402

PROMPTS = ("a red car", "a cat on the grass")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_emu3_folder(tmp_path_factory.mktemp("emu3") / "model")


def _generate(folder: Path, out: Path, *extra: str) -> int:
    return main(["generate", "--model", str(folder), *(a for p in PROMPTS for a in ("--prompt", p)), "--out", str(out),
                 "--no-progress", *extra])


def test_generate_greedy_methods_agree_with_the_api(folder: Path, tmp_path: Path) -> None:
    """Greedy AR, coupled SJD and PJD at context = row length give the same codes through the CLI
    as through ``lantern.load``; the images have the VQ decoder's size; run.json records the grid
    and the folder's sampling defaults."""
    runs = {"ar": [], "sjd-coupled": ["--sjd-window", "6"], "pjd": ["--pjd-window", "2", "--pjd-context", "4"]}
    codes = {}
    for method, extra in runs.items():
        out = tmp_path / method
        assert _generate(folder, out, "--method", method, "--temperature", "0", *extra) == 0
        codes[method] = np.load(out / "codes.npy")
    assert codes["ar"].shape == (2, 16)
    assert (codes["sjd-coupled"] == codes["ar"]).all() and (codes["pjd"] == codes["ar"]).all()
    api = lantern.load(folder)(prompts=list(PROMPTS), method="ar", temperature=0.0)
    assert (api.codes.numpy() == codes["ar"]).all()
    run = json.loads((tmp_path / "ar" / "run.json").read_text())
    assert run["layout"] == {"name": "emu3", "height": 4, "width": 4, "pixel_size": [32, 32]}
    assert run["sampling"]["cfg_scale"] == 3.0 and run["sampling"]["top_k"] == 8  # the folder's generation.json
    assert Image.open(tmp_path / "ar" / "0001_prompt1.png").size == (32, 32)


def test_generate_image_size(folder: Path, tmp_path: Path) -> None:
    """``--image-size 48``: 6 x 6 codes, 48-pixel images, the API's codes at the same size."""
    out = tmp_path / "big"
    assert _generate(folder, out, "--image-size", "48", "--method", "pjd", "--pjd-window", "2", "--pjd-context", "6",
                     "--temperature", "0") == 0
    codes = np.load(out / "codes.npy")
    assert codes.shape == (2, 36) and Image.open(out / "0000_prompt0.png").size == (48, 48)
    api = lantern.load(folder, image_size=48)(prompts=list(PROMPTS), method="ar", temperature=0.0)
    assert (api.codes.numpy() == codes).all()


def test_generate_sampled_relaxed_row_with_the_folders_table(folder: Path, tmp_path: Path) -> None:
    args = ("--method", "sjd-coupled-lantern++", "--sjd-window", "4", "--seed", "5")
    assert _generate(folder, tmp_path / "a", *args) == 0
    assert _generate(folder, tmp_path / "b", *args) == 0
    a, b = np.load(tmp_path / "a" / "codes.npy"), np.load(tmp_path / "b" / "codes.npy")
    assert (a == b).all() and a.min() >= 0 and a.max() < 32
    run = json.loads((tmp_path / "a" / "run.json").read_text())
    assert run["method"]["relaxation"]["mode"] == "relative"


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--method", "lantern++"], "--method lantern++ needs a drafter: pass --drafter DIR"),
        (["--layout", "anole"], "--layout is not used by Emu3 models"),
        (["--t5", "/tmp"], "--t5 is not used by Emu3 models"),
        (["--compile"], "--compile is implemented for LlamaGen targets only, not Emu3 models"),
        (["--method", "sjd-coupled", "--sjd-window", "auto"], "pass a number for Emu3 models"),
        (["--image-size", "36"], "--image-size must be a positive multiple of 8 for Emu3 models"),
    ],
)
def test_generate_refuses_in_one_line(folder: Path, tmp_path: Path, extra: list[str], message: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert _generate(folder, out, *extra) == 2
    assert message in capsys.readouterr().err.splitlines()[-1]
    assert not out.exists()


def test_generate_refuses_labels_and_remote_code(folder: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(folder), "--labels", "1", "--out", str(tmp_path / "o")]) == 2
    assert "text-to-image Emu3 model; pass --prompt" in capsys.readouterr().err
    remote = tmp_path / "remote"
    remote.mkdir()
    for f in folder.iterdir():
        if f.is_file() and f.name != "config.json":
            (remote / f.name).symlink_to(f)
    config = json.loads((folder / "config.json").read_text()) | {"auto_map": {"AutoModelForCausalLM": "x.Y"}}
    (remote / "config.json").write_text(json.dumps(config))
    assert main(["generate", "--model", str(remote), "--prompt", "a cat", "--out", str(tmp_path / "o2")]) == 2
    assert "auto_map" in capsys.readouterr().err.splitlines()[-1]


def test_demo(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "demo"
    assert main(["demo", "--model", str(folder), "--methods", "ar,sjd-coupled", "--sjd-window", "4",
                 "--temperature", "0", "--num-images", "2", "--dtype", "float32", "--out", str(out),
                 "--no-progress"]) == 0
    rows = {r["method"]: r for r in json.loads((out / "demo.json").read_text())["results"]}
    assert rows["ar"]["target_forwards"] == 2 * 16 and rows["ar"]["mean_accepted"] == 1.0
    assert rows["sjd-coupled"]["target_forwards"] <= rows["ar"]["target_forwards"]


def test_bench(folder: Path, tmp_path: Path) -> None:
    """bench.json has a row per method, quality against AR's own images at other seeds."""
    import torch

    from lantern.models.features import FeatureNet, FeatureNetConfig

    torch.manual_seed(0)
    features = tmp_path / "features"
    FeatureNet(FeatureNetConfig(image_size=32, num_classes=2, widths=(8, 16), feature_dim=16,
                                norm_groups=4)).save_pretrained(features)
    out = tmp_path / "bench"
    methods = "ar,sjd-coupled/sjd_window=4,pjd/pjd_window=2/pjd_context=2"
    assert main(["bench", "--model", str(folder), "--methods", methods, "--num-images", "4", "--speed-images", "2",
                 "--batch-size", "4", "--num-real", "4", "--curve-images", "0", "--no-ar-spread", "--feature-net",
                 str(features), "--dtype", "float32", "--out", str(out), "--no-progress"]) == 0
    rows = json.loads((out / "bench.json").read_text())
    assert [r["base_method"] for r in rows] == ["ar", "sjd-coupled", "pjd"]
    for row in rows:
        assert all(math.isfinite(row[k]) for k in ("fid", "kid", "precision", "recall"))
        assert row["num_images"] == 4 and row["mean_accepted"] >= 1.0
    assert json.loads((out / "run.json").read_text())["reference"] == "ar"


def test_serve_gives_the_apis_codes(folder: Path) -> None:
    """A prompt request to the server gives the codes of ``lantern.load(folder)(prompts=[...])``;
    a label is the wrong field; the methods offered need no drafter."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from lantern.serve.app import create_app
    from lantern.serve.plan import runnable_methods
    from lantern.serve.scheduler import Scheduler

    pipe = lantern.load(folder, deterministic=True)  # the server's default
    assert "lantern++" not in runnable_methods(pipe) and "sjd-coupled" in runnable_methods(pipe)
    scheduler = Scheduler(pipe, max_batch=2, max_queue=4)
    scheduler.start()
    app = create_app(scheduler, pipeline=pipe, default_method="ar", max_prompt_chars=40)
    with TestClient(app) as c:
        r = c.post("/v1/images/generations", json={"label": 1})
        assert r.status_code == 400 and r.json()["error"]["field"] == "label", r.text
        body = {"prompt": "a red car", "n": 2, "seed": 4, "return_codes": True, "method": "pjd", "pjd_window": 2,
                "pjd_context": 2}
        r = c.post("/v1/images/generations", json=body)
        assert r.status_code == 200, r.text
    expected = pipe(prompts=["a red car"], num_per_label=2, seed=4, method="pjd", pjd_window=2, pjd_context=2)
    assert [d["codes"] for d in r.json()["data"]] == expected.codes.tolist()


def test_build_proximity_from_the_model_folder(folder: Path, tmp_path: Path) -> None:
    """``build-proximity --tokenizer FOLDER`` reads the VQ codebook out of the model's safetensors
    (no model is built); the table fits the stack and runs a relaxed PJD row through ``--proximity``."""
    import torch

    from lantern.targets.proximity import ProximityTable

    out = tmp_path / "prox.safetensors"
    assert main(["build-proximity", "--tokenizer", str(folder), "--k-max", "7", "--out", str(out)]) == 0
    pipe = lantern.load(folder, proximity=out)
    codebook = pipe.stack.codebook()
    ProximityTable.load(out).validate(codebook)
    d = torch.cdist(codebook, codebook)
    d.fill_diagonal_(float("inf"))
    assert ProximityTable.load(out).neighbours[:, 0].long().tolist() == d.argmin(1).tolist()
    assert _generate(folder, tmp_path / "g", "--method", "pjd-lantern", "--pjd-window", "2", "--pjd-context", "2",
                     "--lantern-k", "7", "--proximity", str(out)) == 0
