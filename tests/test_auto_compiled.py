"""``--tree auto`` and the auto windows under ``--compile``: chosen by compiled timings.

The device profile times eager forwards; a compiled round's cost against its tree is not the eager
one's. Under ``--compile`` the cost model's best trees are decoded compiled and the fastest
measured one is chosen, and the windows are timed compiled. These tests drive the choice with a
fake decode and a fake clock, so the outcome is decided by construction, never by this machine's
speed; one test runs a real compiled choice end to end."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import lantern.autotree.window as window_module
import lantern.run
from lantern.autotree.choose import COMPILED_CANDIDATES, time_compiled
from lantern.autotree.model import AcceptanceModel, CostModel
from lantern.autotree.search import select_tree
from lantern.decoding.config import SamplingConfig
from lantern.methods import MethodConfig
from lantern.targets.llamagen_stack import load_stack

DEEP_RATES = ((0.55, 0.2, 0.1, 0.05), (0.6, 0.2, 0.1), (0.6, 0.2, 0.1), (0.6, 0.2), (0.6, 0.2), (0.6,), (0.6,), (0.6,))
FLAT = CostModel(verify_ms=tuple(1.0 + 0.002 * (n - 1) for n in range(1, 65)), begin_ms=(0.05,),
                 feed_ms=(0.05,), overhead_ms=(0.05, 0.01, 0.0), ar_step_ms=1.0)


@pytest.fixture(scope="module")
def stack() -> Any:
    return load_stack("digits", dtype=torch.float32)


class FakeDecodes:
    """run_conditions that decodes nothing: each call advances a fake clock by the tree's cost
    (ms per image token, from ``cost``) and records what it was asked to run."""

    def __init__(self, cost: dict[str, float], num_tokens: int) -> None:
        self.cost, self.num_tokens, self.now = cost, num_tokens, 0.0
        self.calls: list[tuple[str, str | None, int, int]] = []  # (tree, compile, rows, batch_size)

    def clock(self) -> float:
        return self.now

    def __call__(self, stack: Any, conditions: Any, seed: int, sampling: Any, method: MethodConfig,
                 batch_size: int, **kwargs: Any) -> Any:
        spec = method.tree.spec
        rows = len(conditions)
        self.calls.append((spec, kwargs.get("compile"), rows, batch_size))
        self.now += self.cost[spec] * rows * self.num_tokens / 1000
        return SimpleNamespace(codes=torch.zeros(rows, self.num_tokens, dtype=torch.long))


def _deep_choice(cost: CostModel = FLAT) -> Any:
    return select_tree(AcceptanceModel(rates=DEEP_RATES, trials=(), accepts=(), rounds=100, method="lantern"),
                       cost, method="lantern")


@pytest.mark.parametrize("batch_size", [1, 4])
def test_under_compile_the_fastest_timed_tree_wins(stack: Any, monkeypatch: pytest.MonkeyPatch,
                                                   batch_size: int) -> None:
    """The cost model ranks three trees; compiled, its third is the fastest (and faster than AR):
    that one is chosen, and the record says why. Every decode ran compiled at the run's batch
    size, each tree and AR were warmed once (their compilation) before any timed pass, and every
    pass timed all four. Power: the cost model's own pick is another tree."""
    choice = _deep_choice()
    top = [c for c in choice.ranking if c.speedup >= 1.0][:COMPILED_CANDIDATES]
    assert len(top) == COMPILED_CANDIDATES
    specs = [c.config.spec for c in top]
    fake = FakeDecodes({specs[0]: 3.0, specs[1]: 2.0, specs[2]: 1.0, "none": 4.0}, stack.num_tokens)
    monkeypatch.setattr(lantern.run, "run_conditions", fake)
    sampling = SamplingConfig(**stack.default_sampling())
    method = MethodConfig.resolve("lantern")
    timed = time_compiled(stack, method, sampling, choice, "default", batch_size=batch_size, clock=fake.clock)

    assert choice.best is top[0] and timed.best is top[2]  # the model's pick lost to the clock
    assert timed.tree == top[2].config and timed.ranking[0] is top[2] and len(timed.ranking) == len(choice.ranking)
    assert not timed.falls_back_to_ar and timed.compile == "default"
    assert [s for s, _ in timed.compiled_ms_per_token] == [c.spec for c in top] + ["ar"]
    assert dict(timed.compiled_ms_per_token)[top[2].spec] == pytest.approx(1.0)
    assert "timed compiled" in timed.explanation and timed.to_dict()["compiled_ms_per_token"]["ar"] == 4.0
    images = max(2, batch_size)
    order = specs + ["none"]
    assert all(compile == "default" and b == batch_size for _, compile, _, b in fake.calls)
    warm, passes = fake.calls[:4], fake.calls[4:]
    assert [spec for spec, *_ in warm] == order and all(rows == batch_size for _, _, rows, _ in warm)
    assert sorted(spec for spec, *_ in passes) == sorted(order * 2) and all(r == images for _, _, r, _ in passes)
    assert [spec for spec, *_ in passes[4:]] == order[1:] + order[:1]  # the second pass starts elsewhere


