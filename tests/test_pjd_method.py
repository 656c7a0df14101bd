"""``--method pjd`` (parallel Jacobi decoding, ``lantern.decoding.pjd.GridJacobiDrafter``) in the one loop.

Evidence (the grid pieces alone are in test_pjd.py; t2i greedy in test_t2i.py):

* inside the real loop, every verified node's logits equal an explicit recomputation: one forward
  over the condition, every token cached so far and the block, at their image positions, each
  token attending to exactly what the row-causal rule lets it see; the cache's slot cells equal
  the commit history, and commits did happen out of raster order with several rows per forward;
* rows of a batch progress independently (same codes and forwards alone and in a batch);
* with one row at a time (context = row length) PJD is lossless: greedy equals AR token for token
  (batch 1 and 3, CFG on and off) and sampled PJD reproduces the target's joint law of the first
  4 tokens (chi-square against exact enumeration), while the same test rejects a broken q;
* bad window / context values give one-line errors from ``lantern.load`` (and from the CLI: the
  cases are in test_sjd.py's table of bad Jacobi options).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    DIST_LABEL,
    DIST_ROWS,
    DIST_SAMPLING,
    PJDToken,
    cached_stack,
    chi_square,
    dist_model,
    exact_joint,
    generate_pjd,
    pjd_model,
    pjd_reference,
)
from torch import Tensor

import lantern
from lantern.autotree.window import AutoWindowChoice, WindowTrial, choose_window, with_window
from lantern.cli.main import main
from lantern.decoding.config import PJDConfig, SamplingConfig
from lantern.decoding.loop import GenerationOutput
from lantern.decoding.pjd import GridBlock, GridJacobiDrafter
from lantern.decoding.rng import RowRandom
from lantern.errors import LanternError
from lantern.eval.bench import BenchConfig, resolve_auto_windows
from lantern.eval.methods_grammar import parse_methods
from lantern.eval.report import tree_label
from lantern.methods import MethodConfig, method_settings
from lantern.models.llamagen import LlamaGen
from lantern.run import run_generation
from lantern.targets.llamagen import LlamaGenTarget
from lantern.targets.llamagen_stack import load_stack
from lantern.testing import chi_square_threshold, make_random_stack, tiny_llamagen


@pytest.fixture(scope="module")
def random_stack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_stack(tmp_path_factory.mktemp("pjd") / "random", seed=2)


def _run(model: LlamaGen, labels: list[int], sampling: SamplingConfig, config: PJDConfig, seeds: list[int] | None,
         drafter_cls: type[GridJacobiDrafter] = GridJacobiDrafter,
         target_cls: type[LlamaGenTarget] = LlamaGenTarget) -> tuple[GenerationOutput, LlamaGenTarget]:
    out, _, target = generate_pjd(model, labels, sampling, config, seeds, drafter_cls, target_cls)
    return out, target


# ---- the real loop against an explicit recomputation -----------------------------------------


class _Recording(LlamaGenTarget):
    """The target, recording every grid round: (tokens, cells, rows, logits, keep, num_keep)."""

    rounds: list[list[Tensor]]

    def verify_grid(self, tokens: Tensor, cells: Tensor, rows: Tensor, chains: int | None = None) -> Tensor:
        logits = super().verify_grid(tokens, cells, rows, chains)
        self.rounds = [*getattr(self, "rounds", []), [tokens.clone(), cells.clone(), rows.clone(), logits.clone()]]
        return logits

    def commit_grid(self, keep: Tensor, num_keep: Tensor) -> None:
        self.rounds[-1] += [keep.clone(), num_keep.clone()]
        super().commit_grid(keep, num_keep)


def _replay_row(model: LlamaGen, label: int, rounds: list[list[Tensor]], b: int) -> tuple[list[PJDToken], int, int]:
    """Check every real node of batch row ``b`` against :func:`pjd_reference`; returns (the cached
    tokens in commit order, nodes checked, rounds with several image rows)."""
    cls = model.config.cls_token_num
    history = [PJDToken(0, -1, list(range(i))) for i in range(cls)]
    checked = multi = 0
    for tokens, cells, rows, logits, keep, num_keep in rounds:
        real = [i for i in range(tokens.shape[1]) if int(rows[b, i]) >= 0]
        multi += len({int(rows[b, i]) for i in real}) > 1
        block: list[PJDToken] = []
        for i in real:
            cell, row = int(cells[b, i]), int(rows[b, i])
            sees = [k for k, tok in enumerate(history) if tok.cell < cell and not tok.ghost]  # condition: cell -1
            sees += [len(history) + m for m, j in enumerate(real[: len(block)])
                     if int(rows[b, j]) == row and int(cells[b, j]) < cell]
            block.append(PJDToken(int(tokens[b, i]), cell, sees))
        if block:
            ref = pjd_reference(model, label, history, block)
            assert torch.allclose(logits[b, real], ref, atol=1e-5), (len(history), real)
            checked += len(block)
        # The kept tokens join the history with what they saw when computed. The first guess of a
        # newly opened row saw its stand-in root, which is dropped (ZipAR's auxiliary token): its
        # cached keys and values still depend on it, so the stand-in joins too, as a ghost.
        base = len(history)
        kept = [real.index(int(x)) for x in keep[b, : int(num_keep[b])]]
        seen = sorted({s - base for m in kept for s in block[m].sees if s >= base} - set(kept))
        remap = {base + m: base + i for i, m in enumerate(kept + seen)}
        for i, m in enumerate(kept + seen):  # remap[s]: a token that saw an unlisted one fails here
            tok = block[m]
            sees = [remap[s] if s >= base else s for s in tok.sees]
            history.append(PJDToken(tok.token, tok.cell, sees, ghost=i >= len(kept)))
    return [tok for tok in history if not tok.ghost], checked, multi


@torch.no_grad()
@pytest.mark.parametrize("window,context", [(2, 1), (2, 2), (1, 1)])
def test_loop_equals_explicit_recomputation(window: int, context: int) -> None:
    """Two sampled rows of a 4 x 4 image decoded by PJD in the real loop; every verified node's
    logits equal the explicit recomputation, and the cache's slot cells are the commit history."""
    model, labels = pjd_model(), [3, 7]
    s = SamplingConfig(temperature=1.0, top_k=0, cfg_scale=1.0)  # cfg 1: guided logits are the model's
    # seeds for which every setting commits out of raster order in both rows (the test's precondition)
    out, target = _run(model, labels, s, PJDConfig(window, context), [4, 5], target_cls=_Recording)
    rounds = target.rounds  # type: ignore[attr-defined]
    cls = model.config.cls_token_num
    for b in range(2):
        history, checked, multi = _replay_row(model, labels[b], rounds, b)
        assert checked >= 16 and multi >= 1, (checked, multi)
        cells = [tok.cell for tok in history[cls:]]
        assert target.slot_cell is not None
        assert target.slot_cell[b, cls : cls + len(cells)].tolist() == cells  # cache slot -> cell, commit order
        assert cells != sorted(cells), "no commit out of raster order"
        assert len(set(cells)) == len(cells)  # no cell cached twice (stand-ins are never committed)
        assert all(out.codes[b, tok.cell] == tok.token for tok in history[cls:])
    assert bool((out.codes >= 0).all())


