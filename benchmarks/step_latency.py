"""Target step / verify latency of real-size LlamaGen shapes: eager vs compiled vs CUDA graphs.

What bounds a speculative round on a GPU is not the verify's arithmetic but what it costs to
launch it: a batch-1 LlamaGen step in eager mode is a few hundred small kernels, each paid for in
host time. This script times one cached target forward over ``n`` tree tokens after a
half-image prefix, with CFG (2 model rows per image) and random weights, three ways:

* ``eager``: the library's ``LlamaGenTarget.verify`` as the loop calls it today (the key/value
  length follows the row's prefix, so shapes change every step);
* ``static``: the same model forward over the *whole* preallocated cache with a mask (one shape
  for every step: the precondition of compilation and graph capture, as in gpt-fast);
* ``compiled``: ``static`` under ``torch.compile(fullgraph=True)``; on CUDA with
  ``mode="reduce-overhead"`` (CUDA graphs), on CPU with the default mode.

It also counts the operators one eager step dispatches (``torch.profiler``), and reports the
compile time of each (config, n) graph separately. Weights are random: the cost of a forward does
not depend on their values.

    python benchmarks/step_latency.py --configs GPT-B,GPT-L,GPT-XL --out benchmarks/results/step-latency-h100

Writes OUT/step_latency.json and prints one line per (config, mode).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from lantern.decoding.compiling import cpu_vector_options
from lantern.decoding.config import SamplingConfig
from lantern.decoding.trees import tree_from_parents
from lantern.eval.report import machine_description
from lantern.models.llamagen import LlamaGen, llamagen_config
from lantern.targets.base import inference_dtype
from lantern.targets.llamagen import LlamaGenTarget

POINTS = (1, 4, 16, 64)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    for _ in range(3):  # warm-up (and, for reduce-overhead, the recording runs)
        fn()
    samples = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1000


def _count_ops(fn: Callable[[], object]) -> dict[str, int]:
    """Operators and device kernels one call dispatches (top-level aten ops, launches)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        fn()
    events = prof.events()
    aten = sum(1 for e in events if e.name.startswith("aten::") and e.cpu_parent is None)
    launches = sum(1 for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    syncs = sum(1 for e in events if e.name in ("aten::_local_scalar_dense", "cudaStreamSynchronize"))
    return {"aten_ops": aten, "kernel_launches": launches, "host_syncs": syncs}


def _static_forward(model: LlamaGen, target: LlamaGenTarget) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """One cached forward whose shapes never change: attend over the whole cache, masked."""
    cache = target.cache
    assert cache is not None

    def step(tokens: Tensor, positions: Tensor, slots: Tensor, mask: Tensor) -> Tensor:
        h = model.tok_embeddings(tokens)
        hidden = model.forward_cached(h, positions, slots, mask, cache)
        return model.logits(hidden)

    return step


def _static_inputs(target: LlamaGenTarget, n: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    cache = target.cache
    assert cache is not None
    rows, dev = cache.rows, cache.lengths.device
    lengths = cache.lengths
    slots = lengths[:, None] + torch.arange(n, device=dev)
    positions = slots.clone()
    cols = torch.arange(cache.max_len, device=dev)
    chain = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
    rel = cols[None, :] - lengths[:, None]  # [N, S]
    tree = chain[:, rel.clamp(0, n - 1)].permute(1, 0, 2) & ((rel >= 0) & (rel < n))[:, None, :]
    mask = (rel < 0)[:, None, :] | tree  # [N, n, S]
    tokens = torch.zeros(rows, n, dtype=torch.long, device=dev)
    return tokens, positions, slots, mask.contiguous()


def measure(name: str, device: torch.device, dtype: torch.dtype, repeats: int, compile_at: set[int]) -> dict:
    cfg = llamagen_config(name, vocab_size=16384, block_size=256, num_classes=1000)
    model = LlamaGen(cfg).init_weights(seed=0, zero_output=False).to(device, dtype).eval()
    target = LlamaGenTarget(model, SamplingConfig(cfg_scale=4.0), max_tree_nodes=max(POINTS))
    target.start(torch.zeros(1, dtype=torch.long, device=device))
    assert target.cache is not None
    target.cache.lengths += cfg.block_size // 2  # a half-finished image
    step = _static_forward(model, target)
    out: dict = {"config": name, "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
                 "tokens": list(POINTS), "eager_ms": [], "static_ms": [], "compiled_tokens": [], "compiled_ms": [],
                 "compile_s": []}
    with torch.inference_mode():
        for n in POINTS:
            tree = tree_from_parents(torch.arange(-1, n - 1, device=device)[None])
            toks = torch.zeros(1, n, dtype=torch.long, device=device)
            eager = lambda t=toks, tr=tree: target.verify(t, tr.mask, tr.depth)  # noqa: E731
            out["eager_ms"].append(_median_ms(eager, device, repeats))
            if n == 1:
                out["eager_step_ops"] = _count_ops(eager)
            args = _static_inputs(target, n)
            out["static_ms"].append(_median_ms(lambda a=args: step(*a), device, repeats))
            if n not in compile_at:
                continue
            if device.type == "cuda":
                compiled = torch.compile(step, fullgraph=True, dynamic=False, mode="reduce-overhead")
            else:  # without torch 2.13's AVX2 vector code, as lantern's own compiles (compiling.py says why)
                compiled = torch.compile(step, fullgraph=True, dynamic=False, options=cpu_vector_options())
            t0 = time.perf_counter()
            compiled(*args)
            _sync(device)
            out["compiled_tokens"].append(n)
            out["compile_s"].append(round(time.perf_counter() - t0, 2))
            out["compiled_ms"].append(_median_ms(lambda a=args, c=compiled: c(*a), device, repeats))
            if n == 1:
                out["compiled_step_ops"] = _count_ops(lambda a=args, c=compiled: c(*a))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="GPT-B,GPT-L,GPT-XL")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--compile-points", default="1,16", help="tree sizes to compile (each is its own graph); '' = none")
    ap.add_argument("--out", default="step-latency")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = inference_dtype(args.dtype, device)
    results = []
    for name in args.configs.split(","):
        compile_at = {int(x) for x in args.compile_points.split(",") if x}
        r = measure(name.strip(), device, dtype, args.repeats, compile_at)
        results.append(r)
        for mode in ("eager", "static", "compiled"):
            ms = r[f"{mode}_ms"]
            if ms:
                tokens = r["compiled_tokens"] if mode == "compiled" else r["tokens"]
                pts = "  ".join(f"{n}:{m:.2f}" for n, m in zip(tokens, ms, strict=True))
                print(f"{r['config']} {mode:>8} ms  {pts}", flush=True)
        print(f"{r['config']} eager step ops {r.get('eager_step_ops')}  compiled {r.get('compiled_step_ops')}  "
              f"compile s {r['compile_s']}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": dt.date.today().isoformat(), "machine": machine_description(), "device": str(device),
            "dtype": str(dtype).replace("torch.", ""), "cfg_rows": 2, "torch": torch.__version__,
            "prefix": "half image (128 tokens)"}
    (out / "step_latency.json").write_text(json.dumps({**meta, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
