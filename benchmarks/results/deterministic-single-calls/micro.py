"""Microseconds per call of one 768x256 linear layer at a batch-1 AR step's 2 rows and a Jacobi
round's 34, natively and through lantern.models.invariant.chunked_linear with three chunk sets.

    python micro.py float32|bfloat16
"""

import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from lantern.models import invariant as inv


def per_call_us(fn: Callable[[], object], n: int = 3000) -> float:
    for _ in range(200):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    torch.set_num_threads(2)
    dtype = getattr(torch, sys.argv[1])
    w = torch.randn(768, 256, dtype=dtype)
    with torch.inference_mode():
        for name, x in (("m=2", torch.randn(2, 1, 256, dtype=dtype)), ("m=34", torch.randn(2, 17, 256, dtype=dtype))):
            print(name, f"native {per_call_us(lambda x=x: F.linear(x, w)):.1f} us")
            for ch in ((4, 8, 12, 16, 24, 32, 40, 48, 56, 64), (8, 16, 24, 32, 40, 48, 56, 64), (2, 4, 8, 32, 40)):
                sizes = inv.call_sizes(x.shape[0] * x.shape[1], ch)
                us = per_call_us(lambda x=x, ch=ch: inv.chunked_linear(x, w, None, ch))
                print(f"  chunks {ch[:3]} calls {sizes} {us:.1f} us")
            print(f"  plain 8-row call {per_call_us(lambda: F.linear(torch.zeros(8, 256, dtype=dtype), w)):.1f} us")


if __name__ == "__main__":
    main()
