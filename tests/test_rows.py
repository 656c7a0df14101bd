"""Continuous batching's engine side (lantern.decoding.rows): rows that join a running batch, leave
it, or move into a batch of another size give exactly the codes they give alone."""

from __future__ import annotations

import pytest
import torch
from conftest import drive_rounds

import lantern
from lantern.api import resolve_settings
from lantern.decoding.rng import RowRandom
from lantern.decoding.rows import movable
from lantern.errors import LanternError
from lantern.methods import method_names
from lantern.run import PreparedMethod, image_seed, prepare_method

pytestmark = pytest.mark.invariance

LABELS = [3, 1, 4, 1, 5, 9]
SEED = 7


@pytest.fixture(scope="module")
def pipe() -> lantern.Pipeline:
    return lantern.load("digits", deterministic=True)  # codes equal alone and in any batch, on any CPU


def _prepared(pipe: lantern.Pipeline, method: str) -> PreparedMethod:
    method_cfg, sampling = resolve_settings(pipe.stack, method)
    return prepare_method(pipe.stack, method_cfg, sampling)


def _batch(prepared: PreparedMethod, order: list[int]) -> dict[int, torch.Tensor]:
    """The images ``order`` decoded in one plain batch (row r: image ``order[r]``), by image."""
    codes = drive_rounds(prepared.start(prepared.stack.encode([LABELS[i] for i in order]),
                                        [image_seed(SEED, i) for i in order]))
    return {i: codes[r] for r, i in enumerate(order)}


def _joined(prepared: PreparedMethod) -> dict[int, torch.Tensor]:
    """The six images decoded by rows that join, leave and move, by image: a 3-row batch starts
    with images 0 and 1 (row 2 free); image 2 joins after 2 rounds, images 3 and 4 join together
    (prefilled as one batch of 2) when rows free up, and then the running rows move into a 4-row
    batch where image 5 joins."""
    stack, n_total = prepared.stack, prepared.stack.num_tokens
    seeds = [image_seed(SEED, i) for i in range(len(LABELS))]
    got: dict[int, torch.Tensor] = {}
    with torch.inference_mode():
        batch = prepared.start(stack.encode([LABELS[0], LABELS[1], LABELS[0]]), [seeds[0], seeds[1], 0])
        assert movable(batch.target, batch.drafter)
        batch.finish_rows(torch.tensor([2]))
        owner: list[int | None] = [0, 1, None]
        drive_rounds(batch, rounds=2)
        batch.take_rows(prepared.start(stack.encode([LABELS[2]]), [seeds[2]], eager=True), torch.tensor([2]))
        owner[2] = 2
        waiting = [3, 4]
        while any(o is not None for o in owner):
            drive_rounds(batch, rounds=1)
            for r, o in enumerate(owner):
                if o is not None and int(batch.n[r]) >= n_total:
                    got[o], owner[r] = batch.codes[r, :n_total].clone(), None
            free = [r for r, o in enumerate(owner) if o is None]
            if waiting and len(free) >= 2:  # two join at once, prefilled together
                joining = prepared.start(stack.encode([LABELS[i] for i in waiting]), [seeds[i] for i in waiting],
                                         eager=True)
                batch.take_rows(joining, torch.tensor(free[:2]))
                owner[free[0]], owner[free[1]], waiting = waiting[0], waiting[1], []
                break
        drive_rounds(batch, rounds=1)
        # Move the running rows into a larger batch, where image 5 joins.
        big = prepared.start(stack.encode([LABELS[0]] * 4), [0] * 4)
        big.finish_rows(torch.arange(4))
        running = [r for r, o in enumerate(owner) if o is not None]
        big.take_rows(batch, torch.arange(len(running)), torch.tensor(running))
        owner = [owner[r] for r in running] + [None] * (4 - len(running))
        assert len(running) < 4
        big.take_rows(prepared.start(stack.encode([LABELS[5]]), [seeds[5]], eager=True), torch.tensor([len(running)]))
        owner[len(running)] = 5
        codes = drive_rounds(big)
    for r, o in enumerate(owner):
        if o is not None:
            got[o] = codes[r]
    assert sorted(got) == list(range(len(LABELS)))
    return got


@pytest.mark.parametrize("method", method_names(lambda r: r.movable_rows))
def test_rows_joining_leaving_and_moving_give_their_alone_codes(pipe: lantern.Pipeline, method: str) -> None:
    """Every image that joins, leaves and moves (:func:`_joined`) equals its codes in one plain
    batch of the six (in reverse order), and image 3 (joined, then moved) its decode alone too:
    plain batches give every image its alone codes (tests/test_batch_invariance.py), and each
    alone decode costs what the batch of six costs (deterministic mode pads a call to 8 rows)."""
    prepared = _prepared(pipe, method)
    plain = _batch(prepared, list(range(len(LABELS)))[::-1])
    assert torch.equal(plain[3], _batch(prepared, [3])[3]), f"image 3: one batch differs from alone ({method})"
    got = _joined(prepared)
    for i in range(len(LABELS)):
        assert torch.equal(got[i], plain[i]), f"image {i} changed by joining / moving ({method})"
    # The comparison can tell images apart (images 1 and 3: the same label, other image seeds).
    assert LABELS[1] == LABELS[3] and not torch.equal(plain[1], plain[3])


def test_the_rows_check_sees_a_copy_that_forgets_a_row_counter(pipe: lantern.Pipeline,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Power of the test above: when a joining row's random-stream counter is not copied (the row
    keeps the counter of the row it replaces, so it draws other uniforms from its own key), the
    joined images differ from their plain-batch codes."""
    prepared = _prepared(pipe, "ar")
    plain = _batch(prepared, list(range(len(LABELS))))
    monkeypatch.setattr(RowRandom, "row_tensors", lambda self: [(self.k0, 1, 0), (self.k1, 1, 0)])
    got = _joined(prepared)
    changed = [i for i in range(len(LABELS)) if not torch.equal(got[i], plain[i])]
    assert 2 in changed, changed  # image 2 joined row 2 after 2 rounds, whose stream had drawn 2 more


def test_rows_refuse_a_decode_of_another_shape(pipe: lantern.Pipeline) -> None:
    """Rows only move between decodes of the same method and settings: another method's state is refused."""
    ar, sjd = _prepared(pipe, "ar"), _prepared(pipe, "sjd-coupled")
    stack = pipe.stack
    with torch.inference_mode():
        a = ar.start(stack.encode([1, 2]), [0, 1])
        s = sjd.start(stack.encode([1]), [0], eager=True)
        with pytest.raises(LanternError, match="decode states differ"):
            a.take_rows(s, torch.tensor([0]))


def test_grid_drafters_cannot_move_rows(pipe: lantern.Pipeline) -> None:
    """PJD's grid drafter lists no row state: a server runs it in static batches."""
    prepared = _prepared(pipe, "pjd")
    with torch.inference_mode():
        decode = prepared.start(pipe.stack.encode([1]), [0])
    assert not movable(decode.target, decode.drafter)
    with pytest.raises(LanternError, match="cannot move rows"):
        decode.take_rows(decode, torch.tensor([0]))
