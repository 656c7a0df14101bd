"""Hardware-aware trees (lantern.autotree.choose): the tree math, calibration, the search and the CLI.

The tree math is checked against independent computations (a recursion over acceptance outcomes,
brute force over every prefix-closed tree of a size); calibration against drafters whose
acceptance is known (the target as its own drafter accepts its rank-0 sample every time); the
search against synthetic cost curves, so no assertion depends on wall-clock time.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from PIL import Image

from lantern.autotree.calibrate import calibrate, probe_tree, record_rounds
from lantern.autotree.model import (
    AcceptanceModel,
    CostModel,
    RoundRecord,
    count_trials,
    estimate_rates,
    expected_accepted,
    greedy_trees,
    interpolate,
    non_decreasing,
)
from lantern.autotree.search import select_tree
from lantern.cli.main import main
from lantern.decoding.config import SamplingConfig, TreeConfig
from lantern.decoding.sampling import make_generators
from lantern.decoding.trees import STATIC_TREES, canonical_choices, level_widths, probe_choices
from lantern.drafters.oracle import make_oracle_drafter
from lantern.errors import LanternError
from lantern.methods import MethodConfig
from lantern.targets.llamagen import LlamaGenTarget
from lantern.targets.llamagen_stack import load_stack
from lantern.testing import make_random_stack, tiny_llamagen

Choice = tuple[int, ...]




# ---- tree math --------------------------------------------------------------------------------

RATES = ((0.5, 0.2, 0.1), (0.6, 0.15), (0.4, 0.3), (0.7,))


def _exact_expected(choices: list[Choice], rates: tuple[tuple[float, ...], ...]) -> float:
    """E[accepted drafts] by recursion over outcomes: at a reached node, child rank r is the
    accepted one with probability a[d][r] (ranks the tree lacks are simply not tested), nothing
    with the rest; the accepted child adds 1 and recurses."""
    tree = set(choices)

    def expect(node: Choice) -> float:
        d = len(node)
        total = 0.0
        for r in itertools.count():
            child = node + (r,)
            if child not in tree:
                break
            a = rates[d][r] if d < len(rates) and r < len(rates[d]) else 0.0
            total += a * (1.0 + expect(child))
        return total

    return expect(())


def _all_trees(n: int, widths: list[int]) -> set[frozenset[Choice]]:
    """Every prefix-closed tree with contiguous sibling ranks, n drafts, width[d] ranks at depth d+1."""
    trees: set[frozenset[Choice]] = {frozenset()}
    for _ in range(n):
        grown = set()
        for t in trees:
            for parent in [(), *t]:
                d = len(parent)
                if d >= len(widths):
                    continue
                r = sum(1 for c in t if len(c) == d + 1 and c[:d] == parent)
                if r < widths[d]:
                    grown.add(t | {parent + (r,)})
        trees = grown
    return trees


@pytest.mark.parametrize("name", ["chain", "cpu_6", "cpu_9", "mc_sim_7b_63", "naive_extend_57"])
def test_expected_accepted_matches_exact_recursion(name: str) -> None:
    choices = [tuple(c) for c in STATIC_TREES[name]]
    assert expected_accepted(choices, RATES) == pytest.approx(_exact_expected(choices, RATES), abs=1e-12)


def test_expected_accepted_small_case_by_hand() -> None:
    # root -> [0] (0.5) -> [0, 0] (0.5 * 0.6); [1] (0.2): 0.5 + 0.3 + 0.2
    assert expected_accepted([(0,), (1,), (0, 0)], RATES) == pytest.approx(1.0)
    # ranks and depths the rates do not cover are never accepted
    assert expected_accepted([(0,), (1,), (2,), (3,)], RATES) == pytest.approx(0.8)


@pytest.mark.parametrize("n", range(1, 7))
def test_greedy_tree_is_prefix_closed_and_optimal(n: int) -> None:
    widths = [len(r) for r in RATES]
    greedy = greedy_trees(RATES, n)
    tree = greedy[n - 1]
    assert len(tree) == n
    canonical_choices([list(c) for c in tree])  # raises unless prefix-closed with contiguous ranks
    assert [set(t) for t in greedy[:-1]] == [set(tree[: i + 1]) for i in range(n - 1)]  # one node per step
    best = max(expected_accepted(list(t), RATES) for t in _all_trees(n, widths))
    assert expected_accepted(list(tree), RATES) == pytest.approx(best, abs=1e-12)


def _size_cost(kind: str, max_nodes: int = 80) -> CostModel:
    """A cost that depends on the node count only: linear or convex in n, no drafter, no overhead."""
    f = {"linear": lambda n: 1.0 + 0.35 * (n - 1), "convex": lambda n: 1.0 + 0.04 * (n - 1) ** 2}[kind]
    return CostModel(verify_ms=tuple(f(n) for n in range(1, max_nodes + 1)), begin_ms=(0.0,), feed_ms=(0.0,))


@pytest.mark.parametrize("kind", ["linear", "convex"])
def test_greedy_family_finds_the_brute_force_optimum(kind: str) -> None:
    cost = _size_cost(kind)
    widths = [len(r) for r in RATES]
    max_drafts = 6

    def value(t: list[Choice]) -> float:
        return (1 + expected_accepted(t, RATES)) / cost.round_ms(t, 1.0)

    brute = max(value(list(t)) for n in range(1, max_drafts + 1) for t in _all_trees(n, widths))
    greedy = max(value(list(t)) for t in greedy_trees(RATES, max_drafts))
    assert greedy == pytest.approx(brute, rel=1e-12)
    model = AcceptanceModel(rates=RATES, trials=(), accepts=(), rounds=1)
    choice = select_tree(model, cost, max_drafts=max_drafts)
    assert choice.best.tokens_per_second / 1000 >= brute * (1 - 1e-9)  # chains / named trees may only add


def _acceptance(rates: tuple[tuple[float, ...], ...]) -> AcceptanceModel:
    return AcceptanceModel(rates=rates, trials=(), accepts=(), rounds=100, method="lantern++")


DEEP_RATES = ((0.55, 0.2, 0.1, 0.05), (0.6, 0.2, 0.1), (0.6, 0.2, 0.1), (0.6, 0.2), (0.6, 0.2), (0.6,), (0.6,), (0.6,))


def test_choose_chain_when_verify_cost_is_steep() -> None:
    steep = CostModel(verify_ms=tuple(1.0 + 0.6 * (n - 1) for n in range(1, 65)), begin_ms=(0.05,),
                      feed_ms=(0.05,), overhead_ms=(0.05, 0.0, 0.0), ar_step_ms=1.0)
    choice = select_tree(_acceptance(DEEP_RATES), steep, method="lantern++")
    assert choice.best.spec.startswith("chain:")
    assert choice.best.num_nodes - 1 == choice.best.depth
    assert choice.best.speedup == pytest.approx(choice.best.tokens_per_round / choice.best.cost_units)
    assert choice.best.spec in choice.explanation and "would accept" in choice.explanation


def test_choose_wide_tree_when_verify_cost_is_flat() -> None:
    flat = CostModel(verify_ms=tuple(1.0 + 0.002 * (n - 1) for n in range(1, 65)), begin_ms=(0.05,),
                     feed_ms=(0.05,), overhead_ms=(0.05, 0.01, 0.0), ar_step_ms=1.0)
    choice = select_tree(_acceptance(DEEP_RATES), flat, method="lantern++")
    best = choice.best
    assert best.num_nodes - 1 > 2 * best.depth  # many more nodes than levels: a wide tree
    assert best.tokens_per_round > max(c.tokens_per_round for c in choice.ranking if c.spec.startswith("chain:"))
    assert [c.tokens_per_second for c in choice.ranking[1:]] == sorted(
        (c.tokens_per_second for c in choice.ranking[1:]), reverse=True)
    # A grown ("auto") tree is no process-wide name: it runs through its config, which carries the shape.
    grown = next(c for c in choice.ranking if c.spec.startswith("static:auto_"))
    with pytest.raises(LanternError, match="unknown static tree"):
        TreeConfig.parse(grown.spec)
    tree = dataclasses.replace(choice, best=grown).tree
    assert isinstance(tree, TreeConfig) and f"static:{tree.name}" == grown.spec
    assert tree.choices == grown.choices and tree.num_nodes == grown.num_nodes
    resolved = MethodConfig.resolve("lantern++", tree=tree)
    assert resolved.tree == tree and resolved.to_dict()["tree"]["choices"] == [list(c) for c in grown.choices]


def test_falls_back_to_ar_when_speculation_loses() -> None:
    """Large batches make verify and drafting cost more than they save (rows x nodes): when even
    the best tree is predicted slower than AR, --tree auto answers plain AR (tree "ar"), and a
    drafter method resolved with it decodes as AR."""
    from lantern.methods import AR_FALLBACK_TREE

    busy = CostModel(verify_ms=tuple(1.0 + 0.9 * (n - 1) for n in range(1, 65)), begin_ms=(0.6,),
                     feed_ms=(0.6,), overhead_ms=(0.3, 0.0, 0.0), ar_step_ms=1.0)
    choice = select_tree(_acceptance(DEEP_RATES), busy, method="lantern++")
    assert choice.best.speedup < 1.0 and choice.falls_back_to_ar
    assert choice.tree_spec == AR_FALLBACK_TREE == choice.tree
    assert choice.explanation.startswith("plain AR")
    assert MethodConfig.resolve("lantern++", tree=choice.tree_spec).method == "ar"
    cheap = CostModel(verify_ms=tuple(1.0 + 0.1 * (n - 1) for n in range(1, 65)), begin_ms=(0.05,),
                      feed_ms=(0.05,), overhead_ms=(0.05, 0.0, 0.0), ar_step_ms=1.0)
    kept = select_tree(_acceptance(DEEP_RATES), cheap, method="lantern++")
    assert not kept.falls_back_to_ar and kept.tree_spec == kept.best.spec != AR_FALLBACK_TREE


def test_cost_model_counts_one_feed_per_expanded_level() -> None:
    cost = CostModel(verify_ms=(1.0, 2.0, 3.0), begin_ms=(10.0, 20.0), feed_ms=(100.0, 200.0, 300.0),
                     overhead_ms=(1000.0, 10000.0, 100000.0))
    # cpu_6: depth 4; nodes with children per depth 0..3 = [1, 2, 1, 1] -> feeds over 2, 1, 1 nodes
    choices = STATIC_TREES["cpu_6"]
    assert level_widths(choices) == ([2, 2, 1, 1], [1, 2, 1, 1])
    verify = 3.0 + 4 * 1.0  # 7 nodes: linear extrapolation of the last slope
    expected = verify + 20.0 + (200.0 + 100.0 + 100.0) + 1000.0 + 4 * 10000.0 + 7 * 100000.0
    assert cost.round_ms(choices, 2.0) == pytest.approx(expected)
    assert cost.round_ms([[0]], 1.0) == pytest.approx(2.0 + 10.0 + 1000.0 + 10000.0 + 2 * 100000.0)


def test_interpolate_and_monotone_fit() -> None:
    assert interpolate([1, 3, 5], [1.0, 3.0, 4.0], 7) == (1.0, 2.0, 3.0, 3.5, 4.0, 4.5, 5.0)
    assert non_decreasing([1.0, 3.0, 2.0, 4.0]) == (1.0, 2.5, 2.5, 4.0)


# ---- calibration ------------------------------------------------------------------------------


def test_probe_choices_and_trees_of_any_shape() -> None:
    assert probe_choices([3, 2, 1]) == [[0], [1], [2], [0, 0], [0, 1], [0, 0, 0]]
    tree = TreeConfig.from_choices([[0], [1], [0, 0]], prefix="auto")
    assert TreeConfig.from_choices([[1], [0, 0], [0]], prefix="auto") == tree  # same shape, same tree
    assert tree.name.startswith("auto_") and tree.num_nodes == 4 and tree.max_depth == 2
    assert TreeConfig.from_choices([[0], [1], [1, 0]], prefix="auto").name != tree.name  # another shape
    with pytest.raises(LanternError, match="unknown static tree"):  # no registry: the name alone is not a tree
        TreeConfig.parse(f"static:{tree.name}")
    with pytest.raises(TypeError):  # and the built-in table cannot be extended
        STATIC_TREES[tree.name] = [[0]]  # type: ignore[index]
    with pytest.raises(LanternError, match="contiguous"):
        TreeConfig.from_choices([[0], [2]])


def test_trials_and_rates_from_records() -> None:
    probe = probe_choices([3, 2])  # [0] [1] [2] [0,0] [0,1]
    records = [
        RoundRecord((0, 1), depth_cap=5),  # d1: 3 trials, rank 0; d2: 2 trials, rank 1
        RoundRecord((2,), depth_cap=5),  # d1: rank 2; [2] has no children in the probe
        RoundRecord((), depth_cap=5),  # d1: nothing accepted
        RoundRecord((0,), depth_cap=1),  # d1: rank 0; depth 2 is beyond the image
    ]
    trials, accepts = count_trials(records, probe)
    assert trials == [[4, 4, 4], [1, 1]]
    assert accepts == [[2, 0, 1], [0, 1]]
    rates = estimate_rates(trials, accepts, prior_strength=0.0)
    # d1 raw (0.5, 0, 0.25) is not non-increasing: ranks 1 and 2 are pooled
    assert rates[0] == pytest.approx((0.5, 0.125, 0.125))
    assert rates[1] == pytest.approx((0.5, 0.5))  # raw (0, 1) pooled
    with pytest.raises(LanternError, match="not a path of the probe"):
        count_trials([RoundRecord((1, 0), 5)], probe)


@pytest.mark.parametrize(("temperature", "cfg_scale"), [(0.0, 1.0), (1.0, 3.0)])
def test_oracle_drafter_rank0_always_accepted(temperature: float, cfg_scale: float) -> None:
    """The target as its own drafter: greedy drafts are the target's argmax, sampled drafts come
    from q = p, so the rank-0 child is accepted at every depth (up to float rounding)."""
    model = tiny_llamagen(seed=3)
    sampling = SamplingConfig(temperature=temperature, top_k=50 if temperature else 0, cfg_scale=cfg_scale)
    tree, probe = probe_tree(model.config.block_size, widths=(3, 2, 2, 1))
    labels = torch.tensor([1, 4])
    drafter = make_oracle_drafter(model, labels, sampling, tree)
    target = LlamaGenTarget(model, sampling, max_tree_nodes=drafter.num_nodes)
    gens = None if sampling.greedy else make_generators([5, 6])
    records, out = record_rounds(target, drafter, labels, gens)
    n = model.config.block_size
    assert len(records) == int((out.stats.target_forwards - 1).sum())  # one record per row and round
    assert sum(len(r.ranks) + 1 for r in records) == 2 * (n - 1)  # every generated token accounted for
    model_ = AcceptanceModel.from_records(records, probe)
    if sampling.greedy:  # the argmax path is drafted at every level, to the depth cap
        assert all(r.ranks == (0,) * min(4, r.depth_cap) for r in records)
    for d, level in enumerate(model_.rates):
        assert model_.trials[d][0] > 0
        assert level[0] > 0.97, (d, level)


@pytest.fixture(scope="module")
def random_stack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_stack(tmp_path_factory.mktemp("stack") / "random", seed=2)


@pytest.mark.slow
def test_calibration_predicts_its_own_probe_run(random_stack: Path) -> None:
    """calibrate() end to end (the EAGLE drafter, the method's relaxed rule): the model's predicted
    tokens per round for the probe tree agree with what the probe run measured."""
    stack = load_stack(random_stack)
    sampling = SamplingConfig(temperature=1.0, top_k=8, cfg_scale=2.0)
    model = calibrate(stack, "lantern", sampling, labels=[0, 1, 2], seed=3)
    assert model.rounds > 0 and model.method == "lantern"
    assert all(0.0 <= a <= 1.0 for level in model.rates for a in level)
    assert all(sum(level) <= 1.0 + 1e-9 for level in model.rates)
    predicted = model.expected_tokens(model.probe)
    assert predicted > 1.3  # LANTERN relaxation gets drafts of even a random drafter accepted
    assert predicted == pytest.approx(model.measured_tokens_per_round, abs=0.05)
    again = calibrate(stack, "lantern", sampling, labels=[0, 1, 2], seed=3)
    assert again == model  # fixed seeds: calibration is reproducible


def test_calibration_refuses_methods_without_a_tree(random_stack: Path) -> None:
    stack = load_stack(random_stack)
    with pytest.raises(LanternError, match="--tree auto needs a speculative --method"):
        calibrate(stack, "ar", SamplingConfig())


# ---- CLI --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def random_profile(random_stack: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("profile")
    # float32: `generate`'s default precision (profile's default is auto, bf16 where native)
    rc = main(["profile", "--model", str(random_stack), "--quick", "--max-tokens", "12", "--repeats", "2",
               "--cfg-scale", "2", "--top-k", "8", "--dtype", "float32", "--out", str(out), "--no-progress"])
    assert rc == 0
    return out


@pytest.mark.slow
def test_profile_cli_writes_json_and_png(random_profile: Path, random_stack: Path) -> None:
    raw = json.loads((random_profile / "profile.json").read_text())
    for key in ("device", "torch_threads", "machine", "cpu", "date", "sampling", "batch_size", "streams"):
        assert key in raw, key
    assert raw["command"].startswith(f"lantern profile --model {random_stack} --quick")
    assert raw["device"] == "cpu" and raw["batch_size"] == 1 and raw["streams"] == 2
    assert raw["torch_threads"] == 1 and raw["sampling"]["cfg_scale"] == 2.0
    verify = raw["verify"]
    assert verify["tokens"] == [1, 2, 3, 4, 5, 6, 8, 10, 12]
    assert verify["ratio"][0] == 1.0
    assert len(verify["ms"]) == len(verify["ratio"]) == len(verify["tokens"])
    assert all(ms > 0 and math.isfinite(ms) for ms in verify["ms"])
    assert all(r > 0 for r in verify["ratio"])
    drafter = raw["drafter"]
    assert drafter["feed_nodes"][0] == 1 and all(ms > 0 for ms in drafter["feed_ms"] + drafter["begin_ms"])
    assert raw["ar_step_ms"] > 0
    assert set(raw["overhead"]) == {"exact", "lantern", "lantern++"}
    for fit in raw["overhead"].values():
        assert min(fit["fixed_ms"], fit["per_level_ms"], fit["per_node_ms"]) >= 0
        assert [r["tree"] for r in fit["runs"]] == ["chain:1", "chain:4", "chain:8", "star:8",
                                                    "static:reverse_balanced_25"]
    with Image.open(random_profile / "verify_cost.png") as im:
        assert im.format == "PNG" and im.width > 100
    assert not list(random_profile.glob(".*.tmp"))  # atomic writes leave no temporaries


@pytest.mark.slow
def test_generate_tree_auto_with_saved_profile(random_stack: Path, random_profile: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "gen"
    rc = main(["generate", "--model", str(random_stack), "--labels", "0,1", "--method", "lantern", "--tree", "auto",
               "--profile", str(random_profile / "profile.json"), "--cfg-scale", "2", "--top-k", "8",
               "--batch-size", "1", "--out", str(out), "--no-progress"])
    assert rc == 0
    run = json.loads((out / "run.json").read_text())
    auto = run["auto_tree"]
    assert auto["method"] == "lantern" and auto["tree"] and auto["explanation"]
    tree = run["method"]["tree"]
    if auto["tree"] == "ar":  # a random drafter rarely pays for itself: auto may fall back to plain AR
        assert run["method"]["method"] == "ar" and tree["kind"] == "none"
        assert auto["explanation"].startswith("plain AR")
    else:
        assert auto["tree"] == (f"chain:{tree['depth']}" if tree["kind"] == "chain" else f"static:{tree['name']}")
    canonical_choices(auto["choices"])  # raises unless a valid tree (the best one, even when AR wins)
    assert "--tree auto [lantern]" in capsys.readouterr().out
    assert len(list(out.glob("0*.png"))) == 2


@pytest.mark.slow
def test_profile_of_another_precision_is_refused(random_stack: Path, random_profile: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """bf16 and float32 forwards have different cost curves: a float32 profile must not pick a
    tree for a bf16 run."""
    rc = main(["generate", "--model", str(random_stack), "--labels", "0", "--method", "lantern", "--tree", "auto",
               "--profile", str(random_profile / "profile.json"), "--cfg-scale", "2", "--top-k", "8",
               "--dtype", "bfloat16", "--out", str(tmp_path / "g"), "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--profile was measured for a model of shape" in err and "'dtype': 'bfloat16'" in err


@pytest.mark.slow
def test_generate_tree_auto_on_digits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The whole chain on the embedded preset: quick profile, calibration, search, generation."""
    out = tmp_path / "digits"
    rc = main(["generate", "--model", "digits", "--labels", "3", "--method", "lantern++", "--tree", "auto",
               "--batch-size", "1", "--out", str(out), "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    run = json.loads((out / "run.json").read_text())
    assert f"--tree auto [lantern++]: {run['auto_tree']['explanation']}" in printed
    assert run["auto_tree"]["acceptance"]["rounds"] > 0
    assert (out / "0000_label3.png").is_file() and (out / "grid.png").is_file()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["generate", "--model", "digits", "--labels", "0", "--method", "ar", "--tree", "auto"], "--tree auto"),
        (["generate", "--model", "digits", "--labels", "0", "--method", "lantern++", "--profile", "p.json"],
         "--profile"),
        (["profile", "--model", "digits", "--max-tokens", "0"], "--max-tokens"),
        (["profile", "--model", "digits", "--batch-size", "0"], "--batch-size"),
        # the cost profile is eager: the flag made an eager profile look compiled (a probe, 2026-11-30)
        (["profile", "--model", "digits", "--compile"], "--compile is read by --trace only"),
        (["demo", "--methods", "ar", "--tree", "auto"], "--tree auto"),
    ],
)
def test_bad_input_exits_2_naming_the_argument(argv: list[str], needle: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lantern: error:") and needle in err
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.slow
def test_profile_for_another_model_is_refused(random_profile: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    for profile, needle in ((random_profile / "profile.json", "measured for a model of shape"), (bad, "version")):
        out = tmp_path / "out"
        rc = main(["generate", "--model", "digits", "--labels", "0", "--method", "lantern++", "--tree", "auto",
                   "--profile", str(profile), "--batch-size", "1", "--out", str(out), "--no-progress"])
        assert rc == 2
        err = capsys.readouterr().err
        assert "--profile" in err and needle in err
        assert not out.exists()  # a failing run creates no --out folder


@pytest.mark.slow
def test_profile_of_another_batch_names_the_rows_a_call_decodes(random_stack: Path, random_profile: Path,
                                                                tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Two images at the default --batch-size decode 2 rows a call, not the profile's 1: the refusal
    says where the 2 comes from and the two ways out (the same command at --batch-size 1 passes:
    test_generate_tree_auto_with_saved_profile)."""
    rc = main(["generate", "--model", str(random_stack), "--labels", "0,1", "--method", "lantern", "--tree", "auto",
               "--profile", str(random_profile / "profile.json"), "--cfg-scale", "2", "--top-k", "8",
               "--out", str(tmp_path / "g"), "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.strip() == ("lantern: error: --profile was measured at batch size 1, and this run decodes 2 row(s) a "
                           "call (the smaller of --batch-size and the images): measure one with `lantern profile "
                           "--batch-size 2`, or pass --batch-size 1 with at least as many images"), err
    assert not (tmp_path / "g").exists()


def _edited(profile: dict, dotted: str, value: object) -> dict:
    edited = json.loads(json.dumps(profile))
    *parents, last = dotted.split(".")
    node = edited
    for key in parents:
        node = node[key]
    node[last] = value
    return edited


@pytest.mark.parametrize(("dotted", "value", "needle"), [
    ("verify.ms", [1.0, 2.0, 3.0], "verify.tokens and verify.ms must be as long, got 64 and 3"),
    ("verify.ms", "x", "verify.ms must be a non-empty list of finite times >= 0 (ms), got 'x'"),
    ("drafter.feed_nodes", [1, "2"], "drafter.feed_nodes must be a non-empty list of integers >= 1, got [1, '2']"),
    ("ar_step_ms", -1, "ar_step_ms must be a finite time > 0, got -1"),
    ("batch_size", 0, "batch_size must be an integer >= 1, got 0"),
    ("streams", 3, "streams must be 1 or 2, got 3"),
    ("verify.tokens", list(range(2, 66)), "the verify curve must start at 1 token (verify.tokens)"),
    ("overhead.lantern", {"fixed_ms": 1.0}, "missing field overhead.lantern.per_level_ms"),
])
def test_a_hand_edited_profile_names_its_field(dotted: str, value: object, needle: str) -> None:
    """A probe (2026-11-29): verify.ms cut to 3 values was refused for "must start at 1 token";
    "x" as "missing or bad field could not convert string to float"; a negative AR step was
    accepted, and a batch_size of 0 led to the advice "pass --batch-size 0"."""
    from lantern.autotree.profile import DeviceProfile

    saved = json.loads((Path(__file__).parents[1] / "benchmarks/results/profile-digits/profile.json").read_text())
    assert DeviceProfile.from_dict(saved, "p").meta["batch_size"] == 1  # power: the saved profile reads
    assert len(saved["verify"]["tokens"]) == 64
    with pytest.raises(LanternError) as refused:
        DeviceProfile.from_dict(_edited(saved, dotted, value), "p")
    assert str(refused.value) == f"p: {needle}"
