"""``lantern generate`` as a job: sharded across processes, written image by image, resumable.

The request (one image per label or prompt repetition, image ``i`` seeded with
``image_seed(seed, i)``) is shared out by :func:`lantern.distributed.shard`. The job runs in
rounds: every rank decodes its next batch, all ranks send the round's images to rank 0, and rank
0 writes them into the job folder (:meth:`lantern.outputs.OutputFolder.write_job`):

* ``JOB/out/NNNN_label*.png``: each image, written atomically (temporary name, then renamed);
* ``JOB/records/NNNNNNN.npz``: after a round's PNGs, the round's record (request indices, seeds,
  codes, forward counts), written atomically: an image counts as finished once its record exists;
* ``JOB/job.json``: what the job is (model, conditions, seeds, sampling, method, dtype).

When every image is recorded, rank 0 writes ``codes.npy`` (request order), ``grid.png`` (unless ``--no-grid``),
``run.json`` and, with ``--save-npz``, ``samples.npz`` into ``JOB/out`` and renames it onto
``--out``. Without ``--resume`` the job folder is ``.OUT.tmp-PID`` and vanishes on any failure
(all-or-nothing, as every output); with ``--resume`` it is ``.OUT.resume``, survives a kill, and
the next ``--resume`` run checks its ``job.json`` against the new request and decodes only the
images without a record.

A resumed job trusts none of its files blindly: each record is read back and checked (its arrays'
shapes, codes within the image vocabulary, the seeds of its indices, no index twice, and the
sha256 it carries of its own arrays and of its PNGs' bytes), and so is each recorded image's PNG.
A record that fails any check (truncated by a crash, edited, without its hashes, or whose PNG was
deleted or cut short) is removed with a printed note, and its images are decoded again, so the resumed job still
finishes with codes and PNGs that belong together.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from lantern.distributed import DistContext, agree, all_gather, check_enough_items, gather_to_main, shard
from lantern.errors import LanternError
from lantern.outputs import OutputFolder, pause_for_tests, resume_folder

if TYPE_CHECKING:
    from lantern.methods import MethodConfig
    from lantern.run import PreparedMethod
    from lantern.targets.base import ConditionSet

Decode = Callable[[Tensor], list[Any]]  # codes [b, T] -> PIL images

# Test hook (like lantern.outputs.PAUSE_ENV, which must be set too): pause once this many images
# are recorded, so a test can kill a job part-way through its rounds.
PAUSE_AFTER_ENV = "LANTERN_TEST_PAUSE_AFTER_IMAGES"
GRID_MAX_IMAGES = 256  # grid.png shows the first images only: a 50k-image grid is no preview
PNG_THREADS = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
GRID_MAX_ROWS = 16  # beyond this many labels or prompts, grid.png is a square, not a row per condition
NPZ_NAME = "samples.npz"
# What must match for --resume to continue a job: these decide every image. run.json records
# them all, JOB_ONLY_KEYS under "job" (the others are its own top-level fields).
IDENTITY_KEYS = ("model", "seed", "labels", "prompts", "prompt_index", "negative_prompt", "indices", "t5", "sampling",
                 "method", "dtype", "device_type")
JOB_ONLY_KEYS = ("dtype", "device_type")


# The arrays of a record (JOB/records/*.npz); RECORD_HASH ("sha256") is the sha256 of them and of
# PNG_HASHES (each image's PNG bytes), in this order (:func:`_record_digest`). A record without them
# (written before the hashes existed, or with them deleted) is not trusted: its images are redone.
RECORD_ARRAYS = ("indices", "seeds", "codes", "target_forwards", "ranks", "drafter_forwards")
PNG_HASHES = "png_sha256"
RECORD_HASH = "sha256"


@dataclass
class JobRequest:
    """A generate request: the conditions of every image, in request order, and how to run them."""

    names: list[str]  # PNG file name per image
    seed: int
    conditions: ConditionSet  # of every image, in request order
    identity: dict[str, Any]  # IDENTITY_KEYS: what the images depend on
    batch_size: int
    ncol: int  # grid columns (images per label or prompt)
    save_npz: bool = False
    grid: bool = True  # grid.png: off for folders a metric reads (clean-fid would count it as a sample)
    resume: bool = False
    progress: bool = True
    num_tokens: int | None = None  # image codes per image, to check a resumed job's records (None: unchecked)
    vocab_size: int | None = None  # codes lie in [0, vocab_size)
    indices: list[int] | None = None  # --indices: each image's place in the whole run (None: its own position)

    def seed_of(self, position: int) -> int:
        """The seed of the request's image ``position``: that of its place in the run."""
        from lantern.run import image_seed

        return image_seed(self.seed, position if self.indices is None else self.indices[position])


