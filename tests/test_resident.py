"""A decode's state stays at the same addresses decode after decode (``lantern.decoding.resident``).

Under CUDA graphs a compiled round replays on fixed addresses: every tensor of its state is marked
static, and a marked tensor found elsewhere makes torch record the graph again. These tests walk
the state exactly as the round's fingerprint does (``compiling.state_fingerprint``: the tensors
``round_fn`` marks) and check, for every method and every model family, that from a pipeline's
second decode on nothing moves, within a decode or between decodes, and that nothing is carried
from one decode into the next (the third decode's codes equal a fresh pipeline's). They run eager:
the residents are the same code eager and compiled (tests/test_round_graph.py compiles the rounds
on the same state, decode after decode).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from torch import Tensor

import lantern
from lantern.decoding import compiling, loop, resident
from lantern.decoding.config import SamplingConfig
from lantern.decoding.sampling import make_generators
from lantern.methods import MethodConfig
from lantern.run import prepare_method
from lantern.targets.llamagen_stack import ModelStack, load_stack
from lantern.testing import make_random_stack, make_tiny_chameleon_folder, make_tiny_emu3_folder, make_tiny_janus_folder

SAMPLED = SamplingConfig(temperature=1.0, top_k=8, cfg_scale=2.0)
# method -> MethodConfig.resolve keyword arguments, sized for the 4 x 4 random stack: every drafter
# kind (EAGLE dynamic and static trees, chains, Jacobi windows, SJD-PAC's subtree, PJD's grid)
METHODS: dict[str, dict[str, Any]] = {
    "ar": {},
    "sd": {},
    "lantern": {},
    "lantern++": {},
    "sjd": {"sjd_window": 4},
    "sjd-coupled": {"sjd_window": 4},
    "sjd-coupled-lantern": {"sjd_window": 4},
    "sjd-pac": {"sjd_window": 4},
    "gsd": {"sjd_window": 4},
    "sjd-lantern-sv": {"sjd_window": 4},
    "pjd": {"pjd_window": 2, "pjd_context": 2},
}


Addresses = dict[str, tuple[int, int, tuple[int, ...]]]  # path -> (address, its storage's address, shape)


def _addresses(decode: loop.Decode) -> Addresses:
    """Every non-empty tensor of the round's state, as the round marks them."""
    slots: list[compiling.Slot] = []
    compiling.round_state_key(decode.state(), slots, loop.STATE_NAMES)
    return {path: (t.data_ptr(), t.untyped_storage().data_ptr(), tuple(t.shape)) for t, _, path in slots if t.numel()}


@pytest.fixture
def rounds(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Addresses]]:
    """The state's addresses at the start of every round, round after round (decodes one after another)."""
    seen: list[Addresses] = []
    original = loop.Decode.round

    def spy(self: loop.Decode, active: Tensor) -> tuple[Tensor, Tensor]:
        seen.append(_addresses(self))
        return original(self, active)

    monkeypatch.setattr(loop.Decode, "round", spy)
    yield seen


def _moved(before: Addresses, after: Addresses) -> list[str]:
    return [path for path, (address, _, _) in before.items() if path in after and after[path][0] != address]


def _check_stays(per_decode: list[list[Addresses]]) -> None:
    """Within each decode every round sees the state where its first round did, and the third
    decode sees it where the second did. (A value a round makes and reads within itself, such as a
    target's verify handing its row ends to its commit, appears after the first round and is not
    an input of any round: it is not compared.)"""
    for d, decode_rounds in enumerate(per_decode):
        for r, addresses in enumerate(decode_rounds):
            moved = _moved(decode_rounds[0], addresses)
            assert not moved, f"decode {d}, round {r}: state moved: {moved}"
    second, third = per_decode[1][0], per_decode[2][0]
    assert second.keys() == third.keys()
    moved = _moved(second, third)
    assert not moved, f"state tensors at new addresses in the third decode: {moved}"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> ModelStack:
    return load_stack(make_random_stack(tmp_path_factory.mktemp("stack") / "random", seed=3, grid=4, vocab=64))


def _method(name: str) -> MethodConfig:
    return MethodConfig.resolve(name, **METHODS[name])


