"""Assemble an embedded preset from the training runs of scripts/train_preset.sh.

    python scripts/assemble_preset.py NAME RUNS_DIR OUT_DIR

Copies the tokenizer, target and drafter into OUT_DIR/{tokenizer,target,drafter} with 16-bit
weights (loaded back as float32), builds the proximity table from the *stored* codebook, and
writes OUT_DIR/provenance.json with every training command, data hash, commit and metric.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import torch

from lantern.io import read_json, write_json
from lantern.models.drafter import EagleDrafterModel
from lantern.models.llamagen import LlamaGen
from lantern.models.vq import VQModel
from lantern.targets.proximity import build_proximity
from lantern.train.loop import git_commit

K_MAX = 128  # neighbours stored per code: LANTERN's k is capped here; lantern++ uses k = 10
# Default sampling per preset (generation.json). LlamaGen-style: CFG on, top-k keeping ~10% of the
# codebook (LlamaGen/LANTERN keep 1000-2000 of 16384), temperature 1.
# Trees: measured on the 2-core CPU at batch 1 with bf16 targets (benchmarks/RESULTS.md, "Trees";
# `lantern bench --methods METHOD@TREE,...` reproduces it): the paper's 58-node dynamic and 57-node
# static trees cost several target steps to verify here, a chain of n drafts ~1 + 0.05 n steps.
# sd-static uses LANTERN++'s tree, as its definition says. `--tree` / `--tree auto` override.
TREES = {
    "digits": {"sd": "chain:3", "sd-static": "chain:3", "lantern": "chain:3", "lantern++": "chain:3"},
    "photos": {"sd": "chain:3", "sd-static": "chain:6", "lantern": "chain:8", "lantern++": "chain:6"},
}
GENERATION = {
    name: {"temperature": 1.0, "top_k": 100, "top_p": 1.0, "cfg_scale": 3.0, "trees": TREES[name]}
    for name in ("digits", "photos")
}


def _half(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    return model.to(dtype)


def main(name: str, runs: Path, out: Path) -> None:
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    parts = {
        "tokenizer": (VQModel, torch.float16),  # fp16 keeps the decoder's precision; bf16 does not
        "target": (LlamaGen, torch.bfloat16),
        "drafter": (EagleDrafterModel, torch.bfloat16),
    }
    provenance: dict[str, object] = {"preset": name, "assembled": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                     "assembled_at_commit": git_commit(), "steps": {}}
    for part, (cls, dtype) in parts.items():
        model = cls.from_pretrained(runs / part)
        _half(model, dtype).save_pretrained(tmp / part)
        prov = read_json(runs / part / "provenance.json", f"{part} provenance")
        write_json(tmp / part / "provenance.json", prov)
        provenance["steps"][part] = prov  # type: ignore[index]
    codes_cfg = json.loads((runs / "codes" / "extract_config.json").read_text())
    provenance["steps"]["extract-codes"] = codes_cfg  # type: ignore[index]
    data = {k: v for k, v in codes_cfg["train"]["data"].items() if k not in ("split", "num_samples")}
    write_json(tmp / "data.json", data)  # lantern.train.heldout.stack_dataset rebuilds the images from it
    write_json(tmp / "generation.json", GENERATION[name])
    data_meta = runs / "drafter-data" / "train" / "meta.json"
    if data_meta.is_file():
        provenance["steps"]["make-drafter-data"] = json.loads(data_meta.read_text())  # type: ignore[index]
    tokenizer = VQModel.from_pretrained(tmp / "tokenizer")  # the stored (fp16-rounded) codebook
    table = build_proximity(tokenizer.quantize.embedding.weight.detach(), k_max=K_MAX, normalize=True)
    table.save(tmp / "proximity.safetensors")
    provenance["proximity"] = {"k_max": K_MAX, "metric": table.metric, "normalized": table.normalized,
                               "command": f"lantern build-proximity --tokenizer {name}/tokenizer --k-max {K_MAX} "
                                          "--normalize"}
    write_json(tmp / "provenance.json", provenance)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"assembled {name} in {out}: {size / 1e6:.1f} MB")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
