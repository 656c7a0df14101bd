"""How often the batch changes an image: each image decoded alone and in batches of 2, 4 and 8,
per method, in default mode or with ``--deterministic`` (issue 37's targets).

    python benchmarks/batch_invariance.py --model digits --images 200 [--deterministic] \
        [--methods ar,lantern++,...] [--compile default] [--out rates.json]

Force a lower CPU capability the way tests/test_capabilities.py does:
    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 DNNL_MAX_CPU_ISA=AVX2 python benchmarks/...

Prints, per method, the images whose codes differ from their alone codes at any batch size.
Counts, not timings: it may share the machine.
"""

from __future__ import annotations

import argparse
import json

import torch
from tqdm import tqdm

import lantern
from lantern.methods import METHOD_TABLE


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="digits")
    p.add_argument("--images", type=int, default=200)
    p.add_argument("--methods", default=",".join(METHOD_TABLE))
    p.add_argument("--batch-sizes", default="2,4,8")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--compile", default="off")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or auto")
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    pipe = lantern.load(args.model, deterministic=args.deterministic, compile=args.compile, device=args.device,
                        dtype=args.dtype)
    classes = pipe.stack.num_classes or 1
    labels = [i % classes for i in range(args.images)]
    capability = torch.backends.cpu.get_cpu_capability()
    rows = []
    for method in tqdm(args.methods.split(","), desc="methods"):
        alone = pipe(labels=labels, seed=args.seed, method=method, batch_size=1).codes
        changed: set[int] = set()
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            codes = pipe(labels=labels, seed=args.seed, method=method, batch_size=batch).codes
            changed |= {i for i in range(len(labels)) if not torch.equal(codes[i], alone[i])}
        row = {"method": method, "images": len(labels), "changed": len(changed), "model": args.model,
               "deterministic": args.deterministic, "compile": args.compile, "device": args.device, "dtype": args.dtype,
               "capability": capability}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
