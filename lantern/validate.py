"""Validate before you allocate: arguments checked against the model before anything is built.

A bad count, label, device or batch otherwise surfaces late and badly: an integer overflow inside
``torch.tensor``, an ``AssertionError`` from torch's CUDA initialisation, or a key/value cache
that the kernel kills the process for. Each check here raises :class:`LanternError` naming the
argument and what was expected.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from numbers import Integral
from typing import TYPE_CHECKING

from lantern.errors import LanternError, check

# torch is imported by the checks that need a device, not here: the CLI's parser reads this
# module's limits (MAX_TRAIN_STEPS in a --help text), and `lantern --help` should not wait for torch.
if TYPE_CHECKING:
    import torch

# Images one run may ask for: far more than any evaluation needs (FID-50k), and small enough that
# the per-image labels, seeds and codes of a run stay in memory. A typo such as
# ``--num-per-label 1000000000000`` would otherwise build a label list until memory runs out.
MAX_IMAGES = 1_000_000

# Optimiser steps one training run may ask for: a thousand times the longest recipe in the README
# (10k steps), so never a real limit, while a typo such as ``--steps 9223372036854775808`` would
# otherwise train until it is killed.
MAX_TRAIN_STEPS = 10_000_000
MAX_TRAIN_BATCH = 65_536  # a training step's global batch, in examples


# Seeds are 63-bit: image i of a run is seeded with (seed * 1_000_003 + i) mod 2^63
# (lantern.run.image_seed), so a base seed outside [0, 2^63) would silently alias one inside it
# (--seed 9223372036854775808 gave --seed 0's images).
SEED_LIMIT = 2**63


def check_count(value: int, arg: str, minimum: int = 1, maximum: int | None = None, field: str | None = None) -> None:
    """An image / item count: an integer >= ``minimum`` (and <= ``maximum`` when given); never a
    bool, which Python counts as an int (``num_per_label=True`` is no count)."""
    check(isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
          f"{arg} must be an integer >= {minimum}, got {value!r}", field=field)
    check(maximum is None or value <= maximum, f"{arg} must be at most {maximum} (one run), got {value}", field=field)


def check_seed(value: object, arg: str, field: str | None = None) -> int:
    """A base seed: an integer in [0, 2^63) (:data:`SEED_LIMIT`), returned as a Python int."""
    if not isinstance(value, Integral) or isinstance(value, bool):  # 1.5 would be truncated by the per-image seeds
        raise LanternError(f"{arg} must be an integer, got {value!r} ({type(value).__name__})", field=field)
    check(0 <= int(value) < SEED_LIMIT, f"{arg} must be in [0, 2^63), got {value}", field=field)
    return int(value)


def check_image_total(conditions: int, per_condition: int, arg: str) -> None:
    """``conditions`` labels or prompts times ``per_condition`` images each: at most :data:`MAX_IMAGES`."""
    total = conditions * per_condition
    check(total <= MAX_IMAGES, f"{arg}: {conditions} x {per_condition} = {total} images in one run; at most "
                               f"{MAX_IMAGES} (split it into several runs with different --seed)")


def check_image_indices(indices: object, total: int, arg: str = "--indices") -> list[int]:
    """Which images of a run to generate: distinct indices into its ``total`` images (label or prompt
    ``i // per_condition``, as its file names number them), as Python ints in the order given. Each
    keeps its place's random stream, so it is the image the whole run makes there."""
    if isinstance(indices, range):
        indices = list(indices)
    if hasattr(indices, "tolist") and not isinstance(indices, list | tuple):  # a 1-D numpy array or tensor
        shape = getattr(indices, "shape", ())
        check(len(shape) == 1, f"{arg} must be a list of image indices, got a {len(shape)}-D array")
        indices = indices.tolist()
    if not isinstance(indices, list | tuple):
        raise LanternError(f"{arg} must be a list of image indices (integers), got {type(indices).__name__}")
    check(len(indices) > 0, f"{arg} is empty; name at least one image of the run (0..{total - 1})")
    seen: set[int] = set()
    for index in indices:
        if not isinstance(index, Integral) or isinstance(index, bool):
            raise LanternError(f"{arg} must hold integers (image indices), got {index!r} ({type(index).__name__})")
        check(0 <= int(index) < total, f"{arg}: image {index} is not in this run, whose {total} images are "
                                       f"0..{total - 1} (labels or prompts x images per label or prompt)")
        check(int(index) not in seen, f"{arg} names image {index} twice")
        seen.add(int(index))
    return [int(index) for index in indices]


def check_label_values(labels: Sequence[int], num_classes: int, arg: str = "--labels") -> None:
    """Class ids in ``0..num_classes-1``, checked on Python integers: an id past int64 would
    otherwise overflow inside ``torch.tensor`` before any range check sees it."""
    for label in labels:
        check(
            0 <= label < num_classes,
            f"{arg}: label {label} is out of range: this model has {num_classes} classes (0..{num_classes - 1})",
        )


def check_device(name: str | torch.device, arg: str = "--device") -> torch.device:
    """A device this machine has: ``cpu``, ``cuda``/``cuda:N`` with CUDA present, or ``mps``."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise LanternError(f"{arg}: unknown device {str(name)!r} (expected cpu, cuda, cuda:N or mps)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise LanternError(f"{arg} {name}: CUDA is not available ({why}); use --device cpu")
        count = torch.cuda.device_count()
        check(device.index is None or device.index < count,
              f"{arg} {name}: this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
    elif device.type == "mps":
        check(torch.backends.mps.is_available(), f"{arg} {name}: MPS is not available on this machine")
    else:
        check(device.type == "cpu", f"{arg}: lantern runs on cpu, cuda[:N] or mps, got {str(name)!r}")
    return device


def available_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated on ``device`` (None when unknown)."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} bytes"


def check_batch_memory(needed: int, rows: int, device: torch.device, arg: str = "--batch-size") -> None:
    """Refuse a batch whose key/value cache (``needed`` bytes for ``rows`` images decoded together)
    cannot fit in the memory ``device`` has free: a one-line error now rather than a MemoryError,
    or the kernel's OOM killer, after the model is loaded."""
    free = available_memory(device)
    if free is None or needed <= free:
        return
    raise LanternError(
        f"{arg}: decoding {rows} images together needs about {_size(needed)} for the key/value cache alone, more "
        f"than the {_size(free)} free on {device}; use a smaller {arg}"
    )


def check_host_memory(needed: int, what: str, arg: str) -> None:
    """Refuse, before allocating, ``needed`` bytes of CPU memory for ``what`` when this machine has
    less free: one line naming ``arg`` instead of a failed allocation (or the OOM killer) later."""
    import torch

    free = available_memory(torch.device("cpu"))
    if free is None or needed <= free:
        return
    raise LanternError(f"{arg}: {what} needs about {_size(needed)}, more than the {_size(free)} of memory free on "
                       f"this machine; use a smaller {arg}")