# ---- batches, greedy = AR, lossless sampling -------------------------------------------------


@pytest.mark.parametrize(("init", "coupling"), [("random", "independent"), ("above_mode", "independent"),
                                                ("row_above", "maximal")])  # above_mode reads the last predictions
@pytest.mark.parametrize("context", [2, 8])
def test_rows_independent_of_batch(context: int, init: str, coupling: str) -> None:
    """A row gives the same codes, in the same number of forwards, alone and in a batch of 3."""
    model = tiny_llamagen(seed=7)
    s = SamplingConfig(temperature=1.0, top_k=20, cfg_scale=2.0)
    labels, seeds, config = [4, 5, 6], [1, 2, 3], PJDConfig(3, context, init=init, coupling=coupling)
    batch, _ = _run(model, labels, s, config, seeds)
    for i in range(3):
        alone, _ = _run(model, labels[i : i + 1], s, config, seeds[i : i + 1])
        assert torch.equal(batch.codes[i], alone.codes[0]), i
        assert int(batch.stats.target_forwards[i]) == int(alone.stats.target_forwards[0])
    assert any(len(set(step.tolist())) > 1 for step in batch.stats.tokens_per_step)  # rows drifted apart


@pytest.mark.parametrize("coupling", ["independent", "maximal"])
def test_a_coupled_redraw_keeps_guesses_whose_law_did_not_move(coupling: str) -> None:
    """SCD's maximal coupling in PJD's carry-over: where the new prediction p is the law q a guess
    was drawn from, the guess stays (Pr = 1 - TV(p, q) = 1), and a fill (drawn from no
    prediction: a point mass) stays where p is that point; independent redraws move nearly all."""
    b, n, v = 4, 16, 64
    drafter = GridJacobiDrafter(PJDConfig(3, 4, coupling=coupling), SamplingConfig(temperature=1.0), v, n)
    drafter.start(torch.zeros(b, 1), torch.zeros(b, dtype=torch.long))
    assert drafter.q is not None
    gen = torch.Generator().manual_seed(0)
    cell = torch.arange(1, 13).repeat(b, 1)  # [B, M]: 12 open cells per row
    index = cell[:, :, None].expand(-1, -1, v)
    law = torch.softmax(3 * torch.randn(b, 12, v, generator=gen), dim=-1)
    old = torch.multinomial(law.view(-1, v), 1, generator=gen).view(b, 12)
    drawn = torch.arange(12)[None, :].expand(b, -1) < 8  # cells 1-8 were drawn, 9-12 are fills
    p = torch.where(drawn[:, :, None], law, torch.nn.functional.one_hot(old, v).float())
    drafter.q.scatter_(1, index, torch.where(drawn[:, :, None], law, 0.0))
    drafter.drawn.scatter_(1, cell, drawn)
    drafter.canvas.scatter_(1, cell, old)
    y = drafter._redraw(p, old, cell, index, RowRandom.from_seeds([1, 2, 3, 4], "cpu"))
    kept = (y == old)[drawn].float().mean().item()
    assert torch.equal(y[~drawn], old[~drawn])  # p is the fill's point mass: any redraw gives it
    if coupling == "maximal":
        assert kept == 1.0
    else:
        assert kept < 0.6, kept  # each stays with probability sum_x q(x)^2 (measured 0.34)


