"""``--method auto``: the fastest method for this model, device and batch size within a quality
class, read from a *method calibration* (not to be confused with ``--tree auto``'s acceptance
calibration in :mod:`lantern.autotree.calibrate`).

A calibration is one JSON file per model and device setting, written by ``lantern calibrate`` (or
``lantern bench --save-calibration``): every method's τ, its quality verdict against AR's spread
(:class:`lantern.eval.report.ARSpread`: "within", "out", or null when quality was not measured)
and its measured seconds per image at each batch size timed. It is data only (no pickles, no
code), and its schema is checked when it is read, every error one line naming the file.

Where it lives (:class:`Setup`): ``$LANTERN_CALIBRATION_DIR``, else
``$XDG_CACHE_HOME/lantern/calibration``, else ``~/.cache/lantern/calibration``, then
``<model-id>/<key>.json``; or, shipped with a model (whose folder may be read-only),
``<model>/calibration/<key>.json``, read when the user's own is absent. ``model-id`` is a hash of
the model folder's files (:func:`model_identity`), so a preset, a copy of a folder and a Hub
snapshot of the same files share one; ``key`` names the device, precision, compile mode and
batch invariance (``cpu-amd-epyc-7b13-float32-eager``), each of which changes the timings.

Quality classes (``--quality``): ``lossless``, the methods :data:`lantern.methods.METHOD_TABLE`
marks lossless (no quality measurement needed); ``ar``, those plus the methods the calibration
judged within AR's spread. :func:`choose_method` picks the class's fastest at the requested batch
size (the nearest measured one, in ratio, when it was not timed) and says why.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from lantern.errors import LanternError, check
from lantern.methods import METHOD_SETTINGS, METHOD_TABLE

AUTO = "auto"  # --method auto / method="auto"
QUALITY_CLASSES = ("lossless", "ar")
DEFAULT_QUALITY = "ar"
FORMAT = "lantern-method-calibration"
VERSION = 1
CALIBRATION_DIR = "calibration"  # the folder a model may ship its calibrations in
IDENTITY_SAMPLE = 1 << 20  # bytes hashed from each end of every file of the model folder
MAX_MODEL_FILES = 10_000
VERDICTS = (None, "within", "out")
# Cost of a --quick calibration, for the message that asks for one: every method at batch 1 and 8
# (timed on a 2-core Xeon, float32, 21 methods: photos 8.5 min, digits 1.9 min).
QUICK_COST = "about 9 min for photos, 2 for digits, on a 2-core CPU"

# The top-level keys of a calibration file: required ones, then provenance (optional).
_REQUIRED = ("format", "version", "model_id", "key", "batch_sizes", "quality", "methods")
_OPTIONAL = ("model", "device", "dtype", "compile", "deterministic", "threads", "sampling",
             "lantern", "date", "command", "machine")
_METHOD_KEYS = ("tau", "seconds_per_image", "verdict", "worse", "better", "config")


def calibration_dir() -> Path:
    """The user's calibrations: ``$LANTERN_CALIBRATION_DIR``, else ``$XDG_CACHE_HOME/lantern/calibration``,
    else ``~/.cache/lantern/calibration``."""
    if os.environ.get("LANTERN_CALIBRATION_DIR"):
        return Path(os.environ["LANTERN_CALIBRATION_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lantern" / "calibration"


def _model_files(root: Path) -> Iterator[Path]:
    """The files that make a model: everything under ``root`` but hidden entries, caches and its
    shipped calibrations (following links: a Hub snapshot's files are links to blobs)."""
    for folder, dirs, files in os.walk(root, followlinks=True):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in (CALIBRATION_DIR, "__pycache__")]
        yield from (Path(folder) / f for f in files if not f.startswith("."))


def model_identity(root: str | os.PathLike[str]) -> str:
    """16 hex digits of sha256 over every model file's relative path, size and first and last MiB:
    the same for every copy of the same files, different for other weights, settings or drafters;
    a few MiB read whatever the model's size."""
    root = Path(root)
    files = sorted(_model_files(root))
    check(0 < len(files) <= MAX_MODEL_FILES,
          f"--model {root}: {len(files)} files; a model folder for --method auto holds 1 to {MAX_MODEL_FILES}")
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.relative_to(root).as_posix()}\0{size}\0".encode())
        with path.open("rb") as f:
            digest.update(f.read(IDENTITY_SAMPLE))
            if size > IDENTITY_SAMPLE:
                f.seek(max(IDENTITY_SAMPLE, size - IDENTITY_SAMPLE))
                digest.update(f.read())
    return digest.hexdigest()[:16]


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "unknown"


