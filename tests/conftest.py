"""What test modules share: one intra-op thread for the session, fixtures, and plain helpers.

Test modules never import each other; what two of them use lives here (helpers are imported as
``from conftest import ...``), or in :mod:`lantern.testing` when it is useful outside the tests.
"""

from __future__ import annotations

import atexit
import copy
import itertools
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch import Tensor

import lantern
from lantern.cli.main import main
from lantern.decoding import compiling
from lantern.decoding.acceptance import num_uniforms, verify_chain_sampled, verify_tree_sampled
from lantern.decoding.cache import KVCache
from lantern.decoding.config import JacobiConfig, PJDConfig, SamplingConfig
from lantern.decoding.jacobi import JacobiDrafter
from lantern.decoding.loop import Acceptance, GenerationOutput, generate
from lantern.decoding.pjd import GridJacobiDrafter
from lantern.decoding.sampling import apply_cfg, make_generators, probs_from_logits
from lantern.decoding.trees import tree_from_parents
from lantern.errors import LanternError
from lantern.models.chameleon import ChameleonLM, ImageLayout
from lantern.models.drafter import DrafterConfig, EagleDrafterModel
from lantern.models.invariant import make_batch_invariant
from lantern.models.llamagen import LlamaGen
from lantern.targets.chameleon import ChameleonTarget, encode_prompts
from lantern.targets.llamagen import LlamaGenTarget
from lantern.targets.llamagen_stack import ModelStack, load_stack
from lantern.targets.proximity import build_proximity
from lantern.testing import chi_square_pooled, single_thread, tiny_chameleon, tiny_llamagen, tiny_vq

F64 = torch.float64

