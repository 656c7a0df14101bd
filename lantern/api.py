"""The Python face of lantern: ``lantern.load(model)(labels=... | prompts=...)``.

One call loads any model lantern runs (an embedded preset, a LlamaGen c2i or t2i stack folder, an
Anole / Lumina-mGPT folder, a Janus / Janus-Pro or Emu3 folder, or a Hugging Face repo id of one) into a
:class:`Pipeline`; calling it generates images. Settings are resolved here, once, for Python
callers and ``lantern generate`` alike: the stack's ``generation.json``, then the method's
defaults, then the caller's overrides (:func:`resolve_settings`), so the same request gives the
same codes from either side.
"""

from __future__ import annotations

import copy
import difflib
import functools
import inspect
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from numbers import Integral
from pathlib import Path
from typing import TYPE_CHECKING, Any, Never, NoReturn

import numpy as np
import torch
from torch import Tensor

from lantern.calibration import AUTO, MethodChoice, Setup, check_quality
from lantern.calibration import auto_method as calibrated_method
from lantern.decoding.compiling import compile_notices
from lantern.decoding.config import SamplingConfig
from lantern.errors import LanternError, check, python_errors
from lantern.hub import resolve_location
from lantern.machine import in_a_thread_that_ends
from lantern.methods import METHOD_SETTINGS, METHOD_TABLE, MethodConfig, method_settings, resolve_method
from lantern.parts import ModelParts
from lantern.run import PreparedMethod, RunResult

if TYPE_CHECKING:
    from PIL import Image

    from lantern.targets.chameleon_stack import Prompter

SAMPLING_SETTINGS = ("temperature", "top_k", "top_p", "cfg_scale")
ImageSize = tuple[int | None, int | None]  # load's (image_size, image_width): height and width in pixels, as given


def resolve_sampling(stack: Any, **overrides: float | int | None) -> SamplingConfig:
    """The caller's sampling overrides (None = not given), then the stack's ``generation.json``,
    then SamplingConfig's defaults."""
    unknown = sorted(set(overrides) - set(SAMPLING_SETTINGS))
    if unknown:
        raise LanternError(f"unknown sampling setting {unknown[0]!r} (expected {', '.join(SAMPLING_SETTINGS)})",
                           field=unknown[0])
    values: dict[str, Any] = dict(stack.default_sampling())
    given = {k: v for k, v in overrides.items() if v is not None}
    vocab = getattr(stack, "vocab_size", None)
    if "top_k" not in given and vocab is not None and values.get("top_k", 0) > vocab:
        # the caller never gave top_k: name where it came from, and how to change it
        raise LanternError(f"top_k ({values['top_k']}, from {stack.sampling_origin('top_k')}) is larger than the "
                           f"vocabulary ({vocab} image tokens); give a top_k of at most {vocab}", field="top_k")
    return SamplingConfig(**values | given)


def sampling_from(stack: Any, source: Any) -> SamplingConfig:
    """:func:`resolve_sampling` with the overrides read from ``source``'s attributes of the same
    names (an argparse namespace of ``--temperature`` / ``--top-k`` / ``--top-p`` / ``--cfg-scale``)."""
    return resolve_sampling(stack, **{name: getattr(source, name, None) for name in SAMPLING_SETTINGS})


def plain(value: Any) -> Any:
    """A numpy scalar as the Python value it holds (``np.int64(2)`` -> 2): settings are checked as
    Python ints and floats and written to JSON, and a caller's numbers often come from numpy."""
    return value.item() if isinstance(value, np.generic) and not isinstance(value, np.bool_) else value


def api_argument_names() -> frozenset[str]:
    """:func:`api_arguments`, looked up when an error is renamed: it reads the signatures of the
    functions decorated with it, which are made later in this module."""
    return api_arguments()


# A diffusers pipeline's keywords, which its users type first: the suggestion is lantern's name for
# the same thing (difflib offered "temperature" for generator=, nothing for num_images_per_prompt=).
DIFFUSERS_NAMES = {"num_images_per_prompt": "num_per_label", "generator": "seed", "guidance_scale": "cfg_scale",
                   "prompt": "prompts", "class_labels": "labels", "show_progress_bar": "progress",
                   "num_per_prompt": "num_per_label"}  # the last: the CLI's --num-per-prompt (difflib: negative_prompt)
# what diffusers' and transformers' from_pretrained call the arguments of load()
DIFFUSERS_LOAD_NAMES = {"torch_dtype": "dtype", "device_map": "device", "pretrained_model_name_or_path": "model",
                        "height": "image_size", "width": "image_width"}


@python_errors(api_argument_names)
def resolve_settings(stack: Any, method: str, **settings: Any) -> tuple[MethodConfig, SamplingConfig]:
    """Method and sampling for one run, from keyword settings named like the CLI's flags."""
    settings = {name: plain(value) for name, value in settings.items()}
    unknown = sorted(set(settings) - set(SAMPLING_SETTINGS) - set(METHOD_SETTINGS))
    if unknown:
        # a call's own arguments are keywords too: a misspelt one (num_per_prompt) lands here
        own = [name for name in inspect.signature(Pipeline.__call__).parameters if name not in ("self", "settings")]
        close = ([DIFFUSERS_NAMES[unknown[0]]] if unknown[0] in DIFFUSERS_NAMES
                 else difflib.get_close_matches(unknown[0], [*own, *METHOD_SETTINGS, *SAMPLING_SETTINGS], n=1))
        raise LanternError(f"unknown setting {unknown[0]!r}{f' (did you mean {close[0]!r}?)' if close else ''}; "
                           f"a call takes {', '.join(own)} and the settings "
                           f"{', '.join(METHOD_SETTINGS + SAMPLING_SETTINGS)}", field=unknown[0])
    method_cfg = resolve_method(method, stack, **{k: v for k, v in settings.items() if k in METHOD_SETTINGS})
    sampling = resolve_sampling(stack, **{k: v for k, v in settings.items() if k in SAMPLING_SETTINGS})
    return method_cfg, sampling


