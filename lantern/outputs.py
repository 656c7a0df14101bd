"""All-or-nothing outputs: a command's output folder (or file) appears complete or not at all.

A command first checks its output location (:meth:`OutputFolder.check`), before it loads a model
or decodes anything, so an unusable ``--out`` fails at once, and creates nothing while checking.
It then writes everything into a staging folder beside the target, ``.NAME.tmp-PID`` on the same
filesystem, and renames it into place only when complete (:meth:`OutputFolder.write`). A failure,
a full disk or an interruption (SIGINT, SIGTERM) removes the staging folder; a SIGKILL leaves it
behind under that recognisable name, and the next run into the same location removes it. An
existing non-empty folder is refused unless ``overwrite``, which replaces it whole: the old folder
is renamed aside (``.NAME.old-PID``), the new one renamed in, then the old one deleted.

Long jobs (``generate``, :meth:`OutputFolder.write_job`) stage ``.NAME.tmp-PID/out`` the same
way, with the job's per-image records beside ``out``. With ``--resume`` the job folder is
``.NAME.resume`` instead: no PID in its name, never removed by a failure or by another run, so a
killed job is continued by the next ``--resume`` run; ``--out`` still appears only when complete.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from lantern.errors import LanternError, check

# The test-only hook of the interruption tests: with this variable set to a path, a command that
# reaches the middle of its write phase creates that file and waits there (up to a minute), so a
# test can kill it at a known point. Unset (always, outside the tests) it costs one lookup.
PAUSE_ENV = "LANTERN_TEST_PAUSE_WRITES"

_STAGING = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old|probe)-(?P<pid>\d+)$")


def staging_name(name: str, kind: str = "tmp", pid: int | None = None) -> str:
    """``.NAME.tmp-PID`` (a folder being written) or ``.NAME.old-PID`` (one being replaced)."""
    return f".{name}.{kind}-{os.getpid() if pid is None else pid}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_staging(target: Path) -> list[Path]:
    """Delete the staging folders/files of ``target`` left by runs that no longer exist (a
    SIGKILL, a power cut); those of live processes (a concurrent run) are left alone."""
    removed: list[Path] = []
    parent = target.parent
    if not parent.is_dir():
        return removed
    for entry in parent.iterdir():
        m = _STAGING.match(entry.name)
        if m is None or m["name"] != target.name or _pid_alive(int(m["pid"])):
            continue
        _remove(entry)
        removed.append(entry)
    return removed


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _refuse_linked_overwrite(path: str | os.PathLike[str], what: str, overwrite: bool) -> None:
    """``--overwrite`` through a symbolic link would replace what the link points to (and delete
    its old contents), which the user never named: refused, and the target is not touched. A link
    without ``--overwrite`` only writes into an empty or absent target, so it stays allowed."""
    p = Path(path)
    if overwrite and p.is_symlink():
        raise LanternError(f"{what}: {p} is a symbolic link (to {os.readlink(p)}); --overwrite would replace "
                           "what it points to: pass that path itself, or remove the link")


def _resolved(path: str | os.PathLike[str], what: str = "--out") -> Path:
    """``path``, or what it links to: the staging folder must be renamed onto the real folder,
    not onto the link. A link that leads back to itself is refused in one line."""
    p = Path(path)
    if not p.is_symlink():
        return p
    loop = LanternError(f"{what}: {p} is a symbolic link loop (following it never reaches a file or folder); "
                        "remove the link or choose another path")
    try:
        # strict: Python 3.13's non-strict resolve returns a loop as it is, without an error
        return p.resolve(strict=True)
    except RuntimeError:  # a loop, before Python 3.13
        raise loop from None
    except OSError as e:
        if e.errno == errno.ELOOP:  # a loop, from Python 3.13
            raise loop from None
    try:  # a link to a path not made yet (allowed): resolved as far as it goes
        return p.resolve(strict=False)
    except RuntimeError:
        raise loop from None


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(path.anchor or ".")


def check_location(path: Path, what: str) -> None:
    """The folder that will hold ``path`` can be created and written: its nearest existing
    ancestor is a directory where a probe folder can be made (and is removed at once). Creates
    nothing that outlives the check."""
    parent = path.parent
    base = _nearest_existing(parent)
    if not base.is_dir():
        raise LanternError(f"{what}: cannot create directory {parent}: {base} is not a directory")
    probe = base / staging_name(path.name, "probe")
    try:
        probe.mkdir()
    except OSError as e:
        # EACCES reads "Permission denied"; a special file system such as /proc refuses with others.
        # The folder named is the one that exists: it is where writing failed.
        made = f"cannot write into {base}" if base == parent else f"cannot create directory {parent}"
        raise LanternError(f"{what}: {made}: making a folder in {base} failed ({e.strerror})") from None
    probe.rmdir()


def _make_parents(directory: Path, what: str) -> list[Path]:
    """``mkdir -p directory``; returns the folders it created, deepest first (to undo it)."""
    missing = [p for p in (directory, *directory.parents) if not p.exists()]
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LanternError(f"{what}: cannot create directory {directory}: {e.strerror}") from None
    return missing


def _remove_empty(folders: list[Path]) -> None:
    for folder in folders:  # deepest first: each is empty once its child is gone
        with contextlib.suppress(OSError):
            folder.rmdir()


@contextlib.contextmanager
def made_folder(directory: Path, what: str) -> Iterator[Path]:
    """``directory``, created with its missing parents for the block, which are removed again
    after it where they are left empty (a working folder a failed or finished run leaves no trace of)."""
    missing = _make_parents(directory, what)
    try:
        yield directory
    finally:
        _remove_empty(missing)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT / SIGTERM until the block is done (where the platform allows it)."""
    import signal

    held = {signal.SIGINT, signal.SIGTERM}
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def write_error(what: str, target: Path, e: OSError) -> LanternError:
    """The one-line error of a write that failed (full disk, quota, read-only filesystem)."""
    where = f" ({e.filename})" if e.filename else ""
    return LanternError(f"{what}: could not write {target}: {e.strerror or e}{where}; nothing was written")