# The calibrations of the machine's user (``--method auto``, and ``lantern serve``'s default method
# when one exists) must not change what a test runs: every test process, and every server it
# starts, reads an empty folder of its own unless a test points elsewhere.
# Removed when the process exits: CI runs pytest on one machine many times a day.
os.environ["LANTERN_CALIBRATION_DIR"] = tempfile.mkdtemp(prefix="lantern-test-calibrations-")
atexit.register(shutil.rmtree, os.environ["LANTERN_CALIBRATION_DIR"], ignore_errors=True)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``pytest -n auto``: one worker per CPU this process may run on (every test runs on one
    intra-op thread, so a 2-vCPU machine whose CPUs are hyperthreads of one core still gets two;
    xdist's own count would be its physical cores), at most 8 (a worker holds up to ~1.5 GB)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # macOS: no affinity
    return max(1, min(cpus or 1, 8))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``long`` (minutes in one process) run first: under ``-n auto --dist worksteal``
    a worker starts one at once while the others share the rest, instead of one ending the run alone."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)  # stable: the rest keep their order


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> Iterator[None]:
    """Every test runs on one intra-op thread, and so does every process a test starts (they inherit
    ``OMP_NUM_THREADS``): the models are tiny, so threads only add synchronisation, and on a busy
    shared CPU a thread barrier can stall every small op (observed: 0.3 s runs taking 20 s on 2
    busy cores)."""
    with pytest.MonkeyPatch.context() as mp, single_thread():
        mp.setenv("OMP_NUM_THREADS", "1")
        yield


@pytest.fixture(autouse=True)
def _quiet_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test reads the machine's real load: demo / bench / profile add a busy-machine warning to
    what they print and write (a line atop trace.md, bench.md) when other processes compete for the
    cores, so a test of their output would fail on a busy CI machine. Every reading here is of an
    idle machine; ``tests/test_machine.py`` fakes busy ones and reads the real one on purpose."""
    from lantern import machine

    clock = itertools.count(1)

    def idle() -> machine.Reading:  # 1 s apart; no process (others or ours) spent any CPU time
        return machine.Reading(wall=float(next(clock)), load1=0.0, cpus=2, machine_cpu=0.0, own_cpu=0.0)

    monkeypatch.setattr(machine, "read_machine", idle)


# --------------------------------------------------------------------------------------------------
# Acceptance (test_acceptance.py, test_budget.py, test_sjd.py): scalar oracles ([LANTERN], [EAGLE]), random
# inputs and trees, and the exact output distribution of the library's verifier
# --------------------------------------------------------------------------------------------------


REJECT = 1.0 - 2.0**-53  # the largest double below 1: fails every test with probability < 1


def uses_libgomp() -> bool:
    """Whether torch runs on GNU OpenMP (its Linux pip wheels), whose teams belong to the thread that
    opened them; Intel's and LLVM's runtimes pool their workers, so the thread-count tests below
    test a property only libgomp has."""
    try:
        return any("libgomp" in line for line in Path("/proc/self/maps").read_text().splitlines())
    except OSError:
        return False


needs_libgomp = pytest.mark.skipif(not uses_libgomp(), reason="libgomp's per-thread OpenMP teams (torch's pip wheels)")


def threads_left_by(work: Callable[[], Any], settle: float, threads: int = 2) -> int:
    """OS threads that ``work``, run in a fresh thread at ``threads`` intra-op threads, started and left
    running, counted while that thread is still alive: an OpenMP team the thread opened stays that
    long (a server's main thread: the server's life). Threads that are ending are waited for, up to
    ``settle`` s. Counted by thread id, so threads of earlier tests ending meanwhile do not count,
    and Python's own threads are left out."""
    def tids() -> set[str]:  # native threads only: a Python thread (tqdm's monitor, a server's) is not a team
        python = {str(t.native_id) for t in threading.enumerate()}
        return set(os.listdir("/proc/self/task")) - python

    counts: list[int] = []
    before_count = torch.get_num_threads()

    def run() -> None:
        torch.get_num_threads()
        torch.set_num_threads(threads)
        before = tids()
        work()
        deadline = time.monotonic() + settle
        while tids() - before and time.monotonic() < deadline:
            time.sleep(0.01)
        counts.append(len(tids() - before))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    torch.set_num_threads(before_count)  # set_num_threads wrote the process-wide count too
    return counts[0]


def o_residual(r, x, p_tilde, agg, q_j, nbr, cfg) -> list[float]:
    """The residual after rejecting x, written from [LANTERN] and the [LANTERN code] residuals."""
    v_size = len(r)
    mode = "paper" if cfg is None or cfg.is_exact else cfg.residual
    if mode == "paper":
        rt = [0.0 if i in agg else r[i] for i in range(v_size)]
        rt[x] = p_tilde
        if q_j is None:
            v = [0.0 if i == x else rt[i] for i in range(v_size)]
        else:
            v = [max(rt[i] - q_j[i], 0.0) for i in range(v_size)]
        fallback = list(r)
    else:
        drop = set(nbr[x][: cfg.k + 1]) if agg else set()
        if q_j is None:
            v = [0.0 if (i in drop or i == x) else r[i] for i in range(v_size)]
        elif mode == "official-lumina":
            v = [max((0.0 if i in drop else r[i]) - q_j[i], 0.0) for i in range(v_size)]
        else:
            v = [max(r[i] - (0.0 if i in drop else q_j[i]), 0.0) for i in range(v_size)]
        fallback = [1.0 / v_size] * v_size
    s = sum(v)
    return [vi / s for vi in v] if s > 0 else fallback


def o_sample(probs: list[float], u: float) -> int:
    total, cdf = 0.0, []
    for pr in probs:
        total += pr
        cdf.append(total)
    target = u * total
    first = next((i for i, c in enumerate(cdf) if c > target), len(probs))
    return min(first, max(i for i, pr in enumerate(probs) if pr > 0))


def draw_orders(q: list[float], m: int):
    """Every ordered draw of m distinct tokens without replacement from q, with its probability."""
    for order in itertools.permutations(range(len(q)), m):
        w, rest = 1.0, 1.0
        for x in order:
            w, rest = (w * q[x] / rest if rest > 0 else 0.0), rest - q[x]
        if w > 0:
            yield list(order), w


def rand_dist(g: torch.Generator, *shape: int, sharpness: float = 2.0) -> Tensor:
    w = torch.rand(*shape, generator=g, dtype=F64) ** sharpness
    return w / w.sum(-1, keepdim=True)


def rand_neighbours(g: torch.Generator, v_size: int) -> Tensor:
    """[V, V-1] random proximity order per token, self excluded."""
    rows = []
    for i in range(v_size):
        others = torch.tensor([j for j in range(v_size) if j != i])
        rows.append(others[torch.randperm(v_size - 1, generator=g)])
    return torch.stack(rows)


def tree_arrays(parents: list[int]) -> dict[str, list]:
    """children (sibling order = node order), depth and root->leaf paths of a parent list."""
    t = len(parents)
    children = [[n for n in range(t) if parents[n] == i] for i in range(t)]
    depth = [0] * t
    for n in range(1, t):
        depth[n] = depth[parents[n]] + 1
    paths = []
    for leaf in (n for n in range(t) if not children[n]):
        path = [leaf]
        while path[-1] != 0:
            path.append(parents[path[-1]])
        paths.append(path[::-1])
    return {"children": children, "depth": depth, "paths": paths}


def pad(rows: list[list[int]], width: int) -> list[list[int]]:
    return [row + [-1] * (width - len(row)) for row in rows]


def batch_trees(trees: list[dict[str, list]]) -> dict[str, Tensor]:
    """Stack per-row trees of equal node count into children [B,T,C], depth [B,T], retrieve."""
    c = max(1, max(len(ch) for tr in trees for ch in tr["children"]))
    d = max(max(tr["depth"]) for tr in trees)
    p = max(len(tr["paths"]) for tr in trees)
    children = torch.tensor([pad(tr["children"], c) for tr in trees])
    retrieve = torch.tensor([pad(tr["paths"], d + 1) + [[-1] * (d + 1)] * (p - len(tr["paths"])) for tr in trees])
    return {"children": children, "depth": torch.tensor([tr["depth"] for tr in trees]), "retrieve": retrieve}


def one_level_tree(orders: Tensor) -> dict[str, Tensor]:
    """Root 0 with children 1..m carrying tokens orders[b] (in sibling order)."""
    b, m = orders.shape
    children = torch.full((b, m + 1, m), -1)
    children[:, 0] = torch.arange(1, m + 1)
    depth = torch.ones(b, m + 1, dtype=torch.long)
    depth[:, 0] = 0
    tokens = torch.cat([torch.zeros(b, 1, dtype=torch.long), orders], 1)
    return {"children": children, "depth": depth, "tokens": tokens}


def measure_first_token(
    p: Tensor, orders: Tensor, weights: Tensor, q: Tensor | None, nbr, cfg, iters: int = 56
) -> Tensor:
    """Exact distribution [V] of the first output token of verify_tree_sampled on a one-level tree.

    p: [V] target at the root; orders: [n, m] sibling tokens of each draw order; weights: [n]
    their probabilities. Each candidate's acceptance probability a_j is the supremum of the
    uniforms it accepts (bisected with earlier candidates forced to reject); the recovered token's
    CDF boundaries are bisected on the last uniform. Precision ~2^-iters.
    """
    n, m = orders.shape
    v = p.numel()
    per = m + v - 1  # rows per order: m acceptance bisections, V-1 CDF boundaries
    tree = one_level_tree(orders.repeat_interleave(per, 0))
    rows = n * per
    slot = torch.arange(per).repeat(n)  # [R]
    is_acc = slot < m
    p_target = p.expand(rows, m + 1, v)
    q_draft = None if q is None else q.expand(rows, m + 1, v)
    lo, hi = torch.zeros(rows, dtype=F64), torch.ones(rows, dtype=F64)
    node = (slot + 1).clamp(max=m)
    for _ in range(iters):
        mid = (lo + hi) / 2
        u = torch.full((rows, num_uniforms(m + 1)), REJECT, dtype=F64)
        u[:, -1] = torch.where(is_acc, 0.5, mid)
        u[is_acc, node[is_acc]] = mid[is_acc]
        res = verify_tree_sampled(p_target, tree["tokens"], tree["children"], tree["depth"],
                                  torch.ones(rows, dtype=torch.long), u, q_draft, nbr, cfg)
        pred = torch.where(is_acc, res.path[:, 1] == node,
                           (res.num_accepted == 0) & (res.next_token <= slot - m))
        lo, hi = torch.where(pred, mid, lo), torch.where(pred, hi, mid)
    a = lo.view(n, per)[:, :m]  # [n, m] acceptance probabilities
    bounds = torch.cat([torch.zeros(n, 1, dtype=F64), lo.view(n, per)[:, m:], torch.ones(n, 1, dtype=F64)], 1)
    reach = torch.cat([torch.ones(n, 1, dtype=F64), torch.cumprod(1 - a, 1)], 1)  # [n, m+1]
    dist = reach[:, -1:] * bounds.diff(dim=1)  # [n, V] recovered-token mass
    dist = dist.scatter_add(1, orders, reach[:, :-1] * a)
    return (weights[:, None] * dist).sum(0)


def deterministic_orders(xs: list[int]) -> tuple[Tensor, Tensor]:
    return torch.tensor([xs]), torch.ones(1, dtype=F64)


def sampled_orders(q: Tensor, m: int) -> tuple[Tensor, Tensor]:
    pairs = list(draw_orders(q.tolist(), m))
    return torch.tensor([o for o, _ in pairs]), torch.tensor([w for _, w in pairs], dtype=F64)


def tv(a, b) -> float:
    return 0.5 * float((torch.as_tensor(a, dtype=F64) - torch.as_tensor(b, dtype=F64)).abs().sum())


def random_parents(rng: random.Random, t: int) -> list[int]:
    return [-1] + [rng.randrange(0, n) for n in range(1, t)]


def random_batch(seed: int, b: int = 48, t: int = 9, v: int = 5):
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    trees = [tree_arrays(random_parents(rng, t)) for _ in range(b)]
    bt = batch_trees(trees)
    tokens = torch.randint(0, v, (b, t), generator=g)  # small V: duplicate siblings happen
    return {
        "trees": trees, **bt, "tokens": tokens,
        "p": rand_dist(g, b, t, v, sharpness=3.0), "q": rand_dist(g, b, t, v, sharpness=2.0),
        "u": torch.rand(b, num_uniforms(t), generator=g, dtype=F64),
        "max_depth": torch.randint(1, t, (b,), generator=g), "nbr": rand_neighbours(g, v),
    }


def check_chain_equals_tree_walk(cfg, sampled: bool) -> None:
    """The all-depths-at-once chain verifier gives exactly the general walk's path, token,
    relaxed count and bonus flag for the same uniforms: random chains of 1-8 drafts, depth caps
    from 0 to past the end, a vocabulary of 5 so drafts repeat, and drafts q could not draw."""
    g = torch.Generator().manual_seed(5)
    b, v = 64, 5
    nbr = rand_neighbours(g, v)
    checked = 0
    for t in range(2, 10):
        tree = batch_trees([tree_arrays([-1, *range(t - 1)])] * b)
        tokens = torch.randint(0, v, (b, t), generator=g)
        p_t = rand_dist(g, b, t, v, sharpness=3.0)
        q = rand_dist(g, b, t, v, sharpness=2.0) if sampled else None
        if q is not None:  # some drafts the drafter could never have drawn (q = 0 at the draft)
            zero = torch.rand(b, t - 1, generator=g) < 0.15
            q[:, :-1].scatter_(2, tokens[:, 1:, None], torch.where(zero[:, :, None], 0.0, q[:, :-1].gather(
                2, tokens[:, 1:, None])))
        u = torch.rand(b, num_uniforms(t), generator=g, dtype=F64)
        max_depth = torch.randint(0, t + 1, (b,), generator=g)
        ref = verify_tree_sampled(p_t, tokens, tree["children"], tree["depth"], max_depth, u, q, nbr, cfg)
        got = verify_chain_sampled(p_t, tokens, max_depth, u, q, nbr, cfg)
        for name in ("path", "num_accepted", "next_token", "num_relaxed", "is_bonus"):
            assert torch.equal(getattr(got, name), getattr(ref, name)), (t, name)
        checked += int((ref.num_accepted > 0).sum()) + int((~ref.is_bonus).sum())
    assert checked > 200  # both accepts and rejections were exercised


# --------------------------------------------------------------------------------------------------
# Exact sampling (test_speculative.py, test_sjd*.py, test_pjd_method.py): a 3x3 model whose joint law
# of the first image tokens is enumerated exactly, and a chi-square test against it
# --------------------------------------------------------------------------------------------------

DIST_ROWS = 6000  # samples per run, one generator per row (seeded by row index)
DIST_SAMPLING = SamplingConfig(temperature=1.0, top_k=4, cfg_scale=2.0)
DIST_LABEL = 3


@cache
def dist_model() -> LlamaGen:
    """6 image tokens, a 3x3 grid: the joint of 4 tokens has 6^4 cells, 4^4 = 256 under top-k."""
    return tiny_llamagen(seed=3, logit_std=0.4, vocab_size=6, block_size=9, dim=16, n_layer=1, n_head=2, multiple_of=16)


@torch.no_grad()
def exact_joint(model: LlamaGen, sampling: SamplingConfig, k: int) -> Tensor:
    """p(x_0..x_{k-1}) [V^k] (row-major in x_0..x_{k-1}) by enumerating every prefix with full
    uncached forwards, guided and processed exactly as the loop's p."""
    v = model.config.vocab_size
    joint = torch.ones(1, dtype=torch.float64)
    prefixes = torch.zeros(1, 0, dtype=torch.long)  # [V^t, t]
    for _ in range(k):
        n = prefixes.shape[0]
        logits = model(torch.full((n,), DIST_LABEL), prefixes)[0][:, -1]
        if sampling.use_cfg:
            uncond = model(model.null_condition(n), prefixes)[0][:, -1]
            logits = apply_cfg(torch.cat([logits, uncond]), sampling.cfg_scale, 2)
        p = probs_from_logits(logits, sampling).double()  # [n, V]
        joint = (joint[:, None] * p).reshape(-1)
        prefixes = torch.cat([prefixes.repeat_interleave(v, 0), torch.arange(v).repeat(n)[:, None]], dim=1)
    return joint


def chi_square(codes: Tensor, p: Tensor) -> tuple[float, int]:
    return chi_square_pooled(codes, p, dist_model().config.vocab_size)


# --------------------------------------------------------------------------------------------------
# Jacobi decoding (test_sjd.py, test_sjd_coupled.py, test_gsd.py, test_pjd_method.py)
# --------------------------------------------------------------------------------------------------


@cache
def cached_stack(path: str) -> ModelStack:
    return load_stack(path)


def generate_jacobi(
    model: LlamaGen,
    labels: Tensor,
    sampling: SamplingConfig,
    config: JacobiConfig,
    seeds: list[int] | None,
    drafter_cls: type[JacobiDrafter] = JacobiDrafter,
    acceptance: Acceptance | None = None,
    compile: str | None = None,
) -> GenerationOutput:
    cfg = model.config
    drafter = drafter_cls(config, sampling, cfg.vocab_size, cfg.block_size)
    target = LlamaGenTarget(model, sampling, max_tree_nodes=drafter.num_nodes, compile=compile)
    gens = None if seeds is None else make_generators(seeds)
    return generate(target, labels, generators=gens, drafter=drafter, acceptance=acceptance, compile=compile)


def assert_rows_independent(
    model: LlamaGen, s: SamplingConfig, config: JacobiConfig, acceptance: Acceptance | None
) -> GenerationOutput:
    """Each of 3 rows gives the same codes, in the same number of forwards, alone and in the
    batch, and the rows did drift apart (with batch-invariant matmuls, on a copy of ``model``: the
    property under test is the engine's, which floats that change with the batch would hide on
    some CPUs). Returns the batched run."""
    model = make_batch_invariant(copy.deepcopy(model))
    labels, seeds = [4, 5, 6], [1, 2, 3]
    batch = generate_jacobi(model, torch.tensor(labels), s, config, seeds, acceptance=acceptance)
    for i in range(3):
        alone = generate_jacobi(model, torch.tensor(labels[i : i + 1]), s, config, seeds[i : i + 1],
                                acceptance=acceptance)
        assert torch.equal(batch.codes[i], alone.codes[0]), i
        assert int(batch.stats.target_forwards[i]) == int(alone.stats.target_forwards[0])
    assert any(len(set(step.tolist())) > 1 for step in batch.stats.tokens_per_step)  # rows drifted apart
    return batch


# --------------------------------------------------------------------------------------------------
# PJD's explicit recomputation (test_pjd.py, test_pjd_method.py)
# --------------------------------------------------------------------------------------------------

PJD_WIDTH = 4  # a 4 x 4 image (block_size 16)


def pjd_model() -> LlamaGen:
    return tiny_llamagen(seed=11, vocab_size=32, block_size=PJD_WIDTH * PJD_WIDTH, dim=32, n_layer=2, n_head=2,
                         multiple_of=16)


@dataclass
class PJDToken:
    token: int
    cell: int  # raster index; -1 for condition tokens
    sees: list[int] = field(default_factory=list)  # ids (indices into the row's history) it attended to
    # never cached, in the history only because a cached token saw it (a new row's stand-in root):
    # the reference computes it, later tokens never see it
    ghost: bool = False


def pjd_reference(model: LlamaGen, label: int, history: list[PJDToken], block: list[PJDToken]) -> Tensor:
    """Logits [len(block), V] of the block by one forward over condition + history + block, every
    token attending to exactly its recorded ``sees`` (and itself), at its image position."""
    cls = model.config.cls_token_num
    seq = history + block
    n = len(seq)
    mask = torch.zeros(1, n, n, dtype=torch.bool)
    for i, tok in enumerate(seq):
        mask[0, i, tok.sees] = True
        mask[0, i, i] = True
    h_cond = model.embed_condition(torch.tensor([label]))
    h_img = model.tok_embeddings(torch.tensor([[t.token for t in seq[cls:]]]))
    positions = torch.tensor([[*range(cls), *[cls + t.cell for t in seq[cls:]]]])
    cache = KVCache(model.config.n_layer, 1, model.config.kv_heads, n, model.config.head_dim)
    hidden = model.forward_cached(torch.cat([h_cond, h_img], dim=1), positions, torch.arange(n)[None], mask, cache)
    return model.logits(hidden)[0, len(history):]


# --------------------------------------------------------------------------------------------------
# Chameleon-family layouts, tiny model and greedy AR reference (test_chameleon*.py, test_pjd_chameleon.py)
# --------------------------------------------------------------------------------------------------

LUMINA = ImageLayout(name="lumina-mgpt", height=3, width=3, prefix=(8197, 8805, 8805), uncond=(8197, 8805, 8805),
                     eol=8803)
ANOLE = ImageLayout(name="anole", height=3, width=3)
CHAMELEON_LAYOUTS = {"lumina": LUMINA, "anole": ANOLE}
# Lumina-mGPT's wide and tall sizes (its prefix names the rows, then the codes per row, in 32-pixel patches)
NON_SQUARE_LAYOUTS = {
    "wide": ImageLayout(name="lumina-mgpt", height=2, width=5, prefix=(8197, 8805, 8806), uncond=(8197, 8805, 8806),
                        eol=8803),
    "tall": ImageLayout(name="lumina-mgpt", height=5, width=2, prefix=(8197, 8806, 8805), uncond=(8197, 8806, 8805),
                        eol=8803),
}
CHAMELEON_PROMPTS = [[101, 102, 103], [150], [120, 121]]


@cache
def chameleon_lm(seed: int = 0, num_codes: int = 16, logit_std: float = 0.3) -> ChameleonLM:
    return ChameleonLM(tiny_chameleon(seed=seed, num_codes=num_codes, logit_std=logit_std))


def chameleon_greedy_ar(layout: ImageLayout, cfg: float, prompts: list[list[int]] = CHAMELEON_PROMPTS) -> Tensor:
    ids, mask = encode_prompts(prompts, layout)
    sampling = SamplingConfig(temperature=0.0, top_k=0, cfg_scale=cfg)
    return generate(ChameleonTarget(chameleon_lm(), layout, sampling), ids, cond_mask=mask).codes


# --------------------------------------------------------------------------------------------------
# Text-to-image: a tiny T5 folder and T2I stack (test_t2i.py, test_api.py, test_any_stack.py,
# test_distributed.py)
# --------------------------------------------------------------------------------------------------

T5_MAXLEN = 12  # caption slots: T5 max_length = the target's cls_token_num (120 in LlamaGen T2I)
T5_DIM = 32  # T5 d_model = the target's caption_dim (2048 for flan-t5-xl)
T5_WORDS = "a photo of cat dog red car on the beach with blue sky and mountains house in snow painting".split()


def write_tiny_t5(path: Path) -> Path:
    """A random one-layer T5 encoder and a word-level tokenizer (pad 0, </s> 1, unk 2) saved as a
    transformers folder, like a local copy of google/flan-t5-xl."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(T5_WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(str(path))
    cfg = transformers.T5Config(
        vocab_size=len(vocab), d_model=T5_DIM, d_kv=16, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
        feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )
    torch.manual_seed(0)
    transformers.T5EncoderModel(cfg).eval().save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_t5(tmp_path_factory.mktemp("t5") / "flan-t5-tiny")


def tiny_t2i_target(seed: int = 3) -> LlamaGen:
    return tiny_llamagen(seed, model_type="t2i", cls_token_num=T5_MAXLEN, caption_dim=T5_DIM, block_size=64)


@pytest.fixture(scope="module")
def t2i_stack(tmp_path_factory: pytest.TempPathFactory, t5_dir: Path) -> Path:
    """target/ (t2i), tokenizer/, drafter/ (random EAGLE), proximity table and t5/."""
    root = tmp_path_factory.mktemp("t2i") / "stack"
    target = tiny_t2i_target()
    target.save_pretrained(root / "target")
    vq = tiny_vq(0, 256)
    vq.save_pretrained(root / "tokenizer")
    torch.manual_seed(5)
    EagleDrafterModel(DrafterConfig.for_target(target.config)).save_pretrained(root / "drafter")
    build_proximity(vq.quantize.embedding.weight.detach(), k_max=64).save(root / "proximity.safetensors")
    shutil.copytree(t5_dir, root / "t5")
    return root


# --------------------------------------------------------------------------------------------------
# Files (test_train*.py, test_safety.py, test_chameleon_vq.py, test_drafter.py)
# --------------------------------------------------------------------------------------------------


def image_folder(root: Path, n: int = 12, size: int = 16) -> Path:
    """Smooth coloured blobs: learnable in a few steps, different per image."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:size, 0:size] / size
    lines = []
    for i in range(n):
        cx, cy, r = rng.uniform(0.2, 0.8, 3)
        blob = np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (0.05 + 0.1 * r))
        color = rng.uniform(0, 255, 3)
        pixels = (blob[..., None] * color).astype(np.uint8)
        Image.fromarray(pixels).save(root / f"img{i:02d}.png")
        lines.append(f"img{i:02d}.png,{i % 3}")
    (root / "labels.csv").write_text("\n".join(lines) + "\n")
    return root


