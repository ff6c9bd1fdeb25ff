"""``StageRunner``: one pipeline stage on its TP mesh — parameters, paged KV cache, jitted step."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pipejax.pp_utils import IntermediateSpec, IntermediateTensors, TensorSpec, logical_sharding
from pipejax.runner.batch import ALL_LOGPROBS, ModelBatch, SamplerOutput
from pipejax.runner.checkpoint import load_stage_params
from pipejax.runner.config import CacheConfig, ModelConfig, SchedulerConfig, StageConfig
from pipejax.runner.cpu import dots as cpu_dots
from pipejax.runner.cpu import layer_views
from pipejax.runner.cpu.select import KERNEL_NAMES, KernelOptions, Selection, build_in_background, select
from pipejax.runner.inputs import Buckets, build_step_inputs
from pipejax.runner.model import RULES, StepInputs, StepShape, kv_cache_spec
from pipejax.runner.model_impl import NATIVE, get_model_impl
from pipejax.runner.prompt_logprobs import prompt_logprobs, scorer
from pipejax.runner.sampler import LogitsAdjustment, SamplingMetadata, to_sampler_output
from pipejax.runner.sampler import sample as sample_tokens

log = logging.getLogger(__name__)

LOGPROB_BUCKETS = (0, 1, 5, 20)


def _param_bytes(params: dict) -> int:
    return sum(w.nbytes for w in params.values())


def kv_bytes_per_block(cfg: ModelConfig, stage: StageConfig, tp: int, block_size: int) -> int:
    """Bytes one KV block takes on each device of the stage (K and V, all the stage's layers)."""
    L, _, _, heads, head_dim = kv_cache_spec(cfg, stage, tp, 1, block_size).shape
    per_device_heads = max(1, heads // tp)
    return 2 * L * block_size * per_device_heads * head_dim * jnp.dtype(cfg.dtype).itemsize


class StageRunner:
    """Runs one stage: ``execute(batch, hidden)`` -> ``IntermediateTensors`` or ``SamplerOutput``."""

    def __init__(
        self,
        model_path: str | Path,
        mesh: Mesh,
        stage: StageConfig = StageConfig(),
        cache: CacheConfig = CacheConfig(num_blocks=256),
        model_config: ModelConfig | None = None,
        seed: int = 0,
        model_impl: str = "jax",
        scheduler: SchedulerConfig = SchedulerConfig(),
        decode_attention: str = "auto",
        decode_layers: str = "auto",
        few_row_dots: str = "auto",
        dense_matmuls: str = "auto",
        prefill_attention: str = "auto",
        kernel_build: str = "wait",
        dense_tiles: str = "auto",
    ):
        self.model_path = Path(model_path)
        self.mesh = mesh
        self.stage = stage
        self.cfg = model_config or ModelConfig.from_pretrained(model_path)
        self._prompt_scorer = scorer(self.cfg)
        self.tp = mesh.shape["tp"]
        self.limits = scheduler.for_model(self.cfg)
        self.max_model_len = self.limits.max_model_len
        self.cache_config = cache
        self.block_size = cache.block_size
        self.buckets = Buckets.make(
            self.limits.max_num_batched_tokens, self.limits.max_num_seqs, self.max_model_len, self.block_size
        )
        self.seed = seed
        self.impl, self.impl_name = get_model_impl(model_impl), model_impl
        self._kernel_options = KernelOptions(dense_matmuls, decode_attention, prefill_attention, decode_layers,
                                             few_row_dots, kernel_build, dense_tiles)
        # which CPU kernels run here: measured against XLA's formulation on this host where asked "auto"
        started = time.time()
        self.selection = self._select(self._kernel_options)
        self.selection_span = (started, time.time())  # wall clock: a first start on a host measures here
        self._kernel_build = build_in_background(self.selection)  # kernels numba has not built yet
        if self.impl is NATIVE:
            self.params = load_stage_params(self.model_path, self.cfg, stage, mesh, panels=self.selection.panels)
            if self.selection.keeps_tiles:
                self.params = self._keep_tiles(self.params)
        else:
            self.params = self.impl.load_params(self.model_path, self.cfg, stage, mesh)
        self.compiled_shapes: set[tuple] = set()
        self.num_blocks = 0
        self.kv_cache: tuple[jax.Array, jax.Array] | None = None
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._use_selection(self.selection)
        self._few_row_dots = self.selection.few_row_dots
        self._decode_params = None  # per-layer views, where decode steps run the layers unrolled
        if self.selection.decode_layers == "unrolled":
            try:
                self._decode_params = layer_views.per_layer(self.params, self.cfg, self.stage)
            except RuntimeError as e:  # a weight whose layers cannot be aliased: the scan, not a second copy
                if decode_layers == "unrolled":
                    raise
                log.warning("stage %d: decode steps run the layer scan: %s", stage.pp_rank, e)
        if cache.num_blocks is not None:  # else the caller sizes it once the weights are in memory
            self.allocate_kv_cache(cache.num_blocks)

    def _keep_tiles(self, params: dict) -> dict:
        from pipejax.runner.cpu import dense

        started, before = time.perf_counter(), _param_bytes(params)
        params = dense.keep_tiles(params)
        log.info("stage %d: the dense weights' AMX tiles kept beside their panels (faster from %d rows here): %.0f MB "
                 "more, split in %.1fs", self.stage.pp_rank, self.selection.dense_kept_rows,
                 (_param_bytes(params) - before) / 1e6, time.perf_counter() - started)
        return params

    def _select(self, options: KernelOptions) -> Selection:
        return select(self.mesh, self.cfg, options, self.limits, native=self.impl is NATIVE,
                      remember_in=jax.config.jax_compilation_cache_dir)

    def _use_selection(self, selection: Selection) -> None:
        """Run ``selection``'s kernels from the next step on (its steps are jitted anew: each shape compiles again
        on first use)."""
        self.selection = selection
        self.dense_matmuls = selection.dense_matmuls
        self.decode_attention = selection.decode_attention
        self.prefill_attention = selection.prefill_attention
        forward = functools.partial(self.impl.forward, cfg=self.cfg, stage=self.stage, block_size=self.block_size)
        if self.impl is NATIVE:
            forward = functools.partial(forward, kernels=selection.kernels(self.mesh))
        self._jit_step = functools.partial(jax.jit, forward, static_argnames=("shape",), donate_argnums=(1,),
                                           out_shardings=(self._replicated, self._cache_shardings()))
        self._step = self._jit_step()
        self.__dict__.pop("_few_row_step", None)

    def adopt_built_kernels(self) -> bool:
        """Between two steps: where the background build of this stage's kernels has finished, measure them
        against XLA's formulation (as a start with them built does) and switch to those that won; whether
        anything changed. A dense kernel that won waits for the next start: the weights are laid out for XLA's
        dots at load."""
        if self._kernel_build is None or not self._kernel_build.finished():
            return False
        build, self._kernel_build = self._kernel_build, None
        if not build.succeeded:
            return False
        started = time.perf_counter()
        chosen = self._select(dataclasses.replace(self._kernel_options, build="wait"))
        if chosen.panels != self.selection.panels:
            log.info("stage %d: the dense kernel measured faster here; it runs from the next start (the weights "
                     "were laid out for XLA's dots at load)", self.stage.pp_rank)
            chosen = dataclasses.replace(chosen, dense_matmuls=self.selection.dense_matmuls)
        # the same for AMX's kept tiles: made at load (and aliased by the decode layers' views) or not at all
        chosen = dataclasses.replace(chosen, dense_kept_rows=self.selection.dense_kept_rows)
        switched = [n for n in (*KERNEL_NAMES, "quantized_kernel") if getattr(chosen, n) != getattr(self.selection, n)]
        log.info("stage %d: CPU kernels built in the background, measured in %.1fs; %s", self.stage.pp_rank,
                 time.perf_counter() - started,
                 f"switching {', '.join(switched)} to the kernel (step shapes compile again as they come)"
                 if switched else "XLA's formulation stays")
        if switched:
            self._use_selection(chosen)
        else:
            self.selection = dataclasses.replace(self.selection, pending=())
        return bool(switched)

    @property
    def few_row_dots(self) -> str | None:
        """Which library XLA:CPU runs the dots of decode steps of a few rows with: "ynnpack" (XLA's default) or
        "eigen" (XLA's own dot); with "auto", measured here at the first such step (``cpu_dots``, not while the
        weights load; remembered next to JAX's compilation cache where that is on). None off CPU."""
        if self._few_row_dots == "auto":
            self._few_row_dots = cpu_dots.choice(jax.config.jax_compilation_cache_dir)
        return self._few_row_dots

    @functools.cached_property
    def _few_row_step(self):
        """The jitted step for decode steps of a few rows: without YNNPACK where that measured faster."""
        return self._jit_step(compiler_options=cpu_dots.WITHOUT_YNNPACK) if self.few_row_dots == "eigen" else self._step

    @property
    def decode_layers(self) -> str:
        """How decode steps run the layers here: "unrolled" (over per-layer views) or "scan"."""
        return "scan" if self._decode_params is None else "unrolled"

    # --- KV cache ---------------------------------------------------------------------------

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate (or replace) the paged KV cache: ``num_blocks`` blocks, block 0 reserved for padding."""
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks} must be >= 2 (block 0 is reserved for padding)")
        self.kv_cache = None  # free the old cache first
        self.num_blocks = num_blocks
        self.kv_cache = self._allocate_kv_cache()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks ``src -> dst`` in every layer (a host's copy-on-write of a shared block)."""
        if not pairs:
            return
        src, dst = (np.asarray(x, np.int32) for x in zip(*pairs, strict=True))
        self.kv_cache = _copy_blocks(self._require_cache(), src, dst)

    def _require_cache(self) -> tuple[jax.Array, jax.Array]:
        if self.kv_cache is None:
            raise RuntimeError(f"stage {self.stage.pp_rank}: allocate_kv_cache(num_blocks) before executing")
        return self.kv_cache

    def _cache_shardings(self):
        spec = kv_cache_spec(self.cfg, self.stage, self.tp, self.num_blocks, self.block_size)
        sharding = logical_sharding(self.mesh, spec.logical_axes, RULES)
        return (sharding, sharding)

    def _allocate_kv_cache(self) -> tuple[jax.Array, jax.Array]:
        spec = kv_cache_spec(self.cfg, self.stage, self.tp, self.num_blocks, self.block_size)
        zeros = jax.jit(
            lambda: (jnp.zeros(spec.shape, self.cfg.dtype), jnp.zeros(spec.shape, self.cfg.dtype)),
            out_shardings=self._cache_shardings(),
        )
        return zeros()

    # --- the step ---------------------------------------------------------------------------

    def step_shape(self, batch: ModelBatch) -> StepShape:
        for r in batch.requests:
            if r.end_position > self.max_model_len:
                raise ValueError(
                    f"request {r.request_id!r} reaches position {r.end_position}, beyond max_model_len="
                    f"{self.max_model_len}; shorten the prompt or max_tokens"
                )
        return self.buckets.shape_of(batch, self.block_size)

    def intermediate_spec(self, batch: ModelBatch, shape: StepShape | None = None) -> IntermediateSpec:
        """What this stage receives from the previous one for ``batch`` (hidden states [T, E]); ``shape``: its
        ``step_shape``, where the caller has it already."""
        T = (shape or self.step_shape(batch))[0]
        spec = TensorSpec((T, self.cfg.hidden_size), self.cfg.dtype, self._replicated)
        return IntermediateSpec({"hidden_states": spec})

    def prepare_inputs(self, batch: ModelBatch, shape: StepShape | None = None) -> tuple[StepShape, StepInputs]:
        """A step's host work: the padded shape of ``batch`` (given, or found) and its inputs on the stage's
        devices."""
        shape = shape or self.step_shape(batch)
        host = build_step_inputs(batch, shape, self.block_size)
        return shape, StepInputs(*jax.device_put(tuple(host), self._replicated))  # one batched transfer

    def forward(self, inputs: StepInputs, shape: StepShape, hidden_in: jax.Array | None = None) -> jax.Array:
        """The jitted step on prepared inputs (it writes the KV cache): hidden states [T, E], or on the
        last stage logits [rows, V] (with ``shape.prompt_hidden``: and every token's final hidden states [T, E]).
        ``hidden_in``: the previous stage's hidden states (non-first stages)."""
        if shape.prompt_hidden and not self.stage.is_last:  # only the last stage scores prompts: no second program
            shape = shape._replace(prompt_hidden=False)
        if self._kernel_build is not None:
            self.adopt_built_kernels()
        if shape not in self.compiled_shapes:
            self.compiled_shapes.add(shape)
            log.info(
                "stage %d: compiling step for %s [%d shapes so far, at most %d]",
                self.stage.pp_rank,
                shape,
                len(self.compiled_shapes),
                self.buckets.count(),
            )
        unrolled = self._decode_params is not None and not shape.prefill_rows
        params = self._decode_params if unrolled else self.params
        # (with the dense kernel a decode step's dots are not XLA's: nothing to choose between)
        few_rows = self.dense_matmuls == "xla" and cpu_dots.few_rows(shape)
        step = self._few_row_step if few_rows else self._step
        out, self.kv_cache = step(params, self._require_cache(), inputs, hidden_in, shape=shape)
        return out

    def forward_batch(self, batch: ModelBatch, intermediate: IntermediateTensors | None,
                      shape: StepShape | None = None) -> tuple[jax.Array, StepShape]:
        """``forward`` of ``batch`` (``intermediate``: the previous stage's activations): its output and step shape."""
        shape, inputs = self.prepare_inputs(batch, shape)
        hidden_in = None
        if not self.stage.is_first:
            if intermediate is None:
                raise ValueError(
                    f"stage {self.stage.pp_rank} needs the previous stage's activations for step {batch.step_id}"
                )
            hidden_in = intermediate["hidden_states"]
        return self.forward(inputs, shape, hidden_in), shape

    def execute(
        self, batch: ModelBatch, intermediate: IntermediateTensors | None = None, shape: StepShape | None = None
    ) -> IntermediateTensors | SamplerOutput:
        """One step of ``batch`` (``shape``: its ``step_shape``, where the caller found it already)."""
        out, shape = self.forward_batch(batch, intermediate, shape)
        if not self.stage.is_last:
            return IntermediateTensors({"hidden_states": out})
        return self.sample(batch, out, shape.rows)

    def logits(self, batch: ModelBatch, intermediate: IntermediateTensors | None = None) -> np.ndarray:
        """Last stage only: raw logits [num requests, V] at each request's last token (tests, scoring)."""
        assert self.stage.is_last
        out, _ = self.forward_batch(batch, intermediate)
        return np.asarray(out)[: len(batch.requests)]

    def sample(self, batch: ModelBatch, logits: jax.Array | tuple[jax.Array, jax.Array], num_rows: int,
               bitmasks: Mapping[str, np.ndarray] | None = None) -> SamplerOutput:
        """Last stage: the sampled tokens of ``batch``'s sampling rows from its step's logits ([num_rows, V]), and
        the prompt logprobs its requests' ``prompt_targets`` ask for (``logits`` is then the step's (logits, final
        hidden states)); ``bitmasks``: request id -> the token bitmask its structured output allows now (vLLM's
        layout)."""
        logits, hidden = logits if isinstance(logits, tuple) else (logits, None)
        rows = [(r.sampling, r.output_index, r.request_id) for r in batch.requests]
        meta = SamplingMetadata.build(rows, num_rows, step_seed=hash((self.seed, batch.step_id)) & 0x7FFFFFFF)
        vocab = self.cfg.vocab_size
        wanted = [r.sampling.logprobs for r in batch.requests]
        wanted = [vocab if n == ALL_LOGPROBS else n if n is None else min(n, vocab) for n in wanted]
        asked = [n for n in wanted if n is not None]
        most = max(asked, default=0)
        num_logprobs = next((b for b in LOGPROB_BUCKETS if b >= most), most) if asked else None
        adjust = LogitsAdjustment.build(batch.requests, num_rows, self.cfg.vocab_size, bitmasks)
        result = sample_tokens(logits, meta, num_logprobs=num_logprobs, adjust=adjust)
        keep = [i for i, r in enumerate(batch.requests) if r.sample]  # a prefill chunk short of the end samples none
        out = to_sampler_output(batch.step_id, [r.request_id for r in batch.requests], result, len(rows), wanted,
                                keep=keep)
        if not any(r.prompt_targets for r in batch.requests):
            return out
        if hidden is None:
            raise ValueError(f"prompt_logprobs: model_impl={self.impl_name!r} does not return the hidden states they "
                             f"are computed from; use model_impl='jax' or leave prompt_logprobs out")
        head = {name: w for name, w in self.params.items() if name in ("final_norm", "embed", "lm_head")}
        scored = prompt_logprobs(self._prompt_scorer, head, hidden, batch, vocab)
        return dataclasses.replace(out, prompt_logprobs=scored)


@functools.partial(jax.jit, donate_argnums=(0,))
def _copy_blocks(kv: tuple[jax.Array, jax.Array], src: jax.Array, dst: jax.Array) -> tuple[jax.Array, jax.Array]:
    """kv: ([L, blocks, block_size, K, D], same); blocks ``dst[i]`` take the contents of ``src[i]``."""
    return tuple(c.at[:, dst].set(c[:, src]) for c in kv)

