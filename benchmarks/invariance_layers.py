"""Which layer makes a row's numbers depend on its batch: one image decoded alone and as row 0 of
a batch, eager, with every leaf module of the target hooked; prints the first modules whose
output for that image's rows differs between the two runs, call by call (prefill, then steps).

    python benchmarks/invariance_layers.py --model photos [--deterministic] [--device cuda] \
        [--dtype auto] [--batch-size 8] [--calls 4] [--out layers.json]

``benchmarks/batch_invariance.py`` counts the images a batch changes; this says where. The first
module in call order that differs is the cause; everything after it differs because its input
did. On a CPU in default mode that is a linear layer (the BLAS's kernel depends on the row
count); in ``--deterministic`` mode nothing should differ. The row of an image is found from the
target's ``[cond; uncond]`` layout: image 0 is rows 0 and ``batch`` of a guided batch.
Counts and bits, not timings: it may share the machine.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from torch import Tensor, nn

import lantern


def _first_tensor(out: Any) -> Tensor | None:
    if isinstance(out, Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    return None


class Enough(Exception):
    """Raised by a hook once the calls to compare have run: the rest of the decode is not needed."""


class Recorder:
    """Forward hooks on every leaf module of ``net``: the inputs and outputs of the first ``calls``
    forwards of ``net``, for the rows of image 0 (its ``streams`` rows among ``streams * batch``).
    An input that differs where the previous module's output did not names the functional code
    between them (attention's softmax(QK^T)V sits between ``wqkv``'s output and ``wo``'s input). A forward
    ends where a module runs a second time (the decoding loop calls the network's parts, not always
    its ``forward``, so the calls are counted at the leaves)."""

    def __init__(self, net: nn.Module, calls: int) -> None:
        self.calls = calls
        self.start(1)
        self.handles = []
        for name, module in net.named_modules():
            if name and not list(module.children()):
                self.handles.append(module.register_forward_hook(self._keep(name)))

    def start(self, batch: int) -> None:
        self.call, self.batch, self.seen = 0, batch, set()
        self.outputs: dict[tuple[int, str], Tensor] = {}
        self.order: list[tuple[int, str]] = []

    def _keep(self, name: str) -> Any:
        def hook(_module: nn.Module, args: Any, out: Any) -> None:
            if name in self.seen:
                self.call, self.seen = self.call + 1, set()
                if self.call >= self.calls:
                    raise Enough
            self.seen.add(name)
            self._record(f"{name} (input)", _first_tensor(args))
            self._record(name, _first_tensor(out))
        return hook

    def _record(self, name: str, tensor: Tensor | None) -> None:
        if tensor is None or tensor.dim() == 0 or tensor.shape[0] % self.batch:
            return
        streams = tensor.shape[0] // self.batch
        self.outputs[(self.call, name)] = tensor[[s * self.batch for s in range(streams)]].detach().float().cpu()
        self.order.append((self.call, name))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def compare(alone: dict[tuple[int, str], Tensor], order: list[tuple[int, str]],
            batched: dict[tuple[int, str], Tensor]) -> list[dict[str, Any]]:
    """Every (call, module) whose output for image 0 differs, in call order, with its largest
    absolute difference."""
    rows = []
    for key in order:
        a, b = alone[key], batched.get(key)
        if b is None or a.shape != b.shape:
            rows.append({"call": key[0], "module": key[1], "max_abs_diff": None, "note": "shape or call differs"})
        elif not torch.equal(a, b):
            rows.append({"call": key[0], "module": key[1], "max_abs_diff": float((a - b).abs().max())})
    return rows


def _decode(pipe: lantern.Pipeline, recorder: Recorder, labels: list[int], args: argparse.Namespace) -> None:
    recorder.start(len(labels))
    try:
        pipe(labels=labels, seed=args.seed, method=args.method, batch_size=len(labels))
    except Enough:
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="photos")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or auto")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--calls", type=int, default=4, help="forwards compared: the prefill and then steps")
    p.add_argument("--method", default="ar")
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    pipe = lantern.load(args.model, deterministic=args.deterministic, compile="off", device=args.device,
                        dtype=args.dtype)
    classes = pipe.stack.num_classes or 1
    labels = [i % classes for i in range(args.batch_size)]
    recorder = Recorder(pipe.stack.network(), args.calls)
    try:
        _decode(pipe, recorder, labels[:1], args)
        alone, order = recorder.outputs, recorder.order
        _decode(pipe, recorder, labels, args)
        differ = compare(alone, order, recorder.outputs)
    finally:
        recorder.remove()
    report = {"model": args.model, "deterministic": args.deterministic, "device": args.device, "dtype": args.dtype,
              "method": args.method, "batch_size": args.batch_size, "calls": args.calls,
              "modules_compared": len(order), "differ": len(differ), "first": differ[:12],
              "capability": torch.backends.cpu.get_cpu_capability()}
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
