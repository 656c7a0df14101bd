"""``--compile`` on the Chameleon family (Anole, Lumina-mGPT, Janus, Emu3): one compiled region per round.

The adapter's compiled forward has static shapes: it attends over the whole cache (masked), makes
room for a fixed number of new-line shadows (Lumina-mGPT and Emu3 insert a row-end token the loop
never sees) and pads prompt contexts to the prompt width. These tests hold it to what the LlamaGen round
is held to (tests/test_round_graph.py): every round traces as one graph with no break, a decode
compiles once and never again across rounds, prompt lengths and batches, and the compiled round
decodes exactly what the eager round decodes. Tracing tests use dynamo's ``eager`` backend (the
``eager_backend`` fixture); the inductor tests check the generated kernels, greedily against AR.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

import lantern
from lantern.api import Pipeline
from lantern.cli.main import main
from lantern.decoding import compiling, loop
from lantern.decoding.config import SamplingConfig
from lantern.decoding.sampling import make_generators
from lantern.methods import MethodConfig
from lantern.run import PreparedMethod, prepare_method
from lantern.testing import make_tiny_chameleon_folder, make_tiny_emu3_folder, make_tiny_janus_folder

pytest.importorskip("transformers")
pytest.importorskip("yaml")

# method -> MethodConfig.resolve keyword arguments, sized for the 4 x 4 codes of the tiny folders
# (Lumina-mGPT layout: a row-end token after every 4 codes, so every window and tree crosses one).
METHODS: dict[str, dict[str, Any]] = {
    "ar": {},
    "sd": {"tree": "chain:3"},
    "lantern": {},  # EAGLE-2 dynamic tree, relaxed
    "lantern++": {},  # static tree, relaxed
    "sjd-coupled": {"sjd_window": 4},
    "pjd": {"pjd_window": 2, "pjd_context": 2},
}
EAGLE = {"sd", "lantern", "lantern++"}  # the methods with a drafter model
SAMPLED = SamplingConfig(temperature=1.0, top_k=8, cfg_scale=3.0)
GREEDY = SamplingConfig(temperature=0.0, cfg_scale=3.0)
# Prompts of 1 to 8 words (context widths 8 to 15 tokens), all padded to the prompt width: one compiled round
PROMPTS = ["a red car", "a cat", "a red car on the beach with blue sky"]
OTHER_PROMPTS = ["a dog in snow", "mountains", "a painting of a house on the beach"]


@pytest.fixture(scope="module")
def lumina(tmp_path_factory: pytest.TempPathFactory) -> Pipeline:
    folder = make_tiny_chameleon_folder(tmp_path_factory.mktemp("lumina") / "model")
    return lantern.load(folder, drafter=folder / "drafter", image_size=64)


@pytest.fixture(scope="module")
def released_drafter(lumina: Pipeline, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A drafter folder for the tiny Lumina-mGPT model in the format of LANTERN's released drafters."""
    from lantern.models.chameleon_drafter import save_released_drafter
    from lantern.testing import tiny_released_drafter

    return save_released_drafter(tiny_released_drafter(lumina.stack.model, "lumina-mgpt"),
                                 tmp_path_factory.mktemp("released") / "drafter")


@pytest.fixture(scope="module")
def released(lumina: Pipeline, released_drafter: Path) -> Pipeline:
    return lantern.load(lumina.stack.root, drafter=released_drafter, image_size=64)


def _method(name: str) -> MethodConfig:
    return MethodConfig.resolve(name, **METHODS[name])


def _prepare(pipe: Pipeline, name: str, sampling: SamplingConfig, compile: str | None = None) -> PreparedMethod:
    return prepare_method(pipe.stack, _method(name), sampling, pipe.parts, compile=compile)


def _run(prepared: PreparedMethod, prompts: list[str], seeds: list[int]) -> loop.GenerationOutput:
    conditions = prepared.stack.encode(prompts)
    return prepared.generate(conditions.cond, make_generators(seeds), cond_mask=conditions.mask)


