"""``lantern bench``: the JSON schema, the numbers behind it, and bad input.

One small run on the embedded ``digits`` preset (8x8 tokens) is shared by the schema tests; it
uses the real feature net, so the quality numbers are real (if noisy at this size).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from PIL import Image

from lantern.cli.main import main
from lantern.errors import LanternError
from lantern.eval.bench import BenchConfig, bench_labels, speedup_interval
from lantern.eval.methods_grammar import MethodSpec, parse_batch_sizes, parse_methods, parse_tree_options
from lantern.eval.report import ARSpread, BenchRow, format_table, throughput_table
from lantern.methods import MethodConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REQUIRED = {
    "method": str,
    "mean_accepted": float,
    "target_forwards": float,
    "wall_seconds": float,
    "speedup_vs_ar": float,
    "fid": float,
    "kid": float,
    "precision": float,
    "recall": float,
    "class_accuracy": float,
}
METHODS = ["ar", "sd", "lantern", "lantern++"]
NUM_IMAGES = 20


# ~35 s on 2 cores, once per module: 4 methods x 20 digits, AR at the default 5 seeds, both tau curves
@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    os.environ.setdefault("MPLCONFIGDIR", str(tmp_path_factory.mktemp("mpl")))
    out = tmp_path_factory.mktemp("bench") / "out"
    argv = ["bench", "--model", "digits", "--methods", ",".join(METHODS), "--num-images", str(NUM_IMAGES),
            "--speed-images", "2", "--batch-size", "10", "--num-real", "100", "--curve-images", "2",
            "--dtype", "float32", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    return out


@pytest.fixture(scope="module")
def rows(bench_dir: Path) -> list[dict]:
    return json.loads((bench_dir / "bench.json").read_text())


# slow (~35 s setup): the shared bench_dir run; the only full bench with real quality numbers, spread and curves
@pytest.mark.slow
def test_bench_json_is_a_list_with_one_object_per_method(rows: list[dict]) -> None:
    assert isinstance(rows, list)
    assert [r["method"] for r in rows] == METHODS
    for r in rows:
        for key, kind in REQUIRED.items():
            assert key in r, f"{r['method']} lacks {key}"
            assert isinstance(r[key], kind), f"{r['method']}.{key} = {r[key]!r} is not {kind.__name__}"
            if kind is float:
                assert math.isfinite(r[key]), f"{r['method']}.{key} is not finite"
        assert 0.0 <= r["precision"] <= 1.0 and 0.0 <= r["recall"] <= 1.0
        assert 0.0 <= r["class_accuracy"] <= 1.0
        assert r["fid"] >= 0.0 and r["wall_seconds"] > 0.0
        assert r["num_images"] == NUM_IMAGES and r["speed_images"] == 2
        assert "lantern feature net" in r["feature_net"]


# slow (~35 s when it runs first): reads the shared bench_dir run
@pytest.mark.slow
def test_ar_row_is_the_baseline(rows: list[dict]) -> None:
    ar = rows[0]
    # digits: 8x8 = 64 tokens; AR takes one target forward per token (the prefill yields token 0).
    assert ar["mean_accepted"] == 1.0
    assert ar["target_forwards"] == 64.0
    assert ar["speedup_vs_ar"] == 1.0
    assert ar["speedup_ci"] == [1.0, 1.0]  # AR against itself, image by image: every resample is 1
    assert ar["tree"] == "-" and ar["relaxation"] is None


# slow (~35 s when it runs first): reads the shared bench_dir run
@pytest.mark.slow
def test_speculative_rows_accept_more_than_one_token(rows: list[dict]) -> None:
    for r in rows[1:]:
        assert r["mean_accepted"] > 1.0, r
        assert r["target_forwards"] < 64.0, r
        # tokens per forward, averaged per image, is close to 64 / forwards per image
        assert r["mean_accepted"] == pytest.approx(64.0 / r["target_forwards"], rel=0.15)
        assert r["speedup_vs_ar"] == pytest.approx(rows[0]["wall_seconds"] / r["wall_seconds"], rel=1e-6)
        lo, hi = r["speedup_ci"]  # 2 timed images: an interval over them, around the point estimate's scale
        assert 0 < lo <= hi and lo < 2 * r["speedup_vs_ar"] and hi > r["speedup_vs_ar"] / 2
    relax = {r["method"]: r["relaxation"] for r in rows}
    assert relax["sd"] is None
    assert relax["lantern"]["mode"] == "absolute" and relax["lantern"]["delta"] == 0.1
    assert relax["lantern++"]["mode"] == "relative" and relax["lantern++"]["lam"] == 5.0


# slow (~35 s when it runs first): reads the shared bench_dir run
@pytest.mark.slow
def test_run_json_markdown_and_pngs(bench_dir: Path, rows: list[dict]) -> None:
    run = json.loads((bench_dir / "run.json").read_text())
    assert run["command"].startswith("lantern bench")
    assert run["sampling"]["cfg_scale"] == 3.0 and run["dtype"] == "float32"
    assert run["num_real"] == 100 and run["feature_net"].startswith("lantern feature net")
    assert {"num_images", "batch_size", "ar_seeds"} <= set(run["config"])  # the quality pass's settings
    spread = run["ar_spread"]
    assert spread["seeds"] == [0, 1, 2, 3, 4]  # --ar-seeds default 5, from --seed 0
    assert set(spread["values"]) == {"fid", "kid", "precision", "recall", "class_accuracy"}
    ar = rows[0]
    for key, values in spread["values"].items():
        assert len(values) == 5 and values[0] == pytest.approx(ar[key])  # seed 0 is the table's AR row
        lo, hi = spread["interval"][key]
        assert lo <= min(values) and max(values) <= hi
    assert len(set(spread["values"]["fid"])) == 5  # the seeds differ
    assert ar["outside_ar_spread"] == [] and spread["false_alarm_rate"] == 0.05
    for r in rows:  # each row's verdict: out on the metrics worse than AR's bound, better listed apart
        sides = {k: "worse" if (r[k] > hi if k == "fid" else r[k] < lo) else "better" if (r[k] < lo if k == "fid"
                 else r[k] > hi) else "within" for k in spread["judged"] for lo, hi in [spread["interval"][k]]}
        assert r["outside_ar_spread"] == [k for k, v in sides.items() if v == "worse"], r["method"]
        assert r["better_than_ar"] == [k for k, v in sides.items() if v == "better"], r["method"]
    # tau curves: delta 0 and lambda 1 are the exact rule, so they agree with each other only if the
    # trees agree; both must at least be >= 1 and non-trivially increase at the loosest setting.
    for kind in ("delta", "lambda"):
        points = run["curves"][kind]
        assert len(points) >= 5 and all(p["mean_accepted"] >= 1.0 for p in points)
    delta = {p["value"]: p["mean_accepted"] for p in run["curves"]["delta"]}
    assert delta[0.5] > delta[0.0]
    md = (bench_dir / "bench.md").read_text()
    for r in rows:
        assert f"| {r['method']} |" in md
        assert f"{r['mean_accepted']:.2f}" in md
    assert "not** Inception" in md
    # digits' proximity table holds 128 neighbours: LANTERN's default k of 1000 runs as 128, and says so
    assert "  - lantern: k 128 (the default 1000, capped at the proximity table's K_max), δ 0.1, budget test" in md
    assert [r["relaxation"]["k"] for r in rows if r["method"] == "lantern"] == [128]
    assert run["methods"]["lantern"]["relaxation"]["k"] == 1000  # what was asked for
    # 2 timed images at batch 1: the interval's t has 1 degree of freedom, and the report says what that does
    assert "t interval with 1 degree(s) of freedom: 2 timed batches give a wide interval" in md
    assert "AR's spread over 5 seeds (0, 1, 2, 3, 4), bounds per metric: fid " in md
    assert "t(0.9875, 4) · s · sqrt(1 + 1/5) = ±3.83 s" in md and "at most 5% of the time" in md
    assert "| vs AR spread |" in md
    names = ["grid_ar.png", "grid_sd.png", "grid_lantern.png", "grid_lanternpp.png", "accept_vs_delta.png",
             "accept_vs_lambda.png", "frontier.png"]
    for name in names:
        with Image.open(bench_dir / name) as im:
            im.verify()
    with Image.open(bench_dir / "grid_ar.png") as im:  # 10 classes as columns, 2 rows of 32-px digits
        assert im.width > 10 * 32 and im.height > 2 * 32


# slow (~35 s when it runs first): reads the shared bench_dir run
@pytest.mark.slow
def test_format_table_lists_every_row(rows: list[dict]) -> None:
    assert bench_labels(3, 7) == [0, 1, 2, 0, 1, 2, 0]
    objs = [BenchRow(r["method"], r["base_method"], r["tree"], r["relaxation"], r["mean_accepted"],
                     r["target_forwards"], r["wall_seconds"], r["seconds_per_image"], r["speedup_vs_ar"],
                     {k: r[k] for k in ("fid", "kid", "precision", "recall", "class_accuracy")}) for r in rows]
    table = format_table(objs)
    assert len(table.splitlines()) == 2 + len(rows)
    assert f"{rows[1]['speedup_vs_ar']:.2f}x" in table


def test_config_and_option_errors() -> None:
    with pytest.raises(LanternError, match="must include ar"):
        BenchConfig(methods=(MethodSpec("sd"),))
    with pytest.raises(LanternError, match="speed-images"):
        BenchConfig(num_images=4, speed_images=8)
    with pytest.raises(LanternError, match="twice"):
        BenchConfig(methods=(MethodSpec("ar"), MethodSpec("ar")))
    with pytest.raises(LanternError, match=r"--ar-seeds must be at most 20, got 21"):
        BenchConfig(ar_seeds=21)
    with pytest.raises(LanternError, match=r"--ar-seeds must be >= 1, got 0"):
        BenchConfig(ar_seeds=0)
    with pytest.raises(LanternError, match="unknown method 'foo'"):
        parse_methods("ar,foo")
    with pytest.raises(LanternError, match="METHOD=TREE"):
        parse_tree_options(["chain:3"])
    with pytest.raises(LanternError, match="does not draft a tree"):
        parse_tree_options(["ar=chain:3"])
    assert parse_tree_options(["lantern++=chain:5"]) == {"lantern++": "chain:5"}
    assert set(parse_tree_options(["auto"])) == {"sd", "sd-static", "lantern", "lantern++"}
    specs = parse_methods("ar,lantern++", {"lantern++": "chain:5"})
    assert specs[1].tree == "chain:5" and specs[0].tree is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--methods", "sd"], "must include ar"),
        (["--num-images", "1"], "num-images"),
        (["--tree", "lantern++"], "METHOD=TREE"),
        (["--dtype", "int8"], "--dtype"),
        (["--feature-net", "/nonexistent/feature-net"], "no such file"),
        (["--sweep", "--no-quality"], "--sweep needs quality metrics"),
        (["--sweep", "--speed-images", "8", "--sweep-images", "4"], "--sweep-images"),
        # silently unused before (a probe, 2026-11-30)
        (["--profile", "p.json"], "--profile is only used with auto trees"),
        (["--speed-batch-size", "1,2,2"], "distinct"),
        (["--methods", "ar,sd/k=3"], "--methods sd/k=3: --lantern-k needs a relaxed method"),
    ],
)
def test_cli_bad_input_exits_2_with_a_message(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["bench", "--model", "digits", "--out", str(tmp_path / "o"), "--no-progress", *argv])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o" / "bench.json").exists()


@pytest.mark.parametrize(("command", "speed_only"), [("bench", "--no-quality"), ("calibrate", "--quick")])
def test_a_model_folder_without_a_feature_net_is_named_before_it_loads(
    command: str, speed_only: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A downloaded Janus / Emu3 / Chameleon folder has no features/: the docs' bench command took the
    model folder itself for the feature net ("holds model_type 'janus', not a lantern feature net")."""
    import lantern.api

    folder = tmp_path / "janus"
    folder.mkdir()
    monkeypatch.setattr(lantern.api, "load_model_stack", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setattr(lantern.api, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main([command, "--model", str(folder), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert capsys.readouterr().err == (
        f"lantern: error: --model {folder} has no features/ feature net to score quality with: pass --feature-net "
        "(a lantern feature net folder, made by `lantern train-features`; inception:PATH; clip:DIR; "
        f"torchscript:PATH; or vgg16:PATH), or {speed_only} to measure speed only\n")


def test_a_preset_name_is_the_preset_whatever_folder_of_that_name_is_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--model photos`` is the preset (resolve_model_dir), even beside a folder ./photos without
    features/: the early check must not refuse it. Power: the same folder named by path is refused."""
    import argparse

    from lantern.cli.common import check_feature_net_early

    monkeypatch.chdir(tmp_path)
    (tmp_path / "photos").mkdir()
    check_feature_net_early(argparse.Namespace(model="photos", feature_net=None), "--no-quality")
    with pytest.raises(LanternError, match="has no features/ feature net"):
        check_feature_net_early(argparse.Namespace(model="./photos", feature_net=None), "--no-quality")


def test_method_at_tree_rows() -> None:
    specs = parse_methods("ar,lantern++@chain:5,lantern++@auto,lantern++")
    assert [s.name for s in specs] == ["ar", "lantern++@chain:5", "lantern++@auto", "lantern++"]
    assert [s.tree for s in specs] == [None, "chain:5", "auto", None]
    with pytest.raises(LanternError, match="does not draft a tree"):
        parse_methods("ar,sjd@chain:3")


@pytest.mark.slow
def test_timed_images_are_the_quality_images() -> None:
    """The speed pass decodes image i with image i's seed, one image at a time and in a rotating
    method order; the codes must equal a plain batched run's (batching and turn-taking change
    nothing), so the timed images are a subset of the images the quality metrics score."""
    import torch

    from lantern.decoding.config import SamplingConfig
    from lantern.eval.bench import time_methods
    from lantern.methods import MethodConfig
    from lantern.run import run_generation
    from lantern.targets.llamagen_stack import load_stack

    stack = load_stack("digits")
    sampling = SamplingConfig(**stack.default_sampling())
    resolved = {"ar": MethodConfig.resolve("ar"), "lantern++": MethodConfig.resolve("lantern++", tree="chain:3")}
    labels = [0, 1, 2]
    runs, walls = time_methods(stack, sampling, resolved, labels, seed=3, batch_size=1, repeats=2)
    for name, cfg in resolved.items():
        batched = run_generation(stack, labels, 3, sampling, cfg, batch_size=3)
        assert torch.equal(runs[name].codes, batched.codes), name
        assert len(walls[name]) == 2 and all(w > 0 for w in walls[name])
    assert runs["lantern++"].stats_dict()["mean_accepted"] > 1.0


@pytest.mark.slow
def test_sweep_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """--sweep: one row per (k, delta) and (k, lambda) point, each with its relaxation, its own
    timing against AR and the quality function's numbers (a small grid here)."""
    import lantern.eval.bench as bench
    from lantern.decoding.config import SamplingConfig
    from lantern.targets.llamagen_stack import load_stack

    monkeypatch.setattr(bench, "SWEEP_LANTERN", {"k": (10,), "delta": (0.05, 0.4)})
    monkeypatch.setattr(bench, "SWEEP_LANTERN_PP", {"k": (10,), "lam": (2.0,)})
    stack = load_stack("digits")
    sampling = SamplingConfig(**stack.default_sampling())
    seen: list[int] = []

    def quality(codes, labels):  # records how many images each call scores
        seen.append(codes.shape[0])
        return {"fid": float(codes.shape[0])}

    config = BenchConfig(methods=parse_methods("ar,lantern,lantern++"), num_images=4, speed_images=1,
                         batch_size=4, curve_images=0, ar_seeds=1, sweep=True, sweep_images=3)
    result = bench.run_bench(stack, sampling, config, quality, progress=False, log=lambda _: None)
    assert [r.method for r in result.sweep] == ["lantern k=10 delta=0.05", "lantern k=10 delta=0.4",
                                                "lantern++ k=10 lambda=2.0"]
    assert [r.relaxation["delta"] for r in result.sweep[:2]] == [0.05, 0.4]
    assert result.sweep[2].relaxation["lam"] == 2.0 and result.sweep[2].relaxation["k"] == 10
    assert all(r.num_images == 3 and r.speedup_vs_ar > 0 and r.mean_accepted >= 1.0 for r in result.sweep)
    assert seen == [4, 4, 4, 3, 3, 3]  # three methods on 4 images, then three sweep points on 3


def test_method_rows_with_relaxation_settings() -> None:
    """METHOD/KEY=VALUE rows carry their settings; --lantern-budget labels the relaxed rows."""
    specs = parse_methods("ar,lantern/delta=0.2/budget=token,lantern++@chain:3/lambda=2/k=5,lantern", budget="test")
    assert [s.name for s in specs] == ["ar", "lantern/delta=0.2/budget=token",
                                       "lantern++@chain:3/lambda=2/k=5/budget=test", "lantern/budget=test"]
    assert specs[1].settings == {"lantern_delta": 0.2, "lantern_budget": "token"} and specs[0].settings == {}
    assert specs[2].tree == "chain:3"
    assert specs[2].settings == {"lantern_lambda": 2.0, "lantern_k": 5, "lantern_budget": "test"}
    # the short aliases and the full names (the API's keywords, the CLI's flags) are one vocabulary
    assert parse_methods("lantern/lantern_delta=0.2/lantern_budget=token")[0].settings == specs[1].settings
    from lantern.targets.llamagen_stack import load_stack

    stack = load_stack("digits")
    resolved = specs[1].resolve(stack)
    assert resolved == MethodConfig.resolve("lantern", tree=stack.default_tree("lantern"), lantern_delta=0.2,
                                            lantern_budget="token")
    assert resolved.relaxation is not None and resolved.relaxation.budget == "token"
    with pytest.raises(LanternError, match="expected /KEY=VALUE"):
        parse_methods("ar,lantern/gamma=3")
    with pytest.raises(LanternError, match="delta must be a number"):
        parse_methods("ar,lantern/delta=big")


@pytest.mark.slow
def test_throughput_table_per_batch_size() -> None:
    """--speed-batch-size 1,2: latency rows at batch 1, and images/s of every method at batch 2 on
    max(speed_images, 2) images, each against AR at the same batch size; start-up is recorded."""
    import lantern.eval.bench as bench
    from lantern.decoding.config import SamplingConfig
    from lantern.targets.llamagen_stack import load_stack

    assert parse_batch_sizes("1,4,16") == [1, 4, 16] and parse_batch_sizes(2) == [2]
    for bad in ("0", "a", "", "1,-4"):
        with pytest.raises(LanternError, match="--speed-batch-size must be"):
            parse_batch_sizes(bad)
    stack = load_stack("digits")
    sampling = SamplingConfig(**stack.default_sampling())
    config = BenchConfig(methods=parse_methods("ar,lantern++"), num_images=2, speed_images=1, curve_images=0,
                         ar_seeds=1, throughput_batch_sizes=(2,))
    result = bench.run_bench(stack, sampling, config, None, progress=False, log=lambda _: None)
    assert [(p["batch_size"], p["method"], p["images"]) for p in result.throughput] == [(2, "ar", 2),
                                                                                       (2, "lantern++", 2)]
    assert result.throughput[0]["speedup_vs_ar"] == 1.0 and result.throughput[1]["images_per_second"] > 0
    assert all(r.startup_seconds > 0 for r in result.rows)
    table = throughput_table(result.throughput)
    assert "| lantern++ | " in table and "batch 2: images/s" in table


def test_ar_spread_bounds_are_one_sided_bonferroni_prediction_bounds() -> None:
    """Two judged metrics (FID, precision): each one-sided at 1 - 0.05/2, i.e. t(0.975, 4); only
    worse is out. The false-alarm rate and power by simulation: tests/test_yardstick.py."""
    spread = ARSpread((0, 1, 2, 3, 4), {"fid": [1.0, 2.0, 3.0, 4.0, 5.0], "precision": [0.5] * 5})
    half = 2.776445 * math.sqrt(2.5) * math.sqrt(1.2)  # t(0.975, 4) * s * sqrt(1 + 1/n)
    assert spread.interval("fid") == pytest.approx((3.0 - half, 3.0 + half))
    assert spread.interval("precision") == (0.5, 0.5)  # no spread: anything worse than AR's value is out
    assert spread.outside({"fid": 3.0 + half + 1e-6, "precision": 0.5, "recall": 0.1}) == ["fid"]
    assert spread.outside({"fid": 3.0 - half - 1e-6, "precision": 0.5}) == []  # better FID: not out
    assert spread.sides({"fid": 3.0 - half - 1e-6, "precision": 0.6}) == {"fid": "better", "precision": "better"}
    assert spread.outside({"fid": 3.0, "precision": 0.4}) == ["precision"]
    assert spread.outside({"fid": 3.0, "precision": 0.5, "kid": 99.0}) == []  # KID is not judged


@pytest.mark.slow
def test_combine_bench_takes_speed_from_one_run_and_quality_from_the_other(tmp_path: Path) -> None:
    """benchmarks/combine_bench.py: speed columns from the --speed run, tau and metrics from the
    --quality run, each row judged against the quality run's AR interval."""
    import subprocess
    import sys

    def write(folder: Path, rows: list[dict], run: dict) -> Path:
        folder.mkdir()
        (folder / "bench.json").write_text(json.dumps(rows))
        (folder / "run.json").write_text(json.dumps(run))
        return folder

    def row(method: str, tau: float, speedup: float, fid: float | None, prec: float | None) -> dict:
        return {"method": method, "base_method": method, "tree": "-", "relaxation": None, "mean_accepted": tau,
                "target_forwards": 64 / tau, "wall_seconds": 1 / speedup, "seconds_per_image": 0.5 / speedup,
                "speedup_vs_ar": speedup, "num_images": 200, "speed_images": 2, "wall_seconds_repeats": [1.0],
                "startup_seconds": 0.0, "outside_ar_spread": None, "fid": fid, "kid": None, "precision": prec,
                "recall": None, "class_accuracy": None}

    speed = write(tmp_path / "s", [row("ar", 1.0, 1.0, None, None), row("sjd", 2.5, 1.75, None, None)],
                  {"command": "lantern bench --no-quality"})
    spread = {"seeds": [0, 1, 2], "values": {"fid": [1.0, 1.1, 1.2], "precision": [0.6, 0.61, 0.62]}}
    quality = write(tmp_path / "q", [row("ar", 1.0, 1.0, 1.0, 0.6), row("sjd", 2.2, 9.9, 1.1, 0.3)],
                    {"command": "lantern bench", "model": "digits", "ar_spread": spread})
    out = tmp_path / "c"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "combine_bench.py"
    subprocess.run([sys.executable, str(script), "--speed", str(speed), "--quality", str(quality), "--out", str(out)],
                   check=True, capture_output=True, env={**os.environ, "MPLCONFIGDIR": str(tmp_path / "mpl")})
    md = (out / "bench.md").read_text()
    # sjd: tau 2.20 and FID 1.10 from the quality run, 1.75x from the speed run; precision 0.3 is
    # worse than AR's bound (0.61 - t(0.975, 2) · 0.01 · sqrt(4/3) = 0.560: 2 metrics, 2.5 % each), FID inside.
    assert "| sjd | - | 2.20 | 29.1 | 0.286 | 1.75x | 1.10 | - | 0.300 | - | - | out: prec |" in md
    assert "lantern bench --no-quality" in md and (out / "frontier.png").stat().st_size > 0


def _simulated_chunks(gen: torch.Generator, n: int, passes: int) -> tuple[list[list[float]], list[list[float]]]:
    """Seconds [pass][chunk] of AR and a method on n images: AR's time varies by image (log-normal),
    the method's speed-up too (log-normal around 3), and each pass adds 5 % machine noise."""
    ar = torch.exp(0.3 * torch.randn(n, generator=gen, dtype=torch.float64))
    method = ar / torch.exp(math.log(3.0) + 0.25 * torch.randn(n, generator=gen, dtype=torch.float64))

    def passes_of(t: torch.Tensor) -> list[list[float]]:
        return [(t * torch.exp(0.05 * torch.randn(n, generator=gen, dtype=torch.float64))).tolist()
                for _ in range(passes)]

    return passes_of(ar), passes_of(method)


def test_speedup_interval_covers_the_speedup_of_the_image_distribution() -> None:
    """The bench's 95 % interval for a speed-up (AR's seconds over the method's, over the images)
    covers the true ratio E[AR] / E[method] of the images it was drawn from in 90-99 % of 400
    simulated runs of 16 images x 2 passes, and in 88-99 % with 4 images (measured: 95 % and
    93 %). False-positive rate: at the measured coverage a count outside the band has probability
    below 1e-4 (4 standard errors or more). Power: a 50 % interval, far too narrow for 95 %, fails
    the band. Fixed seeds."""
    gen = torch.Generator().manual_seed(11)
    big_ar, big_m = _simulated_chunks(gen, 2_000_000, 1)
    truth = sum(big_ar[0]) / sum(big_m[0])  # the images' speed-up (to ~0.1 %)

    def coverage(images: int, level: float) -> float:
        hits = 0
        for ar, m in [_simulated_chunks(gen, images, 2) for _ in range(400)]:
            ci = speedup_interval(ar, m, level=level)
            assert ci is not None and ci[0] <= ci[1]
            hits += ci[0] <= truth <= ci[1]
        return hits / 400

    assert 0.90 <= coverage(16, 0.95) <= 0.99
    assert 0.88 <= coverage(4, 0.95) <= 0.99
    assert coverage(16, 0.5) < 0.88  # the power check
    assert speedup_interval([[1.0, 2.0], [1.0, 2.0]], [[0.5, 1.0], [0.5, 1.0]]) == [2.0, 2.0]  # same ratio everywhere
    assert speedup_interval([[1.0]], [[0.5]]) is None  # one batch: no interval


# ---- a probe of the measurement tools (2026-11-30) ----------------------------------------------


def test_the_speedup_is_its_intervals_estimate() -> None:
    """With --repeats, the speed-up was AR's median pass over the method's median pass, which can
    come from different passes, while its interval paired the chunks: a probe read 3.11x beside a
    0.87-1.28x interval. Both are now each chunk's median over the passes, summed."""
    from lantern.eval.bench import paired_seconds

    ar = [[0.25, 0.25, 2.0, 0.25], [0.25] * 4, [0.25, 0.25, 0.25, 6.0]]  # one slow chunk in two passes
    method = [[0.24] * 4, [0.24, 0.24, 0.24, 3.0], [0.24] * 4]
    old = sorted(map(sum, ar))[1] / sorted(map(sum, method))[1]
    ci = speedup_interval(ar, method)
    assert ci is not None and not ci[0] <= old <= ci[1]  # power: the old estimate is outside
    assert paired_seconds(ar) == pytest.approx(1.0) and paired_seconds(method) == pytest.approx(0.96)
    assert ci[0] <= paired_seconds(ar) / paired_seconds(method) <= ci[1]


def test_bench_rows_record_their_chunks_and_agree_with_their_interval() -> None:
    """A speed-only run with 2 passes: each row's speed-up is the ratio of the chunks it records
    (``chunk_seconds``, [pass][chunk]) and lies inside its own interval."""
    import lantern.eval.bench as bench
    from lantern.decoding.config import SamplingConfig
    from lantern.targets.llamagen_stack import load_stack

    stack = load_stack("digits")
    config = BenchConfig(methods=parse_methods("ar,sjd-coupled"), num_images=3, speed_images=3, curve_images=0,
                         ar_seeds=1, repeats=2)
    result = bench.run_bench(stack, SamplingConfig(**stack.default_sampling()), config, None, progress=False,
                             log=lambda _: None)
    ar, row = result.rows
    assert [len(p) for p in row.chunk_seconds] == [3, 3] and len(ar.chunk_seconds) == 2
    assert row.speedup_vs_ar == pytest.approx(bench.paired_seconds(ar.chunk_seconds) /
                                              bench.paired_seconds(row.chunk_seconds), rel=1e-3)
    assert row.speedup_ci is not None and row.speedup_ci[0] <= row.speedup_vs_ar * (1 + 1e-3)
    assert row.speedup_vs_ar <= row.speedup_ci[1] * (1 + 1e-3)


def test_a_latency_batch_is_never_larger_than_its_images() -> None:
    """``--speed-batch-size 4 --speed-images 2`` timed one batch of 2 and recorded batch 4; a
    calibration at --batch-sizes 16 (8 speed images) stored batch-8 times under 16."""
    from lantern.eval.calibrate import calibration_config

    with pytest.raises(LanternError, match=r"--speed-images \(2\) must be at least the \(first\) --speed-batch-size "
                                           r"\(4\): the latency rows time whole batches"):
        BenchConfig(methods=parse_methods("ar"), num_images=4, speed_images=2, speed_batch_size=4)
    assert BenchConfig(methods=parse_methods("ar"), num_images=4, speed_images=4, speed_batch_size=4)  # power
    for quick in (True, False):
        config = calibration_config(["ar", "sd"], [16, 1], quick)
        assert (config.speed_images, config.speed_batch_size) == (16, 16) and config.num_images >= 16
    assert calibration_config(["ar"], [1, 16], True).speed_images == 8  # throughput sizes time max(8, b) anyway


def test_speed_only_timing_is_not_capped_by_the_quality_images() -> None:
    """``--speed-images 300 --no-quality`` was refused: "must be <= --num-images (200)", a setting
    of the quality pass that does not run (a probe, 2026-11-30)."""
    from lantern.cli.bench import bench_config
    from lantern.cli.main import build_parser

    def config(*argv: str) -> BenchConfig:
        return bench_config(build_parser().parse_args(["bench", "--methods", "ar", *argv]))

    assert config("--speed-images", "300", "--no-quality").speed_images == 300
    with pytest.raises(LanternError, match=r"--speed-images \(300\) must be <= --num-images \(200\)"):
        config("--speed-images", "300")  # power: with quality, the timed images are quality images


def test_a_batch_size_given_twice_is_refused() -> None:
    """``--speed-batch-size 1,2,2 --save-calibration`` timed batch 2 twice and wrote a calibration
    that --method auto then refused."""
    for flag in ("--speed-batch-size", "--batch-sizes"):
        with pytest.raises(LanternError, match=f"^{flag} must be an integer >= 1 or distinct ones like 1,4,16, got "
                                               "'1,2,2'$"):
            parse_batch_sizes("1,2,2", flag)
    assert parse_batch_sizes("2,1") == [2, 1]


def test_a_saturated_proportion_is_judged_at_its_step() -> None:
    """AR at 1000 of 1000 correct (5 seeds of 200) gave class accuracy a zero-width bound: one miss
    in 200 was "out". A proportion's s is now at least one image's step (1/N); the false-alarm
    rate this gives is simulated in ARSpread.floor's docstring. Five equal precisions averaged a
    hair off themselves and an equal row read "better" or "worse"."""
    acc = ARSpread((0, 1, 2, 3, 4), {"class_accuracy": [1.0] * 5}, counts={"class_accuracy": 200})
    assert acc.sides({"class_accuracy": 0.995}) == {"class_accuracy": "within"}
    assert acc.sides({"class_accuracy": 0.98}) == {"class_accuracy": "worse"}  # power: four misses
    old = ARSpread((0, 1, 2, 3, 4), {"class_accuracy": [1.0] * 5})  # without counts (an older run.json): no floor
    assert old.sides({"class_accuracy": 0.995}) == {"class_accuracy": "worse"}
    assert ARSpread.from_dict(acc.to_dict()) == acc
    prec = ARSpread((0, 1, 2, 3, 4), {"precision": [0.94] * 5})
    assert prec.sides({"precision": 0.94}) == {"precision": "within"}
    assert prec.sides({"precision": 0.9399}) == {"precision": "worse"}


def test_a_calibration_replaced_is_kept_and_a_bad_one_is_not_written(tmp_path: Path) -> None:
    """``bench --save-calibration`` of one method silently took the place of a full calibration."""
    from lantern.calibration import Calibration, MethodCalibration, load_calibration

    def calibration(methods: tuple[str, ...], sizes: tuple[int, ...]) -> Calibration:
        return Calibration("m", "k", sizes, {m: MethodCalibration(m, 1.0, {b: 0.1 for b in sizes}) for m in methods})

    path = tmp_path / "cal" / "k.json"
    assert calibration(("ar", "sd", "lantern++"), (1, 4)).write(path) == (path, None)
    written, note = calibration(("ar",), (1,)).write(path)
    kept = tmp_path / "cal" / "k.previous.json"
    assert note == f"the calibration it replaced (3 methods at batch 1, 4, speed only) is kept as {kept}"
    assert set(load_calibration(kept).methods) == {"ar", "sd", "lantern++"}
    assert set(load_calibration(written).methods) == {"ar"}
    with pytest.raises(LanternError, match="batch_sizes"):
        calibration(("ar",), (2, 2)).write(path)
    assert set(load_calibration(path).methods) == {"ar"}  # left as it was
