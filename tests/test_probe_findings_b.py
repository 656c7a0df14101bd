"""Regression tests for the bad-input probe of issue 30 (findings 2, 3, 6, 9, 10, 11): each bad
argument, file or folder ends in one specific :class:`LanternError` line (or a note and a correct
run), never a traceback, partial output or silent wrong result."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import T5_MAXLEN

import lantern
from lantern.cli.main import main
from lantern.errors import LanternError
from lantern.io import LanternWarning, trusted_checkpoints
from lantern.outputs import OutputFile
from lantern.targets.text import load_t5
from lantern.testing import make_tiny_chameleon_folder

# --------------------------------------------------------------------------------------------------
# 9. The Python API: every wrong type or value names the argument
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits() -> lantern.Pipeline:
    return lantern.load("digits")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"labels": 3}, r"^labels: expected a list of class ids \(integers\), got int 3$"),
    ({"labels": "0"}, r"^labels: expected a list of class ids \(integers\), got str '0'$"),
    ({"labels": []}, r"^labels: the list is empty"),
    ({"labels": [1.5]}, r"^labels\[0\]: expected a class id \(an integer\), got float 1.5$"),
    ({"labels": [2, True]}, r"^labels\[1\]: expected a class id \(an integer\), got bool True$"),
    ({"labels": np.array([[1, 2]])}, r"^labels: expected a 1-D integer array of class ids, got a 2-D int64"),
    ({"labels": np.array([1.0])}, r"^labels: expected a 1-D integer array of class ids, got a 1-D float64"),
    ({"labels": [0], "temperature": "1.0"}, r"^temperature must be a number, got '1.0' \(str\)$"),
    ({"labels": [0], "cfg_scale": [2]}, r"^cfg_scale must be a number, got \[2\] \(list\)$"),
    ({"labels": [0], "top_k": True}, r"^top_k must be an integer >= 0"),
    ({"labels": [0], "seed": "abc"}, r"^seed must be an integer, got 'abc' \(str\)$"),
    ({"labels": [0], "seed": 1.5}, r"^seed must be an integer, got 1.5 \(float\)$"),
    ({"labels": [0], "progress": "yes"}, r"^progress must be True or False"),
])
def test_api_bad_arguments_name_the_argument(digits: lantern.Pipeline, kwargs: dict, message: str) -> None:
    with pytest.raises(LanternError, match=message):
        digits(**kwargs)


def test_api_takes_integer_arrays_as_labels(digits: lantern.Pipeline) -> None:
    """A 1-D integer numpy array or tensor is a list of labels (documented on Pipeline.__call__)."""
    expected = digits(labels=[1, 2], seed=3, temperature=0.0).codes
    for labels in (np.array([1, 2]), np.array([1, 2], dtype=np.int32), torch.tensor([1, 2]), (np.int64(1), 2)):
        assert torch.equal(digits(labels=labels, seed=3, temperature=0.0).codes, expected)
    assert isinstance(LanternError("x"), ValueError)  # one class to catch, wrong types included


def test_api_prompts_must_be_a_list_of_strings(tmp_path: Path) -> None:
    folder = make_tiny_chameleon_folder(tmp_path / "cham")
    pipe = lantern.load(folder)
    with pytest.raises(LanternError, match=r"^prompts: expected a list of strings, got one string 'a cat'"):
        pipe(prompts="a cat")
    with pytest.raises(LanternError, match=r"^prompts\[1\]: expected a string, got int 3$"):
        pipe(prompts=["a cat", 3])


@pytest.mark.parametrize(("auto_map", "why"), [
    ({"AutoTokenizer": ["custom.Tokenizer", None]}, "asks to run the folder's own Python code"),
    ("custom.Tokenizer", "AttributeError: 'str' object has no attribute 'get'"),
])
def test_load_refuses_a_folder_whose_tokenizer_config_asks_for_its_own_code(
        tmp_path: Path, auto_map: object, why: str) -> None:
    folder = Path(make_tiny_chameleon_folder(tmp_path / "cham"))
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("tokenizer_class", None)  # else transformers uses the named class and ignores auto_map
    config["auto_map"] = auto_map
    config_file.write_text(json.dumps(config))
    with pytest.raises(LanternError) as e:
        lantern.load(folder)
    assert str(e.value).startswith(f"model {folder}: no usable tokenizer")
    assert why in str(e.value) and "\n" not in str(e.value)


# --------------------------------------------------------------------------------------------------
# 10. A T5 pytorch_model.bin carrying a pickle payload: lantern's one-line refusal, and a way in
# --------------------------------------------------------------------------------------------------


class Payload:
    """Unpickling this runs ``exec``: it creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def _t5_with_pickled_weights(t5_dir: Path, out: Path, payload: bool) -> Path:
    from safetensors.torch import load_file

    shutil.copytree(t5_dir, out)
    state: dict[str, object] = dict(load_file(out / "model.safetensors"))
    (out / "model.safetensors").unlink()
    if payload:
        state["extra"] = Payload(out / "PWNED")
    torch.save(state, out / "pytorch_model.bin")
    return out