@pytest.mark.parametrize("name", list(METHODS))
def test_compiled_round_never_recompiles(lumina: Pipeline, name: str, eager_backend: list[int]) -> None:
    """A decode compiles its round once, on a Lumina-mGPT layout, as one graph (``fullgraph=True``:
    a graph break, such as an ``int(...)`` or ``bool(...)`` of a tensor, the eager adapter's host
    reads, is an error) that holds the forward; no recompilation across rounds (rows accept
    different numbers of codes and cross their row ends at different rounds), nor for other
    prompts of other lengths and other seeds. One region call per round; the codes equal the eager
    decode's. Inductor's kernels are the subject of test_inductor_compiled_greedy_equals_eager."""
    eager = _prepare(lumina, name, SAMPLED)
    compiled = _prepare(lumina, name, SAMPLED, compile="default")
    # An EAGLE drafter also absorbs the image prefix's features in the prefill (the Lumina layout's
    # 3 tokens): one more region, compiled on its own, called once per decode.
    prefill = 1 if name in EAGLE else 0
    before, calls = counters["stats"]["unique_graphs"], compiling.region_calls
    lines: list[str] = []
    with compiling.announce_compiles(lines.append):
        first = _run(compiled, PROMPTS, [1, 2, 3])
    assert [line.split(" (")[0] for line in lines[::2]] == (["compiling the context step"] if prefill else []) + [
        "compiling the decoding round"]  # each region's first call, named
    assert counters["stats"]["unique_graphs"] == before + 1 + prefill
    assert len(eager_backend) == 1 + prefill and eager_backend[-1] > 50  # the round's graph holds the forward
    assert compiling.region_calls - calls == first.stats.steps + prefill  # one region per round, nothing else
    second = _run(compiled, OTHER_PROMPTS, [7, 8, 9])
    assert counters["stats"]["unique_graphs"] == before + 1 + prefill  # the same graphs: no recompilation
    assert torch.equal(first.codes, _run(eager, PROMPTS, [1, 2, 3]).codes)
    assert torch.equal(second.codes, _run(eager, OTHER_PROMPTS, [7, 8, 9]).codes)
    assert torch.equal(first.stats.target_forwards, _run(eager, PROMPTS, [1, 2, 3]).stats.target_forwards)
    if name != "ar":  # rows really took different numbers of codes per round (padding was exercised)
        assert any(len(set(step.tolist())) > 1 for step in first.stats.tokens_per_step)


@pytest.mark.parametrize("name", ["lantern++", "sjd-coupled", "pjd"])
def test_compiled_rows_independent_of_batch(lumina: Pipeline, name: str, eager_backend: list[int]) -> None:
    """A row's sampled codes are the same alone and in a batch of three prompts of other lengths
    (other left padding, rows crossing row ends at other rounds), compiled."""
    prepared = _prepare(lumina, name, SAMPLED, compile="default")
    batch = _run(prepared, PROMPTS, [11, 12, 13])
    for i, prompt in enumerate(PROMPTS):
        alone = _run(prepared, [prompt], [11 + i])
        assert torch.equal(batch.codes[i], alone.codes[0]), i


@pytest.mark.parametrize("name,reference", [
    ("sjd-coupled", "ar"), pytest.param("sd", "ar", marks=pytest.mark.slow),
    pytest.param("pjd", "pjd", marks=pytest.mark.slow),  # rows decoded in parallel: lossy, so its own eager codes
])
def test_inductor_compiled_greedy_equals_eager(lumina: Pipeline, name: str, reference: str) -> None:
    """Inductor's kernels (not only dynamo's trace), greedy, on the Lumina-mGPT layout (row-end
    shadows in the round): exact speculative decoding compiled gives greedy AR's codes token for
    token; PJD compiled gives eager PJD's."""
    expected = _run(_prepare(lumina, reference, GREEDY), PROMPTS, [0, 0, 0])
    out = _run(_prepare(lumina, name, GREEDY, compile="default"), PROMPTS, [0, 0, 0])
    assert torch.equal(out.codes, expected.codes)
    assert out.stats.mean_accepted > 1.0  # drafts were accepted: the speculative path ran


