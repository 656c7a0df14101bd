"""``--method auto`` (lantern.calibration): the fastest calibrated method of a quality class.

Every choice here is made on a synthetic calibration whose numbers are written in the test, so
each expected answer can be read off the table below; nothing is timed. Each test says in its
docstring what it catches (how it can fail).
"""

from __future__ import annotations

import json
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

import lantern
from lantern.calibration import (
    FORMAT,
    Calibration,
    Setup,
    choose_method,
    load_calibration,
    model_identity,
    nearest_batch_size,
)
from lantern.cli.main import main
from lantern.errors import LanternError
from lantern.methods import METHOD_TABLE
from lantern.testing import make_random_stack

# method: (s/img at batch 1, s/img at batch 8, verdict, worse metrics). At each (class, batch) a
# faster method sits outside the class, so a chooser that ignored the class would pick it.
TABLE: dict[str, tuple[float, float, str | None, list[str]]] = {
    "ar": (2.0, 0.50, "within", []),
    "sd": (1.4, 0.60, "within", []),  # lossless; faster than ar at batch 1 only
    "sjd-coupled": (1.1, 0.45, "within", []),  # lossless: the lossless answer at both sizes
    "lantern": (0.9, 0.70, "within", []),  # relaxed, within: the ar answer at batch 1
    "pjd": (1.0, 0.30, "within", []),  # lossy at its defaults, within: the ar answer at batch 8
    "sjd-coupled-lantern": (0.6, 0.20, "out", ["fid", "class_accuracy"]),  # fastest everywhere, out
}
EXPECTED = {("lossless", 1): "sjd-coupled", ("lossless", 8): "sjd-coupled", ("ar", 1): "lantern", ("ar", 8): "pjd"}


