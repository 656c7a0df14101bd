"""lantern: LANTERN / LANTERN++ relaxed speculative decoding for visual autoregressive models.

::

    import lantern
    pipe = lantern.load("digits")                      # preset, stack folder, t2i, Chameleon, Janus, Emu3 or org/name
    out = pipe(labels=[3, 7], method="lantern++", seed=0)
    out.images[0].save("x.png")

Everything below is re-exported lazily (module ``__getattr__``): ``import lantern`` loads no torch
and no optional extra; a name is imported from its module on first use.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from lantern.version import DISTRIBUTION, __version__

if TYPE_CHECKING:
    from lantern.api import Pipeline, PipelineOutput, load, resolve_settings
    from lantern.decoding.config import JacobiConfig, RelaxationConfig, SamplingConfig, TreeConfig
    from lantern.decoding.loop import Acceptance, Drafter, GenerationOutput, SpecStats, Target, generate
    from lantern.errors import LanternError
    from lantern.methods import MethodConfig
    from lantern.run import RunResult, run_conditions, run_generation, run_generation_t2i
    from lantern.targets.base import Conditions, Stack
    from lantern.targets.chameleon_stack import ChameleonStack
    from lantern.targets.emu3 import Emu3Stack
    from lantern.targets.janus import JanusStack
    from lantern.targets.llamagen_stack import ModelStack, load_stack

# public name -> module that defines it
_EXPORTS = {
    name: module
    for module, names in {
        "lantern.api": ("load", "Pipeline", "PipelineOutput", "resolve_settings"),
        "lantern.decoding.loop": ("generate", "GenerationOutput", "SpecStats", "Drafter", "Acceptance", "Target"),
        "lantern.decoding.config": ("SamplingConfig", "TreeConfig", "RelaxationConfig", "JacobiConfig"),
        "lantern.methods": ("MethodConfig",),
        "lantern.run": ("RunResult", "run_generation", "run_generation_t2i", "run_conditions"),
        "lantern.targets.base": ("Stack", "Conditions"),
        "lantern.targets.llamagen_stack": ("ModelStack", "load_stack"),
        "lantern.targets.chameleon_stack": ("ChameleonStack",),
        "lantern.targets.janus": ("JanusStack",),
        "lantern.targets.emu3": ("Emu3Stack",),
        "lantern.errors": ("LanternError",),
    }.items()
    for name in names
}

__all__ = [
    "DISTRIBUTION",
    "__version__",
    "Acceptance",
    "ChameleonStack",
    "Conditions",
    "Drafter",
    "Emu3Stack",
    "GenerationOutput",
    "JacobiConfig",
    "JanusStack",
    "LanternError",
    "MethodConfig",
    "ModelStack",
    "Pipeline",
    "PipelineOutput",
    "RelaxationConfig",
    "RunResult",
    "SamplingConfig",
    "SpecStats",
    "Stack",
    "Target",
    "TreeConfig",
    "generate",
    "load",
    "load_stack",
    "resolve_settings",
    "run_conditions",
    "run_generation",
    "run_generation_t2i",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        if importlib.util.find_spec(f"lantern.{name}") is not None:  # a submodule: lantern.methods.METHOD_SETTINGS
            return importlib.import_module(f"lantern.{name}")
        raise AttributeError(f"module 'lantern' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access skips __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