def test_compiled_ar_faster_than_every_tree_falls_back_to_ar(stack: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The eager model predicts speculation wins; compiled, AR is faster per token than every timed
    tree: the method decodes as AR, and the record says so. Power: the same choice with AR slower
    keeps a tree (the test above)."""
    choice = _deep_choice()
    assert not choice.falls_back_to_ar
    specs = [c.config.spec for c in choice.ranking if c.speedup >= 1.0][:COMPILED_CANDIDATES]
    fake = FakeDecodes({**dict.fromkeys(specs, 2.0), "none": 1.5}, stack.num_tokens)
    monkeypatch.setattr(lantern.run, "run_conditions", fake)
    timed = time_compiled(stack, MethodConfig.resolve("lantern"), SamplingConfig(**stack.default_sampling()), choice,
                          "default", clock=fake.clock)
    assert timed.falls_back_to_ar and timed.tree == "ar" and timed.tree_spec == "ar"
    assert timed.to_dict()["compiled_winner"] == "ar" and timed.to_dict()["tree"] == "ar"
    assert "plain AR is the fastest" in timed.explanation


def test_one_tree_faster_than_ar_is_timed_against_ar(stack: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """One tree predicted faster than AR: it is timed against compiled AR, and kept when faster."""
    steep = CostModel(verify_ms=tuple(1.0 + 0.3 * (n - 1) for n in range(1, 65)), begin_ms=(0.1,),
                      feed_ms=(0.1,), overhead_ms=(0.1, 0.0, 0.0), ar_step_ms=1.0)
    choice = _deep_choice(steep)
    faster = [c for c in choice.ranking if c.speedup >= 1.0]
    assert len(faster) == 1
    fake = FakeDecodes({faster[0].config.spec: 1.0, "none": 2.0}, stack.num_tokens)
    monkeypatch.setattr(lantern.run, "run_conditions", fake)
    timed = time_compiled(stack, MethodConfig.resolve("lantern"), SamplingConfig(), choice, "default",
                          clock=fake.clock)
    tree = faster[0].config.spec  # warm-ups, then two passes, the second in rotated order
    assert [spec for spec, *_ in fake.calls] == [tree, "none", tree, "none", "none", tree]
    assert timed.best is faster[0] and not timed.falls_back_to_ar and timed.compile == "default"


@pytest.mark.parametrize("ar_ms", [0.5, 3.0])
def test_a_predicted_fallback_to_ar_is_timed_too(stack: Any, monkeypatch: pytest.MonkeyPatch, ar_ms: float) -> None:
    """Every tree predicted slower than AR (an eager cost model): under --compile the model's best
    trees are still timed against compiled AR, through choose_tree. AR timed faster: plain AR, as
    predicted; a tree timed faster: that tree, the prediction overridden, and the record says so
    (its compile mode, not None as if eager)."""
    steep = CostModel(verify_ms=tuple(3.0 + 0.9 * (n - 1) for n in range(1, 65)), begin_ms=(2.0,),
                      feed_ms=(2.0,), overhead_ms=(1.0, 0.0, 0.0), ar_step_ms=1.0)
    choice = _deep_choice(steep)
    assert choice.falls_back_to_ar and not any(c.speedup >= 1.0 for c in choice.ranking)
    import lantern.autotree.choose as choose_module

    specs = [c.config.spec for c in choice.ranking[:COMPILED_CANDIDATES]]
    fake = FakeDecodes({**dict.fromkeys(specs, 1.0), "none": ar_ms}, stack.num_tokens)
    monkeypatch.setattr(lantern.run, "run_conditions", fake)
    profile = SimpleNamespace(check_matches=lambda *a: None, max_tokens=64, cost_model=lambda rule: steep)
    monkeypatch.setattr(choose_module, "measure_profile", lambda *a, **k: profile)
    monkeypatch.setattr(choose_module, "calibrate", lambda *a, **k: choice.acceptance)
    monkeypatch.setattr(choose_module, "time_compiled", functools.partial(time_compiled, clock=fake.clock))
    timed = choose_module.choose_tree(stack, "lantern", SamplingConfig(**stack.default_sampling()), compile="default")
    assert sorted({spec for spec, *_ in fake.calls}) == sorted([*specs, "none"])
    assert timed.to_dict()["compile"] == "default"
    if ar_ms < 1.0:
        assert timed.falls_back_to_ar and timed.tree == "ar" and timed.compiled_winner == "ar"
    else:
        assert not timed.falls_back_to_ar and timed.tree == choice.ranking[0].config
        assert "prediction that AR wins is overridden" in timed.explanation


@pytest.mark.parametrize("batch_size", [2, 4])
@pytest.mark.parametrize(("compile", "mode"), [(None, None), ("default", "default")])
def test_windows_are_timed_in_the_runs_compile_mode(stack: Any, monkeypatch: pytest.MonkeyPatch,
                                                    compile: str | None, mode: str | None, batch_size: int) -> None:
    """Every window decode runs in the run's mode; compiled, each window is warmed once (its own
    graph), eager one warm-up does for all. The record names the mode. Every decode is of the run's
    batch size (compiled, a graph per batch size; either way, a window's cost per token depends on
    the rows beside it), also when that exceeds the 2 calibration images: 4 rows timed, not 2."""
    calls: list[tuple[int, str | None, int]] = []

    def fake(stack: Any, conditions: Any, seed: int, sampling: Any, method: MethodConfig, batch_size: int,
             **kwargs: Any) -> Any:
        assert method.jacobi is not None
        calls.append((method.jacobi.window, kwargs.get("compile"), len(conditions)))
        codes = torch.zeros(len(conditions), stack.num_tokens, dtype=torch.long)
        forwards = torch.full((len(conditions),), 8)
        return lantern.run.RunResult.from_counts(codes, forwards, 0, 0.0, method)

    monkeypatch.setattr(window_module, "run_conditions", fake)
    choice = window_module.choose_window(stack, MethodConfig.resolve("sjd"), SamplingConfig(**stack.default_sampling()),
                                         batch_size=batch_size, compile=compile)
    windows = sorted({w for w, _, _ in calls})
    assert all(c == mode for _, c, _ in calls) and choice.compile == mode and choice.to_dict()["compile"] == mode
    warm = calls[: len(windows) if mode else 1]
    assert all(rows == batch_size for _, _, rows in calls)  # the warm-ups and every timed pass
    assert [w for w, _, _ in warm] == (windows if mode else windows[:1])
    assert ("compiled (default)" if mode else "eager") in choice.explanation


def test_the_timed_trees_decode_for_real(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The timing's decodes on a real (tiny random) stack: each candidate tree runs through the
    run path and gets a positive measured cost, and the choice is one of them. The decodes run
    eagerly here (compiling each tree costs minutes on a CPU; the compiled round's own tests are
    tests/test_round_graph.py), with the mode they were asked for recorded."""
    from lantern.testing import make_random_stack

    real = lantern.run.run_conditions
    asked: list[str | None] = []

    def eager(*args: Any, compile: str | None = None, **kwargs: Any) -> Any:
        asked.append(compile)
        return real(*args, **kwargs)

    monkeypatch.setattr(lantern.run, "run_conditions", eager)
    tiny = load_stack(make_random_stack(tmp_path / "random", seed=2, grid=4))
    choice = select_tree(AcceptanceModel(rates=DEEP_RATES, trials=(), accepts=(), rounds=100, method="lantern"),
                         FLAT, method="lantern", max_depth=tiny.num_tokens - 1)
    sampling = SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, cfg_scale=1.0)
    timed = time_compiled(tiny, MethodConfig.resolve("lantern"), sampling, choice, "default", images=1, passes=1)
    ms = dict(timed.compiled_ms_per_token)
    assert len(ms) == COMPILED_CANDIDATES + 1 and all(v > 0 for v in ms.values()) and "ar" in ms
    assert timed.tree_spec in ms
    assert asked == ["default"] * 2 * (COMPILED_CANDIDATES + 1)  # a warm-up and one timed pass per tree, and AR
