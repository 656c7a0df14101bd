"""``lantern`` command line: one entry point, one sub-command per job.

Every run writes its resolved configuration next to its outputs. Bad arguments end with a one-line
``lantern: error: ...`` naming the argument, and exit code 2; no partial output files are left.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from lantern.cli.bench import add_bench
from lantern.cli.calibrate import add_calibrate
from lantern.cli.common import check_sampling_flags, check_seed_flags
from lantern.cli.demo import add_demo
from lantern.cli.generate import add_generate
from lantern.cli.profile import add_profile
from lantern.cli.score import add_score
from lantern.cli.serve import add_serve
from lantern.cli.tools import add_build_proximity, add_convert_llamagen, add_make_random_stack
from lantern.errors import COMMAND_LINE, LanternError
from lantern.version import DISTRIBUTION, __version__


class Parser(argparse.ArgumentParser):
    """argparse's parser with its errors on one line, like every other ``lantern`` error: the
    argument and what was wrong, then where the usage is (argparse prints its whole usage block
    first, which buries the one line that matters). Sub-command parsers are this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="lantern", description="Relaxed speculative decoding for visual AR models.")
    parser.add_argument("--version", action="version", version=f"lantern {__version__} ({DISTRIBUTION})")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_generate(sub)
    add_build_proximity(sub)
    add_make_random_stack(sub)
    add_convert_llamagen(sub)
    add_demo(sub)
    add_profile(sub)
    add_bench(sub)
    add_calibrate(sub)
    add_score(sub)
    add_serve(sub)
    from lantern.cli.train import add_train_commands

    add_train_commands(sub)
    return parser


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that ``finally`` blocks (staging folders) run."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated()


def _one_line(e: BaseException) -> str:
    """A user-facing failure that is not a :class:`LanternError` (a path the OS refused, memory), in one line."""
    if isinstance(e, OSError):
        where = f": {e.filename}" if e.filename else ""
        return f"{e.strerror or e}{where}"
    if _cpu_allocator_failed(e):  # its text names the bytes asked for: worth keeping, on one line
        asked = str(e).strip().splitlines()[0]
        return f"out of memory: {asked}; try a smaller --batch-size (or smaller model sizes)"
    return "out of memory; use a smaller --batch-size or fewer images" if _out_of_memory(e) else str(e)


# What torch's CPU allocator says when malloc fails (a plain RuntimeError, unlike CUDA's
# OutOfMemoryError): "[enforce fail at alloc_cpu.cpp:...] . DefaultCPUAllocator: can't allocate
# memory: you tried to allocate N bytes. Error code 12 (Cannot allocate memory)"; Windows builds
# say "not enough memory".
_CPU_ALLOCATOR_MESSAGES = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory")


def _cpu_allocator_failed(e: BaseException) -> bool:
    return isinstance(e, RuntimeError) and any(m in str(e) for m in _CPU_ALLOCATOR_MESSAGES)


def _out_of_memory(e: BaseException) -> bool:
    """MemoryError, torch.cuda.OutOfMemoryError (a RuntimeError; matched by name so that the top
    level imports no torch), or a failed allocation of torch's CPU allocator (matched by its text)."""
    return isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or _cpu_allocator_failed(e)


@contextlib.contextmanager
def _notices(args: argparse.Namespace) -> Iterator[None]:
    """What a command shows on stderr besides its own bars, off under ``--no-progress`` and on a
    torchrun rank other than 0: a line before a compiled region's first call (seconds to minutes
    before the first tokens), and transformers' own "Loading weights" bar."""
    from lantern.decoding.compiling import compile_notices
    from lantern.models.hf_folder import LOADING_BARS

    shown = not getattr(args, "no_progress", False) and os.environ.get("RANK", "0") == "0"
    token = LOADING_BARS.set(shown)
    try:
        with compile_notices(shown):
            yield
    finally:
        LOADING_BARS.reset(token)


