"""pipejax.ray_executor: the composition root — engine, executors, offline LLM API, CLI.

The public names load on first use: a Ray stage actor imports its module from this package before
it knows its chips, and JAX (which the engine imports) reads ``JAX_PLATFORMS`` once, at import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipejax.ray_executor.engine.engine import LLMEngine
    from pipejax.ray_executor.engine.request import CompletionOutput, RequestOutput
    from pipejax.ray_executor.llm import LLM
    from pipejax.runner.batch import SamplingParams, StructuredOutputs

_PUBLIC = {
    "LLM": "pipejax.ray_executor.llm",
    "CompletionOutput": "pipejax.ray_executor.engine.request",
    "LLMEngine": "pipejax.ray_executor.engine.engine",
    "RequestOutput": "pipejax.ray_executor.engine.request",
    "SamplingParams": "pipejax.runner.batch",
    "StructuredOutputs": "pipejax.runner.batch",
}
__all__ = ["LLM", "CompletionOutput", "LLMEngine", "RequestOutput", "SamplingParams", "StructuredOutputs"]


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)
