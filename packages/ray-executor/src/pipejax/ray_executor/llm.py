"""The offline API in the established shape: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from pipejax.ray_executor.config import EngineConfig
from pipejax.ray_executor.engine.engine import LLMEngine
from pipejax.ray_executor.engine.request import CompletionOutput, RequestOutput
from pipejax.ray_executor.engine_args import engine_config
from pipejax.runner.batch import SamplingParams
from pipejax.runner.config import OFFLINE_MAX_NUM_BATCHED_TOKENS

Prompt = str | dict | Sequence[int]


def offline_engine_config(model: str | None = None, **engine_args: Any) -> EngineConfig:
    """``engine_config`` for offline use: a step budget (``max_num_batched_tokens``) not given is
    ``OFFLINE_MAX_NUM_BATCHED_TOKENS`` (2048) rather than the server's 512, as vLLM's ``LLM`` class gets a larger
    one than its server. No stream waits through an offline batch's larger prefill steps."""
    if engine_args.get("max_num_batched_tokens") is None:
        engine_args["max_num_batched_tokens"] = OFFLINE_MAX_NUM_BATCHED_TOKENS
    return engine_config(model, **engine_args)


class LLM:
    def __init__(self, model: str | None = None, warmup: bool = True, **engine_args: Any):
        """``engine_args``: the keywords of ``engine_args.engine_config`` (the command line's engine flags:
        ``pipeline_parallel_size``, ``tensor_parallel_size``, ``max_num_seqs``, ...); see ``offline_engine_config``."""
        self._start(offline_engine_config(model, **engine_args), warmup)

    @classmethod
    def from_config(cls, config: EngineConfig, warmup: bool = True) -> LLM:
        """An ``LLM`` over an ``EngineConfig`` built elsewhere (the CLI's arguments, a server's)."""
        llm = cls.__new__(cls)
        llm._start(config, warmup)
        return llm

    def _start(self, config: EngineConfig, warmup: bool) -> None:
        self.engine = LLMEngine(config)
        if warmup:  # compile the common buckets now rather than during the first requests
            self.engine.executor.warmup()
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run all prompts to completion; outputs come back in prompt order.

        Every prompt is validated before any is queued, so a bad one raises ``ValueError`` and
        leaves the engine as it was.
        """
        if isinstance(prompts, str | dict) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts; give one, or one per prompt")
        parents = [f"{next(self._ids)}" for _ in prompts]
        added: list[str] = []
        try:
            for pid, prompt, sp in zip(parents, prompts, params, strict=True):
                for k in range(sp.n):
                    child = dataclasses.replace(sp, n=1, seed=None if sp.seed is None else sp.seed + k)
                    self.engine.add_request(f"{pid}-{k}", prompt, child)
                    added.append(f"{pid}-{k}")
        except Exception:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(added), disable=not use_tqdm, desc="generate") as bar:
            wanted = set(added)
            while len(finished) < len(added):
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError(f"engine idle with {len(added) - len(finished)} requests unaccounted for")
                for out in self.engine.step_finished():
                    if out.request_id in wanted:
                        finished[out.request_id] = out
                        bar.update(1)
        return [self._merge(pid, sp.n, finished) for pid, sp in zip(parents, params, strict=True)]

    @staticmethod
    def _merge(parent: str, n: int, finished: dict[str, RequestOutput]) -> RequestOutput:
        children = [finished[f"{parent}-{k}"] for k in range(n)]
        outputs = [dataclasses.replace(c.outputs[0], index=k) for k, c in enumerate(children)]
        first = children[0]
        return RequestOutput(parent, first.prompt, first.prompt_token_ids, outputs, True, first.prompt_logprobs)

    def shutdown(self) -> None:
        self.engine.shutdown()


__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