@dataclass
class RoundPart:
    """One rank's share of one round (empty when its shard is done)."""

    rank: int
    indices: list[int]
    codes: np.ndarray  # [b, T] int64
    pixels: list[np.ndarray]  # the decoded images, uint8 [H, W] or [H, W, 3]
    target_forwards: list[int]
    drafter_forwards: int
    seconds: float
    compile_seconds: float = 0.0  # of ``seconds``: first calls of compiled regions (RunResult.compile_seconds)


def run_job(parts: PreparedMethod, request: JobRequest, out: OutputFolder | None, ctx: DistContext, decode: Decode,
            record: dict[str, Any]) -> dict[str, Any] | None:
    """Generate the request across the ranks of ``ctx`` into ``out``; rank 0 returns ``run.json``'s
    content (``record`` plus the statistics), the other ranks None. ``parts``: the prepared method
    (``lantern.run.prepare_run``); ``decode``: codes [b, T] -> PIL images."""
    n = len(request.names)
    check_enough_items(n, ctx)
    if not ctx.is_main:  # rank 0 opens the job; the others learn its verdict and finished images
        agree(None, ctx)
        _rounds(parts, request, ctx, decode, all_gather(None, ctx)[0], None)
        return None
    assert out is not None  # rank 0 checked --out
    with out.write_job(resume=request.resume) as job, contextlib.ExitStack() as held:
        try:
            held.enter_context(_locked(job))
            done = _open_job(job, request)
            error = None
        except LanternError as e:
            done, error = [], str(e)
        agree(error, ctx)
        all_gather(done, ctx)
        if error is None:
            _log_run(job, record, ctx.world_size, len(done))
        started = time.perf_counter()
        ranks = _rounds(parts, request, ctx, decode, done, job)
        return _finish(job, request, parts.method, record, ranks, len(done), started)


# Each run of a job (one, or several with --resume), as run.json's "runs" lists them: the settings
# that may change between runs without changing the request (batch size, device, deterministic
# kernels, processes), so a resumed job's record says how each part of it was decoded.
RUN_LOG = "runs.json"
RUN_LOG_KEYS = ("command", "date", "batch_size", "device", "deterministic")


def _log_run(job: Path, record: dict[str, Any], processes: int, resumed: int) -> None:
    from lantern.io import read_json, write_json

    path = job / RUN_LOG
    try:
        runs = read_json(path, "job run log") if path.exists() else []
    except LanternError as e:
        runs = e
    if not isinstance(runs, list):  # only a record, never a reason to stop a job: started again
        print(f"lantern: note: --resume: {runs if isinstance(runs, LanternError) else f'{path} is not a list'}; "
              "run.json will list the runs from this one on")
        runs = []
    entry = {k: record[k] for k in RUN_LOG_KEYS if k in record}
    write_json(path, [*runs, {**entry, "processes": processes, "images_already_recorded": resumed}])


