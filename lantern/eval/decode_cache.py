"""``lantern bench --cache DIR``: the bench's quality decodes kept on disk, reused when they match.

A bench's long part is its quality decodes: every method on ``--num-images`` images, AR at
``--ar-seeds`` seeds, the tau curves and the sweep. Without a cache, a bench stopped part-way (a
kill, a node's time limit, an error in the last row) keeps nothing, and a bench that adds one row
to last night's run decodes AR's five seeds again. With ``--cache DIR``, each decode is written to
``DIR`` as it finishes, and a later run reuses every decode whose inputs are the same:

* the **key** is everything that decides the codes: the model folder's files (path, size and
  mtime of each, so a retrained model misses), lantern's own source (any change to the decoding
  code misses), torch's and transformers' versions (the Chameleon, Janus and Emu3 targets run
  transformers' layers), the machine, device type and dtype, batch-invariant kernels
  (``--deterministic``) or not, the process and thread counts, the conditions' bytes, the seed,
  the sampling settings, the method as it runs (k capped at the table) and the batch size. A
  decode is the same decode only if all of these are; nothing is reused on a guess.
* **speed is never cached**: the timed passes are measured in this run, beside this run's AR.
* an entry is a safetensors file (codes, per-image target forwards; the key in its metadata),
  written under a temporary name and renamed, so a kill leaves either a whole entry or none. An
  entry is checked when read (its key, shapes, codes within the vocabulary, forward counts within
  the tokens), and one that fails is decoded again with a printed note: a cache folder is never
  trusted blindly, and nothing in it can run code.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import torch

from lantern.decoding.config import SamplingConfig
from lantern.distributed import DistContext, all_gather
from lantern.errors import LanternError
from lantern.eval.bench import Runner
from lantern.io import atomic_path, read_safetensors, save_safetensors
from lantern.methods import MethodConfig
from lantern.parts import ModelParts
from lantern.run import RunResult, load_acceptance
from lantern.targets.base import Conditions, Stack
from lantern.version import installed_version

FORMAT = "lantern bench decode 1"  # an entry's "format" metadata; another value is another layout


@cache
def lantern_source_digest() -> str:
    """sha256 of lantern's own Python source (every module, by path): a decode made by other code
    is another decode, even at the same version number (a source checkout between commits)."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def folder_fingerprint(folder: Path) -> str:
    """sha256 over each file's path, size and mtime under ``folder`` (a file: itself): a model
    retrained or replaced in place changes it, without reading gigabytes of weights."""
    digest = hashlib.sha256()
    paths = sorted(p for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else [folder]
    for path in paths:
        st = path.stat()  # through a Hub snapshot's links: the blob's size and time
        name = path.relative_to(folder).as_posix() if folder.is_dir() else path.name
        digest.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def conditions_digest(conditions: Conditions) -> str:
    """sha256 of the conditions' bytes, shapes and dtypes (labels, captions or prompt ids, and mask)."""
    digest = hashlib.sha256()
    for t in (conditions.cond, conditions.mask):
        if t is None:
            digest.update(b"none\n")
            continue
        flat = t.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{tuple(t.shape)}\0{t.dtype}\n".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class DecodeCache:
    """The folder of ``--cache``: one safetensors file per decode, named by its key's digest.
    ``context``: what every decode of this run shares (model, software, machine, dtype, ...)."""

    def __init__(self, folder: Path, context: Mapping[str, Any], log: Callable[[str], None] = print) -> None:
        self.folder, self.context, self.log = folder, dict(context), log
        self.reused = 0  # decodes read back in this run
        self.written = 0
        self.failed = 0  # entries that could not be written (a note each)

    @classmethod
    def for_stack(cls, folder: str | os.PathLike[str], stack: Stack, world_size: int = 1,
                  extra: Mapping[str, Any] | None = None, log: Callable[[str], None] = print) -> DecodeCache:
        """The cache of a run on ``stack`` (``extra``: further settings that decide its codes, e.g. a
        Chameleon layout and image size)."""
        from lantern.eval.report import machine_description
        from lantern.models.invariant import is_batch_invariant

        context = {
            "model": str(Path(stack.root).resolve()),
            "model_files": folder_fingerprint(Path(stack.root).resolve()),
            "lantern_source": lantern_source_digest(),
            "torch": torch.__version__,
            # the Chameleon, Janus and Emu3 targets run transformers' own layers: a new release may round otherwise
            "transformers": installed_version("transformers"),
            "machine": machine_description(),
            "device_type": torch.device(stack.device).type,
            "dtype": str(stack.dtype).replace("torch.", ""),
            "batch_invariant": is_batch_invariant(stack.network()),  # load(..., deterministic=True)
            "processes": world_size,
            "threads": torch.get_num_threads(),  # a CPU's reductions may split (and round) by thread count
            **dict(extra or {}),
        }
        return cls(Path(folder), context, log)

    def key(self, conditions: Conditions, seed: int, sampling: SamplingConfig, method: MethodConfig,
            batch_size: int) -> str:
        """The canonical JSON of everything that decides one decode's codes."""
        fields = {**self.context, "conditions": conditions_digest(conditions), "num_images": len(conditions),
                  "seed": seed, "sampling": sampling.to_dict(), "method": method.to_dict(), "batch_size": batch_size}
        return json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)

    def path(self, key: str) -> Path:
        return self.folder / f"{hashlib.sha256(key.encode()).hexdigest()[:40]}.safetensors"

    def read(self, key: str, stack: Stack, num_images: int, method: MethodConfig) -> RunResult | None:
        """The decode stored under ``key``, checked; None when there is none or it fails a check
        (with a note: the decode is then made again and the entry replaced)."""
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            tensors, meta = read_safetensors(path, "--cache entry")
            return _checked(tensors, meta, key, stack, num_images, method)
        except (LanternError, ValueError, KeyError, TypeError) as e:
            self.log(f"lantern: note: --cache: {path.name} is not a usable decode ({e}); decoding it again")
            return None

    def write(self, key: str, run: RunResult) -> None:
        """Store a finished decode (whole or not at all: written beside, then renamed). A write that
        fails (a full disk, a quota) is a note, not the end of the run: the bench goes on without
        that entry, which the next run decodes again."""
        forwards = torch.cat([o.stats.target_forwards for o in run.output_stats]).cpu()
        drafter = sum(o.stats.drafter_forwards for o in run.output_stats)
        meta = {"format": FORMAT, "key": key, "drafter_forwards": str(int(drafter)),
                "wall_seconds": repr(float(run.wall_seconds))}
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with atomic_path(self.path(key)) as tmp:
                save_safetensors({"codes": run.codes.cpu().to(torch.int64).contiguous(),
                                  "target_forwards": forwards.to(torch.int64).contiguous()}, tmp, meta)
        except OSError as e:
            self.failed += 1
            self.log(f"lantern: note: --cache: could not write an entry in {self.folder} ({e.strerror or e}); "
                     "the run goes on without it")
            return
        self.written += 1

    def summary(self) -> dict[str, Any]:
        """What run.json records of the cache: the folder, and how many decodes it gave and took."""
        return {"folder": str(self.folder), "reused": self.reused, "written": self.written, "failed": self.failed}


