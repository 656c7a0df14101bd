"""Every request's work is bounded before anything is built (issue 38): a tree's node count
(MAX_TREE_NODES) for every method and tree kind, counts and seeds that are no bools and stay in
range, a compile cache that is checked at start and named when damaged, a proximity table or a
resume record that nothing vouches for checked in full or redone.

Each test says what the old behaviour was; the time bounds are generous (a refusal takes
microseconds) because the old behaviour was minutes, or memory until the kernel stepped in."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import lantern
from lantern.cli.main import main
from lantern.decoding import compiling
from lantern.decoding.config import MAX_TREE_NODES, PACConfig, TreeConfig, pac_tree_nodes
from lantern.decoding.trees import STATIC_TREES
from lantern.errors import LanternError
from lantern.methods import METHOD_TABLE, resolve_method
from lantern.testing import make_random_stack
from lantern.validate import SEED_LIMIT, check_count, check_seed


@pytest.fixture(scope="module")
def digits() -> lantern.Pipeline:
    return lantern.load("digits")


# ---- 1, 6. the tree's node count, from the settings alone ----------------------------------------


@pytest.mark.parametrize("window,width,depth", [(16, 4, 3), (16, 3, 3), (4, 1, 5), (8, 5, 1), (3, 3, 4), (32, 2, 6),
                                                (6, 6, 3)])
def test_the_counted_tree_is_the_built_tree(window: int, width: int, depth: int) -> None:
    """pac_tree_nodes (arithmetic) counts exactly the nodes PACConfig.tree builds, root included."""
    assert pac_tree_nodes(window, width, depth) == PACConfig(width, depth).tree(window).num_nodes


def test_every_default_and_documented_tree_fits() -> None:
    """The cap refuses no tree a user is pointed to: every method's defaults, the named static trees,
    SJD-PAC's defaults (35 nodes: the chain of 16 and the 18 subtree nodes off it), the widest
    --sjd-window auto candidate with SJD-PAC's subtree, and the tree sizes the README reports."""
    for method in METHOD_TABLE:
        assert resolve_method(method).tree.round_nodes <= MAX_TREE_NODES, method
    for name in STATIC_TREES:
        assert resolve_method("lantern++", tree=f"static:{name}").tree.num_nodes <= 64, name
    assert resolve_method("sjd-pac").tree.num_nodes == 35
    assert resolve_method("sjd-pac", sjd_window=32).tree.num_nodes == 51
    assert resolve_method("sjd-coupled", sjd_window=34).tree.num_nodes == 35  # DESIGN.md: "window 34"
    assert resolve_method("sd", tree="dynamic").tree.round_nodes == 59
    assert resolve_method("sd", tree=f"chain:{MAX_TREE_NODES - 1}").tree.num_nodes == MAX_TREE_NODES  # the edge


# (settings, field, text the message holds). Old behaviour: every one of these resolved; the SJD-PAC
# ones built their subtree first (64^63 nodes: memory until an allocation failed; 4175 nodes: ~30 s
# a round), the chains were refused only after the model was loaded, against its image size.
OVERSIZED = [
    ({"method": "sjd-pac", "pac_width": 64, "pac_depth": 64, "sjd_window": 63}, "pac_depth",
     "--pac-width 64 --pac-depth 64 (--sjd-window 63) makes a tree of 6.3e+113 nodes per round"),
    ({"method": "sjd-pac", "pac_width": 64, "pac_depth": 3}, "pac_width", "makes a tree of 4175 nodes"),
    ({"method": "sjd-pac", "pac_width": 64, "pac_depth": 4}, "pac_width", "makes a tree of 266318 nodes"),
    ({"method": "sjd-pac", "pac_width": 256, "pac_depth": 256, "sjd_window": 255}, "pac_depth",
     "makes a tree of more than 1e+308 nodes"),
    ({"method": "sjd-pac", "pac_width": 2, "pac_depth": 8, "sjd_window": 200}, "pac_depth",
     "makes a tree of 448 nodes"),
    ({"method": "sjd-pac", "sjd_window": 250}, "sjd_window", "(--sjd-window 250) makes a tree of 269 nodes"),
    ({"method": "sjd", "sjd_window": 300}, "sjd_window", "--sjd-window 300 makes a tree of 301 nodes"),
    ({"method": "gsd", "sjd_window": 10**12}, "sjd_window", "makes a tree of 1e+12 nodes"),
    ({"method": "pjd", "pjd_window": 256}, "pjd_window", "--pjd-window 256 makes a tree of 257 nodes"),
    ({"method": "lantern++", "tree": "chain:100000"}, "tree", "--tree chain:100000 makes a tree of 100001 nodes"),
    ({"method": "sd", "tree": TreeConfig(kind="dynamic", total_tokens=300)}, "tree", "--tree dynamic makes a tree"),
    ({"method": "sd", "tree": TreeConfig(kind="dynamic", depth=100, top_k=100)}, "tree", "of 10000 nodes"),
]