LABELS = {1: [5], 3: [0, 3, 7]}


@cache
def _greedy_ar(path: str, batch: int, cfg_scale: float) -> Tensor:
    s = SamplingConfig(temperature=0.0, cfg_scale=cfg_scale)
    return run_generation(cached_stack(path), LABELS[batch], 0, s, MethodConfig.resolve("ar"), batch).codes


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_one_row_at_a_time_reproduces_ar(random_stack: Path, batch: int, cfg_scale: float) -> None:
    stack = cached_stack(str(random_stack))  # an 8 x 8 image
    s = SamplingConfig(temperature=0.0, cfg_scale=cfg_scale)
    method = MethodConfig.resolve("pjd", pjd_window=3, pjd_context=8)
    result = run_generation(stack, LABELS[batch], 0, s, method, batch)
    assert torch.equal(result.codes, _greedy_ar(str(random_stack), batch, cfg_scale))
    lossy = run_generation(stack, LABELS[batch], 0, s, MethodConfig.resolve("pjd", pjd_window=3, pjd_context=2),
                           batch)
    assert lossy.stats_dict()["target_forwards"] < result.stats_dict()["target_forwards"]  # rows in parallel


class _WrongQ(GridJacobiDrafter):
    """A broken acceptance: every guess is tested against a q that is not the law it was drawn
    from (half its q, half uniform), so both the test and the residual are off."""

    def propose_grid(self, generators: list[torch.Generator] | None) -> GridBlock:
        block = super().propose_grid(generators)
        assert block.q_draft is not None
        q = block.q_draft.clone()
        q[:, :-1] = 0.5 * q[:, :-1] + 0.5 / q.shape[-1]
        return GridBlock(**{**block.__dict__, "q_draft": q})