@pytest.mark.parametrize("name", list(METHODS))
def test_every_methods_state_keeps_its_addresses(stack: ModelStack, name: str, rounds: list[Addresses]) -> None:
    """Three decodes of three rows on one prepared method (rows finish at different rounds): the
    state's addresses hold from the second decode on, and the third decode's codes and forwards
    equal those of a freshly prepared method (residents carry nothing over)."""
    prepared = prepare_method(stack, _method(name), SAMPLED)
    per_decode, outputs = [], []
    for d in range(3):
        rounds.clear()
        outputs.append(prepared.generate(torch.tensor([d, d + 1, d + 2]), make_generators([10 * d, 10 * d + 1, 7])))
        per_decode.append(list(rounds))
    _check_stays(per_decode)
    # The per-decode tensors now live in the pool's residents: the codes and the random streams at least.
    residents = prepared._caches.residents.values()
    kept = {r.untyped_storage().data_ptr() for known in residents for r in known.kept.values()}
    for path in ("codes", "rng.k0", "rng.drawn"):
        assert per_decode[2][0][path][1] in kept, path
    fresh = prepare_method(stack, _method(name), SAMPLED).generate(torch.tensor([2, 3, 4]),
                                                                   make_generators([20, 21, 7]))
    assert torch.equal(outputs[2].codes, fresh.codes)
    assert torch.equal(outputs[2].stats.target_forwards, fresh.stats.target_forwards)