def run_config(seed: int, batch_size: int, device: str, sampling: SamplingConfig,
               method: MethodConfig, *, deterministic: bool = False) -> dict[str, Any]:
    """The resolved configuration of a run, as ``run.json`` records it and ``PipelineOutput.config`` holds it."""
    return {"seed": seed, "batch_size": batch_size, "device": str(device), "deterministic": deterministic,
            "hardware": dict(hardware_record(str(device))), "sampling": sampling.to_dict(), "method": method.to_dict()}


@functools.cache  # fixed for the process (torch and MKL pick their kernels once): not read at every call
def hardware_record(device: str) -> dict[str, str]:
    """What decided a run's floats besides its settings: the device's hardware, the CPU kernels torch
    dispatched to (``ATEN_CPU_CAPABILITY`` forces them; MKL's own ``MKL_ENABLE_INSTRUCTIONS``, when
    set, too) and torch's version. Codes are promised across batches, not across these: two runs
    whose records differ here may part on a near-tie (docs/usage.md)."""
    from lantern.calibration import device_name

    record = {"name": device_name(device), "cpu_kernels": torch.backends.cpu.get_cpu_capability(),
              "torch": torch.__version__}
    mkl = os.environ.get("MKL_ENABLE_INSTRUCTIONS")
    return record | ({"mkl_instructions": mkl} if mkl else {})  # (run_config copies it: a config is its caller's)


def chameleon_layout(root: Path, layout: str | None, image_size: int | None, image_width: int | None = None) -> Any:
    """A Chameleon folder's image layout: ``layout``, else "layout" in its ``generation.json``; at
    ``image_size`` pixels high and ``image_width`` wide (default: as high), else the file's
    ``image_size`` / ``image_width`` (when its layout is the one used: Lumina-mGPT comes as 512, 768
    and 1024 models, whose weights do not say which), else the layout's default."""
    from lantern.models.chameleon import LAYOUTS, layout_by_name
    from lantern.targets.base import read_generation_settings
    from lantern.targets.chameleon_stack import CHAMELEON_GENERATION_KEYS

    settings = read_generation_settings(root, CHAMELEON_GENERATION_KEYS)
    name = layout if layout is not None else settings.get("layout")
    if name is None:
        raise LanternError(
            f"--model {root} is a Chameleon-family model: pass --layout {' or '.join(LAYOUTS)} "
            "(how its images are laid out: Anole 32 x 32 codes; Lumina-mGPT rows with new-line tokens)"
        )
    own = name == settings.get("layout")
    if image_size is None and image_width is None and own and ("image_size" in settings or "image_width" in settings):
        size = {k: settings[k] for k in ("image_size", "image_width") if k in settings}
        try:  # named as the file's, not as an --image-size the user never passed
            return layout_by_name(name, settings.get("image_size"), settings.get("image_width"))
        except LanternError as e:
            given = ", ".join(f"{k}: {v}" for k, v in size.items())
            raise LanternError(f"{root / 'generation.json'}: {given} does not fit the {name} layout ({e})") from None
    if image_size is None and own:  # --image-width alone: the file's height
        image_size = settings.get("image_size")
    return layout_by_name(name, image_size, image_width)


def _window_as_tree(method: str, settings: dict[str, Any]) -> dict[str, Any]:
    """``sjd_window="auto"`` / ``pjd_window="auto"``: the Jacobi method's window measured on this
    device, which is what ``tree="auto"`` means for it (as ``--sjd-window auto`` on the command line)."""
    row = METHOD_TABLE.get(method)
    name = None if row is None else row.window_setting
    if name is None or settings.get(name) != "auto":
        return settings
    check(settings.get("tree") in (None, "auto"), f"{name}='auto' chooses {method}'s window; it cannot be combined "
                                                  f"with tree={settings.get('tree')!r}", field=name)
    return {**{k: v for k, v in settings.items() if k != name}, "tree": "auto"}


