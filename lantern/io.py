"""Files: atomic writes, model folders (``config.json`` + ``model.safetensors``), checkpoint checks.

Outputs are written to a temporary name in the same directory and renamed into place, so an
interrupted or failed run never leaves a half-written file behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lantern.errors import CheckpointError, LanternError

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` only if the body succeeds."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        if tmp_path.exists():  # mkstemp creates 0600; give the result the usual umask permissions
            os.chmod(tmp_path, 0o666 & ~_umask())
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_json(path: str | os.PathLike[str], what: str = "file") -> Any:
    path = Path(path)
    if not path.is_file():
        raise LanternError(f"{what} not found: {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise LanternError(f"{what} {path} is not valid JSON: {e}") from None


def ensure_writable_dir(path: str | os.PathLike[str], what: str = "--out") -> Path:
    """Create ``path`` if needed and check that files can be written into it."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LanternError(f"{what}: cannot create directory {path}: {e.strerror}") from None
    if not path.is_dir():
        raise LanternError(f"{what}: {path} exists and is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise LanternError(f"{what}: directory {path} is not writable")
    return path


def save_model_folder(
    directory: str | os.PathLike[str],
    config: Mapping[str, Any],
    state_dict: Mapping[str, torch.Tensor],
    extra_files: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (+ extra JSON files) into ``directory``."""
    from safetensors.torch import save_file

    directory = ensure_writable_dir(directory, "save directory")
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    with atomic_path(directory / WEIGHTS_NAME) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    write_json(directory / CONFIG_NAME, dict(config))
    for name, obj in (extra_files or {}).items():
        write_json(directory / name, obj)
    return directory


def load_model_folder(directory: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read a model folder written by :func:`save_model_folder`."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if not directory.is_dir():
        raise LanternError(f"model folder not found: {directory}")
    config = read_json(directory / CONFIG_NAME, "model config")
    weights = directory / WEIGHTS_NAME
    if not weights.is_file():
        raise LanternError(f"model folder {directory} has no {WEIGHTS_NAME}")
    return config, load_file(str(weights))


def _preview(keys: list[str], n: int = 5) -> str:
    shown = ", ".join(keys[:n])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > n else "")


def check_state_dict(module: nn.Module, state_dict: Mapping[str, torch.Tensor], source: str = "checkpoint") -> None:
    """Raise :class:`CheckpointError` unless ``state_dict`` has exactly ``module``'s keys and shapes.

    The message lists the first offending keys of each kind (missing, unexpected, mis-shaped).
    """
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    misshaped = [
        f"{k} (checkpoint {tuple(state_dict[k].shape)}, model {expected[k]})"
        for k in expected
        if k in state_dict and tuple(state_dict[k].shape) != expected[k]
    ]
    problems = []
    if missing:
        problems.append(f"missing keys: {_preview(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_preview(unexpected)}")
    if misshaped:
        problems.append(f"mis-shaped keys: {_preview(misshaped, 3)}")
    if problems:
        raise CheckpointError(f"{source} does not match the model: " + "; ".join(problems))


def load_state_dict_strict(
    module: nn.Module, state_dict: Mapping[str, torch.Tensor], source: str = "checkpoint"
) -> None:
    """Check keys and shapes (clear error), then load with ``strict=True``, casting dtypes."""
    check_state_dict(module, state_dict, source)
    own = module.state_dict()
    module.load_state_dict({k: v.to(own[k].dtype) for k, v in state_dict.items()}, strict=True)


def torch_load(path: str | os.PathLike[str], what: str = "checkpoint") -> Any:
    """``torch.load`` on CPU for official training checkpoints (which pickle argparse Namespaces).

    ``weights_only=False`` is needed because LlamaGen's training files store ``args`` as an
    ``argparse.Namespace``; only load files you trust.
    """
    path = Path(path)
    if not path.is_file():
        raise LanternError(f"{what} not found: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=False)
    except Exception as e:  # a torch pickle error is not something a user can act on
        raise LanternError(f"{what} {path} could not be read as a torch checkpoint: {e}") from None