@pytest.mark.parametrize("family", ["janus", "emu3"])
def test_janus_and_emu3_compile_one_graph_with_the_eager_codes(family: str, tmp_path: Path,
                                                                eager_backend: list[int]) -> None:
    """Janus (no row-end token) and Emu3 (a row-end token, its own guidance rows and guided
    log-probs) compile the same way: one graph for two batches of other prompt lengths, the eager
    codes, greedy (AR's) and sampled."""
    make = make_tiny_janus_folder if family == "janus" else make_tiny_emu3_folder
    pipe = lantern.load(make(tmp_path / family))
    before = counters["stats"]["unique_graphs"]
    for sampling, seeds in ((SAMPLED, [1, 2, 3]), (GREEDY, [0, 0, 0])):
        compiled = _prepare(pipe, "sjd-coupled", sampling, compile="default")
        for prompts in (PROMPTS, OTHER_PROMPTS):
            out = _run(compiled, prompts, seeds)
            assert torch.equal(out.codes, _run(_prepare(pipe, "sjd-coupled", sampling), prompts, seeds).codes)
    assert counters["stats"]["unique_graphs"] == before + 2  # one graph per sampling setting
    greedy_ar = _run(_prepare(pipe, "ar", GREEDY), PROMPTS, [0, 0, 0])
    assert torch.equal(_run(_prepare(pipe, "sjd-coupled", GREEDY, compile="default"), PROMPTS, [0, 0, 0]).codes,
                       greedy_ar.codes)