def _checked(tensors: dict[str, torch.Tensor], meta: dict[str, str], key: str, stack: Stack, num_images: int,
             method: MethodConfig) -> RunResult:
    """A stored decode as a run, if it is the decode asked for and holds what a decode can hold."""
    if meta.get("format") != FORMAT:
        raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
    if meta.get("key") != key:  # a digest collision, an entry copied under another name, or edited
        raise ValueError("its key is not this decode's")
    codes, forwards = tensors["codes"], tensors["target_forwards"]
    tokens = stack.num_tokens
    if codes.dtype != torch.int64 or tuple(codes.shape) != (num_images, tokens):
        raise ValueError(f"codes {tuple(codes.shape)} {codes.dtype}, expected ({num_images}, {tokens}) int64")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= stack.vocab_size):
        raise ValueError(f"codes outside [0, {stack.vocab_size})")
    if forwards.dtype != torch.int64 or tuple(forwards.shape) != (num_images,):
        raise ValueError(f"target_forwards {tuple(forwards.shape)} {forwards.dtype}, expected ({num_images},) int64")
    if forwards.numel() and (int(forwards.min()) < 1 or int(forwards.max()) > tokens):
        raise ValueError(f"target forwards outside [1, {tokens}]")
    drafter, seconds = int(meta["drafter_forwards"]), float(meta["wall_seconds"])
    return RunResult.from_counts(codes, forwards, drafter, seconds, method)


class CachedRunner:
    """A bench :class:`lantern.eval.bench.Runner` whose decodes go through a :class:`DecodeCache`:
    read back when stored, else decoded by ``inner`` and stored. Timing is ``inner``'s, always.
    Under several processes rank 0 reads the cache and every rank takes its answer (so all ranks
    decode, or skip, together); rank 0 alone writes."""

    def __init__(self, inner: Runner, store: DecodeCache, ctx: DistContext | None = None) -> None:
        self.inner, self.store, self.ctx = inner, store, ctx

    def loaded(self, stack: Stack) -> ModelParts:
        return self.inner.loaded(stack)

    def time(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.time(*args, **kwargs)

    @property
    def _main(self) -> bool:
        return self.ctx is None or self.ctx.is_main

    def generate(self, stack: Stack, conditions: Conditions, seed: int, sampling: SamplingConfig,
                 method: MethodConfig, batch_size: int) -> RunResult:
        # keyed by the method as it runs: a default k capped at the proximity table is that k
        as_run = load_acceptance(method, self.loaded(stack))[1]
        key = self.store.key(conditions, seed, sampling, as_run, batch_size)
        found = self.store.read(key, stack, len(conditions), as_run) if self._main else None
        if self.ctx is not None and self.ctx.enabled:
            found = all_gather(found, self.ctx)[0]
        if found is not None:
            self.store.reused += 1
            if self._main:
                self.store.log(f"--cache: reused {method.method} at seed {seed} ({len(conditions)} images)")
            return found
        run = self.inner.generate(stack, conditions, seed, sampling, method, batch_size)
        if self._main:
            self.store.write(key, run)
        return run