def test_t5_pickle_payload_is_refused_in_one_line(t2i_stack: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    t5 = _t5_with_pickled_weights(t2i_stack / "t5", tmp_path / "evil-t5", payload=True)
    out = tmp_path / "o"
    rc = main(["generate", "--model", str(t2i_stack), "--prompt", "a cat", "--t5", str(t5), "--out", str(out),
               "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith(f"lantern: error: --t5 weights {t5 / 'pytorch_model.bin'} contains a pickled "
                          "builtins.exec"), err
    assert "--trust-checkpoint" in err and "Traceback" not in err
    assert not (t5 / "PWNED").exists() and not (out / "codes.npy").exists()


def test_trusted_t5_pickle_loads_the_same_encoder(t2i_stack: Path, tmp_path: Path) -> None:
    """--trust-checkpoint reads a .bin-only T5 folder (lantern unpickles it) into the same encoder."""
    t5 = _t5_with_pickled_weights(t2i_stack / "t5", tmp_path / "bin-t5", payload=False)
    expected = load_t5(t2i_stack / "t5", T5_MAXLEN).encode(["a red car", "dog"])
    with trusted_checkpoints(), pytest.warns(LanternWarning, match="full unpickler"):
        got = load_t5(t5, T5_MAXLEN).encode(["a red car", "dog"])
    assert torch.equal(got.mask, expected.mask)
    torch.testing.assert_close(got.embeddings, expected.embeddings, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------
# 11. --overwrite through a symlinked --out: refused, the link's target untouched
# --------------------------------------------------------------------------------------------------


def test_overwrite_through_a_symlinked_out_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    real = tmp_path / "precious"
    real.mkdir()
    (real / "keep.txt").write_text("mine")
    link = tmp_path / "link"
    link.symlink_to(real)
    rc = main(["generate", "--model", "digits", "--labels", "0", "--out", str(link), "--overwrite", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err == (f"lantern: error: --out: {link} is a symbolic link (to {real}); --overwrite would "
                               "replace what it points to: pass that path itself, or remove the link\n")
    assert sorted(p.name for p in real.iterdir()) == ["keep.txt"] and link.is_symlink()
    # the single-file outputs (build-proximity --out) follow the same rule
    file_link = tmp_path / "table-link"
    file_link.symlink_to(real / "keep.txt")
    with pytest.raises(LanternError, match=r"is a symbolic link .*--overwrite would replace"):
        OutputFile.check(file_link, "--out", overwrite=True)
    assert (real / "keep.txt").read_text() == "mine"


# --------------------------------------------------------------------------------------------------
# 6. --feature-net torchscript:FILE runs the file's code: only with --trust-checkpoint
# --------------------------------------------------------------------------------------------------


class _Features(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean((2, 3))


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_torchscript_feature_net_needs_trust_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lantern.eval.metrics import load_feature_extractor

    path = tmp_path / "net.pt"
    torch.jit.script(_Features()).save(str(path))
    out = tmp_path / "bench"
    rc = main(["bench", "--model", "digits", "--feature-net", f"torchscript:{path}", "--out", str(out),
               "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err == (f"lantern: error: --feature-net torchscript:{path}: a TorchScript file runs its own "
                               "code, so lantern loads it only with --trust-checkpoint (trust_checkpoint=True in "
                               "Python)\n")
    assert not out.exists()
    with pytest.raises(LanternError, match="only with --trust-checkpoint"):
        load_feature_extractor(f"torchscript:{path}")
    with trusted_checkpoints(), pytest.warns(LanternWarning, match="running the file's TorchScript code"):
        assert load_feature_extractor(f"torchscript:{path}").dim == 3


# --------------------------------------------------------------------------------------------------
# 2. A proximity table rewritten outside the 64 sampled rows: its table_sha256 catches it
# --------------------------------------------------------------------------------------------------


def _rewrite_table(src: Path, dst: Path) -> Path:
    """``src`` with row 1's two nearest neighbours swapped (row 1 is outside the distance-order
    sample of a 1024-row table) and its header copied unchanged."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), "pt") as f:
        meta = dict(f.metadata())
        nbr = f.get_tensor("neighbours").clone()
    nbr[1, [0, 1]] = nbr[1, [1, 0]]
    save_file({"neighbours": nbr}, str(dst), metadata=meta)
    return dst


def test_a_rewritten_proximity_table_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lantern.targets.llamagen_stack import preset_dir
    from lantern.targets.proximity import SAMPLE_ROWS, ProximityTable, build_proximity, table_sha256

    preset_table = preset_dir("digits") / "proximity.safetensors"
    table = ProximityTable.load(preset_table)  # the embedded tables carry the hash (rebuilt with build-proximity)
    assert table.metadata()["table_sha256"] == table_sha256(table.neighbours)
    sample = torch.linspace(0, table.vocab_size - 1, SAMPLE_ROWS).round().long()
    assert 1 not in sample.tolist()  # the tampering below is invisible to the sampled check

    bad = _rewrite_table(preset_table, tmp_path / "bad.safetensors")
    with pytest.raises(LanternError, match=r"^proximity table .*bad.safetensors: its neighbours do not match the "
                                           r"table_sha256 in its header"):
        ProximityTable.load(bad)
    out = tmp_path / "o"
    rc = main(["generate", "--model", "digits", "--labels", "0", "--method", "lantern", "--proximity", str(bad),
               "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"lantern: error: proximity table {bad}: its neighbours do not match")
    assert err.count("\n") == 1 and not out.exists()

    # A table written before table_sha256 existed still loads; its rows are all checked (test_bounds.py).
    codebook = torch.randn(40, 4, generator=torch.Generator().manual_seed(0))
    old = tmp_path / "old.safetensors"
    build_proximity(codebook, k_max=5).save(tmp_path / "new.safetensors")
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(tmp_path / "new.safetensors"), "pt") as f:
        meta = {k: v for k, v in f.metadata().items() if k != "table_sha256"}
        save_file({"neighbours": f.get_tensor("neighbours")}, str(old), metadata=meta)
    ProximityTable.load(old).validate(codebook)


# --------------------------------------------------------------------------------------------------
# 3. generate --resume checks the job folder's records and PNGs, and redoes what is damaged
# --------------------------------------------------------------------------------------------------

RESUME_ARGS = ["--labels", "0,1,2,3", "--batch-size", "1", "--seed", "4", "--no-progress"]


@pytest.fixture(scope="module")
def random_stack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lantern.testing import make_random_stack

    return make_random_stack(tmp_path_factory.mktemp("stack") / "random", seed=3)


@pytest.fixture(scope="module")
def whole_run(random_stack: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("whole") / "out"
    assert main(["generate", "--model", str(random_stack), "--out", str(out), *RESUME_ARGS]) == 0
    return out


def _stopped_job(stack: Path, out: Path, monkeypatch: pytest.MonkeyPatch, after: int = 2) -> Path:
    """A --resume job stopped once ``after`` images are recorded (as a kill would leave it: the
    job folder keeps its records and PNGs)."""
    import lantern.jobs

    def stop(recorded: int) -> None:
        if recorded >= after:
            raise LanternError("stopped by the test")

    with monkeypatch.context() as m:
        m.setattr(lantern.jobs, "_pause_after", stop)
        assert main(["generate", "--model", str(stack), "--out", str(out), *RESUME_ARGS, "--resume"]) == 2
    job = out.parent / f".{out.name}.resume"
    assert len(list((job / "records").glob("*.npz"))) == after
    return job


def _rewrite_codes(record: Path, value: int) -> None:
    with np.load(record) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["codes"] = np.full_like(arrays["codes"], value)
    with open(record, "wb") as f:
        np.savez(f, **arrays)


DAMAGE = {
    "truncated-record": lambda rec, png: rec.write_bytes(rec.read_bytes()[: len(rec.read_bytes()) // 2]),
    "codes-out-of-vocab": lambda rec, png: _rewrite_codes(rec, 10**6),
    "codes-rewritten-in-vocab": lambda rec, png: _rewrite_codes(rec, 1),
    "png-deleted": lambda rec, png: png.unlink(),
    "png-truncated": lambda rec, png: png.write_bytes(png.read_bytes()[:40]),
}
NOTES = {
    "truncated-record": "cannot be read (BadZipFile",
    "codes-out-of-vocab": "holds codes in [1000000, 1000000], outside the image vocabulary",
    "codes-rewritten-in-vocab": "does not match its sha256",
    "png-deleted": "has no PNG 0001_label1.png",
    "png-truncated": "does not match its PNG 0001_label1.png",
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_resume_redoes_damaged_records_and_pngs(random_stack: Path, whole_run: Path, tmp_path: Path, damage: str,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    job = _stopped_job(random_stack, out, monkeypatch)
    records = sorted((job / "records").glob("*.npz"))
    DAMAGE[damage](records[1], job / "out" / "0001_label1.png")  # the second image's record / PNG
    capsys.readouterr()
    assert main(["generate", "--model", str(random_stack), "--out", str(out), *RESUME_ARGS, "--resume"]) == 0
    printed = capsys.readouterr().out
    assert f"lantern: note: --resume: record {records[1]} {NOTES[damage]}" in printed, printed
    assert "decoding its" in printed and printed.count("lantern: note:") == 1
    for name in sorted(p.name for p in whole_run.iterdir()):
        if name != "run.json":
            assert (out / name).read_bytes() == (whole_run / name).read_bytes(), name
    stats = json.loads((out / "run.json").read_text())["stats"]
    assert (stats["resumed_images"], stats["generated_this_run"]) == (1, 3)
    assert not job.exists()


@pytest.mark.slow
@pytest.mark.parametrize("deleted", [("sha256", "png_sha256"), ("sha256",), ("png_sha256",)])
def test_resume_redoes_records_without_their_hashes(
        random_stack: Path, whole_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], deleted: tuple[str, ...]) -> None:
    """Nothing vouches for a record whose hashes were deleted (an in-vocabulary rewrite of its codes
    passes every other check): its images are decoded again, with a note naming the file (issue 38;
    old behaviour: such a record was trusted, as one written before records carried hashes)."""
    out = tmp_path / "out"
    job = _stopped_job(random_stack, out, monkeypatch)
    records = sorted((job / "records").glob("*.npz"))
    for record in records:
        with np.load(record) as z:
            arrays = {k: z[k] for k in z.files if k not in deleted}
        arrays["codes"] = np.ones_like(arrays["codes"])  # what the missing hashes would have caught
        with open(record, "wb") as f:
            np.savez(f, **arrays)
    capsys.readouterr()
    assert main(["generate", "--model", str(random_stack), "--out", str(out), *RESUME_ARGS, "--resume"]) == 0
    printed = capsys.readouterr().out
    for record in records:
        assert f"lantern: note: --resume: record {record} carries no sha256 / png_sha256" in printed, printed
    assert (out / "codes.npy").read_bytes() == (whole_run / "codes.npy").read_bytes()
    assert json.loads((out / "run.json").read_text())["stats"]["resumed_images"] == 0
