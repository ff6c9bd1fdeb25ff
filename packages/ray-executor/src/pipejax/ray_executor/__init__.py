"""pipejax.ray_executor: the composition root — engine, executors, offline LLM API, CLI."""

from pipejax.ray_executor.engine.engine import LLMEngine
from pipejax.ray_executor.engine.request import CompletionOutput, RequestOutput
from pipejax.ray_executor.llm import LLM
from pipejax.runner.batch import SamplingParams

__all__ = ["LLM", "CompletionOutput", "LLMEngine", "RequestOutput", "SamplingParams"]