def device_name(device: str) -> str:
    """The hardware behind a torch device: the GPU's name, the CPU's model, else the device type."""
    import platform

    import torch

    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    if kind != "cpu":
        return kind
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    named = (line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    return next(named, "") or platform.processor() or platform.machine()


@dataclass(frozen=True)
class Setup:
    """A model on a device, as a run loads it: which calibration applies, where it lives and the
    command that makes it."""

    model: str  # as the user named it (a preset, a folder, a repo id): for messages and commands
    root: Path  # the model's folder
    device: str = "cpu"
    dtype: str = "float32"  # the target's precision, as torch names it without "torch."
    compile: str | None = None  # the resolved compile mode (None: eager)
    deterministic: bool = False  # batch-invariant matmuls (slower)

    @classmethod
    def of(cls, model: str | os.PathLike[str], root: str | os.PathLike[str], device: Any, dtype: Any,
           compile: str | None, deterministic: bool = False) -> Setup:
        """From loaded or resolved values (a torch dtype or its name; a preset's folder is named by the preset)."""
        from lantern.targets.base import PRESETS_DIR

        root = Path(root)
        name = root.name if root.parent.resolve() == PRESETS_DIR.resolve() else str(model)
        return cls(name, root, str(device), str(dtype).replace("torch.", ""), compile, deterministic)

    @cached_property
    def model_id(self) -> str:
        return model_identity(self.root)

    @cached_property
    def key(self) -> str:
        """The device setting's name: hardware, precision, compile mode, batch invariance."""
        import torch

        kind = torch.device(self.device).type
        hardware = _slug(f"{kind}-{device_name(self.device)}") if kind in ("cpu", "cuda") else kind
        return (f"{hardware}-{self.dtype}-{_slug(self.compile) if self.compile else 'eager'}"
                + ("-deterministic" if self.deterministic else ""))

    @property
    def user_file(self) -> Path:
        """Where ``lantern calibrate`` writes and ``--method auto`` looks first."""
        return calibration_dir() / self.model_id / f"{self.key}.json"

    @property
    def model_file(self) -> Path:
        """A calibration shipped inside the model folder, read when the user has none."""
        return self.root / CALIBRATION_DIR / f"{self.key}.json"

    def command(self, quick: bool = False) -> str:
        """The ``lantern calibrate`` command that writes this setting's calibration."""
        flags = [f"--model {self.model}"]
        flags += [f"--device {self.device}"] if self.device != "cpu" else []
        flags += [f"--dtype {self.dtype}"] if self.dtype != "float32" else []
        flags += ([f"--compile {self.compile}"] if self.compile else []) + (["--deterministic"] if self.deterministic
                                                                             else [])
        return " ".join(["lantern calibrate", *flags, *(["--quick"] if quick else [])])


@dataclass(frozen=True)
class MethodCalibration:
    """One method's measurements: τ, its verdict against AR's spread and its seconds per image."""

    name: str
    tau: float
    seconds_per_image: Mapping[int, float]  # batch size -> measured seconds per image
    verdict: str | None = None  # "within" / "out" AR's spread; None: quality not measured
    worse: tuple[str, ...] = ()  # the metrics worse than AR's bound (out when any)
    better: tuple[str, ...] = ()
    config: Mapping[str, Any] | None = None  # the resolved MethodConfig it ran (provenance)

    def to_dict(self) -> dict[str, Any]:
        return {"tau": self.tau, "seconds_per_image": {str(b): s for b, s in sorted(self.seconds_per_image.items())},
                "verdict": self.verdict, "worse": list(self.worse), "better": list(self.better),
                **({"config": dict(self.config)} if self.config is not None else {})}

    def why_not(self, quality: str) -> str | None:
        """Why the method is outside ``quality``'s class, or None when it is inside."""
        if METHOD_TABLE[self.name].lossless:
            return None
        if quality == "lossless":
            return "not lossless at its defaults"
        if self.verdict is None:
            return "quality not measured (a --quick calibration)"
        return f"out of AR's spread (worse: {', '.join(self.worse)})" if self.verdict == "out" else None


@dataclass(frozen=True)
class Calibration:
    """A calibration file's contents (:data:`FORMAT`, version :data:`VERSION`)."""

    model_id: str
    key: str
    batch_sizes: tuple[int, ...]
    methods: Mapping[str, MethodCalibration]
    quality: Mapping[str, Any] | None = None  # how verdicts were judged (None: speed only)
    meta: Mapping[str, Any] = field(default_factory=dict)  # provenance: model, device, dtype, command, ...

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "model_id": self.model_id, "key": self.key, **self.meta,
                "batch_sizes": list(self.batch_sizes), "quality": None if self.quality is None else dict(self.quality),
                "methods": {name: m.to_dict() for name, m in self.methods.items()}}

    def save(self, path: str | os.PathLike[str]) -> Path:
        """:meth:`write`, for callers that print nothing."""
        return self.write(path)[0]

    def write(self, path: str | os.PathLike[str]) -> tuple[Path, str | None]:
        """Write to ``path`` (its folder made): to a temporary name, then renamed into place; and a
        note when it replaced another calibration, which is kept beside it (:func:`previous_file`):
        a quick or one-method run must not silently take the place of a full calibration (hours on
        a large model), after which ``--method auto`` could only choose among what it measured.
        Checked as a reader checks it first, so a file ``--method auto`` would refuse is not written."""
        from lantern.io import finite_or_null, write_json

        path = Path(path)
        content = finite_or_null(self.to_dict())
        Calibration.from_dict(content, f"the calibration to write to {path}")
        path.parent.mkdir(parents=True, exist_ok=True)
        note = None
        if path.is_file():
            kept = previous_file(path)
            os.replace(path, kept)
            note = f"the calibration it replaced ({_summary(kept)}) is kept as {kept}"
        write_json(path, content)
        return path, note

    @classmethod
    def from_dict(cls, raw: Any, source: str) -> Calibration:
        """Checked against the schema; every error is one line naming ``source`` and the field."""
        return _Reader(source).calibration(raw)


