"""PJD's grid forward on Chameleon-family targets (``ChameleonTarget.verify_grid`` / ``commit_grid``)
against an explicit recomputation with transformers' own forward.

``verify_grid`` does for Chameleon what ``LlamaGenTarget.verify_grid`` does (test_pjd.py,
test_pjd_method.py), plus what only this family has: left-padded prompts (positions counted from
each row's first real token, a guidance stream with another prompt), and on Lumina-mGPT a new-line
token after every image row, which the grid never proposes. A node at a row's last cell gets a
*shadow* carrying the new-line token one position later, in its own window; the node's logits are
read at the shadow; ``commit_grid`` keeps the shadow with its node; cells are doubled in the mask
so that a new-line sits between its row's last code and the next row's first. Anole has none.

The reference shares nothing with the target adapter but the model's weights and its code-to-BPE
map (no cache, slot map, key doubling or shadow logic): for every node it builds by hand the token
sequence the node's row-causal rule says it sees (the real prompt tokens, the committed codes before it in
raster order with the committed new-lines among them, the earlier nodes and shadows of its own
window, then the node and its new-line), with the positions the codes have in the AR raster
sequence (``prompt + cell + row`` on Lumina), and runs ``transformers``' own uncached forward:

* where everything the node sees was itself computed seeing exactly what precedes it in that
  sequence, a *plain* causal forward over the sequence alone (no cache, no tree mask);
* always, one forward over the prompt, every token cached so far and the block, each token
  attending to exactly what it saw when it was computed (a committed token of row r + 1 that did
  not see a later commit of row r: PJD's approximation at context < row length, under which no
  plain sequence reproduces the cache). Its keys and values must equal the target's cache slot
  for slot (``slot_cell`` names each slot's cell), so the cache after ``commit_grid`` is the
  recomputation of what was committed.

Two drivers: a hand-written plan of rounds on the target alone (two batch rows progressing
differently, several image rows per forward, a window running across a row end, two shadows of
one cell in two windows, holes, padding), and the real loop (``--method pjd`` with rows open in
parallel), recorded round by round. Both layouts; with and without guidance. The real loop once
cached one cell twice (``test_loop_caches_each_cell_once``: a stand-in's flush of row 0 lost in
``GridJacobiDrafter.commit_grid``, fixed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from conftest import CHAMELEON_LAYOUTS, CHAMELEON_PROMPTS, chameleon_lm
from torch import Tensor

from lantern.decoding.config import SamplingConfig
from lantern.decoding.loop import generate
from lantern.decoding.sampling import make_generators
from lantern.methods import MethodConfig
from lantern.models.chameleon import ChameleonLM, ImageLayout
from lantern.targets.chameleon import ChameleonTarget, encode_prompts
from lantern.testing import chameleon_parts

ATOL = 1e-5


@dataclass
class _Tok:
    """One token of a batch row's image part (its prompt comes first, each stream its own)."""

    bpe: int
    offset: int  # position after the prompt: the token's index in the AR raster sequence of the image
    key: int  # 2 * cell for a code, 2 * cell + 1 for the new-line after it
    row: int  # window (image row of the chain) the token was verified in
    sees: list[int] = field(default_factory=list)  # indices of earlier image tokens it attended to
    # never cached, in the history only because a cached token saw it (a new row's stand-in root and
    # its new-line): the reference computes it, later tokens never see it
    ghost: bool = False


def _raster_offsets(layout: ImageLayout) -> list[int]:
    """Each cell's index in the image part of the AR sequence (rows of codes, each followed by the
    new-line token when the layout has one)."""
    out, i = [], 0
    for cell in range(layout.num_tokens):
        out.append(i)
        i += 2 if layout.eol is not None and cell % layout.width == layout.width - 1 else 1
    return out


def _prompt_streams(layout: ImageLayout, prompt: list[int], cfg: float) -> list[list[int]]:
    """The real (unpadded) token sequence before the image, per stream: [cond] or [cond, uncond]."""
    cond = [*layout.head, *prompt, *layout.tail, *layout.prefix]
    return [cond, list(layout.uncond)] if cfg != 1.0 else [cond]


