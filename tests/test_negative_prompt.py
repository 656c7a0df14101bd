"""A negative prompt per call, per prompt and per server request (``negative_prompt=``,
``--negative-prompt``, the request's ``negative_prompt``) on Emu3 models, whose classifier-free
guidance rows are a prompt; refused in one line by the families whose unconditional rows are not.

The equality with transformers fed each row's own ``negative_prompt_ids`` is in test_emu3.py; here:
a row's codes do not depend on the negatives of the rows beside it, the folder's negative is the
default, greedy lossless methods keep AR's codes under per-row negatives, the guidance rows survive
packing, ``--indices``, the CLI's job record and ``--resume``, and the server batches requests with
and without a negative prompt together.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from conftest import CLI_PROMPTS, generate_prompts  # noqa: E402

import lantern  # noqa: E402
from lantern.errors import LanternError  # noqa: E402
from lantern.targets.base import Conditions, PackedConditions  # noqa: E402
from lantern.targets.emu3 import NEGATIVE_PROMPT  # noqa: E402
from lantern.testing import (  # noqa: E402
    TINY_EMU3_GRID,
    make_tiny_chameleon_folder,
    make_tiny_emu3_folder,
    make_tiny_janus_folder,
)

PROMPTS = ["a red car", "a cat on the grass", "a photo of a mountain lake at dawn"]
NEGATIVES = ["blurry, dark", "", "a photo of a dog, low quality, jpeg artifacts"]
SAMPLED = {"ar": {}, "sjd-coupled": {"sjd_window": 6}, "pjd": {"pjd_window": 2, "pjd_context": 2}}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_emu3_folder(tmp_path_factory.mktemp("negative") / "emu3")


@pytest.fixture(scope="module")
def pipe(folder: Path) -> lantern.Pipeline:
    return lantern.load(folder)


@pytest.mark.parametrize("method", list(SAMPLED))
def test_a_rows_codes_do_not_depend_on_the_negatives_beside_it(pipe: lantern.Pipeline, method: str) -> None:
    """Sampled: three prompts with three negatives decoded as one batch; each image is the same
    generated alone (``indices``: only its prompt and negative encoded), and the same beside other
    negatives. Power: another negative for a row changes that row's codes and no other."""
    settings = SAMPLED[method]
    together = pipe(prompts=PROMPTS, negative_prompt=NEGATIVES, method=method, seed=5, batch_size=3, **settings)
    for row in range(3):
        alone = pipe(prompts=PROMPTS, negative_prompt=NEGATIVES, method=method, seed=5, indices=[row], **settings)
        assert torch.equal(alone.codes[0], together.codes[row]), row
    swapped = [NEGATIVES[0], NEGATIVES[1], "a red car"]
    other = pipe(prompts=PROMPTS, negative_prompt=swapped, method=method, seed=5, batch_size=3, **settings)
    assert torch.equal(other.codes[:2], together.codes[:2])
    assert not torch.equal(other.codes[2], together.codes[2])


def test_the_folders_negative_prompt_is_the_default(folder: Path, pipe: lantern.Pipeline, tmp_path: Path) -> None:
    """No ``negative_prompt``: BAAI's negative (the tiny folder's generation.json names none), the
    same codes as passing it; a string is every row's negative, as the list of it is; a folder whose
    generation.json names another negative uses that one, and a call's own overrides it."""
    sampled = {"method": "sjd-coupled", "seed": 2, "sjd_window": 6}
    default = pipe(prompts=PROMPTS, **sampled)
    assert "negative_prompt" not in default.settings and "negative_prompt" not in default.config
    assert torch.equal(pipe(prompts=PROMPTS, negative_prompt=NEGATIVE_PROMPT, **sampled).codes, default.codes)
    one = pipe(prompts=PROMPTS, negative_prompt="blurry, dark", **sampled)
    assert torch.equal(pipe(prompts=PROMPTS, negative_prompt=["blurry, dark"] * 3, **sampled).codes, one.codes)
    assert not torch.equal(one.codes, default.codes)
    assert one.settings["negative_prompt"] == "blurry, dark"
    own = tmp_path / "own"
    own.mkdir()
    for f in folder.iterdir():
        if f.name != "generation.json":
            (own / f.name).symlink_to(f)
    settings = json.loads((folder / "generation.json").read_text()) | {"negative_prompt": "blurry, dark"}
    (own / "generation.json").write_text(json.dumps(settings))
    variant = lantern.load(own)
    assert torch.equal(variant(prompts=PROMPTS, **sampled).codes, one.codes)
    assert torch.equal(variant(prompts=PROMPTS, negative_prompt=NEGATIVE_PROMPT, **sampled).codes, default.codes)


@pytest.mark.parametrize("method,settings", [("sjd-coupled", {"sjd_window": 6}),
                                             ("pjd", {"pjd_window": 2, "pjd_context": TINY_EMU3_GRID})])