def synthetic(table: dict[str, tuple[float, float, str | None, list[str]]] = TABLE, quality: bool = True,
              model_id: str = "0123456789abcdef", key: str = "cpu-test-float32-eager") -> dict[str, Any]:
    """A calibration file's contents (batch sizes 1 and 8) from ``table``; ``quality`` False: a --quick one."""
    methods = {name: {"tau": 2.0, "seconds_per_image": {"1": b1, "8": b8}, "verdict": verdict if quality else None,
                      "worse": worse if quality else [], "better": []}
               for name, (b1, b8, verdict, worse) in table.items()}
    return {"format": FORMAT, "version": 1, "model_id": model_id, "key": key, "batch_sizes": [1, 8],
            "quality": {"images": 200, "ar_seeds": 5} if quality else None, "methods": methods,
            "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "cfg_scale": 1.0}}


def calibration(**kwargs: Any) -> Calibration:
    return Calibration.from_dict(synthetic(**kwargs), "test")


@pytest.mark.parametrize(("quality", "batch"), sorted(EXPECTED))
def test_auto_picks_the_fastest_method_of_the_class(quality: str, batch: int) -> None:
    """Fails if the chooser ignores the class (it would pick sjd-coupled-lantern, the fastest, which
    the first assertion shows is never the answer), the batch size (the ar answers differ between
    1 and 8), or picks anything but the fastest eligible one."""
    cal = calibration()
    fastest = min(TABLE, key=lambda m: TABLE[m][0 if batch == 1 else 1])
    assert fastest != EXPECTED[quality, batch]  # the test has teeth: the unfiltered answer is wrong
    choice = choose_method(cal, quality, batch, "test.json")
    assert choice.method == EXPECTED[quality, batch]
    assert choice.measured_batch_size == batch and not choice.notes
    times = [s for _, s in choice.ranking]
    assert times == sorted(times) and choice.ranking[0][0] == choice.method
    assert choice.to_dict()["calibration"] == "test.json" and choice.method in choice.explanation


def test_a_method_outside_the_class_is_never_picked() -> None:
    """A faster method judged out never wins ``ar``; a relaxed method judged within never wins
    ``lossless``; checked on 200 random calibrations against the definition of each class. Fails
    if either exclusion is dropped, or if the excluded methods are not reported with a reason."""
    rng = random.Random(0)
    names = list(METHOD_TABLE)
    for _ in range(200):
        table = {name: (rng.uniform(0.1, 3), rng.uniform(0.05, 1), verdict := rng.choice(["within", "out"]),
                        ["fid"] if verdict == "out" else [])
                 for name in ["ar", *rng.sample(names[1:], 6)]}
        cal = calibration(table=table)
        for quality, batch in EXPECTED:
            choice = choose_method(cal, quality, batch)
            eligible = {m for m, (_, _, verdict, _) in table.items()
                        if METHOD_TABLE[m].lossless or (quality == "ar" and verdict == "within")}
            assert choice.method == min(eligible, key=lambda m: table[m][0 if batch == 1 else 1])
            assert set(choice.excluded) == set(table) - eligible and all(choice.excluded.values())
    relaxed_within = choose_method(calibration(), "lossless", 1).excluded
    assert relaxed_within["lantern"] == "not lossless at its defaults" and "pjd" in relaxed_within
    assert "worse: fid, class_accuracy" in choose_method(calibration(), "ar", 1).excluded["sjd-coupled-lantern"]


def test_a_quick_calibration_offers_ar_only_the_lossless_methods() -> None:
    """Without quality verdicts nothing relaxed is eligible, and the choice says so. Fails if an
    unjudged method were taken for one within."""
    choice = choose_method(calibration(quality=False), "ar", 8)
    assert choice.method == "sjd-coupled" and "quality not measured" in choice.excluded["pjd"]
    assert any("no quality verdicts" in note for note in choice.notes)


@pytest.mark.parametrize(("batch", "measured"), [(1, 1), (2, 1), (3, 8), (4, 8), (64, 8)])
def test_an_unmeasured_batch_size_uses_the_nearest_and_says_so(batch: int, measured: int) -> None:
    """Nearest in ratio (3 is nearer 8 than 1: 8/3 < 3/1). Fails on a linear distance (3 -> 1)
    or when the note is missing."""
    assert nearest_batch_size((1, 8), batch) == measured
    choice = choose_method(calibration(), "ar", batch)
    assert choice.measured_batch_size == measured and choice.method == EXPECTED["ar", measured]
    assert bool(choice.notes) is (batch != measured)


def test_a_calibration_timed_on_a_busy_machine_says_so_at_every_choice() -> None:
    """The calibration run printed its busy-machine warning once; a --method auto run weeks later
    reads only the file, so the choice repeats it (from the file's "machine"). Power: a quiet
    calibration's choice has no such note, and the load-average form is read too."""
    from lantern.machine import MachineLoad, Reading

    quiet = synthetic()
    quiet["machine"] = {"description": "test CPU", "busy_warning": None}
    assert not choose_method(Calibration.from_dict(quiet, "test"), "ar", 1).notes
    loads = {  # the bench's own warnings: from CPU seconds, and from the load average without /proc/stat
        "other processes used 40% of the 2 cores while timing": MachineLoad(Reading(0, 0.5, 2, 0.0, 0.0),
                                                                            Reading(10, 1.5, 2, 18.0, 10.0)),
        "load average 3.0 -> 3.5 on 2 cores": MachineLoad(Reading(0, 3.0, 2, None, 0.0),
                                                          Reading(10, 3.5, 2, None, 9.0)),
    }
    for what, load in loads.items():
        busy = synthetic()
        busy["machine"] = {"description": "test CPU", "busy_warning": load.warning()}
        choice = choose_method(Calibration.from_dict(busy, "test"), "ar", 1)
        assert choice.notes == (f"its timings were taken on a busy machine ({what}): calibrate again on a quiet one",)
        assert choice.notes[0] in choice.explanation and choice.method == EXPECTED["ar", 1]


# -- files -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_stack(tmp_path_factory.mktemp("auto") / "random", seed=3)


@pytest.fixture(autouse=True)
def calibration_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test reads and writes calibrations in its own folder, never the user's cache."""
    monkeypatch.setenv("LANTERN_CALIBRATION_DIR", str(tmp_path / "calibrations"))
    return tmp_path / "calibrations"


def write_for(stack: Path, table: dict[str, tuple[float, float, str | None, list[str]]]) -> Path:
    """A synthetic calibration where ``lantern generate --model stack`` (cpu, float32, eager) looks."""
    setup = Setup.of(str(stack), stack, "cpu", "float32", None)
    return Calibration.from_dict(synthetic(table, model_id=setup.model_id, key=setup.key), "test").save(
        setup.user_file)


def test_without_a_calibration_the_error_names_the_command(stack: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """One line, before anything loads or is written, with the command that makes a calibration
    and the quick one with its cost. Fails if auto silently picked a method (rc 0) or the message
    lost the command."""
    out = tmp_path / "out"
    assert main(["generate", "--model", str(stack), "--labels", "0", "--method", "auto", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and not out.exists()
    assert f"`lantern calibrate --model {stack}`" in err and "--quick`" in err and "min" in err
    with pytest.raises(LanternError, match="lantern calibrate --model") as e:
        lantern.load(stack)(labels=[0], method="auto")
    assert "\n" not in str(e.value)


CORRUPTIONS = {
    "not JSON": lambda d: "{not json",
    "a pickle": lambda d: pickle.dumps({"methods": {}}),
    "another format": lambda d: {**d, "format": "something-else"},
    "no ar": lambda d: {**d, "methods": {k: v for k, v in d["methods"].items() if k != "ar"}},
    "unknown method": lambda d: {**d, "methods": {**d["methods"], "warp": d["methods"]["ar"]}},
    "a batch size missing": lambda d: {**d, "methods": {**d["methods"], "sd": {**d["methods"]["sd"],
                                                                              "seconds_per_image": {"1": 1.0}}}},
    "a negative time": lambda d: {**d, "methods": {**d["methods"], "sd": {**d["methods"]["sd"],
                                                                         "seconds_per_image": {"1": -1, "8": 1}}}},
    "out without a metric": lambda d: {**d, "methods": {**d["methods"], "pjd": {**d["methods"]["pjd"], "verdict": "out",
                                                                               "worse": []}}},
    "a verdict without quality": lambda d: {**d, "quality": None},
    "an unknown key": lambda d: {**d, "code": "import os"},
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_malformed_calibration_is_one_line_naming_the_file(stack: Path, tmp_path: Path, corruption: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Each file is written where generate looks; it must fail in one line that names the file
    (no traceback, no choice). Fails if a schema check is missing (the run would go on: rc 0 or a
    KeyError traceback) or the message does not say which file."""
    path = write_for(stack, TABLE)
    broken = CORRUPTIONS[corruption](json.loads(path.read_text()))
    if isinstance(broken, bytes):
        path.write_bytes(broken)
    else:
        path.write_text(broken if isinstance(broken, str) else json.dumps(broken))
    with pytest.raises(LanternError) as e:
        load_calibration(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    out = tmp_path / "out"
    assert main(["generate", "--model", str(stack), "--labels", "0", "--method", "auto", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err and not out.exists()


def test_the_choice_is_recorded_in_run_json_and_the_api_result(stack: Path, tmp_path: Path) -> None:
    """generate --method auto runs the chosen method (run.json's method, and the same codes as
    naming it) and records why: the file, class, batch sizes and ranking; the API's config holds
    the same record. Fails if the choice is not applied or not recorded."""
    table = {"ar": (0.5, 0.2, "within", []), "sjd": (0.4, 0.3, "within", []),
             "sjd-coupled": (0.3, 0.1, "within", []), "sjd-lantern": (0.1, 0.05, "out", ["fid"])}
    path = write_for(stack, table)
    out = tmp_path / "out"
    args = ["generate", "--model", str(stack), "--labels", "0,1", "--batch-size", "2", "--no-progress"]
    assert main([*args, "--method", "auto", "--quality", "ar", "--out", str(out)]) == 0
    run = json.loads((out / "run.json").read_text())
    record = run["auto_method"]
    assert run["method"]["method"] == record["method"] == "sjd-coupled"
    assert record["calibration"] == str(path) and record["quality"] == "ar"
    assert (record["batch_size"], record["measured_batch_size"]) == (2, 1)  # 2 is nearer 1 than 8
    assert record["excluded"] == {"sjd-lantern": "out of AR's spread (worse: fid)"} and record["notes"]
    assert main([*args, "--method", "sjd-coupled", "--out", str(tmp_path / "named")]) == 0
    assert (out / "codes.npy").read_bytes() == (tmp_path / "named" / "codes.npy").read_bytes()
    result = lantern.load(stack)(labels=[0, 1], method="auto", quality="ar", batch_size=2)
    assert result.config["method"]["method"] == "sjd-coupled"
    assert result.config["auto_method"] == record


def test_auto_chooses_for_the_rows_a_call_decodes(stack: Path, tmp_path: Path) -> None:
    """One image at the default batch size (8) decodes as a batch of 1: auto picks batch 1's
    fastest method, in Python and on the command line; eight images pick batch 8's. Fails if the
    choice is made for ``batch_size`` rather than for the rows decoded (sjd would be sjd-coupled)."""
    write_for(stack, {"ar": (0.5, 0.2, "within", []), "sjd": (0.3, 0.3, "within", []),
                      "sjd-coupled": (0.4, 0.1, "within", [])})
    pipe = lantern.load(stack)
    one = pipe(labels=[0], method="auto")
    assert (one.config["method"]["method"], one.config["auto_method"]["batch_size"]) == ("sjd", 1)
    eight = pipe(labels=[0, 1], num_per_label=4, method="auto")
    assert (eight.config["method"]["method"], eight.config["auto_method"]["batch_size"]) == ("sjd-coupled", 8)
    out = tmp_path / "one"
    assert main(["generate", "--model", str(stack), "--labels", "0", "--method", "auto", "--no-progress",
                 "--out", str(out)]) == 0
    run = json.loads((out / "run.json").read_text())
    assert (run["method"]["method"], run["auto_method"]["batch_size"], run["batch_size"]) == ("sjd", 1, 8)


def test_auto_refuses_settings_it_cannot_honour(stack: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """--quality without auto, method settings with auto (the calibration measured defaults) and
    another drafter are refused in one line. Fails if any is silently ignored."""
    write_for(stack, TABLE)
    base = ["generate", "--model", str(stack), "--labels", "0", "--out", str(tmp_path / "o")]
    for extra, needle in ((["--method", "sjd", "--quality", "lossless"], "--quality is only used with --method auto"),
                          (["--method", "auto", "--sjd-window", "4"], "drop --sjd-window"),
                          (["--method", "auto", "--drafter", str(stack / "drafter")], "drop --drafter")):
        assert main([*base, *extra]) == 2
        assert needle in capsys.readouterr().err
    pipe = lantern.load(stack)
    with pytest.raises(LanternError, match="drop lantern_delta or name a method"):
        pipe(labels=[0], method="auto", lantern_delta=0.2)
    with pytest.raises(LanternError, match="^quality is only used with method auto"):
        pipe(labels=[0], method="sjd", quality="ar")
    with pytest.raises(LanternError, match="^quality must be one of lossless, ar"):
        pipe(labels=[0], method="auto", quality="fast")


def test_the_model_identity_follows_the_files(stack: Path, tmp_path: Path) -> None:
    """A copy has the same identity (so a preset, a copy and a Hub snapshot share calibrations);
    a changed weight byte or an added file changes it; shipped calibrations do not count. Fails
    if the identity hashed paths instead of contents, or missed a file."""
    copy = Path(shutil.copytree(stack, tmp_path / "copy"))
    assert model_identity(copy) == model_identity(stack)
    (copy / "calibration").mkdir()
    (copy / "calibration" / "cpu.json").write_text("{}")
    assert model_identity(copy) == model_identity(stack)
    weights = copy / "drafter" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    changed = model_identity(copy)
    assert changed != model_identity(stack)
    (copy / "generation.json").write_text("{}")
    assert model_identity(copy) != changed


def test_a_calibration_shipped_with_the_model_is_read(stack: Path, tmp_path: Path) -> None:
    """A read-only model folder may carry ``calibration/<key>.json``; the user's own wins over it.
    Fails if the model folder is not looked in, or is preferred to the user's file."""
    copy = Path(shutil.copytree(stack, tmp_path / "shipped"))
    setup = Setup.of(str(copy), copy, "cpu", "float32", None)
    shipped = Calibration.from_dict(synthetic(model_id=setup.model_id, key=setup.key), "t").save(setup.model_file)
    from lantern.calibration import find_calibration

    assert find_calibration(setup)[0] == shipped
    Calibration.from_dict(synthetic(model_id=setup.model_id, key=setup.key), "t").save(setup.user_file)
    assert find_calibration(setup)[0] == setup.user_file


def test_a_missing_calibration_names_the_settings_that_have_one(stack: Path) -> None:
    """``bench --save-calibration`` at its default ``--dtype auto`` (bf16 on an AMX CPU) wrote a
    file a float32 ``generate --method auto`` never reads, and the refusal did not say one existed."""
    from lantern.calibration import find_calibration

    bf16 = Setup.of(str(stack), stack, "cpu", "bfloat16", None)
    Calibration.from_dict(synthetic(model_id=bf16.model_id, key=bf16.key), "t").save(bf16.user_file)
    with pytest.raises(LanternError) as err:
        find_calibration(Setup.of(str(stack), stack, "cpu", "float32", None))
    assert f"this model has calibrations of other settings only: {bf16.key})" in str(err.value)
    assert find_calibration(bf16)[0] == bf16.user_file  # power: the setting it was made for finds it


def test_a_bench_result_becomes_a_calibration(stack: Path) -> None:
    """The bench's verdicts map to the file's (no spread: null; none worse: within; else out),
    each batch size's seconds per image come from the latency rows and the throughput table, and
    rows not at their method's defaults are left out. Fails if a verdict or a time is carried
    wrongly, or a non-default row (other settings, other speed) slipped in as the method's."""
    from lantern.eval.calibrate import calibration_from_bench
    from lantern.eval.report import ARSpread, BenchResult, BenchRow
    from lantern.methods import resolve_method

    pipe = lantern.load(stack)
    defaults = {m: resolve_method(m, pipe.stack).to_dict() for m in ("ar", "sd", "lantern")}
    rows = [BenchRow(label, base, "-", None, tau, 10.0, 8 * s, s, 1.0, outside_ar_spread=worse)
            for label, base, tau, s, worse in (("ar", "ar", 1.0, 2.0, []), ("sd", "sd", 2.5, 1.5, []),
                                               ("lantern", "lantern", 7.0, 0.9, ["fid"]),
                                               ("lantern/delta=0.2", "lantern", 8.0, 0.5, []))]
    meta = {"config": {"speed_batch_size": 1, "throughput_batch_sizes": [8], "num_images": 200},
            "methods": {**defaults, "lantern/delta=0.2": resolve_method("lantern", pipe.stack,
                                                                        lantern_delta=0.2).to_dict()},
            "machine": "test", "threads": 1, "sampling": {"temperature": 1.0}}
    throughput = [{"batch_size": 8, "method": r.method, "images_per_second": 1 / (r.seconds_per_image / 4),
                   "resolved": meta["methods"][r.method]} for r in rows]
    spread = ARSpread((0, 1, 2), {"fid": [1.0, 1.1, 0.9]})
    result = BenchResult(rows, meta, spread, {}, [], {}, [], throughput)
    setup = pipe.calibration_setup()
    cal, skipped = calibration_from_bench(result, pipe.stack, setup, "lantern bench ...")
    assert skipped == ["lantern/delta=0.2"] and list(cal.methods) == ["ar", "sd", "lantern"]
    assert [cal.methods[m].verdict for m in cal.methods] == ["within", "within", "out"]
    assert cal.methods["lantern"].worse == ("fid",) and cal.batch_sizes == (1, 8)
    assert cal.methods["sd"].seconds_per_image == {1: 1.5, 8: pytest.approx(1.5 / 4)}
    assert (cal.model_id, cal.key) == (setup.model_id, setup.key)
    again = Calibration.from_dict(json.loads(json.dumps(cal.to_dict())), "round trip")
    assert again.to_dict() == cal.to_dict()
    no_spread = calibration_from_bench(BenchResult(rows, meta, None, {}, [], {}, [], throughput), pipe.stack, setup,
                                       "")[0]
    assert no_spread.quality is None and {m.verdict for m in no_spread.methods.values()} == {None}
    # --tree auto chose another tree for sd at batch 8: that time is not the default sd's
    other = [{**p, "resolved": resolve_method("sd", pipe.stack, tree="chain:2").to_dict()} if p["method"] == "sd"
             else p for p in throughput]
    assert calibration_from_bench(BenchResult(rows, meta, spread, {}, [], {}, [], other), pipe.stack, setup,
                                  "")[1] == ["sd", "lantern/delta=0.2"]


def test_calibrate_writes_what_auto_reads(stack: Path, calibration_dir: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``lantern calibrate --quick`` on a tiny model (speed only, two methods, two images) writes
    a file the reader accepts, where ``method="auto"`` finds it. Fails if the writer and the
    reader disagree on the schema, the identity or the place."""
    args = ["calibrate", "--model", str(stack), "--quick", "--methods", "ar,sjd-coupled", "--speed-images", "2",
            "--batch-sizes", "1,2", "--no-progress"]
    assert main(args) == 0
    setup = Setup.of(str(stack), stack, "cpu", "float32", None)
    cal = load_calibration(setup.user_file)
    assert setup.user_file.is_relative_to(calibration_dir) and f"wrote {setup.user_file}" in capsys.readouterr().out
    assert cal.quality is None and list(cal.methods) == ["ar", "sjd-coupled"] and cal.batch_sizes == (1, 2)
    result = lantern.load(stack)(labels=[0], method="auto", quality="lossless", batch_size=2)
    assert result.config["auto_method"]["calibration"] == str(setup.user_file)
    assert result.config["method"]["method"] == result.config["auto_method"]["method"]


def test_calibrate_refuses_a_folder_as_out_before_it_loads(stack: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """``calibrate --out DIR`` ran every method, then failed writing a temporary file (a probe,
    2026-11-29: "Is a directory: .DIR.3d0l4u30.tmp"). It is refused before the model loads."""
    import lantern.api

    monkeypatch.setattr(lantern.api, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["calibrate", "--model", str(stack), "--quick", "--out", str(tmp_path), "--no-progress"]) == 2
    assert capsys.readouterr().err == (f"lantern: error: --out {tmp_path} is a folder; expected the calibration "
                                       "file to write (a .json path)\n")


@pytest.mark.parametrize("flag", ["--num-images", "--ar-seeds", "--batch-size", "--num-real", "--feature-net"])
def test_calibrate_quick_refuses_the_quality_flags_it_would_ignore(stack: Path, flag: str,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``--quick`` runs no quality pass: ``--num-images 50`` with it was silently unused."""
    import lantern.api

    monkeypatch.setattr(lantern.api, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["calibrate", "--model", str(stack), "--quick", flag, "4", "--no-progress"]) == 2
    assert capsys.readouterr().err == (f"lantern: error: {flag} sets the quality pass, and --quick runs none: "
                                       "drop one of them\n")


# -- the server: --method auto resolved once at start, the default when a calibration exists -------

SERVE_TABLE = {"ar": (0.5, 0.4, "within", []), "sjd": (0.4, 0.3, "within", []),
               "sjd-coupled": (0.3, 0.2, "within", []), "sjd-lantern": (0.1, 0.05, "out", ["fid"])}


def test_the_server_default_is_auto_and_falls_back_without_a_calibration(
        stack: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No --method: auto's choice at --max-batch when a calibration exists, else the fallback,
    said on the console with the command that makes one; --method auto named without a
    calibration is the one-line error. Fails if the server ignored the calibration, picked a method
    outside the class, or refused to start when the user named no method."""
    from lantern.cli.serve import FALLBACK_METHOD, FALLBACK_NO_DRAFTER, server_method
    from lantern.serve.plan import runnable_methods

    pipe = lantern.load(stack)
    method, auto = server_method(pipe, None, None, 8)
    assert auto is None and method == (FALLBACK_METHOD if FALLBACK_METHOD in runnable_methods(pipe)
                                       else FALLBACK_NO_DRAFTER)
    assert f"lantern calibrate --model {stack}" in capsys.readouterr().out
    with pytest.raises(LanternError, match="lantern calibrate --model"):
        server_method(pipe, "auto", None, 8)
    assert server_method(pipe, "sjd", None, 8) == ("sjd", None)  # a named method reads no calibration
    write_for(stack, SERVE_TABLE)
    method, auto = server_method(pipe, None, None, 8)
    assert auto is not None and method == auto.method == "sjd-coupled"  # sjd-lantern is faster but out
    assert (auto.quality, auto.batch_size, auto.measured_batch_size) == ("ar", 8, 8)
    assert "sjd-coupled" in capsys.readouterr().out


def test_the_servers_answers_say_what_auto_chose(stack: Path) -> None:
    """A request naming no method, or ``auto``, runs the server's choice and its settings carry
    the choice (the same record as run.json's); a named method's answer has none, and GET
    /v1/methods shows it. A server without auto refuses ``auto`` naming the field. Fails if auto
    were resolved per request (another method), or not reported."""
    from fastapi.testclient import TestClient

    from lantern.cli.serve import server_method
    from lantern.serve.app import create_app
    from lantern.serve.scheduler import Scheduler

    write_for(stack, SERVE_TABLE)
    pipe = lantern.load(stack)
    method, auto = server_method(pipe, None, None, 2)
    scheduler = Scheduler(pipe, max_batch=2, max_queue=8)
    scheduler.start()
    with TestClient(create_app(scheduler, pipeline=pipe, default_method=method, auto=auto)) as client:
        answers = [client.post("/v1/images/generations", json={"label": 0, "seed": 5, **extra}).json()
                   for extra in ({}, {"method": "auto"}, {"method": "sjd"})]
        listed = client.get("/v1/methods").json()
    assert auto is not None and [a["method"] for a in answers] == ["sjd-coupled", "sjd-coupled", "sjd"]
    assert answers[0]["settings"]["auto_method"] == answers[1]["settings"]["auto_method"] == auto.to_dict()
    assert "auto_method" not in answers[2]["settings"]
    assert listed["default"] == "sjd-coupled" and listed["auto"]["method"] == "sjd-coupled"
    assert answers[0]["data"][0]["b64_json"] == answers[1]["data"][0]["b64_json"]  # one method, one seed
    plain = Scheduler(pipe, max_batch=2, max_queue=8)
    plain.start()
    with TestClient(create_app(plain, pipeline=pipe, default_method="sjd")) as client:
        refused = client.post("/v1/images/generations", json={"label": 0, "seed": 5, "method": "auto"})
    assert refused.status_code == 400 and refused.json()["error"]["field"] == "method"
    assert "--method auto" in refused.json()["error"]["message"]


def test_serve_refuses_quality_without_auto(capsys: pytest.CaptureFixture[str]) -> None:
    """--quality only means something to auto: with a named method it is a one-line refusal before
    anything loads. Fails if the flag were silently ignored."""
    assert main(["serve", "--model", "digits", "--method", "sjd", "--quality", "lossless"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--quality" in err