def _forward(lm: ChameleonLM, ids: list[int], positions: list[int], sees: Tensor
             ) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
    """transformers' uncached forward over one sequence, token i attending to ``sees[i]`` (and
    itself). Returns (code logits [n, V], per layer (keys, values) [H, n, Dh], rotated). The mask
    goes in as a 4-D bias even when it is causal: transformers reads gaps in ``position_ids``
    (cells a token does not see) as packed sequences otherwise."""
    n = len(ids)
    allowed = sees | torch.eye(n, dtype=torch.bool)
    bias = torch.zeros(1, 1, n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
    out = lm.hf.model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]), attention_mask=bias,
                      use_cache=True)
    cache = getattr(out, "cache", None)
    if cache is None:  # transformers 4.x names it past_key_values
        cache = out.past_key_values
    kv = [(layer.keys[0], layer.values[0]) for layer in cache.layers]
    return lm.image_logits(out.last_hidden_state[0]), kv


def _render(prompt: list[int], toks: list[_Tok]) -> tuple[list[int], list[int], Tensor]:
    """(ids, positions, sees mask) of prompt + image tokens: the prompt is causal, every image
    token sees the whole prompt and its recorded image tokens."""
    p, n = len(prompt), len(prompt) + len(toks)
    sees = torch.zeros(n, n, dtype=torch.bool)
    sees[:p, :p] = torch.ones(p, p, dtype=torch.bool).tril()
    for i, tok in enumerate(toks):
        sees[p + i, :p] = True
        sees[p + i, [p + j for j in tok.sees]] = True
    return [*prompt, *(t.bpe for t in toks)], [*range(p), *(p + t.offset for t in toks)], sees