def fake_class(module: str, name: str) -> type:
    """A class pickled under ``module.name`` (a module that is not installed here)."""

    class Fake:
        def __init__(self) -> None:
            self.best_model_path = "/somewhere/last.ckpt"

    Fake.__module__, Fake.__qualname__, Fake.__name__ = module, name, name
    return Fake


def save_with_fake_modules(classes: list[type], save: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Run ``save()`` while each class's module (and its parents) are importable, then remove them."""
    with monkeypatch.context() as m:
        for cls in classes:
            parts = cls.__module__.split(".")
            for i in range(1, len(parts) + 1):
                name = ".".join(parts[:i])
                if name not in sys.modules:
                    m.setitem(sys.modules, name, types.ModuleType(name))
            setattr(sys.modules[cls.__module__], cls.__name__, cls)
        result = save()
    assert all(c.__module__ not in sys.modules for c in classes)
    return result


OFFICIAL_DRAFTER_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 1,
    "vocab_size": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "rope_scaling": None,
    "input_type": "t2i",
}


def official_drafter_state(cfg: dict[str, int]) -> dict[str, torch.Tensor]:
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    g = torch.Generator().manual_seed(0)
    shapes = {
        "embed_tokens.weight": (v, d),
        "fc.weight": (d, 2 * d),
        "fc.bias": (d,),
        **{f"layers.0.self_attn.{p}_proj.weight": (d, d) for p in "qkvo"},
        "layers.0.mlp.gate_proj.weight": (f, d),
        "layers.0.mlp.up_proj.weight": (f, d),
        "layers.0.mlp.down_proj.weight": (d, f),
        "layers.0.post_attention_layernorm.weight": (d,),
    }
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def assert_cli_error(
    model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    """`lantern generate` with ``extra`` options exits 2 with one line matching ``message`` and
    writes no codes."""
    out = tmp_path / "o"
    rc = main(["generate", "--model", model, "--labels", "0", "--out", str(out), "--no-progress", *extra])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("lantern: error: ")
    assert re.search(message, err), err
    assert not (out / "codes.npy").exists()


@pytest.fixture
def eager_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Compile rounds as dynamo's ``eager`` backend does (fullgraph, static shapes, every guard
    kept: no C++ is generated). Yields the op count of every graph dynamo hands the backend, in
    order (a round's graph holds its forwards: hundreds of ops, not a few of bookkeeping)."""
    made: dict[Any, Any] = {}
    graph_ops: list[int] = []

    def eager(gm: torch.fx.GraphModule, _example_inputs: Any) -> Any:
        graph_ops.append(sum(node.op in ("call_function", "call_method", "call_module") for node in gm.graph.nodes))
        return gm.forward  # what backend="eager" returns

    def compiled(fn: Any, mode: str, device_type: str = "cpu", guards: bool = True) -> Any:
        # Guards kept (round_fn skips them): a round that would need a second graph shows up as a
        # recompilation here instead of silently reusing the first.
        if fn not in made:
            made[fn] = torch.compile(fn, fullgraph=True, dynamic=False, backend=eager)
        return made[fn]

    monkeypatch.setattr(compiling, "compiled", compiled)
    monkeypatch.setattr(compiling, "_rounds", {})
    torch._dynamo.reset()
    yield graph_ops
    torch._dynamo.reset()


def generate_pjd(
    model: LlamaGen, labels: list[int], sampling: SamplingConfig, config: PJDConfig, seeds: list[int] | None = None,
    drafter_cls: type[GridJacobiDrafter] = GridJacobiDrafter, target_cls: type[LlamaGenTarget] = LlamaGenTarget,
) -> tuple[GenerationOutput, GridJacobiDrafter, LlamaGenTarget]:
    """PJD through the one loop on a bare LlamaGen (one generator per row when ``seeds`` is given);
    the drafter and target are returned for their counters."""
    cfg = model.config
    drafter = drafter_cls(config, sampling, cfg.vocab_size, cfg.block_size)
    target = target_cls(model, sampling, max_tree_nodes=drafter.num_nodes)
    gens = None if seeds is None else make_generators(seeds)
    return generate(target, torch.tensor(labels), generators=gens, drafter=drafter), drafter, target


# --------------------------------------------------------------------------------------------------
# Serving: a live server for test_serve_api.py and test_serve_browser.py
# --------------------------------------------------------------------------------------------------


@contextmanager
def served(app: Any, timeout: float = 30.0) -> Iterator[str]:
    """``app`` served by uvicorn in a thread on a free 127.0.0.1 port: yields its base URL, and
    stops the server (its lifespan shuts the scheduler down) when the block ends."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    # A bounded drain: a test that left a connection open must not hold the server up at its end.
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()
        assert not thread.is_alive(), f"the test server did not stop within {timeout} s"


SERVE_START_TIMEOUT = 60.0  # import, load digits, warm up: about 5 s on 2 idle cores
SERVE_URL = re.compile(r"^lantern serve: .* on (http://127\.0\.0\.1:\d+)$", re.M)  # the line serve prints


@contextmanager
def serve_process(log: Path, *flags: str) -> Iterator[tuple[Any, str]]:
    """``lantern serve --model digits`` as a process on a free 127.0.0.1 port: yields the process
    and its URL once /health answers. The process is killed if the block leaves it running."""
    import os
    import subprocess

    import httpx

    # --port 0: the server binds a free port itself and prints it. A port chosen here and passed in
    # could be taken in between by another test worker (pytest -n) or any outgoing connection.
    cmd = [sys.executable, "-m", "lantern.cli", "serve", "--model", "digits", "--port", "0", *flags]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url: str | None = None
    try:
        deadline = time.monotonic() + SERVE_START_TIMEOUT
        while True:
            assert proc.poll() is None, f"lantern serve exited with {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"no /health within {SERVE_START_TIMEOUT} s:\n{log.read_text()}"
            if url is None:
                bound = SERVE_URL.search(log.read_text(errors="replace"))
                if bound is None:
                    time.sleep(0.2)
                    continue
                url = bound.group(1)
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# --------------------------------------------------------------------------------------------------
# Janus and Emu3 (test_janus*.py, test_emu3*.py): transformers-format prompt models on the Chameleon
# adapter, checked the same way through the API, the CLI and their drafters
# --------------------------------------------------------------------------------------------------

# Every method without a drafter, at settings the tiny folders' 4 x 4 codes take.
SAMPLED_METHODS = [("ar", {}), ("sjd", {"sjd_window": 4}), ("sjd-coupled", {"sjd_window": 4}),
                   ("sjd-pac", {"sjd_window": 4}), ("gsd", {"sjd_window": 4}),
                   ("pjd", {"pjd_window": 2, "pjd_context": 2}), ("sjd-coupled-lantern", {"sjd_window": 4})]


def copy_with_config(folder: Path, dest: Path, **config: Any) -> Path:
    """``folder`` with its config.json changed (links to the other files)."""
    dest.mkdir()
    for f in folder.iterdir():
        if f.is_file() and f.name != "config.json":
            (dest / f.name).symlink_to(f)
    raw = json.loads((folder / "config.json").read_text()) | config
    (dest / "config.json").write_text(json.dumps(raw))
    return dest


def copy_with_pickles_only(folder: Path, dest: Path) -> Path:
    """``folder``'s files but its safetensors (copied), and a ``pytorch_model.bin`` instead."""
    dest.mkdir()
    for f in folder.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, dest / f.name)
    (dest / "pytorch_model.bin").write_bytes(b"not read")
    return dest


