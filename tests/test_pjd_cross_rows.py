"""PJD windows that run on across a row end while the next row is not open, and the ``above_mode`` fill.

Evidence:

* at context = row length (one row at a time, lossless) greedy PJD with crossing windows equals
  AR token for token (batch 1 and 3, CFG on and off), on LlamaGen and both Chameleon layouts;
* a verified chain did hold cells of two image rows and kept tokens of both, and crossing takes
  no more forwards than windows cut at row ends (strictly fewer on the fixed case below);
* ``above_mode`` copies the mode of the target's last prediction for the cell above (else the
  left neighbour's, else the token there), records as each cell's mode the argmax of the exact
  AR conditional at context = row length, equals ``row_above`` when greedy, and keeps rows
  independent of their batch.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from conftest import CHAMELEON_LAYOUTS, CHAMELEON_PROMPTS, chameleon_greedy_ar, chameleon_lm, generate_pjd
from torch import Tensor

from lantern.cli.common import add_pjd_args
from lantern.decoding.config import PJDConfig, SamplingConfig
from lantern.decoding.loop import GenerationOutput, generate
from lantern.decoding.pjd import GridBlock, GridJacobiDrafter, last_predicted_cell
from lantern.decoding.rng import RowRandom
from lantern.eval.methods_grammar import parse_methods
from lantern.methods import MethodConfig
from lantern.models.llamagen import LlamaGen
from lantern.targets.chameleon import encode_prompts
from lantern.targets.llamagen import LlamaGenTarget
from lantern.testing import chameleon_parts, tiny_llamagen

WIDTH = 6  # a 6 x 6 image


def _model() -> LlamaGen:
    return tiny_llamagen(seed=2, vocab_size=16, block_size=WIDTH * WIDTH, dim=32, n_layer=2, n_head=2,
                         multiple_of=16)


class _Cut(GridJacobiDrafter):
    """The earlier behaviour: every window stops at its row end."""

    crosses_rows = False


class _Recording(GridJacobiDrafter):
    """Records every round's block and how many tokens each chain kept."""

    blocks: list[tuple[GridBlock, Tensor]]

    def propose_grid(self, rng: RowRandom | None) -> GridBlock:
        self.blocks = getattr(self, "blocks", [])
        block = super().propose_grid(rng)
        self.blocks.append((block, torch.empty(0)))
        return block

    def commit_grid(self, block: GridBlock, num_acc: Tensor, next_token: Tensor, logits: Tensor,
                    rng: RowRandom | None, probs: Tensor | None = None
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        self.blocks[-1] = (block, num_acc.clone())
        return super().commit_grid(block, num_acc, next_token, logits, rng, probs)


def _run(model: LlamaGen, labels: list[int], s: SamplingConfig, config: PJDConfig, seeds: list[int] | None = None,
         drafter_cls: type[GridJacobiDrafter] = GridJacobiDrafter) -> tuple[GenerationOutput, GridJacobiDrafter]:
    out, drafter, _ = generate_pjd(model, labels, s, config, seeds, drafter_cls)
    return out, drafter


def _greedy_ar(model: LlamaGen, labels: list[int], cfg_scale: float) -> Tensor:
    s = SamplingConfig(temperature=0.0, cfg_scale=cfg_scale)
    target = LlamaGenTarget(model, s, max_tree_nodes=1)
    return generate(target, torch.tensor(labels)).codes


# ---- the depth cap -----------------------------------------------------------------------------


def test_last_predicted_cell_crosses_only_into_a_row_that_is_not_open() -> None:
    known = torch.tensor([[4, 0, 0], [4, 2, 0], [2, 0, 0], [4, 4, 1]])  # [B, H], rows of 4, context 3
    row = torch.tensor([[0], [1], [0], [2]])
    last = last_predicted_cell(row, known, context=3, width=4)
    # a complete row: its own end; rows with < 3 known and an empty row below: the next row's end;
    # the last row: its own end (the image's)
    assert last[:, 0].tolist() == [3, 11, 7, 11]
    # row 1 at context 2: row 2 is open (2 >= 2), so the window stops at row 1's end
    assert last_predicted_cell(torch.tensor([[1]]), known[1:2], context=2, width=4).tolist() == [[7]]
    # row 0 when row 1 already has a token (it opened earlier): its own end
    assert last_predicted_cell(torch.tensor([[0]]), torch.tensor([[2, 1, 0]]), context=4, width=4).tolist() == [[3]]


# ---- lossless: greedy = AR, crossing happened, no slower than cut windows -------------------------


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_lossless_crossing_windows_reproduce_ar(batch: int, cfg_scale: float) -> None:
    model, labels = _model(), [0, 5, 3][:batch]
    s = SamplingConfig(temperature=0.0, cfg_scale=cfg_scale)
    out, drafter = _run(model, labels, s, PJDConfig(window=WIDTH, context=WIDTH, init="row_above"),
                        drafter_cls=_Recording)
    assert torch.equal(out.codes, _greedy_ar(model, labels, cfg_scale))
    crossed = 0
    for block, num_acc in drafter.blocks:  # type: ignore[attr-defined]
        for b in range(batch):
            real = block.rows[b] >= 0
            rows = set((block.cells[b][real] // WIDTH).tolist())
            first_row = int(block.first_cell[b, 0]) // WIDTH
            # kept cells: the root's (when committed), then first_cell + j for j < num_acc; next token after
            kept_next = int(block.first_cell[b, 0]) + int(num_acc[b, 0])
            crossed += len(rows) == 2 and kept_next // WIDTH > first_row and bool(block.decodes[b, 0])
    assert crossed >= 1, "no window kept tokens across a row end"


def test_lossless_crossing_takes_fewer_forwards_than_cut_windows() -> None:
    """A fixed greedy case (108 codes in 58 forwards crossing, 67 cut): same codes, fewer forwards.
    (Not a law: on a random tiny model a row's carried guesses for the next row can be worse than
    the copies of the finished row above that a cut window's next row starts from.)"""
    model, labels = _model(), [0, 5, 3]
    s = SamplingConfig(temperature=0.0, cfg_scale=3.0)
    config = PJDConfig(window=WIDTH, context=WIDTH, init="row_above")
    crossing, _ = _run(model, labels, s, config)
    cut, _ = _run(model, labels, s, config, drafter_cls=_Cut)
    assert torch.equal(crossing.codes, cut.codes)
    assert bool((crossing.stats.target_forwards <= cut.stats.target_forwards).all())
    assert int(crossing.stats.target_forwards.sum()) < int(cut.stats.target_forwards.sum())


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["lumina", "anole"])
def test_chameleon_greedy_full_row_windows_reproduce_ar(layout: str) -> None:
    """Windows of a whole row cross every row end (on Lumina: a guess at a row's last cell gets its
    new-line shadow in the middle of the chain)."""
    lay, prompts = CHAMELEON_LAYOUTS[layout], CHAMELEON_PROMPTS
    ids, mask = encode_prompts(prompts, lay)
    sampling = SamplingConfig(temperature=0.0, top_k=0, cfg_scale=3.0)
    lm = chameleon_lm()
    method = MethodConfig.resolve("pjd", pjd_window=lay.width, pjd_context=lay.width)
    target, drafter = chameleon_parts(lm, lay, sampling, method, None, lm.image_head)
    out = generate(target, ids, drafter=drafter, cond_mask=mask)
    assert torch.equal(out.codes, chameleon_greedy_ar(lay, 3.0, prompts))


# ---- above_mode ----------------------------------------------------------------------------------


def _drafter(init: str) -> GridJacobiDrafter:
    d = GridJacobiDrafter(PJDConfig(window=3, context=2, init=init), SamplingConfig(temperature=1.0), 50, 16, width=4)
    d.start(torch.zeros(1, 1, 1), torch.tensor([7]))
    return d


def test_above_mode_copies_the_mode_above_else_left_else_the_token() -> None:
    d = _drafter("above_mode")
    d.canvas[0, 0:4] = torch.tensor([7, 11, 12, 13])  # row 0 known
    d.mode[0, 1:4] = torch.tensor([21, -1, 23])  # cell 0 came from the prefill, cell 2 has no mode (-1)
    d.known[0, 0], d.known[0, 1] = 4, 1
    d.canvas[0, 4], d.mode[0, 4] = 20, 30  # row 1's first token, its mode 30
    cell = torch.tensor([[5, 6, 7, 9, 10, 11]])  # row 1's window, then row 2 (nothing above it yet)
    d._initialise(cell, torch.ones_like(cell, dtype=torch.bool), RowRandom.from_seeds([0], torch.device("cpu")))
    assert d.canvas[0, 5:8].tolist() == [21, 12, 23]  # the modes above; cell 2 has none: its token
    row2 = d.canvas[0, 9:12].tolist()  # nothing above, cell 8 empty: noise, then copies of its left
    assert row2[1] == row2[0] and row2[2] == row2[0] and 0 <= row2[0] < 50
    # nothing above (row 0): the left neighbour's mode (the root's), then each guess copies its left
    e = _drafter("above_mode")
    e.mode[0, 0] = 40
    c = torch.tensor([[1, 2, 3]])
    e._initialise(c, torch.ones_like(c, dtype=torch.bool), RowRandom.from_seeds([0], torch.device("cpu")))
    assert e.canvas[0, 1:4].tolist() == [40, 40, 40]  # the root's mode, then each guess's left neighbour


@torch.no_grad()
def test_above_mode_records_the_ar_conditionals_mode() -> None:
    """At context = row length every cell's recorded mode is the argmax of the target's exact AR
    conditional given the codes before it (one uncached forward over the finished image)."""
    model, labels = _model(), [5, 0]
    s = SamplingConfig(temperature=1.0, top_k=0, cfg_scale=1.0)
    out, drafter = _run(model, labels, s, PJDConfig(window=4, context=WIDTH, init="above_mode"), [3, 4])
    logits = model(torch.tensor(labels), out.codes[:, :-1])[0]  # [B, N, V]: position i predicts code i
    n = WIDTH * WIDTH
    assert torch.equal(drafter.mode[:, 1:n], logits[:, -(n - 1):].argmax(-1))
    assert bool((drafter.mode[:, 0] == -1).all())  # token 0 came from the prefill


def test_above_mode_is_row_above_when_greedy() -> None:
    model, labels = _model(), [5, 0, 3]
    s = SamplingConfig(temperature=0.0, cfg_scale=2.0)
    for context in (2, WIDTH):
        a, _ = _run(model, labels, s, PJDConfig(window=3, context=context, init="above_mode"))
        b, _ = _run(model, labels, s, PJDConfig(window=3, context=context, init="row_above"))
        assert torch.equal(a.codes, b.codes)
        assert torch.equal(a.stats.target_forwards, b.stats.target_forwards)


def test_above_mode_in_the_settings_vocabulary() -> None:
    """One name everywhere: the Python API, the CLI's --pjd-init and the bench grammar's init key."""
    assert MethodConfig.resolve("pjd-lantern", pjd_init="above_mode").pjd == PJDConfig(init="above_mode")
    spec = parse_methods("pjd/init=above_mode/context=16")[0]
    assert spec.settings == {"pjd_init": "above_mode", "pjd_context": 16}
    parser = argparse.ArgumentParser()
    add_pjd_args(parser)
    assert parser.parse_args(["--pjd-init", "above_mode"]).pjd_init == "above_mode"