def test_cli_compile_on_a_chameleon_folder(lumina: Pipeline, tmp_path: Path, eager_backend: list[int],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """``lantern generate --compile`` on a Lumina-mGPT folder writes the eager run's codes; a
    released-layout drafter, whose backend reads the model sequence between rounds, is refused with
    one line before anything is written."""
    folder = lumina.stack.root
    common = ["generate", "--model", str(folder), "--prompt", "a red car", "--prompt", "a cat", "--image-size", "64",
              "--method", "sjd-coupled", "--sjd-window", "4", "--seed", "5", "--no-progress"]
    assert main([*common, "--out", str(tmp_path / "eager")]) == 0
    assert main([*common, "--out", str(tmp_path / "compiled"), "--compile", "default"]) == 0
    assert (np.load(tmp_path / "compiled" / "codes.npy") == np.load(tmp_path / "eager" / "codes.npy")).all()
    # The first compiled calls' seconds are reported as compiling, apart from decoding (they were counted as
    # decoding); an eager run compiles nothing, nor does a pipeline's second call.
    stats = {name: json.loads((tmp_path / name / "run.json").read_text())["stats"] for name in ("eager", "compiled")}
    assert stats["eager"]["compile_seconds"] == 0.0
    assert 0.0 < stats["compiled"]["compile_seconds"] <= stats["compiled"]["wall_seconds"]
    printed = capsys.readouterr().out
    assert f"s decoding ({stats['compiled']['compile_seconds']:.2f} s of it compiling)" in printed
    pipe = lantern.load(folder, compile="default", image_size=64)
    first, second = (pipe(prompts=["a cat"], method="sjd-coupled", sjd_window=4, seed=s) for s in (1, 2))
    assert 0.0 < first.stats["compile_seconds"] <= first.stats["wall_seconds"]
    assert second.stats["compile_seconds"] == 0.0


def test_cli_compile_with_a_released_drafter(lumina: Pipeline, released_drafter: Path, tmp_path: Path,
                                            eager_backend: list[int]) -> None:
    """``lantern generate --compile`` with a drafter in the format of LANTERN's released Chameleon
    drafters writes the eager run's codes (LANTERN++, sampled)."""
    common = ["generate", "--model", str(lumina.stack.root), "--drafter", str(released_drafter), "--prompt",
              "a red car", "--prompt", "a cat", "--image-size", "64", "--method", "lantern++", "--seed", "5",
              "--no-progress"]
    assert main([*common, "--out", str(tmp_path / "eager")]) == 0
    assert main([*common, "--out", str(tmp_path / "compiled"), "--compile", "default"]) == 0
    assert (np.load(tmp_path / "compiled" / "codes.npy") == np.load(tmp_path / "eager" / "codes.npy")).all()


@pytest.mark.parametrize("name", ["sd", "lantern", "lantern++"])
def test_released_drafter_rounds_compile_to_one_graph(released: Pipeline, name: str,
                                                      eager_backend: list[int]) -> None:
    """LANTERN's released drafter format, whose backend reads the whole model sequence (the
    prompt, every code and new-line token): a chain, EAGLE-2's dynamic tree and LANTERN++'s static
    tree each compile their round once, as one graph that holds both forwards; no recompilation
    for other prompts and seeds, or a second decode; one region call per round and none besides
    (the prompt's entries are absorbed at the start, eagerly); the eager decode's codes and
    target forwards, sampled."""
    eager = _prepare(released, name, SAMPLED)
    compiled = _prepare(released, name, SAMPLED, compile="default")
    before, calls = counters["stats"]["unique_graphs"], compiling.region_calls
    first = _run(compiled, PROMPTS, [1, 2, 3])
    assert counters["stats"]["unique_graphs"] == before + 1
    assert len(eager_backend) == 1 and eager_backend[-1] > 100  # the target's forward and the drafter's
    assert compiling.region_calls - calls == first.stats.steps
    second, again = _run(compiled, OTHER_PROMPTS, [7, 8, 9]), _run(compiled, PROMPTS, [1, 2, 3])
    assert counters["stats"]["unique_graphs"] == before + 1
    reference = _run(eager, PROMPTS, [1, 2, 3])
    assert torch.equal(first.codes, reference.codes) and torch.equal(again.codes, reference.codes)
    assert torch.equal(second.codes, _run(eager, OTHER_PROMPTS, [7, 8, 9]).codes)
    assert torch.equal(first.stats.target_forwards, reference.stats.target_forwards)
    assert first.stats.mean_accepted > 1.0 and any(len(set(step.tolist())) > 1 for step in first.stats.tokens_per_step)


@pytest.mark.slow
def test_inductor_compiled_released_drafter_greedy_equals_ar(released: Pipeline) -> None:
    """Inductor's kernels with the released drafter format on the Lumina-mGPT layout (row-end steps
    in the drafter and shadows in the target): exact speculative decoding gives greedy AR's codes."""
    expected = _run(_prepare(released, "ar", GREEDY), PROMPTS, [0, 0, 0])
    out = _run(_prepare(released, "sd", GREEDY, compile="default"), PROMPTS, [0, 0, 0])
    assert torch.equal(out.codes, expected.codes) and out.stats.mean_accepted > 1.0


def test_profile_trace_counts_one_region_per_compiled_round(tmp_path: Path, eager_backend: list[int]) -> None:
    """``lantern profile --trace --compile`` on an Emu3 folder (row-end tokens, guidance rows of its
    own): one compiled-region call per round and no host read inside it, where the eager verify
    reads the device once (the longest row, the least padding and the most row ends together)."""
    import json

    folder = make_tiny_emu3_folder(tmp_path / "emu3")
    methods = {}
    for mode in ("off", "default"):
        out = tmp_path / mode
        assert main(["profile", "--model", str(folder), "--trace", "ar,sjd-coupled/window=4", "--trace-images", "2",
                     "--batch-size", "2", "--compile", mode, "--out", str(out), "--no-progress"]) == 0
        methods[mode] = {m["method"]: m for m in json.loads((out / "trace.json").read_text())["methods"]}
    for name in ("ar", "sjd-coupled/window=4"):
        eager, compiled = methods["off"][name], methods["default"][name]
        assert eager["regions_per_round"] == 0 and eager["syncs"]["verify"] == 1
        assert compiled["regions_per_round"] == 1.0
        # none in the round: what is left ("other") is the loop's end test and the prefill's checks
        assert all(v == 0 for phase, v in compiled["syncs"].items() if phase != "other"), compiled["syncs"]
        assert compiled["rounds"] == eager["rounds"]


def test_cache_bytes_is_what_a_start_allocates() -> None:
    """The memory check's figure for a batch is the cache ``start`` allocates, eager and compiled:
    prompts padded to the prompt width, so it grows with the width and not with the prompts."""
    from conftest import CHAMELEON_PROMPTS, LUMINA, chameleon_lm

    from lantern.targets.chameleon import ChameleonTarget, encode_prompts

    ids, mask = encode_prompts(CHAMELEON_PROMPTS, LUMINA)
    for width in (ids.shape[1], 64):
        targets = [ChameleonTarget(chameleon_lm(), LUMINA, SAMPLED, max_tree_nodes=5, compile=mode, prompt_width=width)
                   for mode in (None, "default")]
        allocated = []
        for target in targets:
            target.start(ids, mask)
            assert target.cache is not None
            allocated.append(target.cache.k.nbytes + target.cache.v.nbytes)
        assert targets[0].cache_bytes(len(CHAMELEON_PROMPTS)) == allocated[0] == allocated[1]
    narrow, wide = (ChameleonTarget(chameleon_lm(), LUMINA, SAMPLED, max_tree_nodes=5, prompt_width=w).cache_bytes(1)
                    for w in (ids.shape[1], 64))
    assert wide > narrow


def test_serve_compiled_emu3_gives_the_eager_apis_codes(tmp_path: Path, eager_backend: list[int]) -> None:
    """``lantern serve --compile`` on an Emu3 folder (its row-end token in every compiled round): a
    request's codes are the eager API's."""
    from conftest import assert_serve_gives_the_apis_codes

    folder = make_tiny_emu3_folder(tmp_path / "emu3")
    assert_serve_gives_the_apis_codes(folder, {"method": "sjd-coupled", "sjd_window": 4}, compile="default")


@pytest.mark.parametrize("width", [1, 2, 3, 4, 7, 48, 90])
def test_new_line_slots_hold_every_row_end_a_forward_can_meet(width: int) -> None:
    """The slots a static verify makes for new-line tokens (``new_line_slots`` of the tree's widest
    level and depth levels) hold every row end, at every position of the root in its image row:
    for the static trees, a chain, AR's root and random trees; and the bound is met (it is the
    count at some position), so it wastes nothing the tree's sizes could save."""
    from lantern.decoding.trees import chain_choices, static_tree, tree_from_parents
    from lantern.targets.chameleon import new_line_slots

    gen = torch.Generator().manual_seed(width)
    parents = [static_tree(name).parents for name in ("naive_extend_57", "mc_sim_7b_63")]
    parents += [static_tree(chain_choices(6)).parents, torch.tensor([-1])]
    for t in (5, 17, 40):  # random trees: each node's parent is an earlier node
        parents.append(torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, t)]))
    for p in parents:
        tree = tree_from_parents(p[None])
        depth, t = tree.depth[0], tree.num_nodes
        slots = new_line_slots(t, tree.widest, tree.max_depth + 1, width)
        counts = [int(((root + depth + 1) % width == 0).sum()) for root in range(width)]
        assert max(counts) <= slots, (t, width)
        if tree.max_depth + 1 <= width:
            assert max(counts) == slots  # one depth ends a row at a time: the widest level's


def test_the_default_trees_verify_fewer_new_line_slots_than_their_nodes() -> None:
    """On Lumina-mGPT-768's 48 codes per row, a static verify of LANTERN++'s default tree
    (naive_extend_57: 58 nodes, 16 at its widest depth) carries 16 new-line slots, 74 tokens;
    the bound by leaves x ceil(T / width) made it 58, 116 tokens."""
    from lantern.decoding.trees import static_tree, tree_from_parents
    from lantern.methods import MethodConfig
    from lantern.targets.chameleon import new_line_slots

    tree_cfg = MethodConfig.resolve("lantern++").tree
    tree = tree_from_parents(static_tree(tree_cfg.name).parents[None])
    assert (tree_cfg.name, tree.num_nodes, tree.widest, tree.max_depth) == ("naive_extend_57", 58, 16, 5)
    assert new_line_slots(tree.num_nodes, tree.widest, tree.max_depth + 1, 48) == 16