def assert_left_padded(encoded: Any, ids: list[list[int]]) -> None:
    """Each prompt's ids end its row of ``encoded`` (the batch is left-padded), and the mask holds
    exactly them."""
    width = max(len(i) for i in ids)
    for row, own in enumerate(ids):
        assert encoded.cond[row, width - len(own):].tolist() == own
        assert encoded.mask[row].sum() == len(own) and bool(encoded.mask[row, width - len(own):].all())


def guided_step_logits(stack: Any, prompts: list[str], codes: Tensor, steps: int, cfg_scale: float,
                       negative: list[str] | None = None) -> list[Tensor]:
    """The target's guided logits [B, V] before each of the first ``steps`` codes of ``prompts``
    decoded together, fed ``codes`` [B, >= steps] one at a time (a row end is read at its new-line);
    ``negative``: a negative prompt per prompt (Emu3)."""
    encoded = stack.encode(prompts, negative=negative)
    target = stack.make_target(SamplingConfig(temperature=0.0, top_k=0, cfg_scale=cfg_scale))
    root = tree_from_parents(torch.full((len(prompts), 1), -1))
    out = []
    with torch.no_grad():
        logits, _ = target.start(encoded.cond, encoded.mask, encoded.guidance_rows())
        for step in range(steps):
            out.append(logits)
            logits = target.verify(codes[:, step : step + 1], root.mask, root.depth)[0][:, 0]
            target.commit(torch.zeros(len(prompts), 1, dtype=torch.long), torch.ones(len(prompts), dtype=torch.long))
    return out


