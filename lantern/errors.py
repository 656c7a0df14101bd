"""User-facing errors.

Every error a user can cause with a bad argument, file or checkpoint is a :class:`LanternError`
whose message names the argument and what was expected. The CLI prints these without a stack
trace; anything else reaching the top level is a bug in lantern.
"""

from __future__ import annotations


class LanternError(ValueError):
    """A bad argument, file or checkpoint, described for the user."""


class CheckpointError(LanternError):
    """A checkpoint whose keys or shapes do not match the model it is loaded into."""


def check(condition: bool, message: str) -> None:
    """Raise :class:`LanternError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise LanternError(message)
