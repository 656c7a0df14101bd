"""User-facing errors.

Every error a user can cause with a bad argument, file or checkpoint is a :class:`LanternError`
whose message names the argument and what was expected. The CLI prints these without a stack
trace; anything else reaching the top level is a bug in lantern.
"""

from __future__ import annotations


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
