"""Opt-in compilation of the decode engine's hot regions (``--compile``, ``compile=`` in the library).

The compiled regions are pure, static-shape functions of tensors (gpt-fast's recipe):

* the target step (``lantern.targets.llamagen._verify_step``): embeddings, every layer with its cache
  writes, the final norm, the LM head and CFG, for one tree shape. AR runs the same function
  with a one-node tree, so speed-ups are measured against a compiled AR;
* the drafter steps (``lantern.drafters.eagle._context_step`` / ``_feed_step``): the EAGLE layer, the
  shared LM head and CFG, over preallocated buffers;
* the fused acceptance (``lantern.decoding.loop._accept_core``): target probabilities, the (relaxed)
  acceptance walk and the recovered / bonus sample, from uniforms drawn outside.

Every region is compiled with ``fullgraph=True`` (a graph break is an error, not a silent slow
path) and ``dynamic=False`` (one graph per shape: tree size, batch size). Random numbers are drawn
outside, from each row's ``torch.Generator``, so compiled and eager decoding consume the same
streams. Modes: ``default`` (inductor kernels), ``reduce-overhead`` (plus CUDA graphs: one replay
per step instead of hundreds of launches), ``max-autotune``. ``auto`` picks ``reduce-overhead``
on CUDA and ``default`` elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lantern.errors import check

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # modes that capture CUDA graphs

_compiled: dict[tuple[Callable[..., Any], str, str], Callable[..., Any]] = {}


def resolve_compile(mode: str | None, device: torch.device | str) -> str | None:
    """None / "off" -> None (eager); "auto" / "on" -> the device's best mode; else a torch mode."""
    if mode is None or mode == "off":
        return None
    if mode in ("auto", "on"):
        return "reduce-overhead" if torch.device(device).type == "cuda" else "default"
    check(mode in COMPILE_MODES,
          f"--compile must be off, auto or one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    return mode


def uses_cuda_graphs(mode: str | None, device: torch.device) -> bool:
    """Whether compiled regions replay CUDA graphs: their outputs are then overwritten by the
    next replay of the same graph, so callers that keep them must clone them."""
    return mode in _GRAPH_MODES and device.type == "cuda"


def compiled(fn: Callable[..., Any], mode: str, device_type: str = "cpu") -> Callable[..., Any]:
    """``torch.compile(fn, fullgraph=True, dynamic=False, mode=mode)``, built once per (fn, mode,
    device type).

    One graph per static shape: a run with several tree sizes and batch sizes needs more cache
    entries than dynamo's default 8, so the limit is raised. On a CPU, ``default`` mode also
    generates a C++ wrapper around the kernels (``cpp_wrapper``): the drafter's small graphs are
    bound by the per-kernel Python calls otherwise (measured: a photos LANTERN++ round 8.2 ->
    6.1 ms, AR unchanged), for ~20 s more compilation.
    """
    key = (fn, mode, device_type)
    if key not in _compiled:
        cfg: Any = torch._dynamo.config
        cfg.cache_size_limit = max(cfg.cache_size_limit, 64)
        cfg.accumulated_cache_size_limit = max(cfg.accumulated_cache_size_limit, 512)
        if mode == "default" and device_type == "cpu":
            _compiled[key] = torch.compile(fn, fullgraph=True, dynamic=False, options={"cpp_wrapper": True})
        else:
            _compiled[key] = torch.compile(fn, fullgraph=True, dynamic=False,
                                           mode=None if mode == "default" else mode)
    return _compiled[key]


def step_fn(fn: Callable[..., Any], mode: str | None, device: torch.device) -> Callable[..., Any]:
    """``fn`` itself (eager) or its compiled form; under CUDA graphs, outputs are cloned on return
    (a later replay would overwrite them while the loop still reads them)."""
    if mode is None:
        return fn
    step = compiled(fn, mode, device.type)
    if not uses_cuda_graphs(mode, device):
        return step

    def run(*args: Any) -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        out = step(*args)
        return tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in out)

    return run


def mark_static(*tensors: torch.Tensor) -> None:
    """Tell dynamo these buffers keep their address (KV caches mutated in place), which CUDA graphs
    need; a no-op for eager use."""
    for t in tensors:
        torch._dynamo.mark_static_address(t)