def assert_greedy_method_reproduces_ar(pipe: Any, prompts: list[str], method: str, settings: dict[str, Any]) -> None:
    """Greedy ``method`` gives greedy AR's codes in no more target forwards."""
    ar = pipe(prompts=prompts, method="ar", temperature=0.0)
    out = pipe(prompts=prompts, method=method, temperature=0.0, **settings)
    assert torch.equal(out.codes, ar.codes)
    assert out.stats["target_forwards"] <= ar.stats["target_forwards"]


def assert_sampled_rows_do_not_depend_on_the_batch(pipe: Any, prompts: list[str], method: str,
                                                   settings: dict[str, Any], num_codes: int) -> None:
    """Sampled ``method`` runs on three prompts (codes of a 32-code vocabulary), and rows 0 and 2
    are the same decoded alone as in the batch of three (other prompt lengths)."""
    together = pipe(prompts=prompts, method=method, seed=3, batch_size=3, **settings)
    assert together.codes.shape == (3, num_codes) and int(together.codes.min()) >= 0 and int(together.codes.max()) < 32
    for row in (0, 2):
        alone = pipe(prompts=prompts, method=method, seed=3, batch_size=1, **settings)
        assert torch.equal(alone.codes[row], together.codes[row]), row


# ``lantern.load`` options of other families, with what their refusal names.
# (the Python API names its arguments: "layout is not used by ...")
OTHER_FAMILIES_OPTIONS = [({"layout": "anole"}, "^layout "), ({"vq": "x.ckpt"}, "^vq"), ({"t5": "t5"}, "^t5 ")]


