"""User-facing errors.

Every error a user can cause with a bad argument, file or checkpoint is a :class:`LanternError`
whose message names the argument and what was expected. The CLI prints these without a stack
trace; anything else reaching the top level is a bug in lantern.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Collection
from contextvars import ContextVar
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


class LanternError(ValueError):
    """A bad argument, file or checkpoint, described for the user in one line.

    ``field``: the setting the error is about (a name of the settings vocabulary, ``top_k``,
    ``lantern_delta``, ``tree`` ...), where the check knows it: data, so that the server answers it
    without parsing the message. None where the error is about no single setting.
    """

    def __init__(self, message: str = "", *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class CheckpointError(LanternError):
    """A checkpoint whose keys or shapes do not match the model it is loaded into."""


def check(condition: bool, message: str, field: str | None = None) -> None:
    """Raise :class:`LanternError` with ``message`` (about setting ``field``) unless ``condition`` holds."""
    if not condition:
        raise LanternError(message, field=field)


def first_given(**settings: object) -> str | None:
    """The name of the first of ``settings`` that is set (not None): the ``field`` of a check that
    refuses several settings together."""
    return next((name for name, value in settings.items() if value is not None), None)


# What transformers raises for a broken or unusual model folder: besides OSError / ValueError, a
# malformed tokenizer_config.json (e.g. an ``auto_map`` that is a string) surfaces as
# AttributeError, IndexError, KeyError or TypeError from inside its loaders.
TRANSFORMERS_LOAD_ERRORS: tuple[type[Exception], ...] = (
    OSError, ValueError, KeyError, AttributeError, IndexError, TypeError,
)


def transformers_reason(error: BaseException) -> str:
    """One line saying why transformers refused a folder: its messages run over several lines,
    and one that asks for ``trust_remote_code`` is rephrased (lantern never runs a folder's code)."""
    text = str(error)
    if "trust_remote_code" in text:
        return "its config asks to run the folder's own Python code (auto_map), which lantern never does"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else ""
    if first.endswith(":"):  # the line announces what follows ("... from one of:"): keep that too
        first = " ".join(lines)
        first = first if len(first) <= 300 else first[:299] + "…"
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


# ---- one name per surface ---------------------------------------------------------------------
# A check is written once, naming the command-line flag (``--sjd-window``); a Python caller passed
# the keyword ``sjd_window`` and reads it back so. The command line (and the server, which names
# the request field) renders its own surface: COMMAND_LINE is set by ``lantern``'s main.

COMMAND_LINE: ContextVar[bool] = ContextVar("lantern_command_line", default=False)
# a command quoted in a message (`lantern profile --batch-size 2`, "(lantern serve --max-body-bytes)") keeps its flags
_QUOTED = re.compile(r"`[^`]*`|\(lantern [^)]*\)")
_FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)(?: ([A-Z][A-Z_]*)\b)?")


def python_names(message: str, names: Collection[str]) -> str:
    """``message`` with the flags of ``names`` written as the Python arguments they are
    (``--sjd-window`` -> ``sjd_window``, ``--drafter DIR`` -> ``drafter=DIR``); flags of no such
    argument, and commands quoted in the message, are kept."""

    def argument(m: re.Match[str]) -> str:
        name = m.group(1).replace("-", "_")
        if name not in names:
            return m.group(0)
        return f"{name}={m.group(2)}" if m.group(2) else name

    parts, last = [], 0
    for quoted in _QUOTED.finditer(message):
        parts += [_FLAG.sub(argument, message[last:quoted.start()]), quoted.group(0)]
        last = quoted.end()
    return "".join([*parts, _FLAG.sub(argument, message[last:])])


def python_errors(names: Callable[[], Collection[str]]) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A public Python entry point whose :class:`LanternError` names its arguments (``names()``,
    read at the first error) as Python does; called from the command line, the flags stay."""

    def wrap(func: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(func)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return func(*args, **kwargs)
            except LanternError as e:
                renamed = python_names(str(e), names())
                if COMMAND_LINE.get() or renamed == str(e) or len(e.args) != 1:
                    raise
                try:
                    error = type(e)(renamed, field=e.field)
                except TypeError:  # a subclass of another signature: as it is
                    raise e from e.__cause__
                raise error.with_traceback(e.__traceback__) from e.__cause__

        return call

    return wrap