def test_without_residents_the_state_moves(stack: ModelStack, rounds: list[Addresses],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Power of the checks above: with keep_resident doing nothing (the engine before it), the
    third decode finds state tensors at new addresses (codes, random streams, trees, counters)."""
    monkeypatch.setattr(loop, "keep_resident", lambda state, residents: None)
    prepared = prepare_method(stack, _method("sjd-coupled"), SAMPLED)
    per_decode = []
    for d in range(3):
        rounds.clear()
        prepared.generate(torch.tensor([d, d + 1]), make_generators([d, d + 1]))
        per_decode.append(list(rounds))
    with pytest.raises(AssertionError, match="new addresses in the third decode"):
        _check_stays(per_decode)


@pytest.mark.parametrize("family", ["chameleon", "chameleon-released", "janus", "emu3"])
def test_prompt_families_keep_their_addresses(family: str, tmp_path: Path, rounds: list[Addresses]) -> None:
    """The same on the Chameleon family (Lumina-mGPT layout: row-end tokens; its EAGLE drafter, and
    LANTERN's released drafter format, whose cache comes from the pipeline's pool), Janus and Emu3
    folders, with prompts and guidance rows, through ``lantern.load``."""
    make = {"janus": make_tiny_janus_folder, "emu3": make_tiny_emu3_folder}.get(family, make_tiny_chameleon_folder)
    folder = make(tmp_path / family)
    methods = ["ar", "sjd-coupled"] if family in ("janus", "emu3") else ["ar", "sjd-coupled", "lantern"]
    drafter = None
    if family == "chameleon-released":  # the folder's model (seed 0), a released-format drafter beside it
        from lantern.models.chameleon import ChameleonLM
        from lantern.models.chameleon_drafter import save_released_drafter
        from lantern.testing import tiny_chameleon, tiny_released_drafter

        drafter = tmp_path / "released"
        save_released_drafter(tiny_released_drafter(ChameleonLM(tiny_chameleon(seed=0))), drafter)
        methods = ["lantern"]
    pipe = lantern.load(folder, drafter)
    prompts = ["a red square", "a blue circle"]
    for method in methods:
        settings = {"sjd_window": 4} if method.startswith("sjd") else {}
        per_decode, outputs = [], []
        for d in range(3):
            rounds.clear()
            outputs.append(pipe(prompts=prompts, seed=d, method=method, **settings))
            per_decode.append(list(rounds))
        _check_stays(per_decode)
        fresh = lantern.load(folder, drafter)(prompts=prompts, seed=2, method=method, **settings)
        assert torch.equal(outputs[2].codes, fresh.codes), method
    if family == "chameleon-released":  # its cache is the pool's from the first decode (not copied every decode)
        assert per_decode[0][0]["drafter.backend.cache.k"][0] == per_decode[1][0]["drafter.backend.cache.k"][0]


@pytest.mark.parametrize("case", ["t2i", "deterministic", "token-budget"])
def test_other_targets_and_modes_keep_their_addresses(case: str, t2i_stack: Path, tmp_path: Path,
                                                      rounds: list[Addresses]) -> None:
    """LlamaGen text-to-image (T5 captions and their mask in the target), the batch-invariant
    layers (``deterministic=True``) and LANTERN's per-token budget (its own accounting state)."""
    if case == "t2i":
        pipe, conditions, settings = lantern.load(t2i_stack), {"prompts": ["a red car", "a dog"]}, {}
    else:
        folder = make_random_stack(tmp_path / "random", seed=3, grid=4, vocab=64)
        pipe = lantern.load(folder, deterministic=case == "deterministic")
        conditions = {"labels": [1, 2]}
        settings = {"lantern_budget": "token"} if case == "token-budget" else {}
    per_decode, outputs = [], []
    for d in range(3):
        rounds.clear()
        outputs.append(pipe(**conditions, seed=d, method="lantern", **settings))
        per_decode.append(list(rounds))
    _check_stays(per_decode)
    fresh = (lantern.load(t2i_stack) if case == "t2i" else lantern.load(folder, deterministic=case == "deterministic"))
    assert torch.equal(outputs[2].codes, fresh(**conditions, seed=2, method="lantern", **settings).codes)


# -- keep_resident on a state built by hand ---------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Frozen:
    index: Tensor


class Pair(NamedTuple):
    left: Tensor
    right: Tensor


class Holder:
    def __init__(self, base: Tensor, table: Tensor) -> None:
        self.row = base[0]  # two views of one storage
        self.col = base[:, 1]
        self.same = self.row  # one tensor found twice
        self.table = table  # shared by every decode (a proximity table): never copied
        self.frozen = Frozen(torch.arange(4) + int(base[0, 0]))
        self.pair = Pair(base.sum(0), torch.zeros(0))  # a NamedTuple, with an empty tensor


def _state(value: float, table: Tensor) -> list[object]:
    base = torch.full((3, 3), value)
    return [Holder(base, table), (torch.full((2,), value), 7), torch.full((5,), value)]


def _pointers(state: list[object]) -> list[int]:
    slots: list[compiling.Slot] = []
    compiling.round_state_key(state, slots)
    return [t.data_ptr() for t, _, _ in slots if t.numel()]


def test_keep_resident_moves_per_decode_storages_and_keeps_their_shape() -> None:
    table = torch.arange(6.0)
    residents: dict[object, resident.Residents] = {}
    first = _state(1.0, table)
    resident.keep_resident(first, residents)  # the first decode of this fingerprint: left as it is
    second = _state(2.0, table)
    originals = [t.clone() for t in (second[0].row, second[2])]  # type: ignore[attr-defined]
    resident.keep_resident(second, residents)
    third = _state(3.0, table)
    third_inputs = (third[0].row, third[2])  # type: ignore[attr-defined]
    resident.keep_resident(third, residents)
    assert _pointers(second) == _pointers(third) != _pointers(first)
    holder = third[0]
    assert isinstance(holder, Holder)
    assert holder.table is table  # the same storage every decode: not copied, not replaced
    assert len(next(iter(residents.values())).kept) == 5  # base, frozen.index, pair.left, the tuple's, the last
    assert holder.same is holder.row  # one tensor stays one tensor
    holder.row[1] = 9.0  # views of one storage stay views of one storage
    assert float(holder.col[0]) == 9.0 and float(holder.col[1]) == 3.0  # base[0, 1] is row[1] and col[0]
    assert torch.equal(holder.frozen.index, torch.arange(4) + 3)  # a frozen dataclass's field replaced
    assert isinstance(holder.pair, Pair) and torch.equal(holder.pair.left, torch.full((3,), 9.0))
    assert holder.pair.right.numel() == 0
    tup = third[1]
    assert isinstance(tup, tuple) and tup[1] == 7 and torch.equal(tup[0], torch.full((2,), 3.0))
    # The callers' tensors were read, never written: the second decode's own ones hold their values.
    assert torch.equal(third_inputs[0], torch.full((3,), 3.0)) and torch.equal(third_inputs[1], torch.full((5,), 3.0))
    assert torch.equal(originals[0], torch.full((3,), 2.0)) and torch.equal(originals[1], torch.full((5,), 2.0))


def test_keep_resident_keeps_what_kind_of_tensor_each_was() -> None:
    """A tensor made in inference mode (most of a decode's state) stays an inference tensor, one
    made outside it (a target's forward counter, made with the target) a plain one: dynamo guards
    on the difference, and a plain tensor may be updated in place outside inference mode."""
    residents: dict[object, resident.Residents] = {}

    def state() -> list[object]:
        plain = torch.zeros(2)
        with torch.inference_mode():
            return [plain, torch.zeros(3)]

    for _ in range(3):
        pinned = state()
        with torch.inference_mode():
            resident.keep_resident(pinned, residents)
    plain, inference = pinned
    assert isinstance(plain, Tensor) and isinstance(inference, Tensor)
    assert not plain.is_inference() and inference.is_inference()
    plain.add_(1)  # outside inference mode
    assert len(next(iter(residents.values())).kept) == 2


def test_keep_resident_keys_by_how_storages_are_shared() -> None:
    """Two states with the same shapes but another sharing of storages are another layout: their
    residents are kept apart (one view per storage could not stand for two storages)."""
    residents: dict[object, resident.Residents] = {}
    base = torch.zeros(4)
    resident.keep_resident([base[:2], base[2:]], residents)
    resident.keep_resident([torch.zeros(2), torch.zeros(2)], residents)
    assert len(residents) == 2
