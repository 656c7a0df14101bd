"""Opt-in compilation of the decode engine (``--compile``, ``compile=`` in the library).

**One region per round.** Under ``compile`` the loop runs each decoding round as one compiled
callable (:func:`round_fn`): the drafter's whole chain or tree (every feed and every level's
draws, unrolled at trace time to the tree's static depth), the target verify with its tree mask,
the acceptance rule, residual / bonus sampling, the cache commits of target and drafter and the
bookkeeping (codes, lengths, root). That is what SGLang's EAGLE worker, vLLM's EAGLE proposer and
TensorRT-LLM's one-model speculative worker capture in CUDA graphs; gpt-fast compiles the same
kind of static-shape step. Everything inside is static-shape and sync-free: accepted lengths are
index tensors over the tree's fixed width, finished rows compute and write nothing, random numbers
come from a counter hash (``lantern.decoding.rng``), not from ``torch.Generator`` objects. The
compiled round is built with ``fullgraph=True`` (a graph break is an error, not a silent slow
path) and ``dynamic=False`` (one graph per method, tree and batch size). On CUDA ``auto`` picks
``reduce-overhead``: the round is one CUDA-graph replay.

The finer regions (:func:`step_fn`: the target step, the drafter steps, the fused acceptance) are
inlined when they run inside a compiled round; they are compiled on their own only where a caller
uses them outside the loop (the prefill, ``lantern profile``'s cost probes).

**Start-up.** Each (method, tree, batch size) is traced and compiled once per process. Inductor's
generated kernels are cached on disk (:func:`compile_cache_dir`: ``$LANTERN_COMPILE_CACHE``, else
``$XDG_CACHE_HOME/lantern/compile`` or ``~/.cache/lantern/compile``), so a second run of the same
command skips code generation and C++ compilation and pays only the trace. That first call takes
seconds to minutes before the first round's tokens; within :func:`announce_compiles` (the CLI,
unless ``--no-progress``) it is announced, so that a progress bar frozen at 0 does not look like a hang.

Modes: ``default`` (inductor kernels), ``reduce-overhead`` (plus CUDA graphs), ``max-autotune``.
``auto`` picks ``reduce-overhead`` on CUDA and ``default`` elsewhere.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from lantern.errors import LanternError, check

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # modes that capture CUDA graphs

_compiled: dict[tuple[Callable[..., Any], str, str], Callable[..., Any]] = {}
_rounds: dict[tuple[object, ...], Callable[..., Any]] = {}  # round_fn's compiled copies, by fingerprint
# Calls of compiled regions made by the engine since import (``lantern profile --trace`` reads the
# difference across a round: its ``regions_per_round``).
region_calls = 0
# Seconds spent in the first call of each compiled region since import: its compilation (or the
# cache's loading) and one run. A run reports the difference as the part of its decoding time that
# was compiling, not decoding (``RunResult.compile_seconds``).
first_call_seconds = 0.0
_announcers: list[Callable[[str], None]] = []  # announce_compiles' writers, innermost last


def compile_cache_dir() -> Path:
    """Where inductor's compiled artifacts persist across processes: ``$LANTERN_COMPILE_CACHE``,
    else ``$XDG_CACHE_HOME/lantern/compile``, else ``~/.cache/lantern/compile``."""
    if os.environ.get("LANTERN_COMPILE_CACHE"):
        return Path(os.environ["LANTERN_COMPILE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lantern" / "compile"


# Whether the user chose inductor's cache folder before lantern was imported (inductor writes its
# default into the same variable the first time it compiles, so it is read here, at import).
_USER_CACHE_DIR = "TORCHINDUCTOR_CACHE_DIR" in os.environ


def _use_cache_dir() -> None:
    """Point inductor's caches (FX graph and AOT-autograd caches, kernels) at :func:`compile_cache_dir`,
    unless the user chose ``TORCHINDUCTOR_CACHE_DIR`` (inductor reads the variable at every use)."""
    check_cache_dir()
    if not _USER_CACHE_DIR:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache_dir())


def _cache_in_use() -> tuple[Path, str, str]:
    """The folder inductor caches in, how a message names it, and the variable that moves it."""
    if _USER_CACHE_DIR:
        path = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")).expanduser()
        return path, f"TORCHINDUCTOR_CACHE_DIR={path}", "TORCHINDUCTOR_CACHE_DIR"
    path = compile_cache_dir()
    named = f"LANTERN_COMPILE_CACHE={path}" if os.environ.get("LANTERN_COMPILE_CACHE") else f"the compile cache {path}"
    return path, named, "LANTERN_COMPILE_CACHE"


_writable_caches: set[Path] = set()  # checked once per process and folder


def check_cache_dir() -> None:
    """LanternError, before anything is compiled, unless the compile cache is a folder this process
    can write: inductor finds out only when it first writes there, after minutes of compiling
    (read-only: its OSError traceback; a file: an error that blamed ``--out``)."""
    path, named, variable = _cache_in_use()
    if path in _writable_caches:
        return
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        what = "is a file, not a folder" if path.is_file() else f"cannot be written ({e.strerror or e})"
        raise LanternError(f"{named} {what}: set {variable} to a writable folder (compiled kernels are cached "
                           "there)") from None
    _writable_caches.add(path)


# Inductor's functions that load a cache hit's artifacts (its generated module and compiled library):
# an error raised under one of them comes from a damaged cache file, not from compiling.
_CACHE_HIT_LOADERS = frozenset({"_lookup_graph", "cache_hit_post_compile", "after_deserialization"})
# Where inductor opens a compiled library. It rebuilds a library only when its file is missing, so
# a damaged ``.so`` is loaded even when the graph itself is compiled afresh (seen on AMD EPYC, where
# the damage changed the FX graph key; the error is an ImportError "invalid ELF header" under these frames).
_LIBRARY_LOADERS = frozenset({"_load_library", "_load_library_inner"})


def _frames(error: BaseException) -> set[str]:
    return {frame.f_code.co_name for frame, _ in traceback.walk_tb(error.__traceback__)}


def cache_damage(error: BaseException) -> LanternError | None:
    """One line for an error that loading the compile cache raised (random bytes in a cached
    ``.py`` end in a UnicodeDecodeError, in a ``.so`` in a failed rebuild or an ImportError, all
    wrapped in dynamo's BackendCompilerFailed or inductor's InductorError), found by the frames it
    passed through; None for any other error."""
    chain: list[BaseException] = []
    cause: BaseException | None = error
    while cause is not None and all(cause is not seen for seen in chain):
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    if not any(_frames(e) & _CACHE_HIT_LOADERS or (isinstance(e, ImportError) and _frames(e) & _LIBRARY_LOADERS)
               for e in chain):
        return None
    path, named, variable = _cache_in_use()
    return LanternError(f"{named} is damaged ({type(chain[-1]).__name__} loading a cached kernel): delete the folder "
                        f"{path} (it is rebuilt on the next run) or set {variable} to another one")


def resolve_compile(mode: str | None, device: torch.device | str) -> str | None:
    """None / "off" -> None (eager); "auto" / "on" -> the device's best mode; else a torch mode."""
    if mode is None or mode == "off":
        return None
    check(not isinstance(mode, bool),  # torch.compile's habit: a flag there, a mode name here
          f"--compile takes a mode name, not {mode!r}: 'auto' compiles for this device, 'off' (or None) does not")
    check(mode in ("auto", "on", *COMPILE_MODES),
          f"--compile must be off, auto or one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    check_cache_dir()  # at the start of a compiled run, not after its first compilation
    if mode in ("auto", "on"):
        return "reduce-overhead" if torch.device(device).type == "cuda" else "default"
    return mode


def uses_cuda_graphs(mode: str | None, device: torch.device) -> bool:
    """Whether compiled regions replay CUDA graphs: their outputs are then overwritten by the
    next replay of the same graph, so callers that keep them must clone them."""
    return mode in _GRAPH_MODES and device.type == "cuda"


def compiled(fn: Callable[..., Any], mode: str, device_type: str = "cpu", guards: bool = True) -> Callable[..., Any]:
    """``torch.compile(fn, fullgraph=True, dynamic=False, mode=mode)``, built once per (fn, mode,
    device type).

    One graph per static shape: a run with several tree sizes and batch sizes needs more cache
    entries than dynamo's default 8, so the limit is raised. On a CPU, ``default`` mode also
    generates a C++ wrapper around the kernels (``cpp_wrapper``): the drafter's small graphs are
    bound by the per-kernel Python calls otherwise (measured: a photos LANTERN++ round 8.2 ->
    6.1 ms, AR unchanged), for ~20 s more compilation. ``guards=False``: dynamo checks no guards
    before a call (see :func:`round_fn`, which guards once per decode instead).
    """
    key = (fn, mode, device_type)
    if key not in _compiled:
        _use_cache_dir()
        _quiet_inductor_imports()
        cfg: Any = torch._dynamo.config
        cfg.cache_size_limit = max(cfg.cache_size_limit, 64)
        cfg.accumulated_cache_size_limit = max(cfg.accumulated_cache_size_limit, 512)
        options: dict[str, Any] = dict(torch._inductor.list_mode_options(mode))
        if mode == "default" and device_type == "cpu":
            options["cpp_wrapper"] = True
        if device_type == "cpu":
            options.update(cpu_vector_options())
        if not guards and hasattr(torch.compiler, "skip_guard_on_inbuilt_nn_modules_unsafe"):
            # guard_filter_fn came with these helpers (torch 2.7); older versions keep their guards.
            options["guard_filter_fn"] = _no_guards
        _compiled[key] = torch.compile(fn, fullgraph=True, dynamic=False, options=options)
    return _compiled[key]


def cpu_vector_options() -> dict[str, Any]:
    """Inductor options for this CPU. On AVX2 (what an AMD EPYC or any CPU without AVX-512 runs,
    or ``ATEN_CPU_CAPABILITY=avx2``), torch 2.13's vectorised C++ for the fused SJD round indexes
    out of bounds (``index out of bounds: 0 <= tmp2 < V`` on the sampled tokens, then the process
    aborts), while its scalar code and its AVX-512 code are right: there, kernels are generated
    without SIMD (``cpp.simdlen = 1``; matmuls and attention still run MKL's and ATen's own
    vectorised kernels). Checked by tests/test_capabilities.py, which reruns the compiled
    distribution tests under forced AVX2."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return {"cpp.simdlen": 1} if pick_vec_isa().bit_width() == 256 else {}


def _quiet_inductor_imports() -> None:
    """Import what inductor imports during the first compilation now, without the two messages
    those imports print about torch's own code, once per process, in the middle of a user's run
    or before a one-line error:

    - ``torch.utils.mkldnn``: its classes are built with the deprecated
      ``torch.jit.script_method`` (a DeprecationWarning);
    - ``torch.utils.cpp_extension``: a CUDA build of torch (what ``pip install torch`` gives on
      Linux) on a machine with a CUDA toolkit and no GPU logs "No CUDA runtime is found, using
      CUDA_HOME=..." when it is imported. A CPU compilation builds no CUDA extension, so the line
      only misleads; with a GPU present it is never logged."""
    import logging
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script_method` is deprecated",
                                category=DeprecationWarning)
        import torch.utils.mkldnn  # noqa: F401
    if "torch.utils.cpp_extension" not in sys.modules and not torch.cuda.is_available():
        log = logging.getLogger("torch.utils.cpp_extension")  # torch 2.13 logs the line
        level = log.level
        log.setLevel(logging.ERROR)
        printed = io.StringIO()  # torch 2.6 prints it to stderr
        try:
            with contextlib.redirect_stderr(printed):
                import torch.utils.cpp_extension  # noqa: F401
        finally:
            log.setLevel(level)
            sys.stderr.write("".join(line for line in printed.getvalue().splitlines(keepends=True)
                                     if not line.startswith("No CUDA runtime is found")))


def _no_guards(entries: list[Any]) -> list[bool]:
    return [False] * len(entries)


def step_fn(fn: Callable[..., Any], mode: str | None, device: torch.device) -> Callable[..., Any]:
    """``fn`` itself (eager, or inlined when traced inside a compiled round) or its compiled form."""
    if mode is None or torch.compiler.is_compiling():
        return fn
    what = "the " + fn.__name__.strip("_").replace("_", " ")  # "the context step": an EAGLE prefill's
    return _counted(compiled(fn, mode, device.type), uses_cuda_graphs(mode, device), what)


def round_fn(
    fn: Callable[..., Any], mode: str | None, device: torch.device, state: tuple[object, ...] = ()
) -> Callable[..., Any]:
    """A decoding round as one compiled region (``fn`` itself when ``mode`` is None).

    state: everything the round reads besides its per-round tensors (target, drafter, random
    streams, codes, acceptance and sampling settings).

    **Guards once per decode, not once per round.** Before every call of a compiled function
    dynamo evaluates its guards: a check of every tensor's shape, stride and dtype and of every
    Python value the trace read. A round reaches the target, the drafter, their caches and every
    parameter of both models, and the check cost ~0.9 ms per round on the CPU (7 % of a photos
    LANTERN round; as much as a whole GPU round). So the round is compiled per *fingerprint* of
    its state (:func:`_fingerprint`: the same facts, read once per decode), as a copy of ``fn``
    with its own code object (dynamo keeps compiled entries per code object) and no guards.
    A decode with another method, tree, batch size or model gets another copy.

    Under CUDA graphs the addresses of the tensors the round mutates in place are marked static,
    so that cudagraph trees replay the round instead of skipping it for "mutated inputs". A marked
    tensor found at another address makes torch record the graph again: within a decode the round
    updates its state in place, and between decodes ``lantern.decoding.resident`` puts it back at
    the previous decode's addresses.
    """
    if mode is None:
        return fn
    graphs = uses_cuda_graphs(mode, device)
    slots: list[Slot] = []
    key = (fn, mode, device.type, _fingerprint(state, slots))
    if graphs:
        mark_static(*(t for t, _, _ in slots))
    if key not in _rounds:
        name = f"{fn.__name__}_{len(_rounds)}"
        code = fn.__code__.replace(co_name=name, co_qualname=name)
        copy = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
        _rounds[key] = _counted(compiled(copy, mode, device.type, guards=False), graphs, "the decoding round")
    return _rounds[key]


# A tensor of a round's state, how to put another tensor in its place (``lantern.decoding.resident``)
# and where it was found ("target.root_index": for messages and tests).
Slot = tuple[torch.Tensor, Callable[[Any], None], str]


def round_state_key(state: list[object], slots: list[Slot], names: Sequence[str] = ()) -> object:
    """:func:`_fingerprint` of a round's state, given as a list so that even its top-level
    tensors can be put back in place (the slots' setters write into the list); ``names``: what
    the paths call the list's items (default ``[0]``, ``[1]``, ...)."""
    return tuple(_fingerprint(x, slots, 5, _item_setter(state, i), names[i] if i < len(names) else f"[{i}]")
                 for i, x in enumerate(state))


def _fingerprint(obj: object, slots: list[Slot], depth: int = 6,
                 put: Callable[[Any], None] | None = None, path: str = "") -> object:
    """What a compiled round's trace depends on, as a hashable value: tensors by shape, stride,
    dtype and device (and appended to ``slots`` with their setter and path: the state a round may
    mutate); modules by identity (their parameters are graph inputs); Python scalars, strings and
    settings by value; objects by type and attributes, ``depth`` levels down. A
    :class:`~lantern.decoding.cache.CachePool` is left out (it holds caches of other batches)."""
    if isinstance(obj, torch.Tensor):
        slots.append((obj, put or _fixed, path))
        return ("T", tuple(obj.shape), obj.stride(), obj.dtype, obj.device, obj.requires_grad)
    if obj is None or isinstance(obj, (bool, int, float, str, torch.dtype, torch.device)):
        return obj
    if isinstance(obj, torch.nn.Module) or callable(obj) or depth == 0:
        return (type(obj).__qualname__, id(obj))
    if isinstance(obj, list):
        return tuple(_fingerprint(x, slots, depth - 1, _item_setter(obj, i), f"{path}[{i}]") for i, x in enumerate(obj))
    if isinstance(obj, tuple):
        items = list(obj)  # what the tuple's setters rebuild it from
        return tuple(_fingerprint(x, slots, depth - 1, _tuple_setter(obj, items, i, put), f"{path}[{i}]")
                     for i, x in enumerate(obj))
    if isinstance(obj, dict):
        return tuple((k, _fingerprint(v, slots, depth - 1, _item_setter(obj, k), f"{path}[{k!r}]"))
                     for k, v in obj.items())
    if type(obj).__name__ == "CachePool":
        return "CachePool"
    if hasattr(obj, "__dict__"):
        attrs = vars(obj).items()
        return (type(obj).__qualname__,
                tuple((k, _fingerprint(v, slots, depth - 1, _attr_setter(obj, k), f"{path}.{k}")) for k, v in attrs))
    return (type(obj).__qualname__, id(obj))


def _fixed(_: object) -> None:
    raise TypeError("this tensor of a round's state sits where it cannot be replaced (pass the state as a list)")


def _item_setter(container: Any, key: Any) -> Callable[[torch.Tensor], None]:
    return lambda t: container.__setitem__(key, t)


def _attr_setter(obj: object, name: str) -> Callable[[torch.Tensor], None]:
    return lambda t: object.__setattr__(obj, name, t)  # frozen dataclasses (TreeBuffers) too


def _tuple_setter(tup: tuple[Any, ...], items: list[Any], i: int,
                  put: Callable[[Any], None] | None) -> Callable[[torch.Tensor], None]:
    """A tuple is rebuilt from ``items`` and put where it was found; its items' setters share that
    list, so that several of them replaced one after the other all end up in the tuple."""

    def set_item(t: torch.Tensor) -> None:
        items[i] = t
        rebuilt = type(tup)(*items) if hasattr(tup, "_fields") else type(tup)(items)  # a NamedTuple or a tuple
        (put or _fixed)(rebuilt)

    return set_item


@contextlib.contextmanager
def announce_compiles(write: Callable[[str], None]) -> Iterator[None]:
    """Within the block, the first call of each compiled region (it traces and compiles, or loads
    the cache: seconds to minutes) is announced with ``write``, before and after: one line each."""
    _announcers.append(write)
    try:
        yield
    finally:
        _announcers.remove(write)


def compile_notices(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """:func:`announce_compiles` as ``lantern: ...`` lines on stderr, above any tqdm bar (what the
    CLI and ``pipe(..., progress=True)`` show), or nothing."""
    if not enabled:
        return contextlib.nullcontext()
    from tqdm.auto import tqdm

    return announce_compiles(lambda line: tqdm.write(f"lantern: {line}", file=sys.stderr))


def _counted(step: Callable[..., Any], graphs: bool, what: str) -> Callable[..., Any]:
    """Count every call (``region_calls``); under CUDA graphs, open a new replay step and clone the
    outputs on return (a later replay would overwrite them while the loop still reads them).
    ``what`` names the region in the first call's announcement (:func:`announce_compiles`)."""
    first = True

    def run(*args: Any) -> Any:
        global region_calls, first_call_seconds
        nonlocal first
        region_calls += 1
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        write = _announcers[-1] if first and _announcers else None
        if write is not None:
            write(f"compiling {what} (once per method and batch size in a process; inductor's kernels are "
                  f"cached in {compile_cache_dir()}) ...")
        start = time.perf_counter() if first else 0.0
        try:  # the first call compiles (or loads the cache): a damaged cache is one line
            out = step(*args)
        except Exception as e:
            damage = cache_damage(e)
            if damage is None:
                raise
            raise damage from e
        if first:
            first = False
            spent = time.perf_counter() - start
            first_call_seconds += spent
            if write is not None:
                write(f"compiled {what} in {spent:.1f} s")
        return tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in out) if graphs else out

    return run


def mark_static(*tensors: torch.Tensor) -> None:
    """Tell dynamo these buffers keep their address (KV caches mutated in place), which CUDA graphs
    need; a no-op for eager use."""
    for t in tensors:
        torch._dynamo.mark_static_address(t)