def previous_file(path: Path) -> Path:
    """Where a replaced calibration is kept: ``KEY.previous.json`` beside it (one generation)."""
    return path.with_name(f"{path.stem}.previous{path.suffix}")


def _summary(path: Path) -> str:
    """A calibration's methods and batch sizes, in a few words (what a replacement dropped)."""
    try:
        old = load_calibration(path)
    except LanternError:
        return "unreadable"
    sizes = ", ".join(map(str, old.batch_sizes))
    quality = "speed only" if old.quality is None else "with quality"
    return f"{len(old.methods)} methods at batch {sizes}, {quality}"


def load_calibration(path: str | os.PathLike[str]) -> Calibration:
    from lantern.io import read_json

    return Calibration.from_dict(read_json(path, "calibration"), f"calibration {path}")


class _Reader:
    """The schema check of a calibration file, each error naming the file and the field."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, what: str) -> LanternError:
        return LanternError(f"{self.source}: {where}: {what} (make it again with `lantern calibrate`)")

    def number(self, value: Any, where: str, positive: bool = True) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or (
                positive and value <= 0):
            raise self.fail(where, f"expected a {'positive ' if positive else ''}finite number, got {value!r:.40}")
        return float(value)

    def names(self, value: Any, where: str) -> tuple[str, ...]:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.fail(where, f"expected a list of metric names, got {value!r:.40}")
        return tuple(value)

    def calibration(self, raw: Any) -> Calibration:
        if not isinstance(raw, dict):
            raise LanternError(f"{self.source} is not a lantern calibration: expected a JSON object, got "
                               f"{type(raw).__name__}")
        if raw.get("format") != FORMAT:
            raise LanternError(f"{self.source} is not a lantern calibration (\"format\" is not {FORMAT!r})")
        if raw.get("version") != VERSION:
            raise self.fail("version", f"this lantern reads version {VERSION}, got {raw.get('version')!r:.40}")
        missing = [k for k in _REQUIRED if k not in raw]
        unknown = sorted(set(raw) - set(_REQUIRED) - set(_OPTIONAL))
        if missing or unknown:
            raise self.fail("keys", f"missing {', '.join(missing)}" if missing else f"unknown {', '.join(unknown)}")
        for name in ("model_id", "key"):
            if not isinstance(raw[name], str) or not raw[name]:
                raise self.fail(name, f"expected a non-empty string, got {raw[name]!r:.40}")
        sizes = raw["batch_sizes"]
        whole = isinstance(sizes, list) and all(type(b) is int and b >= 1 for b in sizes)  # bools are not sizes
        if not whole or not sizes or len(set(sizes)) < len(sizes):
            raise self.fail("batch_sizes", f"expected a list of distinct batch sizes >= 1, got {sizes!r:.40}")
        quality = raw["quality"]
        if quality is not None and not isinstance(quality, dict):
            raise self.fail("quality", f"expected an object or null, got {quality!r:.40}")
        methods = raw["methods"]
        if not isinstance(methods, dict) or "ar" not in methods:
            raise self.fail("methods", "expected an object of methods, ar among them")
        entries = {name: self.method(name, entry, tuple(sizes), quality is not None)
                   for name, entry in methods.items()}
        meta = {k: raw[k] for k in _OPTIONAL if k in raw}
        return Calibration(raw["model_id"], raw["key"], tuple(sizes), entries, quality, meta)

    def method(self, name: str, entry: Any, sizes: tuple[int, ...], judged: bool) -> MethodCalibration:
        where = f"methods.{name}"
        if name not in METHOD_TABLE:
            raise self.fail(where, f"not a method of this lantern ({', '.join(METHOD_TABLE)})")
        if not isinstance(entry, dict) or sorted(set(entry) - set(_METHOD_KEYS)) or "seconds_per_image" not in entry:
            raise self.fail(where, f"expected an object with seconds_per_image (keys: {', '.join(_METHOD_KEYS)})")
        times = entry["seconds_per_image"]
        if not isinstance(times, dict) or sorted(times) != sorted(str(b) for b in sizes):
            raise self.fail(f"{where}.seconds_per_image", f"expected one time per batch size {list(sizes)}")
        verdict, worse = entry.get("verdict"), self.names(entry.get("worse", []), f"{where}.worse")
        if verdict not in VERDICTS or (verdict is not None and not judged) or (verdict == "out") != bool(worse):
            raise self.fail(f"{where}.verdict", f"expected \"within\", \"out\" (with its worse metrics) or null (null "
                                                f"when quality is null), got {verdict!r:.40} with worse {list(worse)}")
        config = entry.get("config")
        if config is not None and not isinstance(config, dict):
            raise self.fail(f"{where}.config", "expected an object")
        return MethodCalibration(
            name, self.number(entry.get("tau"), f"{where}.tau"),
            {int(b): self.number(s, f"{where}.seconds_per_image.{b}") for b, s in times.items()},
            verdict, worse, self.names(entry.get("better", []), f"{where}.better"), config)


def find_calibration(setup: Setup) -> tuple[Path, Calibration]:
    """The calibration for ``setup``: the user's, else the one shipped in the model folder; without
    either, a one-line error with the command that makes one."""
    for path in (setup.user_file, setup.model_file):
        if path.is_file():
            calibration = load_calibration(path)
            check(calibration.model_id == setup.model_id and calibration.key == setup.key,
                  f"calibration {path} is for model {calibration.model_id} / {calibration.key}, not this "
                  f"{setup.model_id} / {setup.key}: make one with `{setup.command()}`")
            return path, calibration
    others = sorted({p.stem for folder in (setup.user_file.parent, setup.model_file.parent) if folder.is_dir()
                     for p in folder.glob("*.json")} - {setup.key})
    # e.g. `bench --save-calibration` at its default --dtype auto (bf16 on a CPU with AMX) and a
    # float32 generate: the settings are named, so the flag that differs shows
    elsewhere = f"; this model has calibrations of other settings only: {', '.join(others)}" if others else ""
    raise LanternError(
        f"--method auto needs a calibration of {setup.model} on {setup.key}, and there is none (looked for "
        f"{setup.user_file}{elsewhere}): make one with `{setup.command()}` (every method's speed and quality), or a "
        f"quick one with `{setup.command(quick=True)}` (speed only, {QUICK_COST}; --quality ar then picks among "
        f"lossless methods only); or name a --method", field="method")


def nearest_batch_size(sizes: Iterable[int], batch_size: int) -> int:
    """The measured batch size nearest ``batch_size`` in ratio (4 -> 8 rather than 1; a tie -> the smaller)."""
    return min(sizes, key=lambda b: (abs(math.log(b / batch_size)), b))


@dataclass(frozen=True)
class MethodChoice:
    """What ``--method auto`` picked and why: run.json's and ``PipelineOutput.config``'s ``auto_method``."""

    method: str
    quality: str
    batch_size: int  # asked for
    measured_batch_size: int  # whose timings decided
    calibration: str  # the file read
    ranking: tuple[tuple[str, float], ...]  # the class's methods, fastest first: (method, s/img)
    excluded: Mapping[str, str]  # calibrated methods outside the class: method -> why
    tau: float
    notes: tuple[str, ...] = ()
    sampling: Mapping[str, Any] | None = None  # the sampling the calibration ran (None: not recorded)

    @property
    def explanation(self) -> str:
        s = dict(self.ranking)[self.method]
        others = ", ".join(f"{m} {t:.3g}" for m, t in self.ranking[1:4])
        return (f"{self.method} ({s:.3g} s/img at batch {self.measured_batch_size}, tau {self.tau:.2f}): the fastest "
                f"method of class {self.quality} in {self.calibration}" + (f"; next: {others}" if others else "")
                + "".join(f"; {n}" for n in self.notes))

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "quality": self.quality, "batch_size": self.batch_size,
                "measured_batch_size": self.measured_batch_size, "calibration": self.calibration,
                "seconds_per_image": dict(self.ranking)[self.method], "tau": self.tau,
                "ranking": [[m, s] for m, s in self.ranking], "excluded": dict(self.excluded),
                "notes": list(self.notes), "explanation": self.explanation,
                "calibrated_sampling": None if self.sampling is None else dict(self.sampling)}

    def with_sampling(self, used: Mapping[str, Any]) -> MethodChoice:
        """A note when the run samples otherwise than the calibration did (τ and quality move with it)."""
        if self.sampling is None or dict(self.sampling) == dict(used):
            return self
        return replace(self, notes=(*self.notes, f"calibrated at sampling {dict(self.sampling)}, this run uses "
                                                 f"{dict(used)}"))


def check_quality(quality: str | None, method: str) -> str:
    """``--quality`` / ``quality=``: a class of :data:`QUALITY_CLASSES`, only with method auto."""
    if method != AUTO:
        check(quality is None, f"--quality is only used with --method auto, got --method {method}", field="quality")
        return DEFAULT_QUALITY
    quality = DEFAULT_QUALITY if quality is None else quality
    check(quality in QUALITY_CLASSES, f"--quality must be one of {', '.join(QUALITY_CLASSES)}, got {quality!r:.40}",
          field="quality")
    return quality


def choose_method(calibration: Calibration, quality: str, batch_size: int, source: str = "") -> MethodChoice:
    """The fastest calibrated method of ``quality``'s class at ``batch_size`` (or the nearest
    measured batch size); ``ar`` is lossless, so every calibration has an answer."""
    quality = check_quality(quality, AUTO)
    measured = nearest_batch_size(calibration.batch_sizes, batch_size)
    excluded = {name: why for name, m in calibration.methods.items() if (why := m.why_not(quality)) is not None}
    ranking = sorted(((name, m.seconds_per_image[measured]) for name, m in calibration.methods.items()
                      if name not in excluded), key=lambda pair: pair[1])  # stable: the table's order on ties
    notes = []
    if measured != batch_size:
        notes.append(f"batch {batch_size} was not measured: the timings of batch {measured} (nearest of "
                     f"{', '.join(map(str, calibration.batch_sizes))}) decided")
    if calibration.quality is None and quality == "ar":
        notes.append("the calibration has no quality verdicts (--quick): only lossless methods were eligible")
    busy = busy_warning(calibration)
    if busy is not None:  # said when it was written, and again at every choice it decides
        notes.append(f"its timings were taken on a busy machine ({busy}): calibrate again on a quiet one")
    best = ranking[0][0]
    sampling = calibration.meta.get("sampling")
    return MethodChoice(best, quality, batch_size, measured, source, tuple(ranking), excluded,
                        calibration.methods[best].tau, tuple(notes), sampling if isinstance(sampling, dict) else None)


def busy_warning(calibration: Calibration) -> str | None:
    """What the calibration's own timing recorded of other processes competing for the cores (the
    bench's busy-machine check), without its "WARNING: busy machine" lead; None when quiet."""
    machine = calibration.meta.get("machine")
    warning = machine.get("busy_warning") if isinstance(machine, dict) else None
    if not isinstance(warning, str) or not warning:
        return None
    inner = re.search(r"\((.*?)\)", warning)  # "WARNING: busy machine (others used 40 % ...): ..."
    return inner.group(1) if inner else warning


def auto_method(setup: Setup, quality: str | None, batch_size: int, settings: Mapping[str, Any]) -> MethodChoice:
    """``--method auto``: refuse method settings (the calibration measured each method at its
    defaults), find ``setup``'s calibration, choose."""
    given = next((name for name in METHOD_SETTINGS if settings.get(name) is not None), None)
    if given is not None:
        flag = "--" + given.replace("_", "-")
        raise LanternError(f"--method auto runs the calibrated method at its defaults; drop {flag} or name a --method",
                           field=given)
    quality = check_quality(quality, AUTO)
    path, calibration = find_calibration(setup)
    return choose_method(calibration, quality, batch_size, str(path))
