"""lantern's version, from the installed distribution's metadata (``lantern --version``,
``lantern.__version__``). The distribution is ``lantern-ar`` on PyPI, because ``lantern`` there is
an unrelated project; the import name and the command stay ``lantern``."""

from __future__ import annotations

from importlib import metadata

DISTRIBUTION = "lantern-ar"


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution``, or None when it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


# "0+unknown": a source tree on sys.path that was never installed
__version__ = installed_version(DISTRIBUTION) or "0+unknown"


def software() -> dict[str, str]:
    """What made a result file (``run.json``, ``bench``'s, ``demo.json``, ``profile.json``): lantern's,
    torch's and Python's versions, and when (UTC). Imports torch: call it where a run has."""
    import datetime
    import platform

    import torch

    return {"lantern": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
