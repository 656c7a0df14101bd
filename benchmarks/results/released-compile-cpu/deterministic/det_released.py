"""Deterministic-mode cost of the released backend's static shapes: the same Chameleon-B target and
released-format drafter, eager, batch-invariant layers, the backend static (now) or sized to the batch
(before); and the default mode, for scale. One process, modes interleaved per pass."""
import statistics
import sys

import torch

sys.path.insert(0, "benchmarks")
import round_cost as rc

from lantern.decoding.config import TreeConfig
from lantern.drafters import released
from lantern.models.invariant import make_batch_invariant

torch.manual_seed(0)
model, drafter, _, _ = rc.build("Chameleon-B", None, torch.device("cpu"), torch.float32, "released")
lm, layout = model
tree = TreeConfig.parse(sys.argv[1] if len(sys.argv) > 1 else "chain:6")
init = released.ReleasedDrafterBackend.__init__
force: dict[str, bool | None] = {"static": None}
def patched(self, *a, **k):
    init(self, *a, **k)
    if force["static"] is not None:
        self.static = force["static"]
released.ReleasedDrafterBackend.__init__ = patched
res: dict[str, list[float]] = {}
for p in range(3):
    for mode in ("default", "det-static", "det-batch-sized"):
        make_batch_invariant(lm, enabled=mode != "default")
        make_batch_invariant(drafter, enabled=mode != "default")
        force["static"] = False if mode == "det-batch-sized" else None
        for batch in (1, 4):
            ar, _ = rc.time_rounds(model, None, None, batch, 0, None, 20, 1)
            ch, _ = rc.time_rounds(model, drafter, tree, batch, 4, None, 20, 1)
            res.setdefault(f"{mode} b{batch} ar", []).append(ar)
            res.setdefault(f"{mode} b{batch} {tree.spec if hasattr(tree, 'spec') else 'chain'}", []).append(ch)
    print("pass", p, flush=True)
for k, v in res.items():
    print(f"{k:40s} {statistics.median(v):8.2f} ms  {[round(x, 1) for x in v]}")