DIST_TOKENS = 4


@cache
def _grid_dist_model(width: int) -> LlamaGen:
    """The 3 x 3 model of test_speculative.py (conftest.dist_model), or a 4 x 4 one like it (same V = 6)."""
    if width == 3:
        return dist_model()
    return tiny_llamagen(seed=3, logit_std=0.4, vocab_size=6, block_size=16, dim=16, n_layer=1, n_head=2,
                         multiple_of=16)


class _StaleCoupling(GridJacobiDrafter):
    """A broken coupling: a redraw that kept its old guess keeps the old guess's law too (the SCD
    reference code's bookkeeping, lantern.decoding.jacobi's NOTE): the kept guess is then tested
    against a q it no longer follows."""

    def _redraw(self, p: Tensor, old: Tensor, cell: Tensor, index: Tensor, gens: RowRandom) -> Tensor:
        y = super()._redraw(p, old, cell, index, gens)
        assert self.q is not None
        self._stale = (index, (y == old) & self.drawn.gather(1, cell), self.q.gather(1, index).clone())
        return y

    def _carry_over(self, *args: Any, **kwargs: Any) -> None:
        super()._carry_over(*args, **kwargs)
        index, stale, q_old = self._stale
        assert self.q is not None
        self.q.scatter_(1, index, torch.where(stale[:, :, None], q_old, self.q.gather(1, index)))


@cache
def _dist_run(width: int, broken: bool = False, coupling: str = "independent") -> GenerationOutput:
    # window 2 on a 3 x 3 image, 3 on a 4 x 4 one; context = the row length: one row at a time
    rows = DIST_ROWS
    drafter = (_StaleCoupling if coupling == "maximal" else _WrongQ) if broken else GridJacobiDrafter
    out, _ = _run(_grid_dist_model(width), [DIST_LABEL] * rows, DIST_SAMPLING,
                  PJDConfig(width - 1, width, coupling=coupling), list(range(rows)), drafter)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("width", "coupling"), [(3, "independent"), (4, "independent"), (4, "maximal")])
def test_one_row_at_a_time_matches_target_distribution(width: int, coupling: str) -> None:
    """Chi-square goodness of fit of the first 4 tokens' joint law (V = 6, top-k 4, CFG 2: 256
    cells), at significance 0.001: a correct implementation fails with probability 0.1 % per
    test (fixed seeds: deterministic). 3 x 3: token 3 opens row 1 through a root that is the row
    above's real last token, and is tested as a fresh guess of the new row; 4 x 4: row 0's third
    token is often a carried guess (drawn from the previous round's p and tested with it), which
    ``maximal`` coupling redraws from the guess it replaces (SCD): still lossless."""
    p = exact_joint(_grid_dist_model(width), DIST_SAMPLING, DIST_TOKENS)
    out = _dist_run(width, coupling=coupling)
    stat, df = chi_square(out.codes[:, :DIST_TOKENS], p)
    assert df >= 30
    assert stat < chi_square_threshold(df), f"chi2 = {stat:.1f} with {df} dof"
    # guesses were accepted: the Jacobi path ran (measured 1.20 and 1.35; a row's last token is never a guess)
    assert out.stats.mean_accepted > 1.15


