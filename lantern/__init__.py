"""lantern: LANTERN / LANTERN++ relaxed speculative decoding for visual autoregressive models.

::

    import lantern
    pipe = lantern.load("digits")                      # preset, stack folder, t2i, Chameleon or org/name
    out = pipe(labels=[3, 7], method="lantern++", seed=0)
    out.images[0].save("x.png")

Everything below is re-exported lazily (module ``__getattr__``): ``import lantern`` loads no torch
and no optional extra; a name is imported from its module on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lantern.api import Pipeline, PipelineOutput, load, resolve_settings
    from lantern.chameleon import ChameleonStack
    from lantern.config import RelaxationConfig, SamplingConfig, TreeConfig
    from lantern.errors import LanternError
    from lantern.generate import Acceptance, Drafter, GenerationOutput, SpecStats, generate
    from lantern.jacobi import JacobiConfig
    from lantern.pipeline import MethodConfig, RunResult, run_conditions, run_generation, run_generation_t2i
    from lantern.stack import Conditions, ModelStack, Stack, load_stack
    from lantern.target import Target

# public name -> module that defines it
_EXPORTS = {
    "load": "lantern.api", "Pipeline": "lantern.api", "PipelineOutput": "lantern.api",
    "resolve_settings": "lantern.api",
    "generate": "lantern.generate", "GenerationOutput": "lantern.generate", "SpecStats": "lantern.generate",
    "Drafter": "lantern.generate", "Acceptance": "lantern.generate",
    "Target": "lantern.target",
    "SamplingConfig": "lantern.config", "TreeConfig": "lantern.config", "RelaxationConfig": "lantern.config",
    "JacobiConfig": "lantern.jacobi",
    "MethodConfig": "lantern.pipeline", "RunResult": "lantern.pipeline", "run_generation": "lantern.pipeline",
    "run_generation_t2i": "lantern.pipeline", "run_conditions": "lantern.pipeline",
    "ModelStack": "lantern.stack", "load_stack": "lantern.stack", "Stack": "lantern.stack",
    "Conditions": "lantern.stack", "ChameleonStack": "lantern.chameleon",
    "LanternError": "lantern.errors",
}

__all__ = [
    "Acceptance",
    "ChameleonStack",
    "Conditions",
    "Drafter",
    "GenerationOutput",
    "JacobiConfig",
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
        raise AttributeError(f"module 'lantern' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access skips __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