def pause_for_tests() -> None:
    """The hook of :data:`PAUSE_ENV` (see there); does nothing when it is unset."""
    marker = os.environ.get(PAUSE_ENV)
    if not marker:
        return
    Path(marker).touch()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.05)


def check_training_out(path: str | os.PathLike[str], what: str = "--out") -> Path:
    """A training run's ``--out`` (which keeps its own checkpoints and ``--resume`` rules): not a
    file, and creatable; checked before any data is read. Creates nothing."""
    out = Path(path)
    _resolved(out, what)  # refuses a link loop, which exists() would call absent
    if out.exists() and not out.is_dir():
        raise LanternError(f"{what}: {out} exists and is not a directory")
    check_location(out, what)
    return out


@dataclass(frozen=True)
class _Output:
    path: Path
    what: str = "--out"
    overwrite: bool = False

    @contextlib.contextmanager
    def _undo_on_failure(self) -> Iterator[None]:
        """Create the missing parents of ``path`` for the body; if it fails, remove them again,
        and report a failed write (full disk, quota, read-only filesystem) in one line."""
        created = _make_parents(self.path.parent, self.what)
        done = False
        try:
            yield
            done = True
        except OSError as e:
            raise write_error(self.what, self.path, e) from None
        finally:
            if not done:
                _remove_empty(created)


