"""No file lantern reads may run code, and a corrupt file gets a one-line error naming it.

Every entry point that reads a pickle (official LlamaGen / VQ ``.pt``, ``build-proximity``, the
Chameleon VQGAN via ``--vq`` and inside ``--model``, official drafter ``.bin``, ``--resume``) is
handed a pickle whose ``__reduce__`` would create a marker file: the marker must stay absent and
the error must name the file and the refused class. Legitimate official layouts (an
``argparse.Namespace`` beside the weights) load without any flag.
"""

from __future__ import annotations

import argparse
import fractions
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import OFFICIAL_DRAFTER_CONFIG, fake_class, image_folder, official_drafter_state, save_with_fake_modules
from safetensors.torch import save_file

from lantern.cli.main import main
from lantern.errors import LanternError
from lantern.io import LanternWarning, load_checkpoint
from lantern.models.llamagen import LlamaGen
from lantern.models.vq import VQModel
from lantern.targets.proximity import ProximityTable, build_proximity, table_sha256
from lantern.testing import make_random_stack, tiny_llamagen, tiny_vq, tiny_vq_config


class Payload:
    """Unpickling this runs ``exec``: it creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def _evil(path: Path, weights: dict[str, torch.Tensor], key: str = "model") -> Path:
    """An official-looking checkpoint (real weights under ``key``) that also carries the payload."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({key: weights, "steps": 1, "args": Payload(path.parent / "PWNED")}, path)
    return path


def _marker(path: Path) -> Path:
    return path.parent / "PWNED"


def _one_line_error(capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    """The command's stderr is one ``lantern: error:`` line (no traceback) containing ``needles``."""
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("lantern: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def test_the_payload_runs_when_fully_unpickled(tmp_path: Path) -> None:
    """The marker is a real detector: a full unpickler runs the payload."""
    path = _evil(tmp_path / "evil.pt", {"w": torch.zeros(2)})
    torch.load(path, weights_only=False)
    assert _marker(path).exists()


# ---- Python entry points ----------------------------------------------------------------------


def test_official_llamagen_checkpoint_refuses_the_payload(tmp_path: Path) -> None:
    model = tiny_llamagen()
    path = _evil(tmp_path / "GPT-B.pt", model.state_dict())
    with pytest.raises(LanternError, match=r"LlamaGen checkpoint .*GPT-B\.pt contains a pickled builtins\.exec.*"
                                           r"--trust-checkpoint") as info:
        LlamaGen.from_official_checkpoint(path, model.config)
    assert "\n" not in str(info.value) and not _marker(path).exists()


def test_official_vq_checkpoint_refuses_the_payload(tmp_path: Path) -> None:
    path = _evil(tmp_path / "vq_ds16_c2i.pt", tiny_vq().state_dict())
    with pytest.raises(LanternError, match=r"VQ checkpoint .*vq_ds16_c2i\.pt contains a pickled builtins\.exec"):
        VQModel.from_official_checkpoint(path, tiny_vq_config())
    assert not _marker(path).exists()


def test_official_layouts_with_a_namespace_load_without_a_flag(tmp_path: Path) -> None:
    """LlamaGen's training scripts save ``{"model", "optimizer", "steps", "args": Namespace}``."""
    model = tiny_llamagen()
    args = argparse.Namespace(gpt_model="GPT-B", image_size=256, lr=1e-4, no_compile=False, data_path=None)
    gpt = tmp_path / "c2i_B_256.pt"
    torch.save({"model": model.state_dict(), "optimizer": {"state": {}, "param_groups": [{"lr": 1e-4}]},
                "steps": 50000, "args": args}, gpt)
    loaded = LlamaGen.from_official_checkpoint(gpt, model.config)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values(),
                                                  strict=True))
    vq = tiny_vq()
    vq_file = tmp_path / "vq.pt"
    torch.save({"model": vq.state_dict(), "ema": vq.state_dict(), "steps": 3, "args": args}, vq_file)
    assert torch.equal(VQModel.from_official_checkpoint(vq_file, tiny_vq_config()).quantize.embedding.weight,
                       vq.quantize.embedding.weight)
    assert load_checkpoint(gpt)["args"] == args  # rebuilt as the real Namespace, attributes intact