class _Replay:
    """One batch row's explicit recomputation: its image history (what the cache holds, plus ghosts)
    and, round by round, the block's tokens with what each may see."""

    def __init__(self, lm: ChameleonLM, layout: ImageLayout, prompts: list[list[int]]) -> None:
        self.lm, self.layout, self.prompts = lm, layout, prompts
        self.offsets = _raster_offsets(layout)
        self.history: list[_Tok] = []
        self.block: list[_Tok] = []
        self.read_at: list[int] = []  # per real node: the block token its logits are read at
        self.plain = self.masked = 0  # nodes checked by each reference

    def _sees(self, key: int, row: int) -> list[int]:
        """The row-causal rule: committed tokens before ``key`` in raster order (new-lines included),
        and the earlier tokens of the same window in this block."""
        h = len(self.history)
        return ([i for i, t in enumerate(self.history) if t.key < key and not t.ghost]
                + [h + j for j, t in enumerate(self.block) if t.row == row and t.key < key])

    def set_block(self, nodes: list[tuple[int, int, int]]) -> None:
        """nodes: (BPE id, cell, window row) of the block's real nodes, in block order."""
        self.block, self.read_at = [], []
        w = self.layout.width
        for bpe, cell, row in nodes:
            self.block.append(_Tok(bpe, self.offsets[cell], 2 * cell, row, self._sees(2 * cell, row)))
            if self.layout.eol is not None and cell % w == w - 1:  # the row's new-line, in the node's window
                self.block.append(_Tok(self.layout.eol, self.offsets[cell] + 1, 2 * cell + 1, row,
                                       self._sees(2 * cell + 1, row)))
            self.read_at.append(len(self.block) - 1)

    def expected(self) -> list[Tensor]:
        """Per stream, the logits [nodes, V] of the block's real nodes, from one forward over prompt +
        history + block with every token's own visibility; and, for each node whose view is a plain
        causal sequence, a plain forward over that sequence alone must give the same."""
        h, out = len(self.history), []
        for prompt in self.prompts:
            logits, _ = _forward(self.lm, *_render(prompt, self.history + self.block))
            node_logits = logits[len(prompt) + h + torch.tensor(self.read_at)]
            out.append(node_logits)
            for n, at in enumerate(self.read_at):
                plain = self._plain_view(h + at)
                if plain is None:
                    continue
                toks = self.history + self.block
                ids = [*prompt, *(toks[i].bpe for i in plain)]
                positions = [*range(len(prompt)), *(len(prompt) + toks[i].offset for i in plain)]
                ref, _ = _forward(self.lm, ids, positions, torch.ones(len(ids), len(ids), dtype=torch.bool).tril())
                assert torch.allclose(node_logits[n], ref[-1], atol=ATOL), (n, self.layout.name)
                self.plain += 1
            self.masked += len(self.read_at)
        return out

    def _plain_view(self, i: int) -> list[int] | None:
        """Token ``i``'s view (its sees, then itself) in raster order, when every token in it saw
        exactly the tokens before it there: a plain causal sequence (None otherwise)."""
        toks = self.history + self.block
        view = sorted([*toks[i].sees, i], key=lambda j: toks[j].key)
        for k, j in enumerate(view):
            if set(toks[j].sees) != set(view[:k]):
                return None
        return view

    def commit(self, kept_nodes: list[int]) -> None:
        """Keep real nodes ``kept_nodes`` (indices among the block's real nodes) with their new-lines;
        block tokens a kept one saw join as ghosts."""
        kept_tokens = set()
        for n in kept_nodes:
            at = self.read_at[n]
            kept_tokens |= {at, at - 1} if self.block[at].key % 2 else {at}
        h = len(self.history)
        needed, todo = set(kept_tokens), list(kept_tokens)
        while todo:
            for s in self.block[todo.pop()].sees:
                if s >= h and s - h not in needed:
                    needed.add(s - h)
                    todo.append(s - h)
        order = sorted(needed)
        remap = {h + j: h + i for i, j in enumerate(order)}
        for j in order:
            tok = self.block[j]
            sees = [remap[s] if s >= h else s for s in tok.sees]
            self.history.append(_Tok(tok.bpe, tok.offset, tok.key, tok.row, sees, ghost=j not in kept_tokens))

    def check_cache(self, target: ChameleonTarget, b: int, batch: int) -> None:
        """The target's cache rows of batch row ``b`` (every stream) hold the recomputation's keys and
        values: prompt slots in order, image slots found by their grid key in ``slot_cell``."""
        cache, slot_cell, key_mask = target.cache, target.slot_cell, target.key_mask
        assert cache is not None and slot_cell is not None and key_mask is not None
        width = key_mask.shape[1]
        cached = [t for t in self.history if not t.ghost]
        for s, prompt in enumerate(self.prompts):
            r = s * batch + b
            length = int(cache.lengths[r])
            assert length == width + len(cached), (length, width, len(cached))
            keys = slot_cell[r, width:length].tolist()
            assert sorted(keys) == sorted(t.key for t in cached)  # the committed tokens, in some slot order
            _, kv = _forward(self.lm, *_render(prompt, self.history))
            p = len(prompt)
            # a key cached twice (test_loop_caches_each_cell_once fails on it): the n-th copy is the n-th committed
            where: dict[int, list[int]] = {}
            for j, key in enumerate(keys):
                where.setdefault(key, []).append(width + j)
            slots = [*torch.nonzero(key_mask[r]).flatten().tolist(), *(where[t.key].pop(0) for t in cached)]
            index = [*range(p), *(p + i for i, t in enumerate(self.history) if not t.ghost)]
            for layer, (k_ref, v_ref) in enumerate(kv):
                assert torch.allclose(cache.k[layer, r][:, slots], k_ref[:, index], atol=ATOL), (layer, s)
                assert torch.allclose(cache.v[layer, r][:, slots], v_ref[:, index], atol=ATOL), (layer, s)


def _guided(per_stream: list[Tensor], cfg: float) -> Tensor:
    return per_stream[0] if len(per_stream) == 1 else per_stream[1] + cfg * (per_stream[0] - per_stream[1])


# A 3 x 3 image (row ends: cells 2, 5, 8). Per round and batch row: each window as (image row, first
# cell, length) and how many of its nodes the round keeps (a prefix, as a Jacobi test does).
ROUNDS = [
    # 0: row 0's window runs across its row end (cell 3 sees cell 2's new-line shadow)
    {0: [((0, 0, 4), 3)], 1: [((0, 0, 2), 2)]},
    # 0: rows 1 and 2 open in one forward, each window with a shadow of cell 5 (row 2's root is a
    # stand-in at the row above's last cell); 1: row 0's window crosses its row end, all kept
    {0: [((1, 3, 3), 1), ((2, 5, 2), 0)], 1: [((0, 2, 3), 3)]},
    # 0: row 1 completes while row 2 commits cell 6, which never saw cells 4 and 5 (a stale token)
    {0: [((1, 4, 2), 2), ((2, 6, 2), 1)], 1: [((1, 5, 1), 1), ((2, 5, 3), 0)]},
    # 0: cell 7 sees the stale cell 6 (only the explicit-visibility reference applies); 1: plain
    {0: [((2, 7, 2), 2)], 1: [((2, 6, 3), 3)]},
]


