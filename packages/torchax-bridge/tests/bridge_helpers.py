"""Test helpers: checkpoints saved by transformers itself (the oracle), and all stages of a model
chained in this process (the same loop the engine runs, minus the scheduler)."""

from __future__ import annotations

import jax
import numpy as np
import transformers
from pipejax_test_support import hf_greedy
from pipejax_test_support import make_hf_checkpoint as shared_checkpoint

from pipejax.pp_utils import InProcessTransport, stage_meshes
from pipejax.runner.batch import ModelBatch, SamplingParams, ScheduledRequest
from pipejax.runner.config import CacheConfig, SchedulerConfig, StageConfig
from pipejax.runner.runner import StageRunner

__all__ = ["GREEDY", "PROMPTS", "ChainedStages", "greedy_generate", "hf_greedy", "make_hf_checkpoint", "prefill_batch"]

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], list(range(30, 51))]


def make_hf_checkpoint(path, arch: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """The shared oracle's random checkpoint (``pipejax_test_support``), 4 layers deep."""
    return shared_checkpoint(path, arch, seed, **{"num_hidden_layers": 4, **overrides})


class ChainedStages:
    """All pp stages of a model in this process on disjoint devices, linked by in-process transports."""

    def __init__(self, path, pp: int, tp: int, model_impl: str, num_blocks: int = 64, block_size: int = 8):
        meshes = stage_meshes(jax.devices(), pp, tp)
        cache = CacheConfig(block_size=block_size, num_blocks=num_blocks)
        limits = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
        self.stages = [
            StageRunner(path, mesh, StageConfig(i, pp), cache, model_impl=model_impl, scheduler=limits)
            for i, mesh in enumerate(meshes)
        ]
        self.links = [InProcessTransport(f"stage {i}") for i in range(pp - 1)]

    def _run_to_last(self, batch: ModelBatch):
        hidden = None
        for i, stage in enumerate(self.stages[:-1]):
            if i > 0:
                hidden = self.links[i - 1].receive(batch.step_id, stage.intermediate_spec(batch), timeout=30)
            self.links[i].send(batch.step_id, stage.execute(batch, hidden))
        if len(self.stages) > 1:
            return self.links[-1].receive(batch.step_id, self.stages[-1].intermediate_spec(batch), timeout=30)
        return None

    def logits(self, batch: ModelBatch) -> np.ndarray:
        return self.stages[-1].logits(batch, self._run_to_last(batch))

    def execute(self, batch: ModelBatch):
        return self.stages[-1].execute(batch, self._run_to_last(batch))


def block_table(request: int, blocks_per_request: int = 8) -> tuple[int, ...]:
    """Disjoint blocks for request ``request`` (block 0 is the runner's reserved padding block)."""
    return tuple(range(1 + request * blocks_per_request, 1 + (request + 1) * blocks_per_request))


def prefill_batch(prompts: list[list[int]]) -> ModelBatch:
    return ModelBatch(0, tuple(ScheduledRequest(f"r{i}", tuple(p), 0, block_table(i)) for i, p in enumerate(prompts)))


def greedy_generate(stages: ChainedStages, prompts: list[list[int]], max_new_tokens: int, chunk: int = 8):
    """A minimal continuous-batching loop: prompts prefilled in chunks of ``chunk`` tokens, all
    requests in one ragged step (prefill chunks mixed with decodes), then decoded together."""
    tables = [block_table(i) for i in range(len(prompts))]
    computed = [0] * len(prompts)  # tokens already in the KV cache
    seqs = [list(p) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    step = 0
    while any(len(o) < max_new_tokens for o in outputs):
        reqs = []
        for i, seq in enumerate(seqs):
            if len(outputs[i]) >= max_new_tokens:
                continue
            todo = seq[computed[i] :][:chunk]
            last = computed[i] + len(todo) == len(seq)
            reqs.append(ScheduledRequest(f"r{i}", tuple(todo), computed[i], tables[i], GREEDY, sample=last))
        result = stages.execute(ModelBatch(step, tuple(reqs)))
        for r in reqs:
            computed[int(r.request_id[1:])] += len(r.token_ids)
        for rid, tok in zip(result.request_ids, result.token_ids, strict=True):
            outputs[int(rid[1:])].append(tok)
            seqs[int(rid[1:])].append(tok)
        step += 1
    return outputs