@pytest.mark.parametrize("settings,field,text", [
    *OVERSIZED,
    # A K or D past the cap alone (old: 10**9 hung; with --pac-depth 1 it was no tree, but a K past
    # the vocabulary, refused only once the model was loaded).
    ({"method": "sjd-pac", "pac_width": 10**9}, "pac_width", "--pac-width must be at most 256"),
    ({"method": "sjd-pac", "pac_width": 10**400, "pac_depth": 1}, "pac_width", "--pac-width must be at most 256"),
    ({"method": "sjd-pac", "pac_depth": 257, "sjd_window": 10}, "pac_depth", "--pac-depth must be at most 256"),
])
def test_an_oversized_tree_is_refused_from_its_settings(settings: dict[str, Any], field: str, text: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(LanternError) as caught:
        resolve_method(**settings)
    assert time.perf_counter() - t0 < 1.0
    error = caught.value
    assert error.field == field and text in str(error) and "\n" not in str(error), (error.field, str(error))
    flag = "--tree" if field == "tree" else f"--{field.replace('_', '-')}"
    if "makes a tree" in text:
        assert f"at most {MAX_TREE_NODES} fit one verify forward" in str(error)
        assert str(error).endswith(flag)  # what to lower, as the user typed it
    else:
        assert str(error).startswith(flag)


def test_the_api_refuses_a_huge_subtree_at_once(digits: lantern.Pipeline) -> None:
    """``lantern.load('digits')(labels=[1], method='sjd-pac', pac_width=10**9)``: old behaviour, a
    hang in one C call that ignored Ctrl-C, growing ~1 GB every 10 s."""
    t0 = time.perf_counter()
    with pytest.raises(LanternError, match=r"^pac_width must be at most 256 \(the nodes a tree may have\), got "
                                           r"1000000000$") as caught:
        digits(labels=[1], method="sjd-pac", pac_width=10**9)
    assert time.perf_counter() - t0 < 1.0 and caught.value.field == "pac_width"
    t0 = time.perf_counter()
    with pytest.raises(LanternError, match=r"^pac_width 64 pac_depth 64 \(sjd_window 63\) makes a tree of "
                                           r"6.3e\+113 nodes") as caught:
        digits(labels=[1], method="sjd-pac", pac_width=64, pac_depth=64, sjd_window=63)
    assert time.perf_counter() - t0 < 1.0 and caught.value.field == "pac_depth"


# ---- 10. counts and seeds: no bools, no aliases ---------------------------------------------------


@pytest.mark.parametrize("kwargs,field,message", [
    # Old: True was taken as 1 image / a batch of 1.
    ({"num_per_label": True}, "num_per_label", r"^num_per_label must be an integer >= 1, got True$"),
    ({"batch_size": True}, "batch_size", r"^batch_size must be an integer >= 1, got True$"),
    # Old: seeds were taken modulo 2^63 (2**70 gave seed 0's images) and negative ones accepted.
    ({"seed": 2**70}, "seed", r"^seed must be in \[0, 2\^63\), got 1180591620717411303424$"),
    ({"seed": SEED_LIMIT}, "seed", r"^seed must be in \[0, 2\^63\), got 9223372036854775808$"),
    ({"seed": -1}, "seed", r"^seed must be in \[0, 2\^63\), got -1$"),
    ({"seed": True}, "seed", r"^seed must be an integer, got True \(bool\)$"),
    # Old: True was a width of 1 (PACConfig refused it already) or a lantern k of 1.
    ({"method": "sjd-pac", "pac_width": True}, "pac_width", r"^pac_width must be an integer >= 1, got True$"),
    ({"method": "lantern", "lantern_k": True}, "lantern_k", r"^lantern_k must be an integer >= 0, got True$"),
])
def test_the_api_refuses_bools_as_counts_and_seeds_out_of_range(digits: lantern.Pipeline, kwargs: dict[str, Any],
                                                               field: str, message: str) -> None:
    with pytest.raises(LanternError, match=message) as caught:
        digits(labels=[1], **kwargs)
    assert caught.value.field == field


def test_seed_bounds() -> None:
    assert check_seed(SEED_LIMIT - 1, "--seed") == SEED_LIMIT - 1 and check_seed(0, "--seed") == 0
    assert check_seed(torch.tensor(5).item(), "seed") == 5
    with pytest.raises(LanternError, match=r"^--seed must be in \[0, 2\^63\)"):
        check_seed(SEED_LIMIT, "--seed")
    with pytest.raises(LanternError, match=r"^--trace-images must be an integer >= 1, got False$"):
        check_count(False, "--trace-images")


# ---- 8. the compile cache ---------------------------------------------------------------------------


def _unwritable_folder(tmp_path: Path) -> Path:
    """A folder this process cannot write: a read-only one, or (as root, who writes there anyway)
    /sys, which even root cannot add files to."""
    folder = tmp_path / "readonly"
    folder.mkdir()
    folder.chmod(0o555)
    if not os.access(folder, os.W_OK):
        return folder
    if Path("/sys").is_dir() and not _can_create_in(Path("/sys")):
        return Path("/sys")
    pytest.skip("no folder here that this process cannot write")


def _can_create_in(folder: Path) -> bool:
    try:
        (folder / ".lantern-probe").touch()
    except OSError:
        return False
    (folder / ".lantern-probe").unlink()
    return True


@pytest.fixture
def own_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lantern chooses the cache (not a TORCHINDUCTOR_CACHE_DIR of the environment); nothing checked yet."""
    monkeypatch.setattr(compiling, "_USER_CACHE_DIR", False)
    monkeypatch.setattr(compiling, "_writable_caches", set())


@pytest.mark.usefixtures("own_cache")
def test_an_unusable_compile_cache_is_one_line_at_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Old behaviour: a read-only cache failed after ~50 s of compiling with inductor's OSError
    traceback; a cache path that is a file failed with an error that blamed --out."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    unwritable = _unwritable_folder(tmp_path)
    for cache, what in ((a_file, "is a file, not a folder"), (a_file / "sub", "cannot be written (Not a directory)"),
                        (unwritable, "cannot be written (")):
        monkeypatch.setenv("LANTERN_COMPILE_CACHE", str(cache))
        out = tmp_path / "out"
        t0 = time.perf_counter()
        assert main(["generate", "--model", "digits", "--labels", "0", "--compile", "default", "--out", str(out),
                     "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert time.perf_counter() - t0 < 10.0  # nothing was compiled (a compile here takes ~45 s)
        assert err.startswith(f"lantern: error: LANTERN_COMPILE_CACHE={cache} {what}") and err.count("\n") == 1, err
        assert "set LANTERN_COMPILE_CACHE to a writable folder" in err and "--out" not in err
        assert not out.exists()
    monkeypatch.delenv("LANTERN_COMPILE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(a_file))  # the default location, under a file
    with pytest.raises(LanternError, match=rf"^the compile cache {a_file}/lantern/compile cannot be written"):
        lantern.load("digits", compile="default")


def cache_hit_post_compile() -> None:  # named as inductor's loader of a cache hit
    b"\x97".decode()


@pytest.mark.usefixtures("own_cache")
def test_only_errors_from_loading_the_cache_are_called_damage(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LANTERN_COMPILE_CACHE", str(tmp_path / "c"))
    try:
        try:
            cache_hit_post_compile()
        except UnicodeDecodeError as e:
            raise RuntimeError("backend='inductor' raised") from e
    except RuntimeError as e:
        damage = compiling.cache_damage(e)
    assert damage is not None and str(damage) == (
        f"LANTERN_COMPILE_CACHE={tmp_path / 'c'} is damaged (UnicodeDecodeError loading a cached kernel): delete the "
        f"folder {tmp_path / 'c'} (it is rebuilt on the next run) or set LANTERN_COMPILE_CACHE to another one")
    try:
        b"\x97".decode()  # the same error anywhere else (a compiler bug, a model's own code) is not the cache's
    except UnicodeDecodeError as e:
        assert compiling.cache_damage(e) is None
    for error, named in ((ImportError, True), (RuntimeError, False)):  # only a library that does not load
        try:
            try:
                _load_library_inner(error)
            except Exception as e:
                raise RuntimeError("InductorError") from e
        except RuntimeError as e:
            damage = compiling.cache_damage(e)
        assert (damage is not None) == named, error
        assert damage is None or str(damage).startswith(
            f"LANTERN_COMPILE_CACHE={tmp_path / 'c'} is damaged (ImportError loading a cached kernel)")


def _load_library_inner(error: type[Exception]) -> None:  # named as inductor's loader of a compiled library
    raise error("invalid ELF header")


def _generate_compiled(model: Path, cache: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """``lantern generate`` compiled, in a fresh process (which reads the cache from disk), on ``cache``."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["LANTERN_COMPILE_CACHE"] = str(cache)
    argv = ["generate", "--model", str(model), "--labels", "0", "--batch-size", "1", "--compile", "default",
            "--no-progress", "--out", str(out)]
    return subprocess.run([sys.executable, "-m", "lantern.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=900)


@pytest.mark.slow
@pytest.mark.long  # ~50 s: a cold compile, then two damaged copies of its cache
def test_a_damaged_compile_cache_is_named(tmp_path: Path) -> None:
    """Random bytes in the cache's generated modules (``.py``) or compiled libraries (``.so``).
    Old behaviour: a BackendCompilerFailed traceback (a UnicodeDecodeError, or a failed C++ rebuild).
    The model is the smallest stack (2 layers, a 4x4 grid): its AR round compiles in half the time
    of digits', and the cache holds the same kinds of files."""
    model = make_random_stack(tmp_path / "model", grid=4)
    cache = tmp_path / "cache"
    first = _generate_compiled(model, cache, tmp_path / "first")
    assert first.returncode == 0, first.stderr[-2000:]
    for suffix in (".py", ".so"):
        damaged = tmp_path / f"damaged{suffix}"
        shutil.copytree(cache, damaged)
        files = sorted(damaged.rglob(f"*{suffix}"))
        assert files
        for path in files:
            path.write_bytes(os.urandom(4096))
        run = _generate_compiled(model, damaged, tmp_path / f"out{suffix}")
        assert run.returncode == 2, run.stderr[-2000:]
        assert run.stderr.startswith(f"lantern: error: LANTERN_COMPILE_CACHE={damaged} is damaged (")
        assert run.stderr.count("\n") == 1 and f"delete the folder {damaged}" in run.stderr, run.stderr


# ---- 9. a proximity table without its hash --------------------------------------------------------


def test_a_table_without_its_hash_is_checked_in_full(tmp_path: Path) -> None:
    """Old behaviour: only 64 sampled rows were compared with the codebook, so rows outside the
    sample could be reordered (acceptance 2.69 -> 2.52) and the table loaded, rc 0."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from lantern.targets.llamagen_stack import preset_dir
    from lantern.targets.proximity import SAMPLE_ROWS, ProximityTable

    preset = preset_dir("digits") / "proximity.safetensors"
    with safe_open(str(preset), "pt") as f:
        meta = {k: v for k, v in f.metadata().items() if k != "table_sha256"}
        nbr = f.get_tensor("neighbours").clone()
    codebook = lantern.load("digits").stack.codebook()
    assert codebook is not None
    unhashed = tmp_path / "unhashed.safetensors"
    save_file({"neighbours": nbr}, str(unhashed), metadata=meta)
    table = ProximityTable.load(unhashed)
    assert not table.hashed
    table.validate(codebook)  # the untouched table passes the full check
    sample = torch.linspace(0, table.vocab_size - 1, SAMPLE_ROWS).round().long()
    assert 1 not in sample.tolist()
    nbr[1, [0, 1]] = nbr[1, [1, 0]]  # outside the sample
    save_file({"neighbours": nbr}, str(unhashed), metadata=meta)
    with pytest.raises(LanternError, match=r"unhashed.safetensors: token 1's neighbours are not its nearest"):
        ProximityTable.load(unhashed).validate(codebook)

