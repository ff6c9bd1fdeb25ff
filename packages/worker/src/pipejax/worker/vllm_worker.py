"""pipejax's stage behind vLLM's V1 worker interface (vLLM 0.32; the ``[vllm]`` extra).

vLLM's platform plugin (``pipejax.platform_tpu.vllm_platform``) names ``VllmStageWorker`` as the
worker class and hides tensor parallelism from vLLM: vLLM sees a world of ``pp`` ranks, one per
pipeline stage, and each rank is a ``StageWorker`` that owns its stage's TP devices (a JAX mesh).
vLLM keeps what it is good at (its API and server, tokenizer, scheduler with chunked prefill,
prefix caching and preemption, its executors); pipejax runs the step: the batch, paged attention
over vLLM's block ids, sampling, and stage-to-stage activations over pipejax's PP transport (the
JAX transfer server), never through torch process groups, which carry only control (a one-time
exchange of transfer-server addresses).

Under vLLM's compiled-graph Ray executor (``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``) the graph calls
``model_runner.execute_model(scheduler_output, intermediate_tensors)`` and passes a non-last
stage's return value to the next stage: that value is a one-element handle (the step id) while
the activations take the transfer server, as in every other executor.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
from vllm.config import VllmConfig
from vllm.distributed.parallel_state import (
    ensure_model_parallel_initialized,
    get_pp_group,
    init_distributed_environment,
)
from vllm.sequence import IntermediateTensors
from vllm.utils.network_utils import get_ip
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, LogprobsLists, LogprobsTensors, ModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from pipejax.runner.batch import ModelBatch, SamplerOutput, TokenLogprobs
from pipejax.runner.config import CacheConfig, ModelSource, SchedulerConfig, StageConfig
from pipejax.runner.model import kv_heads_for_tp
from pipejax.worker.vllm_options import OPTIONS_KEY, VllmStageOptions
from pipejax.worker.vllm_requests import RequestStates, UnsupportedFeatureError
from pipejax.worker.worker import StageWorker, WorkerConfig

log = logging.getLogger(__name__)

STEP_HANDLE = "pipejax_step"  # the one tensor a non-last stage hands vLLM's compiled graph


def options(vllm_config: VllmConfig) -> VllmStageOptions:
    opts = VllmStageOptions.of(vllm_config.additional_config)
    if opts is None:
        raise RuntimeError(
            f"VllmStageWorker runs under pipejax's vLLM platform, which records its options in "
            f"additional_config[{OPTIONS_KEY!r}]; set PIPEJAX_PLATFORM=cpu (or run on a TPU host) so vLLM picks it"
        )
    return opts


def _apply_stage_environment(env: dict[str, str], rank: int) -> None:
    """Before JAX opens a device: this stage's chips (TPU) or simulated devices (CPU)."""
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        log.info("stage %d: JAX is already initialised in this process; keeping its devices", rank)
        return
    os.environ.update(env)


class VllmStageRunner:
    """One stage's step for vLLM: ``execute_model`` / ``sample_tokens`` over a ``StageWorker``."""

    supports_mm_inputs = False  # read by vLLM's compiled-graph Ray worker wrapper

    def __init__(self, stage_worker: StageWorker):
        self.stage_worker = stage_worker
        self.stage = stage_worker.stage
        self.states = RequestStates()
        self.step_id = 0
        self.pending: ModelBatch | None = None  # the last stage's step whose tokens sample_tokens returns

    def execute_model(self, so, intermediate_tensors: IntermediateTensors | None = None):
        assert self.pending is None, "sample_tokens must follow an execute_model that returned None"
        self.states.update(so)
        if so.kv_cache_block_copies:  # copy-on-write of a partly shared block, before it is written
            self.stage_worker.copy_blocks([(c.src_block_id, c.dst_block_id) for c in so.kv_cache_block_copies])
        # new_block_ids_to_zero: not needed, attention never reads a position past a row's length.
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        step_id, self.step_id = self.step_id, self.step_id + 1
        if intermediate_tensors is not None and STEP_HANDLE in intermediate_tensors.tensors:
            got = int(intermediate_tensors[STEP_HANDLE][0])
            if got != step_id:
                raise RuntimeError(
                    f"stage {self.stage.pp_rank}: the previous stage sent step {got}, expected {step_id}")
        batch = self.states.batch(so, step_id)
        # the last stage samples in sample_tokens: vLLM's scheduler computes the grammars' bitmasks meanwhile
        self.stage_worker.execute_model(batch, defer_sampling=self.stage.is_last)
        if not self.stage.is_last:
            return IntermediateTensors({STEP_HANDLE: np.array([step_id], np.int64)})
        self.pending = batch
        return None  # vLLM asks for it with sample_tokens

    def sample_tokens(self, grammar_output) -> ModelRunnerOutput:
        """The pending step's tokens, each structured output's request limited to its grammar's bitmask."""
        batch, self.pending = self.pending, None
        if batch is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        bitmasks = None
        if grammar_output is not None:
            bitmasks = dict(zip(grammar_output.structured_output_request_ids, grammar_output.grammar_bitmask,
                                strict=True))
        out = self.stage_worker.sample_deferred(bitmasks)
        prompt_logprobs = self.states.record_prompt_logprobs(batch, out)
        self.states.record(out)
        return _model_runner_output(batch, out, prompt_logprobs)


