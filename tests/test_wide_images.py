"""Wide and tall images (``image_size`` = height, ``image_width``) on Lumina-mGPT's layout.

Lumina-mGPT generates at any size in 32-pixel patches (its item processor's crop sizes, 4:1 to
1:4): the prefix names the rows then the codes per row, the prompt the size as width x height, and
a new-line token ends every row of W codes. What the square tests prove must hold there too:
greedy lossless methods (a drafter's tree, SJD's windows that cross row ends, SJD-PAC, PJD at
context = row) give greedy AR's codes; a sampled row's codes do not depend on its batch; the
folder's CLI writes a W x H image. Cached AR against full recomputation and tree attention against
causal paths on these grids are in tests/test_chameleon.py. Emu3's wide and tall images are checked
against transformers' own generation in tests/test_emu3.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import CHAMELEON_PROMPTS, NON_SQUARE_LAYOUTS, chameleon_greedy_ar, chameleon_lm
from PIL import Image

import lantern
from lantern.cli.main import main
from lantern.decoding.config import SamplingConfig
from lantern.decoding.loop import generate
from lantern.decoding.sampling import make_generators
from lantern.errors import LanternError
from lantern.methods import MethodConfig
from lantern.models.chameleon import GRID_TOKEN_BASE, IMAGE_START_ID, lumina_layout
from lantern.targets.chameleon import encode_prompts
from lantern.targets.chameleon_stack import init_chameleon_drafter
from lantern.testing import chameleon_parts, make_tiny_chameleon_folder, make_tiny_janus_folder

CFG = 3.0


def _methods(width: int) -> dict[str, dict[str, Any]]:
    """Lossless methods with windows that cross a row end (rows of ``width`` codes)."""
    return {"sd": {"tree": "chain:3"}, "sjd": {"sjd_window": 4}, "sjd-coupled": {"sjd_window": 4},
            "sjd-pac": {"sjd_window": 3}, "pjd": {"pjd_window": 2, "pjd_context": width}}


@pytest.mark.parametrize("shape", list(NON_SQUARE_LAYOUTS))
@pytest.mark.parametrize("method", list(_methods(1)))
def test_greedy_lossless_methods_reproduce_ar_on_wide_and_tall_grids(shape: str, method: str) -> None:
    lay = NON_SQUARE_LAYOUTS[shape]
    ids, mask = encode_prompts(CHAMELEON_PROMPTS, lay)
    lm = chameleon_lm()
    resolved = MethodConfig.resolve(method, **_methods(lay.width)[method])
    drafter = init_chameleon_drafter(lm, lay).eval() if method == "sd" else None
    target, draft = chameleon_parts(lm, lay, SamplingConfig(temperature=0.0, top_k=0, cfg_scale=CFG), resolved,
                                    drafter, lm.image_head)
    out = generate(target, ids, drafter=draft, cond_mask=mask)
    ar = chameleon_greedy_ar(lay, CFG)
    assert ar.shape == (3, lay.height * lay.width)
    assert torch.equal(out.codes, ar)


def test_the_wide_and_tall_grids_decode_differently() -> None:
    """Power for the equalities above: the two grids (the same 10 codes, rows of 5 or of 2) are not
    one image, so a loop that took the row length from anywhere but the layout would not match."""
    assert not torch.equal(chameleon_greedy_ar(NON_SQUARE_LAYOUTS["wide"], CFG),
                           chameleon_greedy_ar(NON_SQUARE_LAYOUTS["tall"], CFG))


@pytest.mark.parametrize("method,settings", [("sjd-coupled", {"sjd_window": 4}),
                                             ("pjd", {"pjd_window": 2, "pjd_context": 1})])
def test_sampled_rows_do_not_depend_on_the_batch_on_a_wide_grid(method: str, settings: dict[str, Any]) -> None:
    lay, lm = NON_SQUARE_LAYOUTS["wide"], chameleon_lm()
    sampling = SamplingConfig(temperature=1.0, top_k=8, cfg_scale=2.0)
    resolved = MethodConfig.resolve(method, **settings)

    def run(prompts: list[list[int]], seeds: list[int]) -> torch.Tensor:
        ids, mask = encode_prompts(prompts, lay)
        target, drafter = chameleon_parts(lm, lay, sampling, resolved, None, lm.image_head)
        return generate(target, ids, generators=make_generators(seeds), drafter=drafter, cond_mask=mask).codes

    together = run(CHAMELEON_PROMPTS, [1, 2, 3])
    for i in range(3):
        assert torch.equal(together[i], run(CHAMELEON_PROMPTS[i : i + 1], [i + 1])[0]), i
    assert len({tuple(r.tolist()) for r in together}) == 3  # sampled: three different images


def test_lumina_layout_names_rows_then_columns() -> None:
    """Lumina-mGPT's item processor writes <image start>, <rows in 32 px>, <columns in 32 px>; its
    prompt template names the size width x height."""
    lay = lumina_layout(512, 1024)
    assert lay.prefix == (IMAGE_START_ID, GRID_TOKEN_BASE + 16, GRID_TOKEN_BASE + 32)
    assert (lay.height, lay.width, lay.pixel_size) == (32, 64, (512, 1024))
    assert lay.format_prompt("a cat").startswith("Generate an image of 1024x512 according to")
    with pytest.raises(LanternError, match="--image-width must be a positive multiple of 32, got 100"):
        lumina_layout(512, 100)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_chameleon_folder(tmp_path_factory.mktemp("wide") / "model")


def test_cli_writes_a_wide_image(folder: Path, tmp_path: Path) -> None:
    """``--image-size 32 --image-width 96`` on a Lumina-mGPT folder: 2 rows of 6 codes, a PNG three
    times as wide as high (the tiny VQGAN decodes 2 pixels a code, not 16), and run.json's layout
    says so; the same from Python, code for code."""
    out = tmp_path / "o"
    assert main(["generate", "--model", str(folder), "--prompt", "a cat", "--image-size", "32", "--image-width", "96",
                 "--method", "sjd-coupled", "--sjd-window", "4", "--seed", "5", "--out", str(out),
                 "--no-progress"]) == 0
    run = json.loads((out / "run.json").read_text())
    assert run["layout"] == {"name": "lumina-mgpt", "height": 2, "width": 6, "pixel_size": [32, 96]}
    [png] = [p for p in out.glob("0000_*.png")]
    with Image.open(png) as image:
        size = image.size
    assert size == (6 * size[1] // 2, size[1]) and size[1] > 0
    pipe = lantern.load(folder, image_size=32, image_width=96)
    same = pipe(prompts=["a cat"], method="sjd-coupled", sjd_window=4, seed=5)
    assert np.array_equal(np.load(out / "codes.npy"), same.codes.numpy())
    assert same.images[0].size == size


@pytest.mark.parametrize(
    "extra,message",
    [(["--image-width", "100"], "--image-width must be a positive multiple of 32, got 100"),
     (["--layout", "anole", "--image-width", "1024"], "Anole generates 512 x 512 images; --image-width 1024 is not "
                                                       "supported")],
)
def test_bad_widths_are_refused_in_one_line(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            extra: list[str], message: str) -> None:
    assert main(["generate", "--model", str(folder), "--prompt", "a cat", "--out", str(tmp_path / "o"),
                 "--no-progress", *extra]) == 2
    err = capsys.readouterr().err
    assert err == f"lantern: error: {message}\n"
    assert not (tmp_path / "o").exists()


def test_image_width_is_refused_for_fixed_size_families(tmp_path: Path) -> None:
    with pytest.raises(LanternError, match=r"^image_width is only used with Lumina-mGPT and Emu3 models$"):
        lantern.load("digits", image_width=64)
    janus = make_tiny_janus_folder(tmp_path / "janus")
    with pytest.raises(LanternError, match=r"^image_width is not used by Janus models"):
        lantern.load(janus, image_width=64)
    with pytest.raises(LanternError, match=r"load\(\) has no argument 'width' \(did you mean 'image_width'\?\)"):
        lantern.load("digits", width=64)  # type: ignore[call-arg]