@dataclass(eq=False)  # compared by identity: a generated equality would compare tensors and raise
class PipelineOutput:
    """What a :class:`Pipeline` call returns (a transformers-style output dataclass)."""

    images: list[Image.Image]  # PIL images, one per generated row
    codes: Tensor  # [N, T] image token ids
    stats: dict[str, Any]  # as run.json's "stats"
    config: dict[str, Any]  # resolved seed, batch size, device, sampling and method: run.json's values
    outputs: list[Any] = field(default_factory=list)  # per-batch GenerationOutput (SpecStats in .stats)
    # the call's keywords, defaults filled in: pipe(labels, **out.settings) gives these codes again
    settings: dict[str, Any] = field(default_factory=dict)

    @python_errors(lambda: ("directory", "grid", "overwrite"))
    def save(self, directory: str | os.PathLike[str], *, grid: bool = True, overwrite: bool = False) -> Path:
        """Write what ``lantern generate`` writes for these images into ``directory``, all or
        nothing: ``0000.png``, ... in row order, ``codes.npy`` (int64), ``grid.png`` (not with
        ``grid=False``, for a folder an evaluation reads as its samples) and ``run.json`` (this
        call's ``settings``, ``config`` and ``stats``). An existing non-empty folder is refused
        unless ``overwrite``; the folder is returned."""
        from lantern.images import image_grid, save_png
        from lantern.io import write_json
        from lantern.outputs import OutputFolder

        out = OutputFolder.check(directory, "directory", overwrite)
        with out.write() as folder:
            for i, image in enumerate(self.images):
                save_png(image, folder / f"{i:04d}.png")
            with open(folder / "codes.npy", "wb") as f:
                np.save(f, self.codes.detach().cpu().numpy().astype(np.int64))
            if grid and self.images:
                save_png(image_grid(self.images[:256]), folder / "grid.png")  # a preview: the first 256
            write_json(folder / "run.json", {"settings": self.settings, "config": self.config, "stats": self.stats})
        return out.path

    def to_tuple(self) -> tuple[Any, ...]:
        """The fields in order, ``images`` first, as diffusers' outputs give them (``images, *_ = out.to_tuple()``)."""
        return tuple(getattr(self, f.name) for f in fields(self))

    def __getitem__(self, key: int | slice | str) -> Any:
        """diffusers' indexing: ``out[0]`` is ``out.images`` (a position in :meth:`to_tuple`),
        ``out["codes"]`` is ``out.codes``; any other key raises, naming the fields."""
        if isinstance(key, str):
            if key not in {f.name for f in fields(self)}:
                raise KeyError(f"{key!r}: a PipelineOutput holds {', '.join(f.name for f in fields(self))}")
            return getattr(self, key)
        return self.to_tuple()[key]

    def __iter__(self) -> NoReturn:
        """Refused: with ``__getitem__`` Python would iterate the fields, where ``for image in out``
        means the images."""
        raise TypeError("a PipelineOutput is not iterable: iterate out.images (the PIL images), or out.to_tuple()")

    def __repr__(self) -> str:
        """One line: the generated repr printed every per-batch record (a 94-line screen for 8 digits)."""
        size = f" {self.images[0].width}x{self.images[0].height}" if self.images else ""
        stats = ", ".join(f"{k}={self.stats[k]}" for k in ("target_forwards", "mean_accepted") if k in self.stats)
        return (f"PipelineOutput({len(self.images)} images{size}, codes {list(self.codes.shape)}, "
                f"method={self.settings.get('method')!r}, seed={self.settings.get('seed')!r}, {stats})")


# Prepared methods a Pipeline keeps (each holds its caches; the drafter and table are shared):
# enough for a few methods and settings in turn, bounded so ever new settings cannot grow memory.
MAX_PREPARED = 16