def test_lightning_checkpoint_layout_loads_without_a_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A full Lightning training checkpoint (as taming-transformers VQGANs are saved) feeds
    ``build-proximity`` without Lightning installed and without --trust-checkpoint."""
    vq = tiny_vq()
    callback = fake_class("pytorch_lightning.callbacks.model_checkpoint", "ModelCheckpoint")
    hparams = type("AttributeDict", (dict,), {"__module__": "pytorch_lightning.utilities.parsing"})
    ckpt = {"epoch": 12, "global_step": 40000, "pytorch-lightning_version": "1.4.2", "state_dict": vq.state_dict(),
            "callbacks": {callback: {"best_model_score": torch.tensor(0.1), "best_model_path": "/x/last.ckpt"}},
            "optimizer_states": [{"state": {0: {"exp_avg": torch.zeros(2)}}, "param_groups": [{"lr": 4.5e-6}]}],
            "lr_schedulers": [], "loops": {"fit_loop": {"epoch_progress": {"current": {"ready": 12}}}},
            "native_amp_scaling_state": {"scale": 65536.0}, "hparams_name": "kwargs",
            "hyper_parameters": hparams(embed_dim=8, n_embed=256)}
    path = tmp_path / "vqgan.ckpt"
    save_with_fake_modules([callback, hparams], lambda: torch.save(ckpt, path), monkeypatch)
    loaded = load_checkpoint(path)
    assert loaded["hyper_parameters"] == {"embed_dim": 8, "n_embed": 256} and loaded["epoch"] == 12
    out = tmp_path / "prox.safetensors"
    assert main(["build-proximity", "--tokenizer", str(path), "--k-max", "4", "--out", str(out)]) == 0
    ProximityTable.load(out).validate(vq.quantize.embedding.weight)
    assert "warning" not in capsys.readouterr().err.lower()


def test_trust_checkpoint_loads_other_classes_with_a_warning(tmp_path: Path) -> None:
    model = tiny_llamagen()
    path = tmp_path / "odd.pt"
    torch.save({"model": model.state_dict(), "ratio": fractions.Fraction(1, 3)}, path)
    with pytest.raises(LanternError, match=r"odd\.pt contains a pickled fractions\.Fraction"):
        LlamaGen.from_official_checkpoint(path, model.config)
    with pytest.warns(LanternWarning, match=r"odd\.pt: loading with the full unpickler \(--trust-checkpoint\)"):
        loaded = LlamaGen.from_official_checkpoint(path, model.config, trust_checkpoint=True)
    assert torch.equal(loaded.tok_embeddings.weight, model.tok_embeddings.weight)


# ---- CLI entry points -------------------------------------------------------------------------


def test_build_proximity_refuses_the_payload(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _evil(tmp_path / "vq.pt", tiny_vq().state_dict())  # a valid codebook inside
    out = tmp_path / "prox.safetensors"
    assert main(["build-proximity", "--tokenizer", str(path), "--k-max", "4", "--out", str(out)]) == 2
    _one_line_error(capsys, str(path), "builtins.exec", "--trust-checkpoint")
    assert not _marker(path).exists() and not out.exists()


def test_build_proximity_trust_checkpoint_loads_with_a_warning(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    vq = tiny_vq()
    path = tmp_path / "vq.pt"
    torch.save({"model": vq.state_dict(), "ratio": fractions.Fraction(1, 3)}, path)
    out = tmp_path / "prox.safetensors"
    argv = ["build-proximity", "--tokenizer", str(path), "--k-max", "4", "--out", str(out)]
    assert main(argv) == 2
    _one_line_error(capsys, "fractions.Fraction")
    with pytest.warns(LanternWarning, match="--trust-checkpoint"):
        assert main([*argv, "--trust-checkpoint"]) == 0
    ProximityTable.load(out).validate(vq.quantize.embedding.weight)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_stack(tmp_path_factory.mktemp("stack") / "s", grid=4, vocab=64)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_official_drafter_bin_refuses_the_payload(stack: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    drafter = tmp_path / "drafter"
    path = _evil(drafter / "pytorch_model.bin", official_drafter_state(OFFICIAL_DRAFTER_CONFIG))
    (drafter / "config.json").write_text(json.dumps(OFFICIAL_DRAFTER_CONFIG))
    out = tmp_path / "out"
    assert main(["generate", "--model", str(stack), "--labels", "1", "--method", "sd", "--drafter", str(drafter),
                 "--out", str(out), "--no-progress"]) == 2
    _one_line_error(capsys, "drafter weights", str(path), "builtins.exec")
    assert not _marker(path).exists()


@pytest.fixture(scope="module")
def chameleon(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lantern.testing import make_tiny_chameleon_folder

    return make_tiny_chameleon_folder(tmp_path_factory.mktemp("chameleon") / "model")


def _vqgan_state(folder: Path) -> dict[str, torch.Tensor]:
    return torch.load(folder / "vqgan.ckpt", weights_only=True)["state_dict"]


@pytest.mark.parametrize("where", ["--vq", "inside --model"])
def test_chameleon_vqgan_refuses_the_payload(chameleon: Path, tmp_path: Path, where: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    model = _copy(chameleon, tmp_path / "model")
    if where == "--vq":
        path = _evil(tmp_path / "vq" / "vqgan.ckpt", _vqgan_state(chameleon), key="state_dict")
        shutil.copy(chameleon / "vqgan.yaml", path.parent / "vqgan.yaml")
        extra = ["--vq", str(path)]
    else:
        path = _evil(model / "vqgan.ckpt", _vqgan_state(chameleon), key="state_dict")
        extra = []
    assert main(["generate", "--model", str(model), "--prompt", "a cat", "--out", str(tmp_path / "out"),
                 "--no-progress", *extra]) == 2
    _one_line_error(capsys, "VQGAN checkpoint", str(path), "builtins.exec")
    assert not _marker(path).exists()


@pytest.mark.parametrize("trust", [False, True])
def test_chameleon_target_bin_refuses_the_payload_in_one_line(chameleon: Path, tmp_path: Path, trust: bool,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A Chameleon folder's ``pytorch_model.bin`` is read by transformers, tensors-only: a payload
    was refused there with 53 lines of stderr naming neither the file nor the class. Now one line
    naming both, which says that --trust-checkpoint cannot load it (transformers never unpickles
    more) and how to; nothing runs, with or without the flag. Power: the same folder with a
    tensors-only .bin generates."""
    import shutil

    from safetensors.torch import load_file

    folder = tmp_path / "model"
    shutil.copytree(chameleon, folder)
    path = folder / "pytorch_model.bin"
    state = load_file(folder / "model.safetensors")
    torch.save({**state, "args": Payload(_marker(path))}, path)
    (folder / "model.safetensors").unlink()
    argv = ["generate", "--model", str(folder), "--prompt", "a cat", "--method", "ar", "--out", str(tmp_path / "out"),
            "--no-progress", *(["--trust-checkpoint"] if trust else [])]
    assert main(argv) == 2
    _one_line_error(capsys, str(path), "builtins.exec", "even with --trust-checkpoint", "model.safetensors")
    assert not _marker(path).exists() and not (tmp_path / "out").exists()
    torch.save(state, path)  # power: tensors only, the same folder loads and generates
    assert main(argv) == 0 and (tmp_path / "out" / "0000_prompt0.png").is_file()