def assert_load_refuses(folder: Path, refusals: list[tuple[dict[str, Any], str]]) -> None:
    """``lantern.load(folder, **kwargs)`` raises a LanternError matching ``flag``, for each pair."""
    for kwargs, flag in refusals:
        with pytest.raises(LanternError, match=flag):
            lantern.load(folder, **kwargs)


def drive_rounds(decode: Any, rounds: int | None = None) -> Tensor:
    """Rounds of a running ``lantern.decoding.loop.Decode`` until every row is done (or ``rounds``
    of them); returns the codes [B, N] (tests/test_rows.py, tests/test_chameleon_rows.py)."""
    n_total = decode.target.num_tokens
    with torch.inference_mode():
        while (rounds is None or rounds > 0) and bool((decode.n < n_total).any()):
            decode.round(decode.n < n_total)
            rounds = None if rounds is None else rounds - 1
    return decode.codes[:, :n_total].clone()


def dist_codes(folder: Path, prompt: str, method: str, settings: dict[str, Any], rows: int, columns: Any,
               **load: Any) -> Tensor:
    """``columns`` of ``rows`` images of ``prompt`` sampled by ``method`` at ``settings`` (seeds 0..);
    ``load``: more of ``lantern.load``'s keywords (an image size)."""
    from lantern.api import resolve_settings
    from lantern.run import run_conditions

    # the tiny prompts and negative prompt fit: fewer columns
    stack = lantern.load(folder, prompt_width=64, **load).stack
    method_cfg, sampling = resolve_settings(stack, method, **settings)
    conditions = stack.encode([prompt], repeats=rows)
    return run_conditions(stack, conditions, 0, sampling, method_cfg, batch_size=1000).codes[:, columns]


def assert_law(codes: Tensor, p: Tensor, min_df: int) -> None:
    """Chi-square goodness of fit of three codes [N, 3] of a 32-code vocabulary against their exact
    law ``p`` [32^3], at significance 0.001, with at least ``min_df`` degrees of freedom."""
    from lantern.testing import chi_square_threshold

    v = 32
    assert bool((p[(codes * torch.tensor([v * v, v, 1])).sum(1)] > 0).all()), "a sample outside the top-k support"
    stat, df = chi_square_pooled(codes, p, v)
    assert df >= min_df
    assert stat < chi_square_threshold(df), f"chi2 = {stat:.1f} with {df} dof"


# The CLI tests (test_janus_cli.py, test_emu3_cli.py)

CLI_PROMPTS = ("a red car", "a cat on the grass")


def generate_prompts(folder: Path, out: Path, *extra: str) -> int:
    """``lantern generate`` of CLI_PROMPTS with ``folder``'s model."""
    return main(["generate", "--model", str(folder), *(a for p in CLI_PROMPTS for a in ("--prompt", p)), "--out",
                 str(out), "--no-progress", *extra])


def cli_refusals(family: str) -> list[tuple[list[str], str]]:
    """``lantern generate`` options a ``family`` model does not take, with the line that refuses each."""
    return [
        (["--method", "lantern++"], "--method lantern++ needs a drafter: pass --drafter DIR"),
        (["--layout", "anole"], f"--layout is not used by {family} models"),
        (["--t5", "/tmp"], f"--t5 is not used by {family} models"),
        (["--method", "ar", "--sjd-window", "auto"], "--sjd-window auto needs a --method with that window"),
    ]