def _model_runner_output(batch, out: SamplerOutput,
                         prompt_logprobs: dict[str, tuple[list[int], list[TokenLogprobs]]]) -> ModelRunnerOutput:
    req_ids = [r.request_id for r in batch.requests]
    index = {r: i for i, r in enumerate(req_ids)}
    sampled: list[list[int]] = [[] for _ in req_ids]  # [] for a prefill chunk short of the prompt's end
    for req_id, token in zip(out.request_ids, out.token_ids, strict=True):
        sampled[index[req_id]] = [token]
    return ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index=index, sampled_token_ids=sampled, logprobs=_logprobs(index, out),
        prompt_logprobs_dict={req_id: _prompt_logprobs(*scored) for req_id, scored in prompt_logprobs.items()},
    )


def _prompt_logprobs(tokens: list[int], scores: list[TokenLogprobs]) -> LogprobsTensors:
    """vLLM's layout of a whole prompt's logprobs: per prompt token after the first, column 0 that token, then
    the top N; and its rank (in vLLM's own CPU tensors, filled through numpy views)."""
    width = 1 + max((len(lp.top) for lp in scores), default=0)
    out = LogprobsTensors.empty_cpu(len(scores), width)
    ids, values, ranks = (t.numpy() for t in out[:3])
    values[:] = -np.inf
    ids[:] = 0
    for i, (token, lp) in enumerate(zip(tokens, scores, strict=True)):
        ids[i, 0], values[i, 0], ranks[i] = token, lp.sampled, lp.rank
        for j, (tok, value) in enumerate(lp.top, start=1):
            ids[i, j], values[i, j] = tok, value
    return out


def _logprobs(index: dict[str, int], out: SamplerOutput) -> LogprobsLists | None:
    """vLLM's layout: per request row, column 0 the sampled token, then the top N; and its rank."""
    if not any(lp is not None for lp in out.logprobs):
        return None
    width = 1 + max(len(lp.top) for lp in out.logprobs if lp is not None)
    ids = np.zeros((len(index), width), np.int32)
    values = np.full((len(index), width), -np.inf, np.float32)
    ranks = np.zeros(len(index), np.int32)
    for req_id, token, lp in zip(out.request_ids, out.token_ids, out.logprobs, strict=True):
        if lp is None:
            continue
        row = index[req_id]
        ids[row, 0], values[row, 0], ranks[row] = token, lp.sampled, lp.rank
        for j, (tok, value) in enumerate(lp.top, start=1):
            ids[row, j], values[row, j] = tok, value
    return LogprobsLists(ids, values, ranks)