def test_greedy_lossless_methods_keep_ars_codes_under_per_row_negatives(pipe: lantern.Pipeline, method: str,
                                                                         settings: dict[str, Any]) -> None:
    ar = pipe(prompts=PROMPTS, negative_prompt=NEGATIVES, method="ar", temperature=0.0)
    out = pipe(prompts=PROMPTS, negative_prompt=NEGATIVES, method=method, temperature=0.0, **settings)
    assert torch.equal(out.codes, ar.codes)
    assert not torch.equal(ar.codes, pipe(prompts=PROMPTS, method="ar", temperature=0.0).codes)


def test_guidance_rows_survive_packing() -> None:
    """Packed conditions with guidance rows (left-padded, of another width than the prompts), each
    repeated twice, give back the plain rows' prompts and guidance rows for any images, in order;
    chunks with and without guidance rows are refused."""
    cond = torch.tensor([[0, 5, 6], [7, 8, 9]])
    mask = torch.tensor([[False, True, True], [True, True, True]])
    g_ids = torch.tensor([[1, 2, 3, 4], [0, 0, 0, 5]])
    g_mask = torch.tensor([[True] * 4, [False, False, False, True]])
    plain = Conditions(cond, mask, Conditions(g_ids, g_mask))
    packed = PackedConditions.pack([plain], repeats=2)
    for indices in ([3, 0, 1], [2]):
        got, want = packed.take(indices), plain.take([i // 2 for i in indices])
        assert got.guidance is not None and want.guidance is not None
        for a, b in ((got.cond, want.cond), (got.mask, want.mask), (got.guidance.cond, want.guidance.cond),
                     (got.guidance.mask, want.guidance.mask)):
            assert torch.equal(a, b)
    assert torch.equal(packed.rows(2, 4).guidance_rows()[0], g_ids[[1, 1]])  # type: ignore[index]
    with pytest.raises(LanternError, match="all have guidance rows or all have none"):
        PackedConditions.pack([plain, Conditions(cond, mask)])


@pytest.fixture(scope="module")
def other_pipes(tmp_path_factory: pytest.TempPathFactory, t2i_stack: Path) -> dict[str, lantern.Pipeline]:
    root = tmp_path_factory.mktemp("no-negative")
    return {"LlamaGen c2i": lantern.load("digits"), "LlamaGen t2i": lantern.load(t2i_stack),
            "Chameleon-family": lantern.load(make_tiny_chameleon_folder(root / "lumina")),
            "Janus": lantern.load(make_tiny_janus_folder(root / "janus"))}


@pytest.mark.parametrize("family", ["LlamaGen c2i", "LlamaGen t2i", "Chameleon-family", "Janus"])
def test_families_whose_guidance_is_not_a_prompt_refuse_one(other_pipes: dict[str, lantern.Pipeline],
                                                            family: str) -> None:
    pipe = other_pipes[family]
    condition: dict[str, Any] = {"labels": [1]} if family == "LlamaGen c2i" else {"prompts": ["a red car"]}
    with pytest.raises(LanternError, match=f"^negative_prompt: {family} models take no negative prompt") as e:
        pipe(negative_prompt="blurry", **condition)
    assert "\n" not in str(e.value) and e.value.field == "negative_prompt"


@pytest.mark.parametrize("negative,message", [
    (3, "negative_prompt: expected a string, or a list of 3 (one per prompt), got int"),
    (["a", "b"], "negative_prompt: expected a string, or a list of 3 (one per prompt), got 2"),
    (["a", 2, "c"], "negative_prompt: entry 1: expected a string, got int"),
    (["a", "b\ud800", "c"], "negative_prompt: entry 1 is not valid text"),
    (["a", "b", "word " * 300], "negative_prompt: entry 2 takes 30"),
    ("word " * 300, "negative_prompt: takes 30"),
])
def test_bad_negative_prompts_get_one_line(pipe: lantern.Pipeline, negative: Any, message: str) -> None:
    with pytest.raises(LanternError) as e:
        pipe(prompts=PROMPTS, negative_prompt=negative)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_generate_negative_prompt_is_the_apis_and_recorded(folder: Path, tmp_path: Path) -> None:
    """``--negative-prompt``: the codes of ``negative_prompt=`` with the same text, run.json records it,
    ``--resume`` of the job with another negative prompt is refused by name (and with it, continues)."""
    out = tmp_path / "out"
    assert generate_prompts(folder, out, "--negative-prompt", "blurry, dark", "--seed", "3", "--resume") == 0
    codes = np.load(out / "codes.npy")
    api = lantern.load(folder)(prompts=list(CLI_PROMPTS), negative_prompt="blurry, dark", seed=3)
    assert (api.codes.numpy() == codes).all()
    plain = lantern.load(folder)(prompts=list(CLI_PROMPTS), seed=3)
    assert not (plain.codes.numpy() == codes).all()
    assert json.loads((out / "run.json").read_text())["negative_prompt"] == "blurry, dark"
    assert generate_prompts(folder, out, "--negative-prompt", "blurry", "--seed", "3", "--resume") == 2
    assert generate_prompts(folder, out, "--negative-prompt", "blurry, dark", "--seed", "3", "--resume") == 0


@pytest.mark.parametrize("model,message", [
    ("digits", "--negative-prompt: digits is not an Emu3 model"),
    ("emu3", "Emu3's negative prompt takes 30"),
])
def test_generate_refuses_a_negative_prompt_before_loading(folder: Path, tmp_path: Path, model: str, message: str,
                                                           capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A model without one, or a negative past ``--prompt-width``: one line, before the model is read."""
    import lantern.api

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model was read")

    monkeypatch.setattr(lantern.api, "load", never)
    out = tmp_path / "out"
    negative = "blurry" if model == "digits" else "word " * 300
    assert generate_prompts(folder if model == "emu3" else Path(model), out, "--negative-prompt", negative) == 2
    assert message in capsys.readouterr().err.splitlines()[-1]
    assert not out.exists()


def test_serve_requests_with_and_without_a_negative_prompt_decode_in_one_batch(
        folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests queued before the scheduler starts, one with its own negative prompt and one with
    the model's, decode as one batch (its guidance rows differ row by row); each gets the codes
    ``lantern.load`` gives it alone."""
    from lantern.serve import scheduler as scheduler_mod

    batches: list[Conditions] = []
    real = scheduler_mod.batch_conditions

    def spy(rows: Any) -> Conditions:
        batches.append(real(rows))
        return batches[-1]

    monkeypatch.setattr(scheduler_mod, "batch_conditions", spy)
    pipe = lantern.load(folder, deterministic=True)
    sched = scheduler_mod.Scheduler(pipe, max_batch=4, max_queue=8)
    negatives = ("blurry, dark", None)
    tickets = [t for n in negatives
               for t in sched.submit(sched.resolve("a red car", 4, "sjd-coupled", {"sjd_window": 6}, (0, 1),
                                                   negative_prompt=n))]
    sched.start()
    results = [t.future.result(120) for t in tickets]
    sched.shutdown(10)
    first = next(b.guidance for b in batches if b.guidance is not None)  # (the guidance rows batch first)
    assert len(first) == 4
    assert not torch.equal(first.cond[0], first.cond[2]) and torch.equal(first.cond[0], first.cond[1])
    for pair, negative in zip((results[:2], results[2:]), negatives, strict=True):
        expected = pipe(prompts=["a red car"], num_per_label=2, seed=4, method="sjd-coupled", sjd_window=6,
                        negative_prompt=negative)
        assert torch.equal(torch.stack([r.codes for r in pair]), expected.codes)
    assert not torch.equal(results[0].codes, results[2].codes)


def test_serve_takes_a_negative_prompt_and_sends_it_back(folder: Path) -> None:
    """The request's ``negative_prompt``: the codes of ``lantern.load`` with it, the answer's settings
    carry it (sent back, they give the same images); over-long: 400 naming the field; a LlamaGen
    server refuses the field (400, ``field: negative_prompt``)."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from lantern.serve.app import create_app
    from lantern.serve.scheduler import Scheduler

    pipe = lantern.load(folder, deterministic=True)
    scheduler = Scheduler(pipe, max_batch=2, max_queue=4)
    scheduler.start()
    app = create_app(scheduler, pipeline=pipe, default_method="ar", max_prompt_chars=40)
    body = {"prompt": "a red car", "n": 2, "seed": 4, "return_codes": True}
    with TestClient(app) as c:
        r = c.post("/v1/images/generations", json={**body, "negative_prompt": "blurry, dark"})
        assert r.status_code == 200, r.text
        again = c.post("/v1/images/generations", json={**body, **r.json()["settings"]})
        long = c.post("/v1/images/generations", json={"prompt": "a", "negative_prompt": "x" * 41})
    assert long.status_code == 400 and long.json()["error"]["field"] == "negative_prompt", long.text
    expected = pipe(prompts=["a red car"], num_per_label=2, seed=4, negative_prompt="blurry, dark")
    assert [d["codes"] for d in r.json()["data"]] == expected.codes.tolist()
    assert r.json()["settings"]["negative_prompt"] == "blurry, dark"
    assert [d["codes"] for d in again.json()["data"]] == expected.codes.tolist()
    digits = lantern.load("digits", deterministic=True)
    other = Scheduler(digits, max_batch=2, max_queue=4)
    other.start()
    with TestClient(create_app(other, pipeline=digits, default_method="ar")) as c:
        refused = c.post("/v1/images/generations", json={"label": 1, "negative_prompt": "blurry"})
    assert refused.status_code == 400 and refused.json()["error"]["field"] == "negative_prompt", refused.text