@contextlib.contextmanager
def _locked(job: Path) -> Iterator[None]:
    """Hold JOB/lock for the run: two runs resuming one job at once would write the same images.
    An advisory ``flock``, which the kernel drops when its process dies, so a kill never leaves a
    job locked."""
    import fcntl

    with open(job / "lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LanternError(f"--resume: another run is writing the job in {job}; wait for it to end") from None
        yield


def _open_job(job: Path, request: JobRequest) -> list[int]:
    """A new job's job.json, or (``--resume``) the indices an earlier run recorded, after checking
    that the job is this request."""
    from lantern.io import read_json, write_json

    path = job / "job.json"
    if not path.exists():
        write_json(path, request.identity)
        return []
    check_same_job(read_json(path, "job file"), request.identity, f"--resume: the unfinished job in {job}")
    return _usable_records(job, request)


def _usable_records(job: Path, request: JobRequest) -> list[int]:
    """The indices of the job's sound records (:func:`_record_problem`); every other record is
    removed, with a note, so that its images are decoded again."""
    from tqdm.auto import tqdm

    claimed: set[int] = set()
    folder = job / "records"
    paths = sorted(folder.glob("*.npz")) if folder.is_dir() else []
    # a bar: a resumed 50,000-image job at 384 x 384 hashes several GB of PNGs again
    for path in tqdm(paths, desc="checking the job's records", unit="record",
                     disable=not request.progress or len(paths) < 2):
        record, problem = _read_record(path)
        if record is not None:
            problem = _record_problem(record, job, request, claimed)
        if problem is not None:
            count = "" if record is None else f" {len(record['indices'])}"
            tqdm.write(f"lantern: note: --resume: record {path} {problem}; decoding its{count} image(s) again")
            path.unlink()
            continue
        assert record is not None
        claimed.update(int(i) for i in record["indices"])
    return sorted(claimed)


def _read_record(path: Path) -> tuple[dict[str, np.ndarray] | None, str | None]:
    """A record's arrays, or why it cannot be read (a kill leaves none half-written, as records are
    renamed into place, but a crash of the machine or an edit can)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}, None
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as e:
        return None, f"cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'damaged'})"


def _record_problem(record: dict[str, np.ndarray], job: Path, request: JobRequest, claimed: set[int]) -> str | None:
    """Why a record cannot be trusted, or None: its arrays, their sha256, and its PNGs."""
    missing = [k for k in RECORD_ARRAYS if k not in record]
    if missing:
        return f"lacks {missing[0]!r}"
    indices, codes = record["indices"], record["codes"]
    m = len(indices) if indices.ndim == 1 else -1
    if m < 1 or indices.dtype.kind not in "iu" or codes.dtype.kind not in "iu" or codes.ndim != 2 or not codes.size:
        return "holds arrays of the wrong kind"
    width = request.num_tokens or codes.shape[1]
    if codes.shape != (m, width) or any(record[k].shape != (m,) for k in ("seeds", "target_forwards", "ranks")):
        return f"holds arrays of the wrong shape (codes {codes.shape}, expected ({m}, {width}))"
    n = len(request.names)
    if indices.min() < 0 or indices.max() >= n or len(set(indices.tolist())) != m or not claimed.isdisjoint(
            indices.tolist()):
        return "lists an image index out of range, or one already recorded"
    if codes.min() < 0 or (request.vocab_size is not None and codes.max() >= request.vocab_size):
        return f"holds codes in [{codes.min()}, {codes.max()}], outside the image vocabulary"
    if record["seeds"].tolist() != [request.seed_of(int(i)) for i in indices]:
        return "holds seeds that are not its images' seeds"
    # Without its hashes nothing vouches for the codes (any in-vocabulary rewrite passes the checks
    # above) nor for the PNGs (a valid PNG of another image decodes fine).
    if RECORD_HASH not in record or PNG_HASHES not in record:
        return f"carries no {RECORD_HASH} / {PNG_HASHES} (written before records had them, or edited)"
    if str(record[RECORD_HASH]) != _record_digest(record):
        return "does not match its sha256 (it was changed after it was written)"
    return _png_problem(job, request, record)


def _png_problem(job: Path, request: JobRequest, record: dict[str, np.ndarray]) -> str | None:
    """Why one of the record's PNGs is unusable: absent, or not the bytes the record hashed."""
    hashes = record[PNG_HASHES]
    if hashes.shape != record["indices"].shape:
        return f"holds {hashes.size} PNG hashes for {record['indices'].size} images"
    for j, i in enumerate(record["indices"].tolist()):
        png = job / "out" / request.names[i]
        if not png.is_file():
            return f"has no PNG {png.name}"
        if _file_sha256(png) != str(hashes[j]):
            return f"does not match its PNG {png.name} (changed or cut short)"
    return None


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _record_digest(record: dict[str, np.ndarray]) -> str:
    """sha256 over the record's arrays (name, dtype, shape, bytes), then its PNG hashes."""
    h = hashlib.sha256()
    for key in (*RECORD_ARRAYS, PNG_HASHES):
        if key not in record:
            continue
        array = np.ascontiguousarray(record[key])
        h.update(f"{key}:{array.dtype.str}:{array.shape}:".encode())
        h.update(array.tobytes())
    return h.hexdigest()


def finished_job(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """``--resume`` into an existing ``--out``: the job a finished run there recorded (run.json's
    "job"), or None when ``--out`` holds no finished job (absent, empty, or not ours: then the
    usual checks of ``--out`` apply). A job folder left by a kill after its commit is removed."""
    from lantern.io import read_json

    run = Path(path) / "run.json"
    if not run.is_file():
        return None
    record = read_json(run, "--out run.json")
    if not isinstance(record, dict) or not isinstance(record.get("job"), dict):
        return None
    leftover = resume_folder(Path(path))
    if leftover.is_dir() and not (leftover / "out").exists():
        import shutil

        shutil.rmtree(leftover, ignore_errors=True)
    merged = {**record, **record["job"]}
    return {k: merged[k] for k in IDENTITY_KEYS if k in merged}


def check_same_job(old: dict[str, Any], new: dict[str, Any], where: str) -> None:
    """A resumed job must decide every image the same way: the first differing setting is named."""
    if old.get("seed") != new.get("seed"):
        raise LanternError(f"{where} was started with --seed {old.get('seed')} (its images' seeds); this run has "
                           f"--seed {new.get('seed')}: pass the job's --seed, or another --out")
    for key in IDENTITY_KEYS:
        if old.get(key) != new.get(key):
            raise LanternError(f"{where} was started with a different {key} ({_short(old.get(key))}, now "
                               f"{_short(new.get(key))}): resume it with the same settings, or pass another --out")


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _records(job: Path) -> list[dict[str, np.ndarray]]:
    folder = job / "records"
    if not folder.is_dir():
        return []
    out = []
    for path in sorted(folder.glob("*.npz")):
        with np.load(path) as z:
            out.append({k: z[k] for k in z.files})
    return out


def _rounds(parts: PreparedMethod, request: JobRequest, ctx: DistContext, decode: Decode, done: Sequence[int],
            job: Path | None) -> list[dict[str, Any]]:
    """Decode this rank's share of the images not yet recorded, one batch per round; rank 0
    (``job`` given) writes every round. Returns rank 0's tally of each rank's images, seconds and
    forwards (empty elsewhere): a round's pixels and codes are dropped once written, so a 50,000-image
    job holds no more of them than one round's."""
    from tqdm.auto import tqdm

    finished = set(done)
    pending = [i for i in range(len(request.names)) if i not in finished]
    mine = [pending[j] for j in shard(len(pending), ctx.rank, ctx.world_size)]
    longest = len(shard(len(pending), 0, ctx.world_size))  # rank 0's shard is never shorter
    batch = request.batch_size
    ranks: dict[int, dict[str, Any]] = {}
    recorded = len(finished)
    with tqdm(total=len(request.names), initial=len(finished), desc="images", unit="img",
              disable=not (request.progress and ctx.is_main)) as bar:
        for r in range(-(-longest // batch)):
            part = _generate_batch(parts, request, mine[r * batch : (r + 1) * batch], ctx.rank, decode)
            gathered = gather_to_main(part, ctx)
            if job is None or gathered is None:
                continue
            count = _write_round(job, request, gathered, recorded)
            for p in gathered:
                if p.indices:
                    entry = ranks.setdefault(p.rank, {"rank": p.rank, "images": 0, "seconds": 0.0,
                                                      "compile_seconds": 0.0, "target_forwards": 0})
                    entry["images"] += len(p.indices)
                    entry["seconds"] += p.seconds
                    entry["compile_seconds"] += p.compile_seconds
                    entry["target_forwards"] += sum(p.target_forwards)
            recorded += count
            bar.update(count)
            _pause_after(recorded)
    return [ranks[r] for r in sorted(ranks)]


def _generate_batch(parts: PreparedMethod, request: JobRequest, indices: list[int], rank: int,
                  decode: Decode) -> RoundPart:
    from lantern.decoding import compiling
    from lantern.run import generate_rows

    if not indices:
        return RoundPart(rank, [], np.zeros((0, 0), np.int64), [], [], 0, 0.0)
    t0, compiling_before = time.perf_counter(), compiling.first_call_seconds
    places = indices if request.indices is None else [request.indices[i] for i in indices]  # their seeds' indices
    output = generate_rows(parts, request.conditions.take(indices), request.seed, places)
    seconds = time.perf_counter() - t0
    # One image at a time: the decoder's batched convolutions differ in their low bits with the batch
    # size, which can move a pixel across a rounding step; a job's PNGs must not depend on how its
    # images were batched or sharded over processes.
    pixels = [np.asarray(img) for row in output.codes for img in decode(row[None])]
    return RoundPart(rank, indices, output.codes.cpu().numpy().astype(np.int64), pixels,
                     [int(f) for f in output.stats.target_forwards.tolist()], output.stats.drafter_forwards, seconds,
                     compiling.first_call_seconds - compiling_before)


def _write_round(job: Path, request: JobRequest, gathered: list[RoundPart], recorded: int) -> int:
    """The round's PNGs, then its record (so a record always has its images). Returns the image count."""
    from PIL import Image

    from lantern.images import save_png
    from lantern.io import atomic_path

    parts = [p for p in gathered if p.indices]
    if not parts:
        return 0
    pngs = [(pix, job / "out" / request.names[i]) for p in parts for i, pix in zip(p.indices, p.pixels, strict=True)]
    # Rank 0 writes every rank's images: one thread would cap a job at some 60 images a second at
    # 384 x 384 (16 ms a PNG), however many GPUs decode. Pillow's PNG encoder releases the GIL, so
    # threads scale with the cores (2 threads: 18 -> 9 ms a PNG on 2 cores); the bytes are the same.
    with ThreadPoolExecutor(min(len(pngs), PNG_THREADS)) as pool:
        list(pool.map(lambda item: save_png(Image.fromarray(item[0]), item[1]), pngs))
    (job / "records").mkdir(exist_ok=True)
    indices = [i for p in parts for i in p.indices]
    record = {
        "indices": np.array(indices, np.int64),
        "seeds": np.array([request.seed_of(i) for i in indices], np.uint64),
        "codes": np.concatenate([p.codes for p in parts]),
        "target_forwards": np.array([t for p in parts for t in p.target_forwards], np.int64),
        "ranks": np.array([p.rank for p in parts for _ in p.indices], np.int64),
        "drafter_forwards": np.array(sum(p.drafter_forwards for p in parts), np.int64),
        # the PNGs as written, read back: what a resumed run compares them with
        PNG_HASHES: np.array([_file_sha256(job / "out" / request.names[i]) for i in indices]),
    }
    record[RECORD_HASH] = np.array(_record_digest(record))
    with atomic_path(_record_path(job, recorded)) as tmp, open(tmp, "wb") as f:
        # (mypy matches **record against savez's allow_pickle: bool; the keys are array names, none is that)
        np.savez(f, **record)  # type: ignore[arg-type]
    return len(indices)


def _record_path(job: Path, recorded: int) -> Path:
    """``records/NNNNNNN.npz`` (NNNNNNN: images recorded before it), or with a suffix when that
    name is taken: after a damaged record was removed, the count can repeat an existing name."""
    path = job / "records" / f"{recorded:07d}.npz"
    k = 1
    while path.exists():
        path = job / "records" / f"{recorded:07d}-{k}.npz"
        k += 1
    return path


def _pause_after(recorded: int) -> None:
    limit = os.environ.get(PAUSE_AFTER_ENV)
    if limit and recorded >= int(limit):
        pause_for_tests()


def _finish(job: Path, request: JobRequest, method: MethodConfig, record: dict[str, Any], ranks: list[dict[str, Any]],
            resumed: int, started: float) -> dict[str, Any]:
    """codes.npy, grid.png, run.json (and samples.npz) from all records, into ``JOB/out``.
    ``started``: when this run began decoding (``time.perf_counter``), for ``elapsed_seconds``:
    beside the decode time (``wall_seconds``) it counts the PNGs, records and these files."""
    from lantern.io import read_json, write_json

    records = _records(job)
    indices = np.concatenate([r["indices"] for r in records])
    n = len(request.names)
    if sorted(indices.tolist()) != list(range(n)):
        raise LanternError(f"the job in {job} does not hold every image exactly once: its records are damaged; "
                           "remove that folder and start again")
    order = np.argsort(indices, kind="stable")
    codes = np.concatenate([r["codes"] for r in records])[order]
    forwards = np.concatenate([r["target_forwards"] for r in records])[order]
    if PAUSE_AFTER_ENV not in os.environ:
        pause_for_tests()  # the interruption tests kill the run here: PNGs written, codes not yet
    out = job / "out"
    _write_codes(out / "codes.npy", codes)
    if request.grid:
        _write_grid(out, request)
    if request.save_npz:
        write_npz(out / NPZ_NAME, [out / name for name in request.names])
    stats = _stats(codes, forwards, sum(int(r["drafter_forwards"]) for r in records), ranks, method)
    elapsed = round(time.perf_counter() - started, 3)
    run = {**record, "job": {k: request.identity[k] for k in JOB_ONLY_KEYS},
           "stats": {**stats, "elapsed_seconds": elapsed, "generated_this_run": n - resumed,
                     "resumed_images": resumed},
           "runs": read_json(job / RUN_LOG, "job run log")}
    write_json(out / "run.json", run)
    return run


def _write_codes(path: Path, codes: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, codes.astype(np.int64))


def _write_grid(out: Path, request: JobRequest) -> None:
    from PIL import Image

    from lantern.images import image_grid, save_png

    images = []
    for name in request.names[:GRID_MAX_IMAGES]:
        with Image.open(out / name) as img:
            images.append(img.copy())
    save_png(image_grid(images, ncol=grid_columns(len(images), request.ncol)), out / "grid.png")


def grid_columns(count: int, per_condition: int) -> int:
    """grid.png's columns: a row per label or prompt (its ``per_condition`` images) while that
    makes at most 16 rows, else a square: 256 images of one label each would be one column 256
    images tall."""
    if math.ceil(count / per_condition) <= GRID_MAX_ROWS:
        return per_condition
    return math.ceil(math.sqrt(count))


def _stats(codes: np.ndarray, forwards: np.ndarray, drafter_forwards: int, ranks: list[dict[str, Any]],
           method: MethodConfig) -> dict[str, Any]:
    """run.json's totals (as ``RunResult.stats_dict``) over all images, and per rank for this run.
    ``wall_seconds``: this run's decode time; under several ranks, that of the slowest rank (the
    ranks decode in parallel), and ``compile_seconds`` that rank's; each rank's own sums are under ``ranks``."""
    from lantern.run import RunResult

    slowest = max(ranks, key=lambda e: e["seconds"], default={"seconds": 0.0, "compile_seconds": 0.0})
    result = RunResult.from_counts(torch.from_numpy(codes), torch.from_numpy(forwards), drafter_forwards,
                                   slowest["seconds"], method, slowest["compile_seconds"])
    # per image, in request order (codes.npy's): its tokens over this is its accepted length
    return {**result.stats_dict(), "target_forwards_per_image": forwards.astype(int).tolist(), "ranks": ranks}


def write_npz(path: Path, images: Sequence[Path]) -> None:
    """``arr_0``: uint8 [N, H, W, 3] in the given order, the layout of the guided-diffusion (ADM)
    FID evaluator and LlamaGen's evaluation scripts. Streamed image by image into the zip (a
    50k-image array need not fit in memory); written atomically."""
    from lantern.io import atomic_path

    first = _rgb(images[0])
    shape = (len(images), *first.shape)
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)), "fortran_order": False, "shape": shape}
    with atomic_path(path) as tmp, zipfile.ZipFile(tmp, "w", allowZip64=True) as zf:
        with zf.open("arr_0.npy", "w", force_zip64=True) as f:
            np.lib.format.write_array_header_2_0(f, header)
            for image in images:
                pix = _rgb(image)
                if pix.shape != first.shape:
                    raise LanternError(f"--save-npz: {image} is {pix.shape}, the first image {first.shape}")
                f.write(pix.tobytes())


def _rgb(path: Path) -> np.ndarray:
    """A PNG as uint8 [H, W, 3] (a grayscale one as 3 equal channels, as the evaluators expect)."""
    from PIL import Image

    with Image.open(path) as img:
        return np.asarray(img.convert("RGB"), dtype=np.uint8)
