"""Files: atomic writes, model folders (``config.json`` + ``model.safetensors``), checkpoint checks.

Outputs are written to a temporary name in the same directory and renamed into place, so an
interrupted or failed run never leaves a half-written file behind.

Every file lantern reads goes through a helper here that turns a corrupt, truncated or foreign
file into a one-line :class:`LanternError` naming it: :func:`read_json`, :func:`load_safetensors`
and :func:`load_checkpoint`. The last is the only place a pickle (``.pt``, ``.bin``, ``.ckpt``) is
read, and it never runs code from the file unless the user vouches for it (see its docstring).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import math
import os
import pickle
import re
import tempfile
import threading
import types
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, ClassVar, Self

import torch
from torch import nn

from lantern.errors import CheckpointError, LanternError, check

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


_UMASK_LOCK = threading.Lock()


def _umask() -> int:
    """The process umask. Reading it means setting it: without the lock, two threads writing files
    at once (a job's PNG threads) could each read the other's temporary 0 and leave it set."""
    with _UMASK_LOCK:
        mask = os.umask(0)
        os.umask(mask)
    return mask


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """``obj`` as strict JSON: a NaN or infinity is an error here (json would write ``NaN``, which
    no strict reader accepts); values that may legitimately be non-finite go through
    :func:`finite_or_null` first."""
    text = json.dumps(obj, indent=2, sort_keys=False, allow_nan=False)
    with atomic_path(path) as tmp:
        tmp.write_text(text + "\n")


def finite_or_null(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, +-inf), at any depth of dicts, lists and tuples,
    replaced by None: how results that may be undefined (a loss with no step logged, a metric of
    a degenerate sample) are written as strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite_or_null(v) for v in obj]
    return obj


def read_json(path: str | os.PathLike[str], what: str = "file") -> Any:
    path = Path(path)
    if not path.is_file():
        raise LanternError(f"{what} not found: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise LanternError(f"{what} {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    except json.JSONDecodeError as e:
        raise LanternError(f"{what} {path} is not valid JSON: {e}") from None
    except RecursionError:  # json's parser recurses once per nesting level; no real file is this deep
        raise LanternError(f"{what} {path} is not usable JSON: its arrays/objects are nested too deeply to "
                           "read") from None


def read_json_object(path: str | os.PathLike[str], what: str = "file") -> dict[str, Any]:
    """:func:`read_json` for files that must hold a JSON object (``{...}``)."""
    raw = read_json(path, what)
    if not isinstance(raw, dict):
        raise LanternError(f"{what} {path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def read_safetensors(
    path: str | os.PathLike[str], what: str = "weights", names: Sequence[str] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors ``names`` (all when None; absent names are left out) and the header metadata of
    a safetensors file; LanternError naming the file if it is missing, truncated or foreign."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise LanternError(f"{what} not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys()) if names is None else [n for n in names if n in f.keys()]
            return {k: f.get_tensor(k) for k in keys}, dict(f.metadata() or {})
    except SafetensorError as e:  # truncated, empty or not a safetensors file at all
        raise LanternError(f"{what} {path} is not a readable safetensors file ({e})") from None


def load_safetensors(path: str | os.PathLike[str], what: str = "weights") -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (see :func:`read_safetensors`)."""
    return read_safetensors(path, what)[0]


def save_safetensors(
    tensors: Mapping[str, torch.Tensor], path: str | os.PathLike[str], metadata: Mapping[str, str] | None = None
) -> None:
    """``safetensors.torch.save_file``, whose failed writes (a full disk, a quota) arrive as a
    SafetensorError that wraps the OS error in its text: raised here as that OSError, so that every
    caller's one-line handling of failed writes (and the CLI's) applies to it."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(dict(tensors), str(path), metadata=None if metadata is None else dict(metadata))
    except SafetensorError as e:
        code = _os_error_code(str(e))
        if code is None:
            raise  # not an I/O failure: a bug, keep its traceback
        raise OSError(code, os.strerror(code), str(path)) from None


def _os_error_code(message: str) -> int | None:
    """The errno inside a safetensors error's text (Rust's ``Os { code: 28, ... }`` or ``os error
    28``), or ENOSPC for a bare "No space left on device"; None when it names no OS error."""
    found = re.search(r"\bcode: (\d+)|os error (\d+)", message)
    if found:
        return int(found.group(1) or found.group(2))
    return errno.ENOSPC if "No space left on device" in message else None


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
    directory = ensure_writable_dir(directory, "save directory")
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    with atomic_path(directory / WEIGHTS_NAME) as tmp:
        save_safetensors(tensors, tmp, metadata={"format": "pt"})
    write_json(directory / CONFIG_NAME, dict(config))
    for name, obj in (extra_files or {}).items():
        write_json(directory / name, obj)
    return directory


TRAIN_CONFIG_FILE = "train_config.json"  # a lantern trainer's resolved settings, in its --out

# What each lantern folder's config.json ``model_type`` holds: named when a folder of one kind is
# given where another is read (a drafter as --target would otherwise pass for an HF port of a
# target and fail on a missing field).
LANTERN_MODEL_KINDS = {"lantern-llamagen": "a LlamaGen target", "lantern-vq": "a VQ tokenizer",
                       "lantern-eagle-drafter": "an EAGLE drafter", "lantern-feature-net": "a feature net"}


def check_not_other_lantern_model(config: Mapping[str, Any], directory: Path, expected: str) -> None:
    """Refuse a lantern folder of another kind than ``expected`` (a model_type), by what it holds."""
    kind = config.get("model_type")
    if isinstance(kind, str) and kind in LANTERN_MODEL_KINDS and kind != expected:
        raise LanternError(f"{directory} holds {LANTERN_MODEL_KINDS[kind]} (model_type {kind!r}), not "
                           f"{LANTERN_MODEL_KINDS[expected]}")


def load_model_folder(directory: str | os.PathLike[str],
                      what: str = "model") -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read a model folder written by :func:`save_model_folder`; ``what`` names its kind in errors
    (``tokenizer``: a VQ folder)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise LanternError(f"{what} folder not found: {directory}")
    config = read_json_object(directory / CONFIG_NAME, f"{what} config")
    weights = directory / WEIGHTS_NAME
    if not weights.is_file():
        raise LanternError(f"{what} folder {directory} has no {WEIGHTS_NAME}")
    return config, load_safetensors(weights, f"{what} weights")


@contextlib.contextmanager
def config_of(path: Path) -> Iterator[None]:
    """A config read from the file ``path`` is built in the block: its refusals name the file (a
    hand-edited ``config.json`` was refused as "dim must be a positive integer", saying not where)."""
    try:
        yield
    except LanternError as e:
        raise type(e)(f"{path}: {e}", field=e.field) from None


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
    module: nn.Module, state_dict: Mapping[str, torch.Tensor], source: str = "checkpoint",
    own: tuple[str, ...] = (),
) -> None:
    """Check keys and shapes (clear error), then load with ``strict=True``, casting dtypes. ``own``:
    name endings of buffers that are bookkeeping, not weights (``num_batches_tracked``,
    ``position_ids``), which some saves leave out: where the file lacks one, the module keeps its own."""
    mine = module.state_dict()
    if own:
        state_dict = {**{k: v for k, v in mine.items() if k.endswith(own) and k not in state_dict}, **state_dict}
    check_state_dict(module, state_dict, source)
    module.load_state_dict({k: v.to(mine[k].dtype) for k, v in state_dict.items()}, strict=True)


# ---- pickled checkpoints -------------------------------------------------------------------------
#
# torch.load(weights_only=True) rebuilds only tensors, plain containers and numbers; any other
# class in the pickle is refused before it is created, so nothing in the file can run. Official
# checkpoints hold a few harmless objects besides their tensors, allowed below by name:
#
# * ``argparse.Namespace``: LlamaGen's training scripts save ``{"model", "optimizer", "steps",
#   "args": Namespace(...)}``. Rebuilding one only sets attributes.
# * PyTorch-Lightning checkpoints (taming-transformers-style VQGANs; Chameleon's ``vqgan.ckpt``
#   needs none of this list: transformers' conversion script reads it with weights_only=True)
#   hold ``state_dict``, ``epoch``, ``global_step``, ``pytorch-lightning_version``,
#   ``optimizer_states``, ``lr_schedulers`` and ``loops`` (plain dicts and tensors), plus
#   ``callbacks``, keyed (Lightning < 1.5) or valued by ``ModelCheckpoint`` / ``EarlyStopping``, and
#   ``hyper_parameters``, an ``AttributeDict``. Those classes are replaced by the inert stand-ins
#   below (Lightning is not imported, and not needed): a stand-in only stores the pickled state.
#   An OmegaConf ``DictConfig`` in ``hyper_parameters`` needs a dozen omegaconf internals, whose
#   names change between releases; it is not allowed, so such a file needs --trust-checkpoint.
# Anything else is refused with the class's name, unless the user vouches for the file.

TRUST_FLAG = "--trust-checkpoint"
_trust_checkpoints: ContextVar[bool] = ContextVar("lantern_trust_checkpoints", default=False)


class LanternWarning(UserWarning):
    """Something the user asked for that weakens a safety check (e.g. --trust-checkpoint)."""


class _PickledObjectStub:
    """Inert stand-in for a pickled class lantern does not import: it only keeps the pickled state."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _PickledObjectStub:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.__dict__["_state"] = state


