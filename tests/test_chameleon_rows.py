"""A Chameleon-family row (Lumina-mGPT, Janus, Emu3) does not depend on its batch, by construction.

Prompts have different lengths, so a batch left-pads them, and rows of a speculative batch reach
different lengths and row ends at different rounds. ATen's attention splits the key axis into
blocks by column, so a row whose keys sat at other columns, or met other trailing masked
columns, would get other floats in a batch than alone (measured before the fix: every verify of
a shorter prompt differed in the last bits, in deterministic mode). Now every prompt is padded to
the stack's prompt width and, in deterministic mode, every verify attends over the whole cache
with a fixed number of new-line slots, so:

* a row's verify logits are bit-identical alone and in a batch (power: a planted 1e-6 that
  depends on the batch size is caught);
* rows join a running batch and move into a larger one with their alone codes, so ``lantern
  serve`` batches these models continuously, and its images are the API's;
* a prompt wider than the prompt width is refused in one line, before anything is decoded.

Marked ``invariance``: tests/test_capabilities.py reruns them under forced AVX2 kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import drive_rounds
from torch import Tensor

import lantern
from lantern.api import resolve_settings
from lantern.cli.main import main
from lantern.decoding.loop import Decode
from lantern.decoding.rows import movable
from lantern.errors import LanternError
from lantern.run import PreparedMethod, image_seed, prepare_method
from lantern.targets import chameleon
from lantern.testing import make_tiny_chameleon_folder, make_tiny_emu3_folder, make_tiny_janus_folder

pytest.importorskip("transformers")
pytest.importorskip("yaml")
pytestmark = pytest.mark.invariance

# 1 to 8 words: contexts of other lengths, so other left padding in a batch than alone
PROMPTS = ["a red car on the beach with blue sky", "a cat", "a red car", "mountains", "a dog in snow",
           "a painting of a house on the beach"]
SEED = 5
# settings for the tiny folders' 4 x 4 codes (a row end after every 4 on Lumina and Emu3)
SETTINGS: dict[str, dict[str, Any]] = {"ar": {}, "lantern": {}, "lantern++": {}, "sjd-coupled": {"sjd_window": 4},
                                       "pjd": {"pjd_window": 2, "pjd_context": 2}}
FOLDERS: dict[str, Callable[[Path], Path]] = {"lumina": make_tiny_chameleon_folder, "janus": make_tiny_janus_folder,
                                              "emu3": make_tiny_emu3_folder}


@pytest.fixture(scope="module")
def pipes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, lantern.Pipeline]:
    """Each family's tiny folder, deterministic (the server's default). Only Lumina's has a drafter."""
    out = {}
    for name, make in FOLDERS.items():
        folder = make(tmp_path_factory.mktemp(name) / "model")
        drafter = folder / "drafter" if (folder / "drafter").is_dir() else None
        size = 64 if name == "lumina" else None
        out[name] = lantern.load(folder, drafter=drafter, deterministic=True, image_size=size)
    return out


def _prepared(pipe: lantern.Pipeline, method: str) -> PreparedMethod:
    method_cfg, sampling = resolve_settings(pipe.stack, method, **SETTINGS[method])
    return prepare_method(pipe.stack, method_cfg, sampling, pipe.parts)


def _start(prepared: PreparedMethod, indices: list[int], eager: bool = False) -> Decode:
    return prepared.start(prepared.stack.encode([PROMPTS[i] for i in indices]),
                          [image_seed(SEED, i) for i in indices], eager=eager)


