"""``lantern score``: folders of images already generated get the metrics their images get from
``lantern.eval.metrics`` directly, with each image's class or prompt read from the folder's own
record (lantern generate) or from ``--prompts`` by the number in its name (LANTERN's folders)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_clip
from PIL import Image

from lantern.cli.main import main
from lantern.eval.metrics import ClipScorer, extract_features, load_feature_extractor, quality_metrics, reference_images
from lantern.eval.score import ImageFolder


def _pngs(paths: list[Path]) -> torch.Tensor:
    """Images as a PNG's bytes say, [N, C, H, W] in [-1, 1] (pixel / 127.5 - 1)."""
    arrays = [np.asarray(Image.open(p)) for p in paths]
    x = torch.from_numpy(np.stack(arrays)).float() / 127.5 - 1
    return x[:, None] if x.dim() == 3 else x.permute(0, 3, 1, 2)


def _generate(out: Path, *extra: str) -> None:
    assert main(["generate", "--model", "digits", "--labels", "0-4", "--num-per-label", "2", "--seed", "3",
                 "--out", str(out), "--no-progress", *extra]) == 0


def test_a_generated_folder_scores_as_its_images_do(tmp_path: Path) -> None:
    _generate(tmp_path / "run", "--method", "sjd-coupled")
    _generate(tmp_path / "some", "--method", "sjd-coupled", "--indices", "9,0,5,2")  # names out of request order
    assert main(["score", str(tmp_path / "run"), str(tmp_path / "some"), "--model", "digits", "--num-real", "60",
                 "--batch-size", "4", "--out", str(tmp_path / "score.json"), "--no-progress"]) == 0
    record = json.loads((tmp_path / "score.json").read_text())
    assert record["reference"] == "the data set of digits" and record["num_real"] == 60
    extractor = load_feature_extractor("digits")
    real = extract_features(extractor, reference_images("digits")[0][:60])
    for row, folder in zip(record["rows"], ("run", "some"), strict=True):
        run = json.loads((tmp_path / folder / "run.json").read_text())
        files = sorted((tmp_path / folder).glob("*_label*.png"))
        labels = [int(p.stem.split("_label")[1]) for p in files]
        by_place = dict(zip(run.get("indices", range(10)), run["labels"], strict=True))
        assert labels == [by_place[int(p.stem.split("_")[0])] for p in files]  # the names carry each class
        expected = quality_metrics(real, _pngs(files), torch.tensor(labels), extractor)
        assert row["images"] == len(files) and row["source"] == "lantern generate"
        assert row["method"] == "sjd-coupled" and row["tau"] == run["stats"]["mean_accepted"] > 1
        for key, value in (("fid", expected.fid), ("precision", expected.precision), ("recall", expected.recall),
                           ("class_accuracy", expected.class_accuracy)):
            assert row["metrics"][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    # power: the classes decide the accuracy (the same images under other labels score otherwise)
    files = sorted((tmp_path / "run").glob("*_label*.png"))
    shifted = [(int(p.stem.split("_label")[1]) + 1) % 10 for p in files]
    assert quality_metrics(real, _pngs(files), torch.tensor(shifted), extractor).class_accuracy != \
        record["rows"][0]["metrics"]["class_accuracy"]


def test_a_plain_folder_takes_its_prompts_by_the_number_in_each_name(tmp_path: Path) -> None:
    """LANTERN's folders: ``prompt_N.png`` is prompt N, whatever order the names sort in (prompt_10
    before prompt_2), and the CLIP score is each image's against its own prompt."""
    clip = tiny_clip(tmp_path / "clip")
    words = ["a kite over a beach", "two dogs", "a red car", "a cat", "a red cat", "two kite"]
    prompts = [words[i % len(words)] + (" red" * (i // len(words))) for i in range(12)]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    g = torch.Generator().manual_seed(0)
    (tmp_path / "fake").mkdir()
    (tmp_path / "real").mkdir()
    for i in range(12):
        for folder in ("fake", "real"):
            pixels = (torch.rand(24, 24, 3, generator=g) * 255).to(torch.uint8).numpy()
            Image.fromarray(pixels).save(tmp_path / folder / f"prompt_{i}.png")
    assert main(["score", str(tmp_path / "fake"), "--reference-images", str(tmp_path / "real"), "--feature-net",
                 f"clip:{clip}", "--prompts", str(tmp_path / "prompts.txt"), "--clip-score", str(clip),
                 "--batch-size", "5", "--out", str(tmp_path / "s.json"), "--no-progress"]) == 0
    row = json.loads((tmp_path / "s.json").read_text())["rows"][0]
    files = sorted((tmp_path / "fake").glob("*.png"))
    assert files[2].name == "prompt_10.png"  # the order the names sort in is not the prompts' order
    own = [prompts[int(p.stem.split("_")[1])] for p in files]
    expected = ClipScorer(clip).scores(_pngs(files), own)
    assert row["metrics"]["clip_score"] == pytest.approx(float(expected.mean()), rel=1e-5)
    assert row["metrics"]["clip_score"] != pytest.approx(float(ClipScorer(clip).scores(_pngs(files), prompts).mean()),
                                                         rel=1e-5)  # power: by file order it would be another
    assert "class_accuracy" not in row["metrics"] and row["source"] == "folder"
    assert ImageFolder.read(tmp_path / "fake", prompts).prompts == own


@pytest.mark.parametrize("extra, message", [
    ([], "score needs real images to compare with: --reference-images DIR, or --model NAME"),
    (["--reference-images", "REAL"], "score needs a feature network: --feature-net SPEC, or --model NAME"),
    (["--model", "digits", "--hps", "x.pt"], "--hps FILE needs --hps-clip DIR"),
    (["--model", "digits", "--clip-score", "CLIP"], "score: RUN has no prompts for clip_score: it is not a prompted "
                                                    "lantern generate run; pass --prompts FILE"),
    (["--model", "digits", "--prompts", "PROMPTS"], "score: 0004_label2.png is image 2, but --prompts holds 2 "
                                                    "prompts"),
    (["--model", "digits", "--out", "TAKEN"], "--out: TAKEN already exists; pass --overwrite to replace it"),
])
def test_bad_input_is_one_line_naming_what_to_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   extra: list[str], message: str) -> None:
    run = tmp_path / "run"
    _generate(run)
    (run / "run.json").unlink()  # a folder lantern did not write: every image, prompts by number
    (tmp_path / "prompts.txt").write_text("a\nb\n")
    (tmp_path / "taken.json").write_text("{}")
    where = {"REAL": str(tmp_path), "CLIP": str(tiny_clip(tmp_path / "clip")), "PROMPTS": str(tmp_path / "prompts.txt"),
             "TAKEN": str(tmp_path / "taken.json")}
    capsys.readouterr()
    assert main(["score", str(run), "--no-progress", *[where.get(x, x) for x in extra]]) == 2
    err = capsys.readouterr().err
    expected = message.replace("RUN", str(run)).replace("TAKEN", str(tmp_path / "taken.json"))
    assert err.startswith("lantern: error: ") and expected in err and err.count("\n") == 1, err


def test_a_folder_of_two_sizes_or_none_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "mixed").mkdir()
    Image.new("L", (32, 32)).save(tmp_path / "mixed" / "0.png")
    Image.new("L", (16, 16)).save(tmp_path / "mixed" / "1.png")
    assert main(["score", str(tmp_path / "mixed"), "--model", "digits", "--no-progress"]) == 2
    assert "1.png is 16x16 grey, but the folder's first image is 32x32 grey" in capsys.readouterr().err
    (tmp_path / "unnumbered").mkdir()
    for name in ("a.png", "b.png"):
        Image.new("L", (32, 32)).save(tmp_path / "unnumbered" / name)
    (tmp_path / "p.txt").write_text("x\n")
    assert main(["score", str(tmp_path / "unnumbered"), "--model", "digits", "--prompts", str(tmp_path / "p.txt"),
                 "--no-progress"]) == 2
    assert "score: a.png has no number in its name to find its prompt by" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["score", str(tmp_path / "empty"), "--model", "digits", "--no-progress"]) == 2
    assert "holds 0 images" in capsys.readouterr().err
    # 16-bit grey PNGs: their top 8 bits (a plain convert("L") clipped every value over 255 to white)
    (tmp_path / "deep").mkdir()
    for i, level in enumerate((1000, 40000)):
        Image.fromarray(np.full((4, 4), level, np.uint16)).save(tmp_path / "deep" / f"{i}.png")
    images = next(ImageFolder.read(tmp_path / "deep").batches(2))[1]
    assert images[:, 0, 0, 0].tolist() == pytest.approx([1000 / 257 / 127.5 - 1, 40000 / 257 / 127.5 - 1])
    assert main(["score", str(tmp_path / "none"), "--model", "digits", "--no-progress"]) == 2
    assert f"score: no such folder {tmp_path / 'none'}" in capsys.readouterr().err
    stack = tmp_path / "stack"  # a model without a data set (a downloaded one): real images are asked for
    assert main(["make-random-stack", "--out", str(stack)]) == 0
    (stack / "data.json").unlink(missing_ok=True)
    capsys.readouterr()
    assert main(["score", str(tmp_path / "mixed"), "--model", str(stack), "--feature-net", "digits",
                 "--no-progress"]) == 2
    assert capsys.readouterr().err == (f"lantern: error: score: --model {stack} has no data set (data.json) to "
                                       "compare with; pass --reference-images DIR (real images)\n")


def test_folders_are_judged_against_ars_spread_as_bench_judges_its_rows(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """``--ar A0 A1``: AR's folders at two seeds make the spread (bench's ARSpread, its seeds read
    from their run.json) and every other folder gets bench's verdict against it."""
    from lantern.eval.report import ARSpread
    from lantern.eval.score import FolderScore, ar_spread, verdict

    for seed in (5, 6):
        _generate(tmp_path / f"ar{seed}", "--seed", str(seed))
    _generate(tmp_path / "fast", "--method", "sjd-coupled")
    assert main(["score", str(tmp_path / "fast"), "--ar", str(tmp_path / "ar5"), str(tmp_path / "ar6"), "--model",
                 "digits", "--num-real", "60", "--out", str(tmp_path / "s.json"), "--no-progress"]) == 0
    record = json.loads((tmp_path / "s.json").read_text())
    spread = ARSpread.from_dict(record["ar_spread"])
    assert spread.seeds == (5, 6) and [r["folder"] for r in record["ar_rows"]] == [str(tmp_path / "ar5"),
                                                                                    str(tmp_path / "ar6")]
    assert spread.values["fid"] == [r["metrics"]["fid"] for r in record["ar_rows"]]
    assert spread.counts == {"precision": 10, "class_accuracy": 10, "recall": 60}
    row = record["rows"][0]
    sides = spread.sides(row["metrics"])
    assert row["vs_ar"] == {"out": [k for k, v in sides.items() if v == "worse"],
                            "better": [k for k, v in sides.items() if v == "better"]}
    assert "vs AR's spread" in capsys.readouterr().out
    # power: a folder far worse than AR on FID is out on it, and only there
    ar_rows = [FolderScore(str(i), 100, "folder", {"fid": f, "precision": 0.9, "recall": 0.8})
               for i, f in enumerate((1.0, 1.1, 0.9, 1.05))]
    spread = ar_spread(ar_rows, 500, [0, 1, 2, 3])
    assert verdict(spread, {"fid": 9.0, "precision": 0.9, "recall": 0.8}) == {"out": ["fid"], "better": []}
    assert verdict(spread, {"fid": 1.0, "precision": 0.9, "recall": 0.8}) == {"out": [], "better": []}
    capsys.readouterr()
    assert main(["score", str(tmp_path / "fast"), "--ar", str(tmp_path / "ar5"), "--model", "digits",
                 "--no-progress"]) == 2
    assert "--ar needs AR's folders at 2 seeds or more (a spread), got 1" in capsys.readouterr().err


def test_an_adm_sample_batch_scores_as_its_folder_does(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--save-npz``'s samples.npz (ADM's layout, read a batch at a time from the zip) gives the
    folder's numbers, its classes from the run.json beside it; a copy kept apart has none, an
    ``arr_1`` of classes gives them; an ADM reference batch .npz is the real images as they are."""
    _generate(tmp_path / "run", "--save-npz", "--method", "sjd-coupled")
    npz = tmp_path / "run" / "samples.npz"
    with np.load(npz) as z:
        images = z["arr_0"]
    np.savez(tmp_path / "apart.npz", images)  # no run.json beside it: only pixels
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    np.savez_compressed(tmp_path / "labelled.npz", arr_0=images, arr_1=np.array(run["labels"]))  # deflated
    real = ((reference_images("digits")[0][:40] + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    np.savez(tmp_path / "real.npz", real.permute(0, 2, 3, 1).expand(-1, -1, -1, 3).numpy())
    for reference in (["--model", "digits"], ["--reference-images", str(tmp_path / "real.npz"), "--feature-net",
                                              "digits"]):
        out = tmp_path / f"score{len(reference)}.json"
        assert main(["score", str(tmp_path / "run"), str(npz), str(tmp_path / "apart.npz"),
                     str(tmp_path / "labelled.npz"), "--num-real", "40", "--batch-size", "3", "--out", str(out),
                     "--no-progress", *reference]) == 0
        record = json.loads(out.read_text())
        folder, own, plain, labelled = record["rows"]
        assert own["images"] == plain["images"] == labelled["images"] == 10 and plain["source"] == "npz"
        assert own["source"] == "lantern generate" and own["method"] == "sjd-coupled" and own["tau"] == folder["tau"]
        for row in (own, plain, labelled):
            for key in ("fid", "kid", "precision", "recall"):
                assert row["metrics"][key] == pytest.approx(folder["metrics"][key], rel=1e-5, abs=1e-7), key
        assert "class_accuracy" not in plain["metrics"]  # ADM's c2i batches carry classes in arr_1; this has none
        assert own["metrics"]["class_accuracy"] == labelled["metrics"]["class_accuracy"] == \
            folder["metrics"]["class_accuracy"]
    assert record["reference"] == f"40 images of {tmp_path / 'real.npz'}"
    extractor = load_feature_extractor("digits")
    expected = quality_metrics(extract_features(extractor, real.float() / 127.5 - 1),
                               _pngs(sorted((tmp_path / "run").glob("*_label*.png"))), None, extractor)
    assert folder["metrics"]["fid"] == pytest.approx(expected.fid, rel=1e-5)
    # what is not an ADM sample batch: one line each, and nothing in the file is unpickled
    np.savez(tmp_path / "floats.npz", arr_0=images.astype(np.float32))
    np.savez(tmp_path / "objects.npz", arr_0=np.array([{"a": 1}, {"b": 2}], dtype=object))
    np.savez(tmp_path / "other.npz", codes=np.zeros(3))
    np.savez(tmp_path / "strings.npz", arr_0=images, arr_1=np.array(["cat"] * 10))
    (tmp_path / "text.npz").write_text("not a zip")
    (tmp_path / "other").mkdir()  # a samples.npz beside a run.json of another run
    np.savez(tmp_path / "other" / "samples.npz", images[:4])
    (tmp_path / "other" / "run.json").write_text((tmp_path / "run" / "run.json").read_text())
    for name, message in (("floats", "arr_0 is float32 [10, 32, 32, 3]; expected uint8 [N, H, W, 3]"),
                          ("objects", "arr_0 is object [2]; expected uint8 [N, H, W, 3]"),
                          ("other", "has no arr_0 (the images of an ADM sample batch); it holds codes"),
                          ("strings", "arr_1 is <U3 [10]; expected one integer class id per image, [10]"),
                          ("text", "is not a readable .npz (File is not a zip file)"),
                          ("other/samples", "run.json does not describe the 4 images of samples.npz")):
        capsys.readouterr()
        assert main(["score", str(tmp_path / f"{name}.npz"), "--model", "digits", "--no-progress"]) == 2
        err = capsys.readouterr().err
        where = tmp_path / (name.split("/")[0] if "/" in name else f"{name}.npz")
        assert err.startswith(f"lantern: error: score: {where}") and message in err, err
        assert err.count("\n") == 1 and ("/" in name or err.count(f"{name}.npz") == 1), err  # the file named once


def test_a_prompted_runs_npz_takes_each_images_prompt_from_its_run(t2i_stack: Path, tmp_path: Path) -> None:
    """--save-npz holds the run's images in the order it was asked for (here --indices 3,0), and
    run.json's prompt_index names each one's prompt in that order."""
    out = tmp_path / "run"
    assert main(["generate", "--model", str(t2i_stack), "--prompt", "a red car", "--prompt", "two dogs",
                 "--num-per-prompt", "2", "--indices", "3,0", "--save-npz", "--out", str(out), "--no-progress"]) == 0
    npz = ImageFolder.read(out / "samples.npz")
    assert npz.source == "lantern generate" and npz.count == 2 and npz.labels is None
    assert npz.prompts == ["two dogs", "a red car"]  # image 3 is prompt 1, image 0 prompt 0
    assert ImageFolder.read(out).prompts == ["a red car", "two dogs"]  # the folder: file-name order, 0000 first