class _LightningCallback(_PickledObjectStub):
    """Stand-in for a Lightning callback (``ModelCheckpoint``, ``EarlyStopping``)."""


class _AttributeDict:
    """Stand-in for Lightning's ``AttributeDict`` (a dict subclass): rebuilt as a plain dict (the
    weights-only unpickler fills only exact dicts, and nothing reads these attributes)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[misc]
        return {}


_LIGHTNING_CALLBACKS = ("model_checkpoint.ModelCheckpoint", "early_stopping.EarlyStopping")
_LIGHTNING_ATTRIBUTE_DICTS = ("pytorch_lightning.utilities.parsing.AttributeDict",
                              "lightning.fabric.utilities.data.AttributeDict",
                              "lightning_fabric.utilities.data.AttributeDict")
SAFE_GLOBALS: list[Any] = [
    argparse.Namespace,
    *[(_LightningCallback, f"{package}.callbacks.{name}")
      for package in ("pytorch_lightning", "lightning.pytorch") for name in _LIGHTNING_CALLBACKS],
    *[(_AttributeDict, name) for name in _LIGHTNING_ATTRIBUTE_DICTS],
]


@contextlib.contextmanager
def trusted_checkpoints(trust: bool = True) -> Iterator[None]:
    """Within the block, :func:`load_checkpoint` fully unpickles files (``--trust-checkpoint``)."""
    token = _trust_checkpoints.set(trust)
    try:
        yield
    finally:
        _trust_checkpoints.reset(token)


def checkpoints_trusted() -> bool:
    """Whether ``--trust-checkpoint`` is in force (:func:`trusted_checkpoints`): for loaders that
    hand pickles to another library (transformers) and must choose their own path when trusted."""
    return _trust_checkpoints.get()


class _TolerantUnpickler(pickle.Unpickler):
    """Full unpickler for trusted files whose classes cannot be imported here (e.g. Lightning's)."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            return type(name, (_PickledObjectStub,), {"__module__": module})


# torch.load takes a pickle *module*; this one only differs in how unknown classes are found.
_tolerant_pickle = types.ModuleType("lantern_tolerant_pickle")
_tolerant_pickle.Unpickler = _TolerantUnpickler  # type: ignore[attr-defined]
_tolerant_pickle.load = pickle.load  # type: ignore[attr-defined]

_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def _reason(error: BaseException) -> str:
    """One line of a torch/pickle error: the weights-only unpickler's own reason where it gives one,
    else the first sentence (torch appends paragraphs of advice that do not apply here)."""
    if isinstance(error, EOFError):
        return "the file ends early (empty or truncated)"
    text = str(error).split("WeightsUnpickler error:", 1)[-1]
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(error).__name__).split(". ", 1)[0]
    if "zip archive" in line or "Invalid argument" in line:  # torch's words for a cut-off zip container
        line += " (the file is truncated or damaged: download or copy it again)"
    return line