@pytest.fixture
def verify_logits(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Tensor]]:
    """Every verify's guided logits [B, T, V] (raster and grid rounds), in order."""
    seen: list[Tensor] = []
    raster, grid = chameleon.ChameleonTarget.verify, chameleon.ChameleonTarget.verify_grid

    def verify(self: chameleon.ChameleonTarget, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        logits, hidden = raster(self, *args, **kwargs)
        seen.append(logits.clone())
        return logits, hidden

    def verify_grid(self: chameleon.ChameleonTarget, *args: Any, **kwargs: Any) -> Tensor:
        logits = grid(self, *args, **kwargs)
        seen.append(logits.clone())
        return logits

    monkeypatch.setattr(chameleon.ChameleonTarget, "verify", verify)
    monkeypatch.setattr(chameleon.ChameleonTarget, "verify_grid", verify_grid)
    yield seen


def _logit_dependence(prepared: PreparedMethod, seen: list[Tensor], indices: list[int]) -> list[tuple[int, int]]:
    """(row, round) of every verify whose logits for a row differ, by one bit, in the batch of
    ``indices`` from the row's decode alone (over the rounds the row runs alone)."""
    seen.clear()
    drive_rounds(_start(prepared, indices))
    together = list(seen)
    found = []
    for r, i in enumerate(indices):
        seen.clear()
        drive_rounds(_start(prepared, [i]))
        alone = list(seen)
        assert len(alone) <= len(together)
        found += [(r, k) for k, a in enumerate(alone) if not torch.equal(a[0], together[k][r])]
    return found


@pytest.mark.parametrize("family,method", [("lumina", "ar"), ("lumina", "lantern++"), ("lumina", "sjd-coupled"),
                                           ("lumina", "pjd"), ("janus", "sjd-coupled"), ("emu3", "ar")])
def test_a_rows_verify_logits_are_bit_identical_alone_and_in_a_batch(
        pipes: dict[str, lantern.Pipeline], verify_logits: list[Tensor], family: str, method: str) -> None:
    """Three prompts of three lengths, decoded together and each alone: every verify's logits of a
    row are the same bits (deterministic mode). Before the fixed prompt width, the two shorter
    prompts differed from the first round on."""
    prepared = _prepared(pipes[family], method)
    assert _logit_dependence(prepared, verify_logits, [0, 1, 2]) == []


@pytest.fixture(scope="module")
def released(pipes: dict[str, lantern.Pipeline], tmp_path_factory: pytest.TempPathFactory) -> lantern.Pipeline:
    """The Lumina folder with a drafter in the format of LANTERN's released Chameleon drafters,
    deterministic: its backend reads the whole model sequence (new-lines included)."""
    from lantern.models.chameleon_drafter import save_released_drafter
    from lantern.testing import tiny_released_drafter

    folder = pipes["lumina"].stack.root
    drafter = save_released_drafter(tiny_released_drafter(pipes["lumina"].stack.model),
                                    tmp_path_factory.mktemp("released") / "drafter")
    return lantern.load(folder, drafter=drafter, deterministic=True, image_size=64)


@pytest.fixture
def drafted_and_verified(verify_logits: list[Tensor], monkeypatch: pytest.MonkeyPatch) -> list[Tensor]:
    """``verify_logits``, with every guided logits [B, (E,) V] a released drafter drafts from in between."""
    from lantern.drafters.released import ReleasedDrafterBackend

    guided = ReleasedDrafterBackend._guided

    def spy(self: ReleasedDrafterBackend, hidden: Tensor) -> Tensor:
        logits = guided(self, hidden)
        verify_logits.append(logits.clone())
        return logits

    monkeypatch.setattr(ReleasedDrafterBackend, "_guided", spy)
    return verify_logits


@pytest.mark.parametrize("method", ["lantern", "lantern++"])
def test_a_released_drafters_logits_are_bit_identical_alone_and_in_a_batch(
        released: lantern.Pipeline, drafted_and_verified: list[Tensor], method: str) -> None:
    """The same with LANTERN's released drafter format (EAGLE-2's dynamic tree, LANTERN++'s static
    one): every drafter and verify logits of a row are the same bits alone and in a batch. Rows
    accept different numbers of codes and reach row ends at other rounds; in deterministic mode
    the backend attends over its whole cache and drafts a row-end step at every depth, so neither
    follows its batch-mates (the eager default sizes both to the batch)."""
    prepared = _prepared(released, method)
    assert _logit_dependence(prepared, drafted_and_verified, [0, 1, 2]) == []


def test_the_logit_check_catches_a_planted_batch_dependence(pipes: dict[str, lantern.Pipeline],
                                                           verify_logits: list[Tensor],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Power: logits that move by 1e-6 with the batch size are found, in every round."""
    guided = chameleon.ChameleonTarget.guided_logits

    def planted(self: chameleon.ChameleonTarget, hidden: Tensor) -> Tensor:
        logits = guided(self, hidden)
        return logits + 1e-6 * logits.shape[0] * logits.abs().max()

    monkeypatch.setattr(chameleon.ChameleonTarget, "guided_logits", planted)
    prepared = _prepared(pipes["lumina"], "ar")
    found = _logit_dependence(prepared, verify_logits, [0, 1])
    assert {row for row, _ in found} == {0, 1} and len(found) >= pipes["lumina"].stack.num_tokens


@pytest.mark.parametrize("family,method", [("lumina", "ar"), ("lumina", "lantern"), ("lumina", "lantern++"),
                                           ("lumina", "sjd-coupled"), ("janus", "sjd-coupled"), ("emu3", "ar"),
                                           ("released", "lantern"), ("released", "lantern++")])
def test_rows_joining_and_moving_give_their_alone_codes(pipes: dict[str, lantern.Pipeline], family: str,
                                                        method: str, request: pytest.FixtureRequest) -> None:
    """A 4-row batch starts with prompt 0 alone (3 rows free); after 2 rounds prompts 1 and 2
    (other lengths) join, prefilled together; after one more round the running rows move into an
    8-row batch, where prompt 3 joins. Every image equals its decode alone (``released``: the
    Lumina folder with a drafter in the format of LANTERN's released ones)."""
    pipe = request.getfixturevalue("released") if family == "released" else pipes[family]
    prepared = _prepared(pipe, method)
    alone = [drive_rounds(_start(prepared, [i]))[0] for i in range(4)]
    with torch.inference_mode():
        batch = _start(prepared, [0, 0, 0, 0])
        assert movable(batch.target, batch.drafter)
        batch.finish_rows(torch.tensor([1, 2, 3]))
        drive_rounds(batch, rounds=2)
        batch.take_rows(_start(prepared, [1, 2], eager=True), torch.tensor([1, 2]))
        drive_rounds(batch, rounds=1)
        big = _start(prepared, [0] * 8)
        big.finish_rows(torch.arange(8))
        big.take_rows(batch, torch.arange(3), torch.arange(3))
        big.take_rows(_start(prepared, [3], eager=True), torch.tensor([3]))
        codes = drive_rounds(big)
    for i in range(4):
        assert torch.equal(codes[i], alone[i]), f"{family} {method}: image {i} changed by joining / moving"
    # Power: the comparison sees another stream (the same prompt, the next image's seed).
    other = prepared.start(prepared.stack.encode([PROMPTS[3]]), [image_seed(SEED, 4)])
    assert not torch.equal(alone[3], drive_rounds(other)[0])


@pytest.mark.parametrize("drafter", ["lantern", "released"])
def test_a_server_batches_these_models_continuously_with_the_apis_images(pipes: dict[str, lantern.Pipeline],
                                                                         drafter: str,
                                                                         request: pytest.FixtureRequest) -> None:
    """``lantern serve``'s engine on a Lumina folder, with lantern's drafter and with one in the
    format of LANTERN's released drafters: two images of one prompt start; after three rounds two
    of a prompt of another length join the running batch (it grows from 2 to 4 rows). Each image
    is the one ``lantern.load(folder)(prompts=[...])`` gives."""
    from lantern.serve.scheduler import Scheduler

    pipe = request.getfixturevalue("released") if drafter == "released" else pipes["lumina"]
    sched = Scheduler(pipe, max_batch=4)
    first = sched.submit(sched.resolve(PROMPTS[0], 11, "lantern++", {}, (0, 1)))
    with torch.inference_mode():
        sched._admit()
        lane = sched._lane(first[0].request)
        assert lane.continuous
        for _ in range(3):
            sched._step(lane)
        assert lane.busy == 2 and not any(t.future.done() for t in first)
        later = sched.submit(sched.resolve(PROMPTS[1], 5, "lantern++", {}, (0, 1)))
        sched._admit()
    assert lane.decode is not None and lane.decode.batch == 4 and lane.busy == 4  # joined mid-batch
    sched.run_until_idle()
    for tickets, prompt, seed in ((first, PROMPTS[0], 11), (later, PROMPTS[1], 5)):
        expected = pipe(prompts=[prompt], num_per_label=2, seed=seed, method="lantern++").codes
        for t in tickets:
            assert torch.equal(t.future.result(0).codes, expected[t.index])


def test_a_prompt_wider_than_the_prompt_width_is_refused_in_one_line(pipes: dict[str, lantern.Pipeline],
                                                                    tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A prompt whose context (the template included) exceeds ``prompt_width`` is refused naming
    the flag, before any decode; a prompt that fits decodes as it does at the default width (other
    floats in its padding columns only: greedy codes are the same); a bad width, or a width for a
    LlamaGen model, is refused too."""
    folder = pipes["lumina"].stack.root
    wide = lantern.load(folder, image_size=64)
    short, long = (int(wide.stack.encode([p]).cond.shape[1]) for p in (PROMPTS[1], PROMPTS[0]))
    assert short < long <= wide.stack.prompt_width == 256
    narrow = lantern.load(folder, image_size=64, prompt_width=short)
    assert narrow.stack.prompt_width == short
    with pytest.raises(LanternError, match=rf"^the prompt takes {long} tokens in the model's template, more than "
                                           rf"prompt_width {short} \(shorten it, or raise prompt_width to "
                                           rf"{long} or more") as e:
        narrow(prompts=[PROMPTS[0]])
    assert e.value.field == "prompt"
    # Of several prompts, the first too long is named by its index, with the longest (the width to ask for)
    lengths = {p: int(wide.stack.encode([p]).cond.shape[1]) for p in PROMPTS}
    several = [PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[1]]
    assert lengths[PROMPTS[1]] == short < lengths[PROMPTS[2]] < long
    with pytest.raises(LanternError, match=rf"^prompt 1 takes {lengths[PROMPTS[2]]} tokens in the model's template, "
                                           rf"more than prompt_width {short} \(2 of 4 prompts do; the longest, "
                                           rf"prompt 2, takes {long}\): shorten them, or raise prompt_width to "
                                           rf"{long} or more") as e:
        narrow(prompts=several, num_per_label=3)
    assert e.value.field == "prompt"
    encoded = wide.stack.encode(several, repeats=3)  # each prompt tokenized once, its context repeated in a row
    assert encoded.cond.shape == (12, long)
    for i, p in enumerate(several):
        alone = wide.stack.encode([p]).cond
        assert all(torch.equal(encoded.cond[3 * i + r, -alone.shape[1]:], alone[0]) for r in range(3))
    from lantern.serve.plan import setting_error
    from lantern.serve.scheduler import Scheduler

    with pytest.raises(LanternError) as e:  # a server refuses the request as it resolves it: a 400 naming the prompt
        Scheduler(narrow).resolve(PROMPTS[0], 0, "ar")
    refusal = setting_error(e.value)
    assert (refusal.status, refusal.field) == (400, "prompt")
    assert str(refusal).startswith(f"prompt: the prompt takes {long} tokens")
    greedy = {"temperature": 0.0}
    assert torch.equal(narrow(prompts=[PROMPTS[1]], **greedy).codes, wide(prompts=[PROMPTS[1]], **greedy).codes)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(LanternError, match=r"^prompt_width must be a positive number of tokens"):
            lantern.load(folder, image_size=64, prompt_width=bad)
    with pytest.raises(LanternError, match="^prompt_width is only used with Chameleon-family models"):
        lantern.load("digits", prompt_width=64)
    out = tmp_path / "out"
    argv = ["generate", "--model", str(folder), "--image-size", "64", "--prompt", PROMPTS[0], "--prompt-width",
            str(short), "--out", str(out), "--no-progress"]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"more than --prompt-width {short}" in err.strip().splitlines()[-1] and "Traceback" not in err
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("family", list(FOLDERS))
def test_a_prompt_that_is_not_text_is_refused_in_one_line(pipes: dict[str, lantern.Pipeline], family: str) -> None:
    """A lone surrogate (half of a UTF-16 pair, as JSON's "\\ud800" decodes) would fail inside the
    tokenizer with a TypeError: the Python call and the server's resolve refuse it in one line,
    naming the prompt (the server answers 400 for its field); valid non-ASCII text still decodes."""
    from lantern.serve.plan import setting_error
    from lantern.serve.scheduler import Scheduler

    pipe = pipes[family]
    with pytest.raises(LanternError, match=r"^prompts: prompt 1 is not valid text: character 2 \('\\ud800'\) is a "
                                           r"lone surrogate"):
        pipe(prompts=["a cat", "a \ud800 cat"])
    with pytest.raises(LanternError) as e:
        Scheduler(pipe).resolve("a \ud800 cat", 0, "ar")
    refusal = setting_error(e.value)
    assert (refusal.status, refusal.field) == (400, "prompt") and "is not valid text" in str(refusal)
    assert pipe(prompts=["ein Café am Meer 🌊"], temperature=0.0).codes.shape[0] == 1


@pytest.mark.parametrize("family", list(FOLDERS))
def test_generate_measures_prompts_before_it_reads_the_model(pipes: dict[str, lantern.Pipeline], family: str,
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The folder's prompt side, read without its weights, measures each prompt as the loaded stack
    encodes it; so ``lantern generate`` refuses a prompt wider than ``--prompt-width`` (and, on Emu3,
    a width its negative prompt does not fit) before the model is read (its loader here raises if called)."""
    from lantern.api import read_prompter

    stack = pipes[family].stack
    size = ["--image-size", "64"] if family == "lumina" else []
    prompter = read_prompter(stack.root, image_size=64 if family == "lumina" else None)
    lengths = [int(stack.encode([p]).cond.shape[1]) for p in PROMPTS]
    assert prompter.context_lengths(PROMPTS) == lengths and len(set(lengths)) > 2
    assert read_prompter("digits") is None
    loaders = {"lumina": "lantern.models.chameleon.load_chameleon", "janus": "lantern.models.janus.load_janus",
               "emu3": "lantern.models.emu3.load_emu3"}

    def no_weights(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the model's weights were read before its prompts were measured")

    if family == "emu3":  # the API (and so the server) refuses a width below the negative prompt as it loads
        negative = len(stack.negative_ids)
        with pytest.raises(LanternError, match=f"^Emu3's negative prompt takes {negative} tokens, more than "
                                               f"prompt_width {negative - 1}: raise it$"):
            lantern.load(stack.root, prompt_width=negative - 1)
        assert lantern.load(stack.root, prompt_width=negative).stack.prompt_width == negative
    monkeypatch.setattr(loaders[family], no_weights)
    short = lengths[1]
    assert short < lengths[0]
    out = tmp_path / "out"
    argv = ["generate", "--model", str(stack.root), *size, "--prompt", PROMPTS[1], "--prompt", PROMPTS[0],
            "--no-progress", "--prompt-width"]
    capsys.readouterr()
    assert main([*argv, str(short), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines()[-1].startswith(f"lantern: error: prompt 1 takes {lengths[0]} tokens in the model's "
                                           f"template, more than --prompt-width {short} (1 of 2 prompts do"), err
    assert "Traceback" not in err and (not out.exists() or not any(out.iterdir()))
    if family == "emu3":  # its guidance rows, the negative prompt, are padded to the width too
        negative = len(stack.negative_ids)
        assert main([*argv, str(negative - 1), "--out", str(out)]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"lantern: error: Emu3's negative prompt takes {negative} tokens, more than --prompt-width {negative - 1}: "
            "raise it")
    with pytest.raises(AssertionError, match="weights were read"):  # the loader is really the one patched
        main([*argv, str(max(lengths[0], len(getattr(stack, "negative_ids", ())))), "--out", str(tmp_path / "fits")])
