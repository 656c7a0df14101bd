"""Models addressed the way the Hugging Face Hub addresses them: ``org/name`` repo ids.

A preset name or an existing local path always wins over a repo id of the same spelling; anything
else shaped like ``org/name`` is fetched (or found in the cache) by ``huggingface_hub``, which
comes with transformers (the ``t2i`` extra) and is imported only when a repo id is given.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from lantern.errors import LanternError

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_PRESETS = ("digits", "photos")  # lantern.targets.base.PRESETS, spelled here so this module imports no torch


def is_repo_id(text: str) -> bool:
    """``org/name``: two path parts, each a Hub name (no ``./``, no absolute path, no deeper folders)."""
    return bool(_REPO_ID.match(text)) and not text.startswith(("./", "../"))


def resolve_location(spec: str | os.PathLike[str], flag: str) -> str:
    """``spec`` unchanged when it is a preset name, an existing path or not a repo id; else the
    local snapshot folder of the Hub repo ``spec`` (``flag`` names the argument in errors)."""
    text = str(spec)
    if text in _PRESETS or Path(text).exists() or not is_repo_id(text):
        return text
    return str(snapshot(text, flag))


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def snapshot(repo_id: str, flag: str) -> Path:
    """The snapshot folder of ``repo_id``: from the cache, or downloaded unless ``HF_HUB_OFFLINE``.

    ``HF_HUB_OFFLINE`` and ``HF_HUB_CACHE`` are read here, at the call, rather than when
    huggingface_hub was imported, so a process that sets them late is still honoured."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise LanternError(f"{flag} {repo_id}: a Hugging Face repo id needs huggingface_hub "
                           "(pip install 'lantern-ar[t2i]'), or pass a local folder") from None
    offline = _env_flag("HF_HUB_OFFLINE")
    try:
        path = snapshot_download(repo_id, cache_dir=os.environ.get("HF_HUB_CACHE") or None,
                                 local_files_only=offline)
    except Exception as e:  # the hub raises many kinds (offline, 404, gated, network); all mean "not available"
        why = "has no complete snapshot in the local Hugging Face cache (HF_HUB_OFFLINE is set)" if offline else \
            f"could not be fetched from the Hugging Face Hub ({type(e).__name__}: not cached, and the Hub is " \
            "unreachable, or the repo is gated or does not exist)"
        raise LanternError(f"{flag} {repo_id}: no such local folder, and the repo {repo_id} {why}; download it where "
                           f"the Hub is reachable (`hf download {repo_id}`) or pass its local folder") from None
    return Path(path)