def assert_generate_refuses_in_one_line(folder: Path, tmp_path: Path, extra: list[str], message: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """``lantern generate`` with ``extra`` exits 2, its last line of stderr holds ``message``, and
    nothing is written."""
    out = tmp_path / "out"
    assert generate_prompts(folder, out, *extra) == 2
    assert message in capsys.readouterr().err.splitlines()[-1]
    assert not out.exists()


def assert_generate_greedy_methods_agree_with_the_api(folder: Path, tmp_path: Path, sjd_window: int,
                                                      layout: dict[str, Any]) -> None:
    """Greedy AR, coupled SJD and PJD at context = row length give the same codes through the CLI
    as through ``lantern.load``; the images have the VQ decoder's size; run.json records the grid
    (``layout``) and the folder's sampling defaults."""
    runs = {"ar": [], "sjd-coupled": ["--sjd-window", str(sjd_window)],
            "pjd": ["--pjd-window", "2", "--pjd-context", "4"]}
    codes = {}
    for method, extra in runs.items():
        out = tmp_path / method
        assert generate_prompts(folder, out, "--method", method, "--temperature", "0", *extra) == 0
        codes[method] = np.load(out / "codes.npy")
    assert codes["ar"].shape == (2, 16)
    assert (codes["sjd-coupled"] == codes["ar"]).all() and (codes["pjd"] == codes["ar"]).all()
    api = lantern.load(folder)(prompts=list(CLI_PROMPTS), method="ar", temperature=0.0)
    assert (api.codes.numpy() == codes["ar"]).all()
    run = json.loads((tmp_path / "ar" / "run.json").read_text())
    assert run["layout"] == layout
    assert run["sampling"]["cfg_scale"] == 3.0 and run["sampling"]["top_k"] == 8  # the folder's generation.json
    assert Image.open(tmp_path / "ar" / "0001_prompt1.png").size == tuple(layout["pixel_size"])


def assert_generate_sampled_relaxed_row_with_the_folders_table(folder: Path, tmp_path: Path) -> None:
    """Sampled coupled SJD with LANTERN++ relaxation (the folder's proximity table) runs, gives the
    same codes twice at one seed, and run.json records the relaxation."""
    args = ("--method", "sjd-coupled-lantern++", "--sjd-window", "4", "--seed", "5")
    assert generate_prompts(folder, tmp_path / "a", *args) == 0
    assert generate_prompts(folder, tmp_path / "b", *args) == 0
    a, b = np.load(tmp_path / "a" / "codes.npy"), np.load(tmp_path / "b" / "codes.npy")
    assert (a == b).all() and a.min() >= 0 and a.max() < 32
    run = json.loads((tmp_path / "a" / "run.json").read_text())
    assert run["method"]["relaxation"]["mode"] == "relative"


def assert_generate_refuses_labels_and_remote_code(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   family: str, auto_map: dict[str, str]) -> None:
    """Labels are refused naming the ``family``; a copy of ``folder`` whose config asks for remote
    code (``auto_map``) is refused in a last line naming auto_map."""
    assert main(["generate", "--model", str(folder), "--labels", "1", "--out", str(tmp_path / "o")]) == 2
    assert f"text-to-image {family} model; pass --prompt" in capsys.readouterr().err
    remote = copy_with_config(folder, tmp_path / "remote", auto_map=auto_map)
    assert main(["generate", "--model", str(remote), "--prompt", "a cat", "--out", str(tmp_path / "o2")]) == 2
    assert "auto_map" in capsys.readouterr().err.splitlines()[-1]


def assert_demo_runs(folder: Path, tmp_path: Path) -> None:
    """``lantern demo`` of greedy AR and coupled SJD: AR takes a forward a code, SJD no more."""
    out = tmp_path / "demo"
    assert main(["demo", "--model", str(folder), "--methods", "ar,sjd-coupled", "--sjd-window", "4",
                 "--temperature", "0", "--num-images", "2", "--dtype", "float32", "--out", str(out),
                 "--no-progress"]) == 0
    rows = {r["method"]: r for r in json.loads((out / "demo.json").read_text())["results"]}
    assert rows["ar"]["target_forwards"] == 2 * 16 and rows["ar"]["mean_accepted"] == 1.0
    assert rows["sjd-coupled"]["target_forwards"] <= rows["ar"]["target_forwards"]


def assert_bench_runs(folder: Path, tmp_path: Path, image_size: int) -> None:
    """bench.json has a row per method, quality against AR's own images at other seeds (a random
    feature net for ``image_size``-pixel images)."""
    from lantern.models.features import FeatureNet, FeatureNetConfig

    torch.manual_seed(0)
    features = tmp_path / "features"
    FeatureNet(FeatureNetConfig(image_size=image_size, num_classes=2, widths=(8, 16), feature_dim=16,
                                norm_groups=4)).save_pretrained(features)
    out = tmp_path / "bench"
    methods = "ar,sjd-coupled/sjd_window=4,pjd/pjd_window=2/pjd_context=2"
    assert main(["bench", "--model", str(folder), "--methods", methods, "--num-images", "4", "--speed-images", "2",
                 "--batch-size", "4", "--num-real", "4", "--curve-images", "0", "--no-ar-spread", "--feature-net",
                 str(features), "--dtype", "float32", "--out", str(out), "--no-progress"]) == 0
    rows = json.loads((out / "bench.json").read_text())
    assert [r["base_method"] for r in rows] == ["ar", "sjd-coupled", "pjd"]
    for row in rows:
        assert all(math.isfinite(row[k]) for k in ("fid", "kid", "precision", "recall"))
        assert row["num_images"] == 4 and row["mean_accepted"] >= 1.0
    assert json.loads((out / "run.json").read_text())["reference"] == "ar"


def assert_serve_gives_the_apis_codes(folder: Path, method: dict[str, Any], compile: str = "off") -> None:
    """A prompt request to the server with ``method`` (the method and its settings) gives the codes
    of ``lantern.load(folder)(prompts=[...])`` (eager, whatever the server's ``compile``); a label
    is the wrong field; the methods offered need no drafter."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from lantern.serve.app import create_app
    from lantern.serve.plan import runnable_methods
    from lantern.serve.scheduler import Scheduler

    pipe = lantern.load(folder, deterministic=True, compile=compile)  # the server's default
    assert "lantern++" not in runnable_methods(pipe) and "sjd-coupled" in runnable_methods(pipe)
    scheduler = Scheduler(pipe, max_batch=2, max_queue=4)
    scheduler.start()
    app = create_app(scheduler, pipeline=pipe, default_method="ar", max_prompt_chars=40)
    with TestClient(app) as c:
        r = c.post("/v1/images/generations", json={"label": 1})
        assert r.status_code == 400 and r.json()["error"]["field"] == "label", r.text
        body = {"prompt": "a red car", "n": 2, "seed": 4, "return_codes": True, **method}
        r = c.post("/v1/images/generations", json=body)
        assert r.status_code == 200, r.text
    eager = pipe if compile == "off" else lantern.load(folder, deterministic=True)
    expected = eager(prompts=["a red car"], num_per_label=2, seed=4, **method)
    assert [d["codes"] for d in r.json()["data"]] == expected.codes.tolist()


def assert_build_proximity_from_the_model_folder(folder: Path, tmp_path: Path, normalize: bool,
                                                 generate: list[str]) -> None:
    """``build-proximity --tokenizer FOLDER`` reads the VQ codebook out of the model's safetensors
    (no model is built); the table fits the stack, its nearest neighbours are the codebook's (of
    unit vectors with ``normalize``), and it runs a relaxed row (``generate``'s method) through
    ``--proximity``."""
    from lantern.targets.proximity import ProximityTable

    out = tmp_path / "prox.safetensors"
    assert main(["build-proximity", "--tokenizer", str(folder), "--k-max", "7", *(["--normalize"] if normalize else []),
                 "--out", str(out)]) == 0
    pipe = lantern.load(folder, proximity=out)
    codebook = pipe.stack.codebook()
    ProximityTable.load(out).validate(codebook)
    if normalize:
        codebook = torch.nn.functional.normalize(codebook, dim=-1)
    d = torch.cdist(codebook, codebook)
    d.fill_diagonal_(float("inf"))
    assert ProximityTable.load(out).neighbours[:, 0].long().tolist() == d.argmin(1).tolist()
    assert generate_prompts(folder, tmp_path / "g", *generate, "--lantern-k", "7", "--proximity", str(out)) == 0


# The drafter tests (test_janus_drafter.py, test_emu3_drafter.py)

DRAFTER_TRAIN_PROMPTS = ["a red car", "a cat on the grass", "a photo of a mountain lake at dawn", "a cat",
                         "a red mountain", "the grass at dawn"]

GREEDY_DRAFTING = [
    ("sd", {"tree": "chain:3"}),
    ("sd", {}),  # the default dynamic tree
    ("lantern", {"tree": "chain:3", "lantern_delta": 0.0}),
]


def train_chameleon_drafter(model: Path, out: Path, *extra: str) -> int:
    """``lantern train-chameleon-drafter``: a few steps, enough to save a drafter (quality is not tested)."""
    prompts = out.parent / f"{out.name}-prompts.txt"
    prompts.write_text("\n".join(DRAFTER_TRAIN_PROMPTS) + "\n")
    return main(["train-chameleon-drafter", "--model", str(model), "--prompts", str(prompts), "--eval-prompts", "1",
                 "--out", str(out), "--steps", "20", "--batch-size", "4", "--lr", "3e-3", "--warmup-steps", "2",
                 "--precision", "fp32", "--dtype", "float32", "--no-progress", *extra])


def assert_greedy_drafting_reproduces_greedy_ar(pipe: Any, prompts: list[str], method: str,
                                                settings: dict[str, Any]) -> None:
    """Greedy ``method`` with the pipeline's drafter gives greedy AR's codes with guidance on (both
    streams drafted and verified), and the drafter ran."""
    ar = pipe(prompts=prompts, method="ar", temperature=0.0)
    assert ar.config["sampling"]["cfg_scale"] == 3.0  # guidance on: both streams are drafted and verified
    out = pipe(prompts=prompts, method=method, temperature=0.0, **settings)
    assert torch.equal(out.codes, ar.codes)
    assert out.stats["drafter_forwards"] > 0


def assert_drafted_rows_do_not_depend_on_the_batch(pipe: Any, prompts: list[str], method: str) -> None:
    """Sampled ``method`` (chain:3 drafts) gives 4 x 4 codes of 32, the same in batches of 3 and 1."""
    together = pipe(prompts=prompts, method=method, seed=3, batch_size=3, tree="chain:3")
    assert together.codes.shape == (3, 16) and int(together.codes.min()) >= 0 and int(together.codes.max()) < 32
    alone = pipe(prompts=prompts, method=method, seed=3, batch_size=1, tree="chain:3")
    assert torch.equal(alone.codes, together.codes)


def assert_generate_with_drafter_gives_ar_codes(folder: Path, drafter: Path, tmp_path: Path,
                                                prompts: list[str]) -> None:
    """``lantern generate --method sd --drafter`` at temperature 0 gives greedy AR's codes."""
    codes = {}
    for method, extra in (("ar", []), ("sd", ["--drafter", str(drafter), "--tree", "chain:3"])):
        out = tmp_path / method
        assert main(["generate", "--model", str(folder), *(a for p in prompts for a in ("--prompt", p)),
                     "--out", str(out), "--no-progress", "--method", method, "--temperature", "0", *extra]) == 0
        codes[method] = np.load(out / "codes.npy")
    assert (codes["sd"] == codes["ar"]).all()


def assert_drafters_refused_in_one_line(folder: Path, others: dict[str, tuple[Path, str]], prompt: str,
                                        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each drafter folder of ``others`` (name: path, the line that must refuse it) is refused in
    that one line by ``lantern.load(folder, drafter=...)`` and by ``lantern generate`` (exit 2,
    nothing written)."""
    for name, (path, message) in others.items():
        with pytest.raises(LanternError, match="^[^\n]*$") as e:  # one line
            lantern.load(folder, drafter=path)(prompts=[prompt], method="sd", temperature=0.0)
        assert message in str(e.value), (name, str(e.value))
        capsys.readouterr()
        out = tmp_path / f"out-{name}"
        assert main(["generate", "--model", str(folder), "--prompt", prompt, "--out", str(out), "--no-progress",
                     "--method", "sd", "--drafter", str(path)]) == 2
        assert message in capsys.readouterr().err.splitlines()[-1] and not out.exists()


def run_launcher(cmd: list[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)`` for a launcher
    (torchrun, accelerate) whose ranks are its children: on a timeout the whole process group is
    killed, ranks included, before ``TimeoutExpired`` is raised. ``subprocess.run`` kills only the
    launcher, so a hung rank outlived the test (seen with torch 2.6, whose gloo teardown can hang).
    The launch's temporary files (torchelastic's log folder, which it never removes) go to a folder
    removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="lantern-test-launch-") as tmp:
        env = {**kwargs.pop("env", os.environ), "TMPDIR": tmp}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, env=env, **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def tiny_clip(folder: Path, hidden_act: str = "quick_gelu") -> Path:
    """A random CLIP with both towers and a word-level tokenizer, laid out as openai/clip-vit-base-patch32
    (``hidden_act="gelu"``: as OpenCLIP's ViT-H-14, HPS's)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[BOS]", "[PAD]", "[EOS]", "[UNK]", "a", "kite", "over", "beach", "two", "dogs", "red", "car", "cat"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", bos_token="[BOS]", eos_token="[EOS]",
                                         unk_token="[UNK]").save_pretrained(folder)
    text = {"vocab_size": len(words), "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 2, "max_position_embeddings": 77, "bos_token_id": 0, "pad_token_id": 1,
            "eos_token_id": 2, "projection_dim": 8,  # 2: pooled at the highest id (transformers' legacy rule)
            "hidden_act": hidden_act}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 32, "patch_size": 16, "projection_dim": 8, "hidden_act": hidden_act}
    torch.manual_seed(0)
    transformers.CLIPModel(transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=8)).eval() \
        .save_pretrained(folder)
    return folder