@dataclass(frozen=True)
class OutputFolder(_Output):
    """An output folder written all-or-nothing. Make one with :meth:`check`, write with :meth:`write`."""

    @classmethod
    def check(cls, path: str | os.PathLike[str], what: str = "--out", overwrite: bool = False,
              reads: Mapping[str, str | os.PathLike[str] | None] | None = None) -> OutputFolder:
        """Validate the location now (before any model is loaded); creates nothing. ``reads``: the
        paths the command reads, by flag: the folder must be none of them and hold none of them,
        since writing it replaces it whole (``--overwrite`` would delete the input)."""
        _refuse_linked_overwrite(path, what, overwrite)
        out = cls(_resolved(path, what), what, overwrite)
        absolute = out.path.resolve()  # (a relative --out was compared with resolved inputs: never equal)
        check(str(path) != "" and absolute != Path.cwd().resolve(),
              f"{what}: {str(path) or repr('')} is the current folder, which a finished run's rename cannot "
              "replace: name a folder")
        for flag, read in (reads or {}).items():
            if read is None or not os.path.exists(read):
                continue
            source = Path(read).resolve()
            if source == absolute or absolute in source.parents:
                raise LanternError(f"{what}: {out.path} is or holds {flag} {read}, which this command reads; "
                                   "writing it would replace that input: choose another folder")
        if out.path.exists() or out.path.is_symlink():
            if not out.path.is_dir():
                raise LanternError(f"{what}: {out.path} exists and is not a directory")
            if not overwrite and not out.is_empty():
                raise LanternError(f"{what}: {out.path} already exists and is not empty; pass --overwrite to "
                                   "replace it, or choose another folder")
        check_location(out.path, what)
        return out

    def is_empty(self) -> bool:
        return self.path.is_dir() and next(self.path.iterdir(), None) is None

    @contextlib.contextmanager
    def write(self) -> Iterator[Path]:
        """Yield a staging folder to write everything into; it becomes ``path`` when the body
        succeeds. On any failure or interruption nothing is left (but the empty ``path`` the user
        may have made beforehand); a failed write becomes a one-line :class:`LanternError`."""
        with self._undo_on_failure():
            remove_stale_staging(self.path)
            staging = self.path.parent / staging_name(self.path.name)
            try:
                _remove(staging)
                staging.mkdir()
                yield staging
                self._commit(staging)
            finally:
                _remove(staging)  # gone already after a commit

    def _commit(self, staging: Path) -> None:
        """Rename ``staging`` onto ``path``. An absent or empty ``path`` is replaced by one
        rename; a non-empty one (only with ``overwrite``) is renamed aside first, and deleted
        once the new folder is in place."""
        if not self.path.exists() or self.is_empty():
            try:
                os.replace(staging, self.path)
                return
            except OSError as e:  # a concurrent run filled it meanwhile
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or self.overwrite:
                    raise
        if not self.overwrite:
            raise LanternError(f"{self.what}: {self.path} was filled by another run meanwhile; nothing was "
                               "written (pass --overwrite to replace it)")
        aside = self.path.parent / staging_name(self.path.name, "old")
        with _signals_deferred():  # Ctrl-C between the two renames would lose the old and the new folder
            os.replace(self.path, aside)
            try:
                os.replace(staging, self.path)
            except OSError:
                os.replace(aside, self.path)  # put the old folder back
                raise
        _remove(aside)


    @contextlib.contextmanager
    def write_job(self, resume: bool = False) -> Iterator[Path]:
        """Yield a job folder JOB for a long run (``lantern.jobs``): ``JOB/out`` becomes ``path``
        when the body succeeds, and JOB keeps the job's own files (its records) beside it.

        Without ``resume`` JOB is the staging folder ``.NAME.tmp-PID`` and everything behaves as
        :meth:`write`. With ``resume`` JOB is ``.NAME.resume`` (:func:`resume_folder`): it is kept
        through failures, interruptions and kills, the next ``resume`` run into the same ``path``
        picks it up, and it is removed once its ``out`` was renamed into place."""
        with self._undo_on_failure():
            remove_stale_staging(self.path)
            job = resume_folder(self.path) if resume else self.path.parent / staging_name(self.path.name)
            committed = False
            try:
                if not resume:
                    _remove(job)
                (job / "out").mkdir(parents=True, exist_ok=True)
                yield job
                self._commit(job / "out")
                committed = True
            finally:
                if committed or not resume:
                    _remove(job)


def resume_folder(path: Path) -> Path:
    """``.NAME.resume`` beside ``path``: the job folder of a resumable run (``generate --resume``),
    named without a PID so that the run after a kill finds it."""
    return path.parent / f".{path.name}.resume"


@dataclass(frozen=True)
class OutputFile(_Output):
    """A single output file (``build-proximity --out``): refused if it exists, unless ``overwrite``;
    written under a staging name beside it and renamed into place."""

    @classmethod
    def check(cls, path: str | os.PathLike[str], what: str = "--out", overwrite: bool = False) -> OutputFile:
        _refuse_linked_overwrite(path, what, overwrite)
        out = cls(_resolved(path, what), what, overwrite)
        if out.path.is_dir():
            raise LanternError(f"{what}: {out.path} is a directory; expected a file name")
        if out.path.exists() and not overwrite:
            raise LanternError(f"{what}: {out.path} already exists; pass --overwrite to replace it")
        check_location(out.path, what)
        return out

    @contextlib.contextmanager
    def write(self) -> Iterator[Path]:
        """Yield a temporary path beside ``path`` (``.NAME.tmp-PID``, removed by a later run if
        this one is killed); renamed onto ``path`` when the body succeeds."""
        with self._undo_on_failure():
            remove_stale_staging(self.path)
            tmp = self.path.parent / staging_name(self.path.name)
            try:
                _remove(tmp)
                yield tmp
                os.replace(tmp, self.path)
            finally:
                _remove(tmp)  # gone already after the rename
