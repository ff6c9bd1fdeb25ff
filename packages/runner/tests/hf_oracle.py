"""Test helpers: our stages chained in one process, next to the shared oracle (``pipejax_test_support``:
Hugging Face checkpoints made by transformers itself, its logits and greedy generation)."""

from __future__ import annotations

import jax
import numpy as np
from pipejax_test_support import ARCHS, hf_greedy, hf_logits, make_hf_checkpoint

from pipejax.pp_utils import InProcessTransport, stage_meshes
from pipejax.runner.batch import ModelBatch, SamplingParams, ScheduledRequest
from pipejax.runner.config import CacheConfig, ModelConfig, StageConfig
from pipejax.runner.runner import StageRunner

__all__ = ["ARCHS", "GREEDY", "ChainedStages", "greedy_generate", "hf_greedy", "hf_logits", "make_hf_checkpoint",
           "prefill_batch"]

GREEDY = SamplingParams(temperature=0.0)


class ChainedStages:
    """All pp stages of a model in this process on disjoint devices, linked by in-process transports."""

    def __init__(self, path, pp: int, tp: int, partition=None, num_blocks: int = 128, block_size: int = 8,
                 expert_parallel: bool = False,
                 decode_attention: str = "auto", decode_layers: str = "auto", few_row_dots: str = "auto",
                 dense_matmuls: str = "auto", prefill_attention: str = "auto", kernel_build: str = "wait",
                 dense_tiles: str = "auto", quantization: str | None = None, **cache):
        meshes = stage_meshes(jax.devices(), pp, tp)
        model = ModelConfig.from_pretrained(path, quantization=quantization)
        cache_cfg = CacheConfig(block_size=block_size, num_blocks=num_blocks, **cache)
        choices = dict(decode_attention=decode_attention, decode_layers=decode_layers, few_row_dots=few_row_dots,
                       dense_matmuls=dense_matmuls, prefill_attention=prefill_attention, kernel_build=kernel_build,
                       dense_tiles=dense_tiles)
        self.stages = [StageRunner(path, m, StageConfig(i, pp, partition, expert_parallel), cache_cfg, model, **choices)
                       for i, m in enumerate(meshes)]
        self.links = [InProcessTransport(f"stage {i}") for i in range(pp - 1)]

    def _run_to_last(self, batch: ModelBatch):
        hidden = None
        for i, stage in enumerate(self.stages[:-1]):
            if i > 0:
                hidden = self.links[i - 1].receive(batch.step_id, stage.intermediate_spec(batch), timeout=30)
            self.links[i].send(batch.step_id, stage.execute(batch, hidden))
        last = self.stages[-1]
        if len(self.stages) > 1:
            return self.links[-1].receive(batch.step_id, last.intermediate_spec(batch), timeout=30)
        return None

    def logits(self, batch: ModelBatch) -> np.ndarray:
        return self.stages[-1].logits(batch, self._run_to_last(batch))

    def execute(self, batch: ModelBatch):
        return self.stages[-1].execute(batch, self._run_to_last(batch))


def prefill_batch(prompts: list[list[int]], step_id: int = 0, blocks_per_request: int = 8) -> ModelBatch:
    reqs = tuple(
        ScheduledRequest(
            f"r{i}", tuple(p), 0, tuple(range(1 + i * blocks_per_request, 1 + (i + 1) * blocks_per_request))
        )
        for i, p in enumerate(prompts)
    )
    return ModelBatch(step_id, reqs)


def greedy_generate(stages: ChainedStages, prompts: list[list[int]], max_new_tokens: int, chunk: int | None = None,
                    arrivals: list[int] | None = None):
    """A minimal continuous-batching loop: prompts prefilled in chunks of ``chunk`` tokens (all
    requests in one ragged step, mixing prefill chunks and decodes), then decoded together. Prompt i
    joins at step ``arrivals[i]`` (default: all at step 0)."""
    blocks_per_request = 16
    tables = [tuple(range(1 + i * blocks_per_request, 1 + (i + 1) * blocks_per_request)) for i in range(len(prompts))]
    computed = [0] * len(prompts)  # tokens already in the KV cache
    seqs = [list(p) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    step = 0
    while any(len(o) < max_new_tokens for o in outputs):
        reqs = []
        for i, seq in enumerate(seqs):
            if len(outputs[i]) >= max_new_tokens or (arrivals and arrivals[i] > step):
                continue
            todo = seq[computed[i] :]
            if chunk is not None:
                todo = todo[:chunk]
            last = computed[i] + len(todo) == len(seq)
            reqs.append(ScheduledRequest(f"r{i}", tuple(todo), computed[i], tables[i], GREEDY, sample=last))
        result = stages.execute(ModelBatch(step, tuple(reqs)))
        for r in reqs:
            i = int(r.request_id[1:])
            computed[i] += len(r.token_ids)
        for rid, tok in zip(result.request_ids, result.token_ids, strict=True):
            i = int(rid[1:])
            outputs[i].append(tok)
            seqs[i].append(tok)
        step += 1
    return outputs