class VllmStageWorker(WorkerBase):
    """A vLLM worker that is one pipejax pipeline stage (constructed by vLLM with these arguments)."""

    def __init__(self, vllm_config: VllmConfig, local_rank: int, rank: int, distributed_init_method: str,
                 is_driver_worker: bool = False):
        super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
        self.options = options(vllm_config)
        self.stage_worker: StageWorker | None = None
        self.model_runner: VllmStageRunner | None = None
        self.transport = None

    # --- start-up, in the order vLLM's executors call it --------------------------------------

    def init_device(self) -> None:
        pc = self.parallel_config
        pp = pc.pipeline_parallel_size
        envs = self.options.stage_environments
        _apply_stage_environment(envs[min(self.local_rank, len(envs) - 1)], self.rank)
        self.device = self.current_platform.device_type  # vLLM's handle; the stage's devices are JAX's
        # vLLM's process groups (gloo, control only): one rank per stage, TP lives inside the stage.
        init_distributed_environment(pc.world_size, self.rank, self.distributed_init_method, self.local_rank,
                                     backend="gloo")
        ensure_model_parallel_initialized(1, pp)
        pp_rank = get_pp_group().rank_in_group
        stage = StageConfig(pp_rank, pp, self.options.pp_layer_partition, pc.enable_expert_parallel)
        recv = send = None
        if pp > 1:
            from pipejax.pp_utils import TransferServerTransport

            self.transport = TransferServerTransport(host=get_ip())
            group = get_pp_group()
            addresses = [group.broadcast_object(self.transport.address if r == pp_rank else None, src=r)
                         for r in range(pp)]
            if pp_rank > 0:
                self.transport.connect_previous(addresses[pp_rank - 1], f"stage {pp_rank - 1}")
            recv = self.transport if pp_rank > 0 else None
            send = self.transport if pp_rank < pp - 1 else None
        self.stage_worker = StageWorker(self._worker_config(stage), recv=recv, send=send)
        self.model_runner = VllmStageRunner(self.stage_worker)
        log.info("vLLM rank %d (pid %d) is pipejax stage %d/%d on %s", self.rank, os.getpid(), pp_rank, pp,
                 ", ".join(str(d) for d in self.stage_worker.devices))

    def _worker_config(self, stage: StageConfig) -> WorkerConfig:
        sched, mc = self.scheduler_config, self.model_config
        return self.options.worker_config(
            ModelSource(self.options.model_path or mc.model, dtype=str(mc.dtype).removeprefix("torch."),
                        quantization=mc.quantization, seed=mc.seed or 0),
            stage,
            # on CPU the host's KV budget (the options') is shared with the stages of vLLM's other data-parallel
            # engines on this host
            CacheConfig(block_size=self.cache_config.block_size,
                        engines_on_host=max(1, self.parallel_config.data_parallel_size_local)),
            SchedulerConfig(max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
                            max_model_len=mc.max_model_len),
        )

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        if load_dummy_weights:
            raise UnsupportedFeatureError("pipejax loads real weights only (load_format='dummy' is not supported)")
        self.stage_worker.load(None)  # the KV cache comes with initialize_from_config

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        sw = self.stage_worker
        cfg, tp = sw.model_config, sw.config.tp_size
        spec = FullAttentionSpec(
            block_size=sw.config.cache.block_size,
            num_kv_heads=kv_heads_for_tp(cfg, tp) // tp,  # per device (K/V heads repeat when tp > their count)
            head_size=cfg.head_dim,
            dtype=self.model_config.dtype,  # vLLM's torch dtype, the one the stage was built in
        )
        return {f"model.layers.{i}.self_attn.attn": spec for i in sw.stage.layer_range(cfg)}

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["NHD"]  # vLLM asks its attention backends otherwise; the runner's layout is its own

    def determine_available_memory(self) -> int:
        """Bytes of KV cache this stage offers (vLLM divides by its page size x the stage's layers)."""
        if self.cache_config.kv_cache_memory_bytes:
            return int(self.cache_config.kv_cache_memory_bytes)
        # Stages on one host share its memory (on CPU: its RAM); vLLM's count of them is a bound.
        blocks = self.stage_worker.available_kv_blocks(stages_on_host=self.parallel_config.local_world_size)
        return blocks * self.stage_worker.kv_bytes_per_block()

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise UnsupportedFeatureError(f"pipejax runs one full-attention KV group; vLLM planned {len(groups)}")
        block_size = groups[0].kv_cache_spec.block_size
        if block_size != self.stage_worker.config.cache.block_size:
            raise ValueError(f"vLLM chose block_size={block_size}, the stage was built for "
                             f"{self.stage_worker.config.cache.block_size}")
        self.stage_worker.allocate_kv_cache(kv_cache_config.num_blocks)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        start = time.perf_counter()
        self.stage_worker.warmup(self.stage_worker.warmup_batches(), progress=False)
        return CompilationTimes(language_model=time.perf_counter() - start, encoder=0.0)

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def get_model(self):
        return self.model_runner

    # --- every step ------------------------------------------------------------------------------

    def execute_model(self, scheduler_output) -> ModelRunnerOutput | None:
        out = self.model_runner.execute_model(scheduler_output)
        return None if isinstance(out, IntermediateTensors) else out  # the activations are on their way

    def sample_tokens(self, grammar_output) -> ModelRunnerOutput:
        return self.model_runner.sample_tokens(grammar_output)

    def take_draft_token_ids(self):
        return None

    def execute_dummy_batch(self) -> None:
        pass  # data parallel engines are independent: nothing to keep in step

    def pipejax_stats(self) -> dict:
        """Not vLLM's: ``llm.collective_rpc("pipejax_stats")`` for tests and logs."""
        sw = self.stage_worker
        layers = sw.stage.layer_range(sw.model_config)
        experts = getattr(sw.runner, "params", {}).get("layers.experts_down")  # [L, experts, Fm, E], sharded
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "pp_rank": sw.stage.pp_rank,
            "layers": (layers.start, layers.stop),
            "devices": [str(d) for d in sw.devices],
            "experts_per_device": 0 if experts is None else experts.addressable_shards[0].data.shape[1],
            # the weights kept quantized, by format (``pipejax.runner.quantized.Quantized``)
            "dtype": sw.runner.cfg.dtype,
            "quantized": sorted({w.fmt.name for w in getattr(sw.runner, "params", {}).values() if hasattr(w, "fmt")}),
            "num_blocks": sw.runner.num_blocks if sw.runner else 0,
            "activation_bytes_sent": self.stage_worker.activation_bytes_sent(),
            **self.model_runner.states.counts,
            "live_requests": len(self.model_runner.states.requests),
        }

    # --- features pipejax does not have ------------------------------------------------------------

    def add_lora(self, lora_request) -> bool:
        raise UnsupportedFeatureError("pipejax does not support LoRA adapters")

    def remove_lora(self, lora_id: int) -> bool:
        raise UnsupportedFeatureError("pipejax does not support LoRA adapters")

    def pin_lora(self, lora_id: int) -> bool:
        raise UnsupportedFeatureError("pipejax does not support LoRA adapters")

    def list_loras(self) -> set[int]:
        return set()

    def sleep(self, level: int = 1) -> None:
        raise UnsupportedFeatureError("pipejax does not support sleep mode")

    def wake_up(self, tags: list[str] | None = None) -> None:
        raise UnsupportedFeatureError("pipejax does not support sleep mode")

    def shutdown(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