@pytest.mark.slow
@pytest.mark.parametrize("coupling", ["independent", "maximal"])
def test_chi_square_detects_a_broken_acceptance(coupling: str) -> None:
    """Power: the same test rejects PJD that tests its guesses against the wrong q (measured
    chi2 814 against a threshold of 109), and coupled PJD whose kept guesses keep their old q
    (measured 135; the right coupling: 96)."""
    p = exact_joint(_grid_dist_model(4), DIST_SAMPLING, DIST_TOKENS)
    stat, df = chi_square(_dist_run(4, broken=True, coupling=coupling).codes[:, :DIST_TOKENS], p)
    assert stat > chi_square_threshold(df), f"chi2 = {stat:.1f} with {df} dof"


# ---- configuration and bad input -------------------------------------------------------------


def test_methods_resolve_and_round_trip() -> None:
    m = MethodConfig.resolve("pjd-lantern++", pjd_window=2, pjd_context=3, lantern_lambda=2.0)
    assert m.pjd == PJDConfig(2, 3, "row_above") and m.tree.depth == 2  # row_above: the measured default
    assert m.relaxation is not None and m.relaxation.lam == 2.0
    assert m.to_dict()["pjd"] == {"window": 2, "context": 3, "init": "row_above", "coupling": "independent"}
    assert MethodConfig.resolve("pjd", pjd_init="random").pjd == PJDConfig()
    coupled = MethodConfig.resolve("pjd", pjd_coupling="maximal")
    assert coupled.pjd == PJDConfig(init="row_above", coupling="maximal")
    assert method_settings(coupled)["pjd_coupling"] == "maximal"
    assert MethodConfig.resolve(**{"method": "pjd", **method_settings(coupled)}) == coupled


def test_python_api_errors_and_run(random_stack: Path) -> None:
    pipe = lantern.load(str(random_stack))
    with pytest.raises(LanternError, match=r"^pjd_window \(20\) must be at most the image row length \(8\)"):
        pipe(labels=[1], method="pjd", pjd_window=20)
    with pytest.raises(LanternError, match=r"^pjd_context must be an integer >= 1, got -1"):
        pipe(labels=[1], method="pjd", pjd_context=-1)
    with pytest.raises(LanternError, match=r"^pjd_coupling must be one of independent, maximal, got 'gumbel'$"):
        pipe(labels=[1], method="pjd", pjd_coupling="gumbel")  # SCD's shared noise: not for PJD's grid
    with pytest.raises(LanternError, match=r"^pjd_window / pjd_context / pjd_init / pjd_coupling need method pjd "):
        pipe(labels=[1], method="sjd-coupled", pjd_coupling="maximal")
    out = pipe(labels=[1, 2], method="pjd", pjd_window=2, pjd_context=4, temperature=0.0)
    ar = pipe(labels=[1, 2], method="ar", temperature=0.0)
    assert out.config["method"]["pjd"] == {"window": 2, "context": 4, "init": "row_above",
                                              "coupling": "independent"}
    assert out.codes.shape == ar.codes.shape


# ---- --pjd-window auto -------------------------------------------------------------------------


def test_choose_pjd_window_measures_windows_within_a_row(random_stack: Path) -> None:
    stack = load_stack(random_stack)  # 8 x 8
    method = MethodConfig.resolve("pjd", pjd_context=4)
    choice = choose_window(stack, method, SamplingConfig(top_k=20), images=1, windows=(2, 4, 9), passes=1)
    assert [t.window for t in choice.trials] == [2, 4]  # a window longer than the row is never tried
    assert all(t.tokens_per_forward >= 1.0 and t.ms_per_token > 0 for t in choice.trials)
    chosen = with_window(method, choice.window)
    assert chosen.pjd == PJDConfig(choice.window, 4, "row_above") and chosen.tree.depth == choice.window