def load_checkpoint(path: str | os.PathLike[str], what: str = "checkpoint", *, trust: bool | None = None) -> Any:
    """``torch.load`` a pickled checkpoint on CPU without letting it run code.

    Only tensors, containers, numbers and the allowed classes above are rebuilt; a file naming any
    other class is refused with a LanternError naming the file and the class. ``trust=True`` (or
    ``--trust-checkpoint``, through :func:`trusted_checkpoints`) loads it with the full unpickler
    after a warning: only for files you would also run as a program.
    """
    path = Path(path)
    if not path.is_file():
        raise LanternError(f"{what} not found: {path}")
    if _trust_checkpoints.get() if trust is None else trust:
        return _load_trusted(path, what)
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=False)
    except pickle.UnpicklingError as e:
        refused = _REFUSED_GLOBAL.search(str(e))
        if refused is not None:
            name = refused.group(1) if "." in refused.group(1) else f"builtins.{refused.group(1)}"  # torch drops it
            raise LanternError(
                f"{what} {path} contains a pickled {name}, which lantern does not load because "
                f"unpickling it could run code; if you trust this file, pass {TRUST_FLAG} "
                "(trust_checkpoint=True in Python)"
            ) from None
        raise LanternError(f"{what} {path} could not be read as a torch checkpoint: {_reason(e)}") from None
    except Exception as e:  # the restricted unpickler runs no code: anything it raises is about the file
        raise LanternError(f"{what} {path} could not be read as a torch checkpoint: {_reason(e)}") from None


def _load_trusted(path: Path, what: str) -> Any:
    warnings.warn(f"{what} {path}: loading with the full unpickler ({TRUST_FLAG}): this runs any code "
                  "the file contains", LanternWarning, stacklevel=3)
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=False, pickle_module=_tolerant_pickle)
    except Exception as e:  # a trusted file may raise anything while unpickling
        raise LanternError(f"{what} {path} could not be read as a torch checkpoint: {_reason(e)}") from None


class DictConfig:
    """``to_dict`` / ``from_dict`` of a frozen config dataclass saved as JSON: tuples are written as
    lists and read back as tuples; an unknown key is an error (a typo, or another model's config)."""

    CONFIG_NAME: ClassVar[str] = "config"  # how errors name it ("VQ config")

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Self:
        """Build from :meth:`to_dict` output."""
        check(isinstance(d, Mapping), f"{cls.CONFIG_NAME} must be a mapping, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(d) - known)
        check(not unknown, f"unknown {cls.CONFIG_NAME} keys: {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