@torch.no_grad()
@pytest.mark.parametrize("layout", ["lumina", "anole"])
@pytest.mark.parametrize("cfg", [1.0, 3.0])
def test_grid_rounds_equal_explicit_recomputation(layout: str, cfg: float) -> None:
    """Four hand-written rounds on the target alone, two batch rows (prompts of different lengths)
    progressing differently: every node's guided logits equal the recomputation's, plain where the
    node's view is a plain sequence; after every commit the cache equals the recomputation."""
    lay, lm = CHAMELEON_LAYOUTS[layout], chameleon_lm()
    prompts = CHAMELEON_PROMPTS[:2]
    ids, mask = encode_prompts(prompts, lay)
    sampling = SamplingConfig(temperature=1.0, top_k=0, cfg_scale=cfg)
    t = max(sum(w[2] for w, _ in plan[b]) for plan in ROUNDS for b in (0, 1))
    target = ChameleonTarget(lm, lay, sampling, max_tree_nodes=t)
    target.start(ids, mask)
    replays = [_Replay(lm, lay, _prompt_streams(lay, p, cfg)) for p in prompts]
    g = torch.Generator().manual_seed(0)
    for plan in ROUNDS:
        tokens, cells = torch.zeros(2, t, dtype=torch.long), torch.zeros(2, t, dtype=torch.long)
        rows = torch.full((2, t), -1, dtype=torch.long)
        keep = torch.full((2, t), -1, dtype=torch.long)
        num_keep = torch.zeros(2, dtype=torch.long)
        kept: list[list[int]] = [[], []]
        for b in (0, 1):
            nodes: list[tuple[int, int, int]] = []
            for (row, first, length), k in plan[b]:
                kept[b] += range(len(nodes), len(nodes) + k)
                for cell in range(first, first + length):
                    i = len(nodes)
                    tokens[b, i] = int(torch.randint(0, lm.num_codes, (1,), generator=g))
                    cells[b, i], rows[b, i] = cell, row
                    nodes.append((int(lm.code_to_bpe(tokens[b, i])), cell, row))
            replays[b].set_block(nodes)
            keep[b, : len(kept[b])] = torch.tensor(kept[b], dtype=torch.long)
            num_keep[b] = len(kept[b])
        logits = target.verify_grid(tokens, cells, rows)
        for b in (0, 1):
            real = int((rows[b] >= 0).sum())
            assert torch.allclose(logits[b, :real], _guided(replays[b].expected(), cfg), atol=ATOL), (plan, b)
        target.commit_grid(keep, num_keep)
        for b in (0, 1):
            replays[b].commit(kept[b])
            replays[b].check_cache(target, b, 2)
    streams = 2 if cfg != 1.0 else 1
    assert [r.masked for r in replays] == [15 * streams, 12 * streams]
    assert [r.plain for r in replays] == [13 * streams, 12 * streams]  # all but the two that see the stale cell 6


def _run_loop(layout: ImageLayout, cfg: float, seeds: list[int], monkeypatch: pytest.MonkeyPatch
              ) -> tuple[ChameleonTarget, list[list[Tensor]], Tensor]:
    """Sampled PJD (window 3, context 2: row r + 1 opens once row r has two tokens, and a window runs
    on past its row end while the next row is closed) in the real loop for two prompts, one
    generator per row. Returns the target, its recorded rounds (tokens, cells, rows, guided logits,
    keep, num_keep) and the codes."""
    lm = chameleon_lm()
    ids, mask = encode_prompts(CHAMELEON_PROMPTS[:2], layout)
    sampling = SamplingConfig(temperature=1.0, top_k=0, cfg_scale=cfg)
    method = MethodConfig.resolve("pjd", pjd_window=3, pjd_context=2)
    target, drafter = chameleon_parts(lm, layout, sampling, method, None, lm.image_head)
    rounds: list[list[Tensor]] = []
    verify_grid, commit_grid = target.verify_grid, target.commit_grid

    def record_verify(tokens: Tensor, cells: Tensor, rows: Tensor, chains: int | None = None) -> Tensor:
        logits = verify_grid(tokens, cells, rows, chains)
        rounds.append([tokens.clone(), cells.clone(), rows.clone(), logits.clone()])
        return logits

    def record_commit(keep: Tensor, num_keep: Tensor) -> None:
        rounds[-1] += [keep.clone(), num_keep.clone()]
        commit_grid(keep, num_keep)

    monkeypatch.setattr(target, "verify_grid", record_verify)
    monkeypatch.setattr(target, "commit_grid", record_commit)
    out = generate(target, ids, generators=make_generators(seeds), drafter=drafter, cond_mask=mask)
    return target, rounds, out.codes