@pytest.mark.slow
def test_cli_auto_pjd_window_is_recorded(random_stack: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o"
    rc = main(["generate", "--model", str(random_stack), "--labels", "1", "--method", "pjd", "--pjd-window", "auto",
               "--pjd-context", "4", "--out", str(out), "--no-progress"])
    assert rc == 0
    assert "--pjd-window auto [pjd]: window " in capsys.readouterr().out
    run = json.loads((out / "run.json").read_text())
    assert run["method"]["pjd"] == {"window": run["auto_window"]["window"], "context": 4, "init": "row_above",
                                   "coupling": "independent"}
    assert run["auto_window"]["window"] in (2, 4, 8)


@pytest.mark.slow
def test_bench_rows_take_pjd_settings_and_auto_windows(random_stack: Path) -> None:
    specs = parse_methods("pjd/window=3/context=2,pjd/window=auto,sjd/window=8,ar")
    assert specs[0].window == 3 and specs[0].settings == {"pjd_window": 3, "pjd_context": 2}
    assert specs[0].name == "pjd/window=3/context=2"
    stack = load_stack(random_stack)
    assert tree_label(specs[0].resolve(stack)) == "pjd:3/c2"
    config, chosen = resolve_auto_windows(stack, SamplingConfig(top_k=20), BenchConfig(methods=specs),
                                          log=lambda _: None, images=1, passes=1)
    assert set(chosen) == {"pjd/window=auto"}  # sjd/window=auto takes the same path (test_autowindow.py)
    pjd, sjd = config.methods[1].resolve(stack), config.methods[2].resolve(stack)
    assert pjd.pjd is not None and pjd.pjd.window == chosen["pjd/window=auto"]["window"] in (2, 4, 8)
    assert config.methods[1].name == "pjd/window=auto"  # the row keeps its name, the record says what was chosen
    assert sjd.jacobi is not None and sjd.jacobi.window == 8
    with pytest.raises(LanternError, match=r"--methods 'pjd/window=wide': window must be a number, got 'wide'"):
        parse_methods("pjd/window=wide")
    coupled, sjd_coupled = parse_methods("pjd/coupling=maximal,sjd-coupled/coupling=gumbel")  # the method's own
    assert coupled.settings == {"pjd_coupling": "maximal"} and sjd_coupled.settings == {"sjd_coupling": "gumbel"}
    assert tree_label(coupled.resolve(stack)) == "pjd:4/c8/maximal"


@pytest.mark.slow
def test_demo_takes_windows_and_auto(random_stack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``lantern demo --pjd-window auto``: the auto choice (its timing is choose_window's, tested
    above; here a fixed stand-in) reaches the pjd row and demo.json."""
    asked: list[str] = []

    def fake_choice(stack: object, method: MethodConfig, *args: object, **kwargs: object) -> AutoWindowChoice:
        asked.append(method.method)
        return AutoWindowChoice(method.method, (WindowTrial(2, 1.5, 1.0), WindowTrial(4, 1.2, 2.0)), 0.1)

    monkeypatch.setattr("lantern.autotree.window.choose_window", fake_choice)
    out = tmp_path / "demo"
    assert main(["demo", "--model", str(random_stack), "--num-images", "1", "--methods", "ar,pjd",
                 "--pjd-window", "auto", "--out", str(out), "--no-progress"]) == 0
    assert asked == ["pjd"]
    assert "--pjd-window auto [pjd]: window 2: 1.50 tokens per forward" in capsys.readouterr().out
    demo = json.loads((out / "demo.json").read_text())
    resolved = {r["method"]: r["resolved"] for r in demo["results"]}
    assert resolved["pjd"]["pjd"]["window"] == demo["auto_windows"]["pjd"]["window"] == 2
    assert set(demo["auto_windows"]) == {"pjd"}
    assert main(["demo", "--model", str(random_stack), "--methods", "ar,sd", "--sjd-window", "2", "--out",
                 str(tmp_path / "bad"), "--no-progress"]) == 2
    assert "--sjd-window needs one of sjd, sjd-lantern" in capsys.readouterr().err