@contextlib.contextmanager
def _warning_lines() -> Iterator[None]:
    """lantern's own warnings as one ``lantern: warning:`` line, as errors are, not Python's
    ``FILE:LINE: LanternWarning: ...`` and the source line that raised it. Only the format changes:
    filters and recorders (``warnings.catch_warnings``) see the same warnings."""
    import warnings

    from lantern.io import LanternWarning

    original = warnings.formatwarning

    def format_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                       line: str | None = None) -> str:
        if issubclass(category, LanternWarning):
            return f"lantern: warning: {message}\n"
        return original(message, category, filename, lineno, line)

    warnings.formatwarning = format_warning
    try:
        yield
    finally:
        warnings.formatwarning = original


@contextlib.contextmanager
def _threads(args: argparse.Namespace, since: Any) -> Iterator[None]:
    """``--threads`` for the command's duration (torch's thread count is the process's: restored
    after, for a Python caller of :func:`main`). ``since``: the machine reading from before torch's
    import, whose time (this process's own CPU taken out) is what auto sees the others by."""
    choice = getattr(args, "threads", None)
    if choice is None or (choice == "auto" and getattr(args, "threads_follow_load", False)):
        yield  # (serve: its decode thread follows the load while it serves)
        return
    import torch

    from lantern.cli.common import choose_threads

    before = torch.get_num_threads()
    torch.set_num_threads(choose_threads(choice, getattr(args, "device", "cpu"), before, since))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _continue_hint(args: argparse.Namespace) -> str:
    """How to pick up what an interrupted command leaves: a trainer keeps its checkpoints, a
    ``--resume`` job its recorded images; anything else left nothing (outputs are all-or-nothing)."""
    if args.func.__name__.startswith("cmd_train_"):
        return f" (the same command with --resume continues from the last checkpoint in {args.out})"
    if getattr(args, "resume", False):
        return " (the same command continues the job: its recorded images are kept)"
    return ""


def _flagged(error: LanternError) -> str:
    """The message, led by its flag when it begins with the setting's Python name (a check written
    for both surfaces, ``lantern_delta must be in [0, 1]``): ``--lantern-delta: lantern_delta ...``."""
    text = str(error)
    if error.field and text.startswith((f"{error.field} must ", f"{error.field} (")):
        return f"--{error.field.replace('_', '-')}: {text}"
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Errors a user can fix (a :class:`LanternError`, an OSError on their paths,
    running out of memory) end with one ``lantern: error:`` line and exit 2; SIGINT / SIGTERM
    exit 130 / 143 once ``finally`` blocks removed partial outputs; anything else is a bug and
    keeps its traceback."""
    import signal
    import threading

    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for provenance (bench records its command)
    func: Callable[[argparse.Namespace], Any] = args.func

    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if in_main else None
    command_line = COMMAND_LINE.set(True)  # errors name the flags (the Python API names its arguments)
    try:
        check_sampling_flags(args)
        check_seed_flags(args)
        from lantern.machine import read_machine

        # --threads auto looks at the machine across torch's import (a second or more of this
        # process's time, its own CPU taken out) rather than in a quarter second of waiting after it
        before_torch = read_machine()
        from lantern.io import trusted_checkpoints  # imports torch: only once the flags are known good

        with (trusted_checkpoints(getattr(args, "trust_checkpoint", False)), _notices(args), _warning_lines(),
              _threads(args, before_torch)):
            return int(func(args) or 0)
    except LanternError as e:
        print(f"lantern: error: {_flagged(e)}", file=sys.stderr)
        return 2
    except (OSError, MemoryError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and not _out_of_memory(e):
            raise  # any other RuntimeError is a bug: keep its traceback
        print(f"lantern: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"lantern: interrupted{_continue_hint(args)}", file=sys.stderr)
        return 130
    except Terminated:
        print(f"lantern: terminated{_continue_hint(args)}", file=sys.stderr)
        return 143
    finally:
        COMMAND_LINE.reset(command_line)  # a Python caller of main() gets its own names back
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