class Pipeline:
    """A loaded model and how to run it; call it with ``labels=`` (c2i) or ``prompts=`` (t2i, Chameleon).

    It holds loaded parts, not paths: the target (its ``stack``), and in ``parts`` the drafter,
    proximity table and T5 encoder, each read on first need and then kept; and the last
    ``MAX_PREPARED`` prepared methods (:meth:`prepare`), so a second call with the same method and
    settings reads nothing from disk and reuses its caches and compiled round (and, with
    ``tree="auto"``, the tree or window the first call measured). Calls from several threads take
    turns (a prepared method's caches serve one batch at a time); :meth:`prepare` runs alongside."""

    def __init__(self, stack: Any, device: str = "cpu", compile: str | None = "off",
                 parts: ModelParts | None = None) -> None:
        """stack: a lantern.targets.base.Stack (ModelStack: LlamaGen c2i / t2i; ChameleonStack); parts:
        its drafter, proximity table and T5 encoder (default: the stack's own)."""
        self.stack, self.device, self.compile = stack, device, compile
        self.parts = parts if parts is not None else ModelParts(stack)
        if hasattr(stack, "generation_settings"):
            stack.generation_settings()  # read (and checked) now, and kept: calls read no file for it
        self._prepared: OrderedDict[tuple[MethodConfig, SamplingConfig, bool], PreparedMethod] = OrderedDict()
        # tree="auto" choices, measured once per (method, its settings, sampling, batch size)
        self._auto_choices: OrderedDict[tuple[Any, ...], tuple[MethodConfig, dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()
        self._call_lock = threading.RLock()  # one decode at a time: the prepared methods' caches are shared

    def __repr__(self) -> str:
        return (f"Pipeline({self.stack.root}, device={self.device!r}, dtype={str(self.stack.dtype)[6:]!r}, "
                f"compile={self.compile!r}, deterministic={self.deterministic})")

    def decode(self, codes: Tensor | np.ndarray) -> list[Image.Image]:
        """The images of ``codes``: ``[N, T]`` image tokens of this model (``out.codes``, or a run's
        ``codes.npy`` read with ``numpy.load``), one PIL image per row, as a call makes them."""
        try:
            table = torch.as_tensor(codes)
        except (TypeError, ValueError, RuntimeError):
            raise LanternError(f"codes must be an integer array or tensor, got {type(codes).__name__}",
                               field="codes") from None
        tokens, vocab = int(self.stack.num_tokens), int(self.stack.vocab_size)
        check(table.ndim == 2 and table.shape[0] >= 1 and table.shape[1] == tokens
              and not table.is_floating_point() and not table.is_complex() and table.dtype != torch.bool,
              f"codes must be an [N, {tokens}] integer array of this model's image tokens, got "
              f"{table.dtype} {list(table.shape)}", field="codes")
        check(bool(((table >= 0) & (table < vocab)).all()), f"codes must be image tokens 0..{vocab - 1}, got "
              f"{int(table.min())}..{int(table.max())}", field="codes")
        return self.stack.to_pil(table.to(torch.long, copy=False).to(self.stack.device))

    @property
    def deterministic(self) -> bool:
        """Whether the target computes batch-invariant matmuls (``load(..., deterministic=True)``)."""
        from lantern.models.invariant import is_batch_invariant

        return is_batch_invariant(self.stack.network())

    @property
    def kind(self) -> str:
        """``c2i``, ``t2i`` or ``chameleon``."""
        return str(self.stack.kind)

    @property
    def drafter(self) -> torch.nn.Module | None:
        """The drafter (read on first access), or None when the model has none."""
        return self.parts.drafter() if self.parts.has_drafter else None

    @property
    def proximity(self) -> Any:
        """The latent proximity table (a ``ProximityTable``, read on first access), or None."""
        return self.parts.table() if self.parts.has_table else None

    def prepare(self, method: MethodConfig, sampling: SamplingConfig, eager: bool = False) -> PreparedMethod:
        """The method ready to run, prepared once per method and sampling settings and kept (least
        recently used dropped past ``MAX_PREPARED``). What every call, ``--tree auto`` and the
        server run. Preparation does not depend on the batch size: a prepared method's caches are
        kept per shape. ``eager``: uncompiled whatever the pipeline's ``compile`` (a server's
        request for settings it did not compile at start-up)."""
        from lantern.run import prepare_method

        key = (method, sampling, eager)
        with self._lock:
            prepared = self._prepared.get(key)
            if prepared is not None:
                self._prepared.move_to_end(key)
                return prepared
        # Outside the lock: a first drafter read or compile must not hold up other callers' hits.
        prepared = prepare_method(self.stack, method, sampling, self.parts, None if eager else self.compile)
        with self._lock:
            prepared = self._prepared.setdefault(key, prepared)
            while len(self._prepared) > MAX_PREPARED:  # a running server lane keeps its own reference
                self._prepared.popitem(last=False)
            return prepared

    @python_errors(api_argument_names)
    def __call__(self, labels: Sequence[int] | np.ndarray | Tensor | None = None,
                 prompts: Sequence[str] | None = None, *, method: str = "ar", seed: int = 0, batch_size: int = 8,
                 num_per_label: int = 1, progress: bool = False, quality: str | None = None,
                 indices: Sequence[int] | np.ndarray | Tensor | None = None,
                 negative_prompt: str | Sequence[str] | None = None, **settings: Any) -> PipelineOutput:
        """Generate ``num_per_label`` images per label or prompt with ``method`` (``"ar"``, ``"sd"``,
        ``"lantern"``, ``"lantern++"``, ``"sjd-coupled"``, ...: ``lantern.methods.METHOD_TABLE``, or
        ``"auto"``), ``batch_size`` rows at a time; image ``i`` draws from its own stream of ``seed``
        (an integer in [0, 2^63)), so the batch never decides it. ``progress``: a tqdm bar.
        ``settings``: the CLI's sampling, method and tree options (listed below).
        ``tree="auto"`` measures this device first: the fastest drafter tree, or for the Jacobi
        methods the fastest window (recorded in ``config`` as ``auto_tree`` / ``auto_window``).
        ``method="auto"``: the fastest method of the ``quality`` class (``"ar"``, the default, or
        ``"lossless"``) in this model's calibration for this device and ``batch_size``
        (:meth:`auto_method`; recorded in ``config`` as ``auto_method``). Both choose for the rows a call
        decodes: ``batch_size``, or the number of images when that is smaller.

        ``indices``: generate only these images of the call, numbered as its output would be
        (image ``i`` is label or prompt ``i // num_per_label``), in the order given: each draws
        from its own place's random stream, so ``pipe(labels, seed=s, num_per_label=n,
        indices=[37])`` is image 37 of the whole call, alone (bit for bit with
        ``deterministic=True``; a server response's image ``i`` likewise).

        ``negative_prompt``: what classifier-free guidance steers away from, one for every prompt or
        a list of one per prompt (Emu3 models, whose unconditional rows are a prompt; None: the
        model's own, ``generation.json``'s ``negative_prompt`` or BAAI's). Other families refuse it.

        ``labels``: a non-empty list or tuple of class ids (Python or numpy integers), or a 1-D
        integer numpy array or tensor (the natural output of a data loader; taken as its list of
        ids). ``prompts``: a non-empty list or tuple of strings. Any other type or value raises
        :class:`~lantern.errors.LanternError` (a ``ValueError``, also for wrong types) naming the
        argument, as the CLI's one-line errors do.

        Settings (``lantern generate``'s flags of the same names; left out: the model's
        ``generation.json``, then the method's default; docs/methods.md says more):

        - ``temperature`` (0: greedy), ``top_k`` (0: off), ``top_p`` (1: off), ``cfg_scale``
          (classifier-free guidance; 1: off): sampling.
        - ``tree``: the drafter methods' draft tree: ``"dynamic"``, ``"static:NAME"``,
          ``"chain:N"``, ``"auto"``, or its choices as a list (``[[0], [1], [0, 0]]``).
        - ``lantern_k`` (neighbours per token), ``lantern_delta`` (LANTERN's mass bound, in [0, 1]),
          ``lantern_lambda`` (LANTERN++'s relative bound, >= 1), ``lantern_residual``
          (``"paper"``, ``"official"``, ``"official-lumina"``), ``lantern_budget`` (``"test"``,
          ``"token"``) and ``lantern_credit`` (``"drawn"``, ``"clean"``): the relaxed methods.
        - ``sjd_window`` (Jacobi window length, or ``"auto"``), ``sjd_init`` (``"random"``,
          ``"repeat_horizon"``), ``sjd_coupling`` (``"independent"``, ``"maximal"``,
          ``"gumbel"``): the SJD methods and ``gsd``; ``gsd_group``: GSD's group size G.
        - ``pac_width`` (K) and ``pac_depth`` (D): ``sjd-pac``'s proactive subtree.
        - ``sv_alpha``: the ``-sv`` methods' share of a run's probability its tail holds, in (0, 1].
        - ``pjd_window`` (guesses per open row, or ``"auto"``), ``pjd_context`` (known tokens a row
          needs before the next opens; the row length is lossless), ``pjd_init`` (``"random"``,
          ``"row_above"``, ``"above_mode"``), ``pjd_coupling`` (``"independent"``, ``"maximal"``):
          the PJD methods."""
        from lantern.validate import check_count, check_image_indices, check_image_total, check_seed

        num_per_label, batch_size, method = plain(num_per_label), plain(batch_size), plain(method)
        settings = {name: plain(value) for name, value in settings.items()}
        check_count(num_per_label, "num_per_label", field="num_per_label")
        check_count(batch_size, "batch_size", field="batch_size")
        seed = check_seed(seed, "seed", field="seed")
        if not isinstance(progress, bool):
            raise LanternError(f"progress must be True or False, got {progress!r}")
        conditions = self._check_conditions(labels, prompts)
        negatives = self._check_negatives(negative_prompt, conditions)
        check_image_total(len(conditions), num_per_label, "num_per_label")
        chosen = None if indices is None else check_image_indices(indices, len(conditions) * num_per_label)
        check_quality(quality, method)  # only with method="auto"
        with self._call_lock:  # calls from several threads take turns
            picked: dict[str, Any] = {}
            # The rows a call decodes: what method="auto" and tree="auto" choose for (two images at
            # batch_size 8 decode as a batch of 2, whose fastest method or tree may be another).
            call_batch = min(batch_size, len(conditions) * num_per_label if chosen is None else len(chosen))
            if method == AUTO:
                choice = self.auto_method(quality, call_batch, **settings)
                method, picked = choice.method, {"auto_method": choice.to_dict()}
            settings = _window_as_tree(method, settings)
            with compile_notices(progress):  # a compiled round's first call: seconds to minutes
                if settings.get("tree") == "auto":  # measured on this device: a drafter tree, or a Jacobi window
                    method_cfg, sampling, auto = self._auto(method, settings, seed, call_batch, progress)
                else:
                    (method_cfg, sampling), auto = resolve_settings(self.stack, method, **settings), {}
                result = self._run(conditions, seed, sampling, method_cfg, batch_size, num_per_label, progress,
                                   chosen, negatives)
            # the tree or window auto chose, not "auto": sent back, the same codes without measuring again
            which: dict[str, Any] = {} if chosen is None else {"indices": chosen}
            if negatives is not None:  # as given: one string, or the list
                which["negative_prompt"] = negative_prompt if isinstance(negative_prompt, str) else negatives
            replay = {"method": result.method.method, "seed": seed, "batch_size": batch_size,
                      "num_per_label": num_per_label, **which, **sampling.to_dict(), **method_settings(result.method)}
            config = {**run_config(seed, batch_size, self.device, sampling, result.method,
                                   deterministic=self.deterministic), **which, **auto, **picked}
            return PipelineOutput(images=self.stack.to_pil(result.codes), codes=result.codes, settings=replay,
                                  stats=result.stats_dict(), config=config, outputs=result.output_stats)

    def calibration_setup(self) -> Setup:
        """This pipeline's model and device setting, as ``--method auto``'s calibration is keyed."""
        from lantern.decoding.compiling import resolve_compile

        return Setup.of(self.stack.root, self.stack.root, self.device, self.stack.dtype,
                        resolve_compile(self.compile, self.device), self.deterministic)

    @python_errors(api_argument_names)
    def auto_method(self, quality: str | None = None, batch_size: int = 8, **settings: Any) -> MethodChoice:
        """``method="auto"``: the fastest method of the ``quality`` class at ``batch_size``, from this
        model's calibration for this device (:mod:`lantern.calibration`), with why; a one-line
        error naming the ``lantern calibrate`` command when there is none. ``settings``: the call's
        (method settings are refused: the calibration measured each method at its defaults)."""
        own = (_same_path(self.parts.drafter_source, self.stack.drafter_dir)
               and _same_path(self.parts.proximity_source, self.stack.proximity_file))
        if not own:
            raise LanternError("method='auto' reads a calibration of the model's own drafter and proximity table; "
                               "load without drafter= / proximity=, or name a method", field="method")
        choice = calibrated_method(self.calibration_setup(), quality, batch_size, settings)
        sampling = resolve_sampling(self.stack, **{k: v for k, v in settings.items() if k in SAMPLING_SETTINGS})
        return choice.with_sampling(sampling.to_dict())

    def _auto(self, method: str, settings: dict[str, Any], seed: int, batch_size: int,
              progress: bool) -> tuple[MethodConfig, SamplingConfig, dict[str, Any]]:
        """``tree="auto"``: the method with the tree or window measured fastest here (``choose_auto``),
        its profile and calibration on this pipeline's loaded drafter and table. Measured on the
        first such call (10-20 s on a CPU) and kept: a later call with the same method, method
        settings, sampling and batch size runs the same choice (its record, with the seconds the
        measurement took, is the first call's); the last ``MAX_PREPARED`` choices are kept."""
        from lantern.autotree.choose import choose_auto

        rest = {k: v for k, v in settings.items() if k != "tree"}
        resolved, sampling = resolve_settings(self.stack, method, **rest)  # checks every setting first
        given = {k: v for k, v in rest.items() if k in METHOD_SETTINGS}
        # keyed on the settings as resolved: defaults given explicitly are the same choice
        as_run = {k: v for k, v in method_settings(resolved).items() if k not in ("tree", "sjd_window")}
        key = (method, repr(sorted(as_run.items())), sampling, batch_size, self.compile)
        with self._lock:
            kept = self._auto_choices.get(key)
            if kept is not None:
                self._auto_choices.move_to_end(key)
        if kept is None:
            kept = choose_auto(self.stack, method, sampling, given, seed=seed, batch_size=batch_size,
                               parts=self.parts, progress=progress, compile=self.compile)
            with self._lock:
                self._auto_choices[key] = kept
                while len(self._auto_choices) > MAX_PREPARED:
                    self._auto_choices.popitem(last=False)
        method_cfg, record = kept
        return method_cfg, sampling, copy.deepcopy(record)

    def _check_conditions(self, labels: Any, prompts: Any) -> list[Any]:
        from lantern.targets.text import check_prompts

        if (labels is None) == (prompts is None):
            given = "neither was given" if labels is None else "not both"
            raise LanternError(f"pass labels=[...] (class-conditional models) or prompts=[...] (text-to-image "
                               f"models): {given}")
        if self.kind == "c2i" and labels is None:
            raise LanternError(f"prompts: {self.stack.root} is a class-conditional model; pass labels=[...]")
        if self.kind != "c2i" and prompts is None:
            raise LanternError(f"labels: {self.stack.root} is a text-to-image model; pass prompts=[...]")
        if prompts is not None:
            return check_prompts(check_prompt_list(prompts), "prompts")
        return check_label_list(labels)

    def _check_negatives(self, negative: Any, conditions: list[Any]) -> list[str] | None:
        """``negative_prompt`` as one per condition, checked (and refused by a family without one)
        before anything is measured or decoded."""
        from lantern.targets.base import negative_prompts

        negatives = negative_prompts(plain(negative), len(conditions))
        self.stack.negative_rows(negatives, len(conditions), 1)  # a family without one refuses; Emu3 checks widths
        return negatives

    def _run(self, conditions: list[Any], seed: int, sampling: SamplingConfig, method: MethodConfig,
             batch_size: int, num_per_label: int, progress: bool, indices: list[int] | None = None,
             negatives: list[str] | None = None) -> RunResult:
        """Every image of the call, or (``indices``) those images alone, each with its place's stream;
        ``negatives``: a negative prompt per condition."""
        from lantern.run import run_conditions

        if indices is not None:  # only the chosen images' conditions are encoded (a t2i prompt's T5 pass)
            if negatives is not None:
                negatives = [negatives[i // num_per_label] for i in indices]
            conditions, num_per_label = [conditions[i // num_per_label] for i in indices], 1
        encoded = self.parts.encode(conditions, num_per_label, batch_size, negative=negatives)
        return run_conditions(self.stack, encoded, seed, sampling, method, batch_size, progress,
                              prepared=self.prepare(method, sampling), indices=indices)

    def t5_dir(self) -> Path:
        return self.parts.t5_dir()

    def t5_encoder(self) -> Any:
        """The T5 prompt encoder of a text-to-image model (``T5Encoder``), read once and kept."""
        return self.parts.t5()


def _same_path(a: Any, b: Any) -> bool:
    return (a is None) == (b is None) and (a is None or Path(a).resolve() == Path(b).resolve())


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_label_list(labels: Any) -> list[int]:
    """``labels=`` of a c2i call as a list of Python ints: a list / tuple of integers, or a 1-D
    integer numpy array or tensor. A bare int or string is refused rather than iterated (``3`` is
    not ``[3]``; ``"12"`` would be two labels), and so are floats and bools (``1.5`` or ``True`` as a
    class id is a caller's bug that ``int()`` would hide)."""
    if isinstance(labels, Tensor):
        labels = labels.detach().cpu().numpy()
    if isinstance(labels, np.ndarray):
        if labels.ndim != 1 or labels.dtype.kind not in "iu":
            raise LanternError(f"labels: expected a 1-D integer array of class ids, got a {labels.ndim}-D "
                               f"{labels.dtype} array")
        labels = labels.tolist()
    if isinstance(labels, range):  # what the type (a Sequence) admits: range(10) for one image per class
        labels = list(labels)
    if not isinstance(labels, (list, tuple)):
        raise LanternError(f"labels: expected a list of class ids (integers), got {type(labels).__name__} "
                           f"{_short(labels)}")
    if not labels:
        raise LanternError("labels: the list is empty; pass at least one class id")
    for i, label in enumerate(labels):
        if not isinstance(label, Integral) or isinstance(label, bool):
            raise LanternError(f"labels[{i}]: expected a class id (an integer), got {type(label).__name__} "
                               f"{_short(label)}")
    return [int(label) for label in labels]


def check_prompt_list(prompts: Any) -> list[str]:
    """``prompts=`` as a list of strings; a bare string is refused rather than split into characters."""
    if isinstance(prompts, str):
        raise LanternError(f"prompts: expected a list of strings, got one string {_short(prompts)} (write "
                           "prompts=[...])")
    if not isinstance(prompts, (list, tuple)):
        raise LanternError(f"prompts: expected a list of strings, got {type(prompts).__name__} {_short(prompts)}")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise LanternError(f"prompts[{i}]: expected a string, got {type(prompt).__name__} {_short(prompt)}")
    return list(prompts)


@python_errors(api_argument_names)
def load(model: str | os.PathLike[str], drafter: str | os.PathLike[str] | None = None, *,
         device: str | torch.device = "cpu",
         dtype: str | torch.dtype = "float32", compile: str | None = "off",
         tokenizer: str | os.PathLike[str] | None = None, t5: str | os.PathLike[str] | None = None,
         vq: str | os.PathLike[str] | None = None, layout: str | None = None, image_size: int | None = None,
         image_width: int | None = None, proximity: str | os.PathLike[str] | None = None,
         deterministic: bool = False, prompt_width: int | None = None, **unknown: Never) -> Pipeline:
    """A :class:`Pipeline` for ``model``: a preset name (``digits``, ``photos``), a LlamaGen stack
    folder (c2i or t2i), an Anole / Lumina-mGPT folder, a Janus / Janus-Pro or Emu3 folder (transformers
    layout), or a Hugging Face repo id of any of these. ``image_size`` (Lumina-mGPT, Emu3): the image's
    height in pixels, and its width unless ``image_width`` is given (a wide or tall image).
    ``drafter``, ``t5`` and ``vq`` take folders or repo ids too. ``dtype``: a name (``float32``,
    ``bfloat16``, ``auto``) or a torch dtype. ``compile``: ``off`` (or None), ``auto`` (a decoding
    round as one compiled graph, CUDA graphs on a GPU) or a ``torch.compile`` mode.
    ``deterministic=True``: batch-invariant matmuls and attention (:mod:`lantern.models.invariant`),
    so an image's codes never depend on the batch it runs in, whatever the kernel library, and a
    lossless method at temperature 0 gives AR's codes token for token in any dtype (the server's
    default; slower, and other samples than the default).
    ``prompt_width`` (Chameleon family): the tokens every prompt context is padded to, the prompt in
    its template (default 256); a longer prompt is refused."""
    if unknown:  # typed Never: a type checker flags them; at run time, one line that names the right one
        name = sorted(unknown)[0]
        own = [p for p in inspect.signature(load).parameters if p != "unknown"]
        close = ([DIFFUSERS_LOAD_NAMES[name]] if name in DIFFUSERS_LOAD_NAMES
                 else difflib.get_close_matches(name, own, n=1))
        raise LanternError(f"load() has no argument {name!r}{f' (did you mean {close[0]!r}?)' if close else ''}; "
                           f"it takes {', '.join(own)}", field=name)
    image_size, image_width, prompt_width = plain(image_size), plain(image_width), plain(prompt_width)
    device = str(device) if isinstance(device, torch.device) else device  # torch.device("cuda", 1): "cuda:1"
    for name, value, what in (("model", model, "a preset name, a folder or a Hub repo id"),
                              ("drafter", drafter, "a folder or a Hub repo id"), ("proximity", proximity, "a file")):
        if not (value is None and name != "model" or isinstance(value, str | os.PathLike)):
            raise LanternError(f"--{name} must be {what} (a string or a path), got {type(value).__name__} "
                               f"{value!r}"[:200], field=name)
    if not isinstance(deterministic, bool):
        raise LanternError(f"deterministic must be True or False, got {deterministic!r}", field="deterministic")
    check(prompt_width is None or (type(prompt_width) is int and prompt_width >= 1),
          f"--prompt-width must be a positive number of tokens, got {prompt_width!r}",
          field="prompt_width")

    def build() -> Pipeline:
        pipe = _load(model, drafter, device=device, dtype=dtype, compile=compile, tokenizer=tokenizer, t5=t5,
                     vq=vq, layout=layout, size=(image_size, image_width), proximity=proximity)
        if prompt_width is not None:
            check(hasattr(pipe.stack, "prompt_width"), "--prompt-width is only used with Chameleon-family models "
                                                       "(Anole, Lumina-mGPT, Janus, Emu3)", field="prompt_width")
            pipe.stack.prompt_width = prompt_width
        if hasattr(pipe.stack, "prompter"):  # what every prompt shares must fit (Emu3: its negative prompt)
            pipe.stack.prompter.check_fits((), pipe.stack.prompt_width)
        if deterministic:
            from lantern.models.invariant import make_batch_invariant

            make_batch_invariant(pipe.stack.network())  # drafters follow the target (follow_batch_invariance)
        return pipe

    # Loading's parallel ops (weight casts, the batch-invariance probe) would leave the caller's
    # thread an OpenMP team for good, and the calls that decode on another thread run slower.
    return in_a_thread_that_ends(build)


def _load(model: str | os.PathLike[str], drafter: str | os.PathLike[str] | None, *, device: str,
          dtype: str | torch.dtype, compile: str | None, tokenizer: str | os.PathLike[str] | None,
          t5: str | os.PathLike[str] | None, vq: str | os.PathLike[str] | None, layout: str | None,
          size: ImageSize, proximity: str | os.PathLike[str] | None) -> Pipeline:
    from lantern.decoding.compiling import resolve_compile
    from lantern.models.chameleon import is_chameleon_folder, refuse_original_release
    from lantern.models.emu3 import is_emu3_folder
    from lantern.models.hf_folder import refuse_remote_code
    from lantern.models.janus import is_janus_folder
    from lantern.targets.base import inference_dtype
    from lantern.targets.llamagen_stack import load_stack
    from lantern.validate import check_device

    check_device(device)
    resolve_compile(compile, device)
    check(not isinstance(dtype, torch.dtype) or dtype in (torch.float32, torch.bfloat16, torch.float16),
          f"--dtype must be float32, bfloat16 or float16 (or a name, or auto), got {dtype}", field="dtype")
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else inference_dtype(dtype, device)
    root = resolve_location(model, "--model")
    paths = {name: None if value is None else resolve_location(value, f"--{name}")
             for name, value in (("drafter", drafter), ("t5", t5), ("vq", vq))}
    prox = None if proximity is None else str(proximity)
    # named now, not at the first call of a method that needs them (an AR call never would)
    if paths["drafter"] is not None and not Path(paths["drafter"]).is_dir():
        raise LanternError(f"--drafter: {_missing(paths['drafter'], 'folder')} (a drafter folder, or a Hub repo id)",
                           field="drafter")
    if prox is not None and not Path(prox).is_file():
        raise LanternError(f"--proximity: {_missing(prox, 'file')} (a proximity table)", field="proximity")
    refuse_remote_code(root)  # a folder whose config needs its own code, of any family
    if is_janus_folder(root):
        return _load_janus(Path(root), paths, tokenizer, layout, size, vq, torch_dtype, device, compile, prox)
    if is_emu3_folder(root):
        return _load_emu3(Path(root), paths, tokenizer, layout, size, vq, torch_dtype, device, compile, prox)
    if is_chameleon_folder(root):
        return _load_chameleon(Path(root), paths, tokenizer, layout, size, torch_dtype, device, compile, prox)
    refuse_original_release(root)  # before the flags below would call it no Chameleon-family model
    for name, value, models in (("layout", layout, "Chameleon-family models (Anole, Lumina-mGPT)"),
                                ("image_size", size[0], "Chameleon-family models (Anole, Lumina-mGPT) and Emu3"),
                                ("image_width", size[1], "Lumina-mGPT and Emu3 models"),
                                ("vq", vq, "Chameleon-family models (Anole, Lumina-mGPT)")):
        if value is not None:
            raise LanternError(f"--{name.replace('_', '-')} is only used with {models}")
    if tokenizer is not None:
        tokenizer = resolve_location(tokenizer, "--tokenizer")
    stack = load_stack(root, tokenizer, dtype=torch_dtype)
    check(t5 is None or stack.kind == "t2i", f"--t5 is only used by text-to-image models; {root} is "
                                             "class-conditional", field="t5")
    stack.target.to(device)
    stack.tokenizer.to(device)
    return Pipeline(stack, device, compile, ModelParts(stack, paths["drafter"], prox, paths["t5"]))


@functools.cache
def api_arguments() -> frozenset[str]:
    """The keyword arguments of the Python API: its errors name them so, not as flags."""
    calls = (load, Pipeline.__call__, Pipeline.auto_method)
    named = {name for call in calls for name in inspect.signature(call).parameters if name != "self"}
    return frozenset(named | set(METHOD_SETTINGS) | set(SAMPLING_SETTINGS))


def _missing(path: Any, kind: str) -> str:
    """Why ``path`` is not the ``kind`` (folder or file) an argument takes: absent, or the other kind."""
    where = Path(path)
    if where.exists():
        return f"{path} is a {'file' if kind == 'folder' else 'folder'}, not a {kind}"
    return f"no such {kind} {path}"


def load_model_stack(model: str | os.PathLike[str], *, device: str = "cpu", dtype: str | torch.dtype = "float32",
                     layout: str | None = None, image_size: int | None = None, image_width: int | None = None,
                     vq: str | os.PathLike[str] | None = None, prompt_width: int | None = None) -> Any:
    """The :class:`~lantern.targets.base.Stack` of any model :func:`load` takes, on ``device``: what
    ``demo``, ``bench`` and ``profile`` run on."""
    return load(model, device=device, dtype=dtype, layout=layout, image_size=image_size, image_width=image_width,
                vq=vq, prompt_width=prompt_width).stack


def read_prompter(model: str | os.PathLike[str], layout: str | None = None,
                  image_size: int | None = None, image_width: int | None = None) -> Prompter | None:
    """A Chameleon-family folder's prompt side (its tokenizer and template), read without its
    weights; None for a model of another family. What ``lantern generate`` measures prompts with
    before it reads a (large) model."""
    from lantern.models.chameleon import check_chameleon_folder, is_chameleon_folder
    from lantern.models.emu3 import is_emu3_folder
    from lantern.models.janus import is_janus_folder
    from lantern.targets.chameleon_stack import ChameleonPrompter, load_prompt_tokenizer
    from lantern.targets.emu3 import read_emu3_prompter
    from lantern.targets.janus import read_janus_prompter

    root = Path(model)
    if is_janus_folder(root):
        return read_janus_prompter(root)
    if is_emu3_folder(root):
        return read_emu3_prompter(root, image_size, image_width)
    if is_chameleon_folder(root):
        check_chameleon_folder(root)  # a released drafter's folder is named, not refused for its tokenizer
        return ChameleonPrompter(load_prompt_tokenizer(root), chameleon_layout(root, layout, image_size, image_width))
    return None


def _load_chameleon(root: Path, paths: dict[str, str | None], tokenizer: object, layout: str | None,
                    size: ImageSize, dtype: torch.dtype, device: str, compile: str | None,
                    proximity: str | None) -> Pipeline:
    from lantern.targets.chameleon_stack import load_chameleon_stack

    for flag, value in (("--t5", paths["t5"]), ("--tokenizer", tokenizer)):
        if value is not None:
            raise LanternError(f"{flag} is not used by Chameleon-family models (they read prompts with their own "
                               "tokenizer, and decode with --vq)")
    stack = load_chameleon_stack(root, chameleon_layout(root, layout, *size), paths["vq"], dtype, device)
    return Pipeline(stack, device, compile, ModelParts(stack, paths["drafter"], proximity))


def _load_janus(root: Path, paths: dict[str, str | None], tokenizer: object, layout: str | None,
                size: ImageSize, vq: object, dtype: torch.dtype, device: str, compile: str | None,
                proximity: str | None) -> Pipeline:
    from lantern.targets.janus import load_janus_stack

    flags = (("--t5", paths["t5"]), ("--tokenizer", tokenizer), ("--layout", layout), ("--image-size", size[0]),
             ("--image-width", size[1]), ("--vq", vq))
    for flag, value in flags:
        if value is not None:
            raise LanternError(f"{flag} is not used by Janus models (they read prompts with their own tokenizer and "
                               "chat template, and decode with their own VQ model)")
    stack = load_janus_stack(root, dtype, device)
    return Pipeline(stack, device, compile, ModelParts(stack, paths["drafter"], proximity))


def _load_emu3(root: Path, paths: dict[str, str | None], tokenizer: object, layout: str | None,
               size: ImageSize, vq: object, dtype: torch.dtype, device: str, compile: str | None,
               proximity: str | None) -> Pipeline:
    from lantern.targets.emu3 import load_emu3_stack

    flags = (("--t5", paths["t5"]), ("--tokenizer", tokenizer), ("--layout", layout), ("--vq", vq))
    for flag, value in flags:
        if value is not None:
            raise LanternError(f"{flag} is not used by Emu3 models (they read prompts with their own tokenizer, "
                               "and decode with their own VQ model)")
    stack = load_emu3_stack(root, dtype, device, image_size=size[0], image_width=size[1])
    return Pipeline(stack, device, compile, ModelParts(stack, paths["drafter"], proximity))