# Seeds whose runs show what the loop test is about (asserted there), on this tiny model and grid.
LOOP_SEEDS = {"lumina": [6, 7], "anole": [10, 11]}


@torch.no_grad()
@pytest.mark.parametrize("layout", ["lumina", "anole"])
@pytest.mark.parametrize("cfg", [1.0, 3.0])
def test_loop_equals_explicit_recomputation(layout: str, cfg: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampled PJD in the real loop with rows open in parallel, two prompts: every verified node's
    guided logits equal the recomputation's, and the final cache holds the recomputation of every
    committed token (new-lines included) at the slots ``slot_cell`` names, each cell once. The runs
    show what the check is about (asserted): in both batch rows, forwards over several image rows,
    commits out of raster order and a node whose view is no plain sequence; a window running on
    past a row end (on Lumina: a guess's shadow seen by the next guess); a new row's stand-in root
    (on Lumina with its new-line) seen by a cached token but never cached itself."""
    lay, lm = CHAMELEON_LAYOUTS[layout], chameleon_lm()
    target, rounds, codes = _run_loop(lay, cfg, LOOP_SEEDS[layout], monkeypatch)
    w, crossing, ghosts = lay.width, 0, []
    for b, prompt in enumerate(CHAMELEON_PROMPTS[:2]):
        replay = _Replay(lm, lay, _prompt_streams(lay, prompt, cfg))
        multi = 0
        for tokens, cells, rows, logits, keep, num_keep in rounds:
            real = [i for i in range(tokens.shape[1]) if int(rows[b, i]) >= 0]
            if not real:
                continue
            nodes = [(int(lm.code_to_bpe(tokens[b, i])), int(cells[b, i]), int(rows[b, i])) for i in real]
            multi += len({row for _, _, row in nodes}) > 1
            crossing += any(c % w == w - 1 and c // w == r and any(r2 == r and c2 > c for _, c2, r2 in nodes)
                            for _, c, r in nodes)  # (a root at a row end sits in the row above its window)
            replay.set_block(nodes)
            assert torch.allclose(logits[b, real], _guided(replay.expected(), cfg), atol=ATOL), (b, len(replay.history))
            replay.commit([real.index(int(i)) for i in keep[b, : int(num_keep[b])]])
        replay.check_cache(target, b, 2)
        cached = [t for t in replay.history if not t.ghost]
        codes_b = {t.key // 2: t.bpe for t in cached if t.key % 2 == 0}
        assert codes_b == {c: int(lm.code_to_bpe(codes[b, c])) for c in codes_b}  # the cache holds the image's codes
        keys = [t.key for t in cached]
        assert len(set(keys)) == len(keys), keys  # each cell (and new-line) cached once
        assert multi >= 1 and keys != sorted(keys), (multi, keys)  # several rows per forward; out of raster order
        assert replay.plain < replay.masked  # a node saw a token that missed a later commit before it
        ghosts += [t.key for t in replay.history if t.ghost]
    assert crossing >= 1  # a window ran on past a row end (on Lumina: a shadow on a guess, not a root)
    assert ghosts and (lay.eol is None or any(k % 2 for k in ghosts)), ghosts  # a stand-in (with its new-line)


@torch.no_grad()
def test_loop_caches_each_cell_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run in which row 1 opens on row 0's real, uncached last token (a committed stand-in): that
    token must then be cached once, not again by a flush chain of row 0 later (every later token
    would attend to it twice). ``GridJacobiDrafter.commit_grid`` marked the row above a stand-in
    flushed with a scatter whose index is 0 for chain rows 0 and 1 alike, and row 0's padding
    chain, written last, reset the mark (found by this test)."""
    target, _, _ = _run_loop(CHAMELEON_LAYOUTS["lumina"], 1.0, [32, 33], monkeypatch)
    assert target.cache is not None and target.slot_cell is not None and target.key_mask is not None
    width = target.key_mask.shape[1]
    for r in range(2):
        keys = target.slot_cell[r, width : int(target.cache.lengths[r])].tolist()
        assert len(set(keys)) == len(keys), (r, keys)