def test_released_chameleon_drafter_bin_refuses_the_payload(chameleon: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """LANTERN's released Anole / Lumina-mGPT drafters ship as ``pytorch_model.bin``: the same loader."""
    from lantern.models.chameleon import load_chameleon
    from lantern.models.chameleon_drafter import save_released_drafter
    from lantern.testing import tiny_released_drafter

    drafter = save_released_drafter(tiny_released_drafter(load_chameleon(chameleon, dtype=torch.float32)),
                                    tmp_path / "released", "pytorch_model.bin")
    path = drafter / "pytorch_model.bin"
    state = torch.load(path, weights_only=True)
    torch.save({**state, "args": Payload(_marker(path))}, path)
    assert main(["generate", "--model", str(chameleon), "--prompt", "a cat", "--method", "sd", "--drafter",
                 str(drafter), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    _one_line_error(capsys, "drafter weights", str(path), "builtins.exec")
    assert not _marker(path).exists() and not (tmp_path / "out").exists()


TRAIN_ARGS = ["train-tokenizer", "--codebook-size", "16", "--ch", "16", "--ch-mult", "1,2", "--z-channels", "8",
              "--norm-groups", "8", "--steps", "8", "--batch-size", "4", "--checkpoint-every", "4", "--eval-images",
              "2", "--no-progress", "--precision", "fp32"]


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(image folder, a training --out stopped after its step-4 checkpoint)."""
    root = tmp_path_factory.mktemp("train")
    images = image_folder(root / "imgs")
    assert main([*TRAIN_ARGS, "--data", str(images), "--out", str(root / "run"), "--stop-after", "4"]) == 0
    return images, root / "run"


def _resume(images: Path, run: Path) -> int:
    return main([*TRAIN_ARGS, "--data", str(images), "--out", str(run), "--resume"])


def test_resume_refuses_the_payload(stopped_run: tuple[Path, Path], tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    images, run = stopped_run
    run = _copy(run, tmp_path / "run")
    ckpt = run / "checkpoints" / "step-00000004"
    for name in ("random_states_0.pkl", "custom_checkpoint_0.pkl"):  # what accelerate's load_state unpickles
        _evil(ckpt / name, {})
    path = _evil(ckpt / "optimizer.pt", {})
    assert _resume(images, run) == 2
    _one_line_error(capsys, "optimizer state", str(path), "builtins.exec")
    assert not _marker(path).exists() and not (run / "model.safetensors").exists()


@pytest.mark.parametrize(("name", "needle"), [("model.safetensors", "is not a readable safetensors file"),
                                               ("optimizer.pt", "could not be read as a torch checkpoint"),
                                               ("extra_state.pt", "could not be read as a torch checkpoint"),
                                               ("trainer_state.json", "is not valid JSON")])
def test_resume_from_truncated_files(stopped_run: tuple[Path, Path], tmp_path: Path, name: str, needle: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    images, run = stopped_run
    run = _copy(run, tmp_path / "run")
    path = run / "checkpoints" / "step-00000004" / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert _resume(images, run) == 2
    _one_line_error(capsys, str(path), needle)


def test_resume_continues_from_lanterns_own_files(stopped_run: tuple[Path, Path], tmp_path: Path) -> None:
    """A checkpoint holds safetensors weights and tensor-only torch files, no accelerate pickles."""
    images, run = stopped_run
    files = {p.name for p in (run / "checkpoints" / "step-00000004").iterdir()}
    assert files == {"model.safetensors", "optimizer.pt", "scheduler.pt", "extra_state.pt", "trainer_state.json"}
    run = _copy(run, tmp_path / "run")
    assert _resume(images, run) == 0 and (run / "model.safetensors").is_file()


# ---- corrupt files ------------------------------------------------------------------------------


@pytest.mark.parametrize(("damage", "needle"), [("truncated", "failed reading zip archive: failed finding central "
                                                                "directory (the file is truncated or damaged"),
                                                 ("empty", "the file ends early (empty or truncated)"),
                                                 ("garbage", "could not be read as a torch checkpoint")])
def test_corrupt_pickled_checkpoint(tmp_path: Path, damage: str, needle: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "vq.pt"
    torch.save({"model": tiny_vq().state_dict()}, path)
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "empty": b"", "garbage": b"\x80\x02garbage" * 64}[damage])
    assert main(["build-proximity", "--tokenizer", str(path), "--k-max", "4", "--out", str(tmp_path / "p")]) == 2
    _one_line_error(capsys, f"VQ checkpoint {path}", needle)


def _generate(model: Path, tmp_path: Path, method: str = "ar") -> int:
    return main(["generate", "--model", str(model), "--labels", "1", "--method", method, "--out",
                 str(tmp_path / "out"), "--no-progress"])


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_corrupt_safetensors_in_a_stack(stack: Path, tmp_path: Path, damage: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    model = _copy(stack, tmp_path / "s")
    path = model / "target" / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "empty": b"", "garbage": b"\x00garbage" * 64}[damage])
    assert _generate(model, tmp_path) == 2
    _one_line_error(capsys, str(path), "is not a readable safetensors file")


def test_non_utf8_config(stack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _copy(stack, tmp_path / "s")
    path = model / "target" / "config.json"
    path.write_bytes(b'{"model_type": "\xff\xfe"}')
    assert _generate(model, tmp_path) == 2
    _one_line_error(capsys, str(path), "is not UTF-8 text")


@pytest.mark.parametrize(("content", "needle"), [
    (b"[]", "must hold a JSON object, got list"),
    (b'{"temperature": "\xff"}', "is not UTF-8 text"),
    (b'{"trees": {"lantern++": 5}}', "generation.json: trees.lantern++: expected a --tree spec string, got 5"),
    (b'{"trees": {"lantern++": "chain:x"}}', "generation.json: trees.lantern++: --tree chain:N needs an integer"),
    (b'{"trees": ["chain:2"]}', "generation.json: trees: expected an object"),
    (b'{"top_k": "ten"}', "generation.json: top_k: expected an integer, got 'ten'"),
    (b'{"top_k": -1}', "generation.json: top_k must be an integer >= 0"),
    (b'{"temperature": true}', "generation.json: temperature: expected a number, got True"),
    # a misspelt key would be ignored, and the run would quietly use the defaults it meant to change
    (b'{"temprature": 0.5}', "generation.json: unknown key 'temprature' (this model family reads cfg_scale, "
                             "temperature, top_k, top_p, trees)"),
    (b'{"layout": "anole"}', "generation.json: unknown key 'layout'"),  # a Chameleon folder's key
    (b'{"trees": {"lanter++": "chain:2"}}', "generation.json: trees.lanter++: not a method (expected one of ar, "),
])
def test_bad_generation_json_names_the_file_and_field(stack: Path, tmp_path: Path, content: bytes, needle: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    model = _copy(stack, tmp_path / "s")
    (model / "generation.json").write_bytes(content)
    assert _generate(model, tmp_path, "lantern++") == 2
    _one_line_error(capsys, needle)


# ---- proximity table integrity --------------------------------------------------------------------


def _table(stack: Path) -> ProximityTable:
    return ProximityTable.load(stack / "proximity.safetensors")


def _tampered(table: ProximityTable, neighbours: torch.Tensor, path: Path) -> Path:
    """The table's own header (codebook hash included) over other neighbour indices, with the
    table hash recomputed for them (as a tamperer can): the checks on the contents must catch it."""
    meta = {**table.metadata(), "table_sha256": table_sha256(neighbours)}
    save_file({"neighbours": neighbours.to(torch.int32).contiguous()}, str(path), metadata=meta)
    return path


def test_out_of_range_indices_are_refused(stack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    table = _table(stack)
    bad = table.neighbours.clone()
    bad[5, 2] = table.vocab_size
    model = _copy(stack, tmp_path / "s")
    path = _tampered(table, bad, model / "proximity.safetensors")
    with pytest.raises(LanternError, match=rf"token indices in \[0, {table.vocab_size}\], expected \[0, 63\]"):
        ProximityTable.load(path)
    assert _generate(model, tmp_path, "lantern") == 2
    _one_line_error(capsys, str(path), "token indices")


def test_each_token_its_own_neighbour_is_refused(stack: Path, tmp_path: Path) -> None:
    table = _table(stack)
    bad = table.neighbours.clone()
    bad[:, 0] = torch.arange(table.vocab_size)
    with pytest.raises(LanternError, match=r"lists token 0 as its own neighbour"):
        ProximityTable.load(_tampered(table, bad, tmp_path / "p.safetensors"))


def test_shuffled_neighbour_order_is_refused(stack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    table = _table(stack)
    codebook = VQModel.from_pretrained(stack / "tokenizer").quantize.embedding.weight.detach()
    table.validate(codebook)  # the genuine table passes
    shuffled = table.neighbours.flip(1)  # farthest first: same sets, reversed order
    model = _copy(stack, tmp_path / "s")
    path = _tampered(table, shuffled, model / "proximity.safetensors")
    tampered = ProximityTable.load(path)  # indices are fine, and the header's hash matches ...
    with pytest.raises(LanternError, match=r"neighbours are not its nearest codebook entries in distance order"):
        tampered.validate(codebook)  # ... but the distances do not
    assert _generate(model, tmp_path, "lantern") == 2
    _one_line_error(capsys, str(path), "distance order")


def test_distance_check_allows_ties(tmp_path: Path) -> None:
    """Duplicated codebook rows are equally near: either order passes, since distances are compared."""
    codebook = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    codebook[7] = codebook[3]
    table = build_proximity(codebook, k_max=6)
    swapped = table.neighbours.clone()
    both = [r for r in range(32) if {3, 7} <= set(swapped[r].tolist())]
    assert both  # rows near the duplicated pair list both of them
    row = swapped[both[0]]
    i, j = (row == 3).nonzero().item(), (row == 7).nonzero().item()
    row[i], row[j] = 7, 3
    assert not torch.equal(swapped, table.neighbours)
    ProximityTable(swapped, table.codebook_sha256, table.metric, table.normalized).validate(codebook)


def test_a_dangling_hub_link_is_named_as_an_interrupted_download(tmp_path: Path) -> None:
    """A Hub cache snapshot links each file to a blob; a deleted or never-finished blob left a raw
    FileNotFoundError from the header check (a probe, 2026-11-29)."""
    from lantern.errors import LanternError
    from lantern.models.hf_folder import check_safetensors_header

    link = tmp_path / "model.safetensors"
    link.symlink_to(tmp_path / "blobs" / "0123abcd")
    with pytest.raises(LanternError) as err:
        check_safetensors_header(link)
    assert str(err.value) == (f"--model: {link} cannot be read (FileNotFoundError: a link whose file is "
                              "missing, as an interrupted download leaves; download it again)")
