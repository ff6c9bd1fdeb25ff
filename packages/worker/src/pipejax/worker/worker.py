"""``StageWorker``: what one process runs for one pipeline stage.

It selects the stage's TP devices, builds the stage mesh, loads its share of the model, sizes and
allocates the paged KV cache, compiles the padding buckets at warm-up, and runs
``execute_model(batch)`` = receive activations (non-first stage) -> runner -> send (non-last).
It knows nothing of Ray: the same object works in-process, in a subprocess, or as the body of a
Ray actor (the executor passes plain arguments and calls plain methods).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import time
from collections import deque
from collections.abc import Mapping, Sequence

import jax
import numpy as np
import psutil
from tqdm import tqdm

from pipejax.pp_utils import DEFAULT_RECEIVE_TIMEOUT_S, ActivationTransport, stage_mesh
from pipejax.runner.batch import ModelBatch, SamplerOutput, SamplingParams, ScheduledRequest
from pipejax.runner.config import CacheConfig, ModelSource, SchedulerConfig, StageConfig
from pipejax.runner.runner import StageRunner, kv_bytes_per_block
from pipejax.worker import compile_stats
from pipejax.worker.compile_stats import CompileStats
from pipejax.worker.kv_sizing import KVCachePlan, plan_kv_cache

log = logging.getLogger(__name__)

WARMUP_STEP_BASE = 1 << 60  # warm-up step ids live far above the engine's (which count from 0)

CACHE_DIR_ENV = "PIPEJAX_COMPILATION_CACHE_DIR"  # read at the edges (compilation_cache_dir_from_env)
MIN_CACHED_COMPILE_S = 0.2  # compiles faster than this are not worth a file


def warmup_batch(index: int, requests: Sequence[tuple[int, int, int]], block_size: int) -> ModelBatch:
    """Warm-up batch ``index``: per request (tokens, start position, positions its block table covers), every
    token 1, every block the reserved padding block 0 (warm-up writes nothing that matters), sampled greedily."""
    return ModelBatch(WARMUP_STEP_BASE + index, tuple(
        ScheduledRequest(f"w{i}", (1,) * n, start, (0,) * math.ceil(end / block_size), SamplingParams(temperature=0))
        for i, (n, start, end) in enumerate(requests)))


def default_compilation_cache_dir() -> str:
    """Where JAX's persistent compilation cache goes unless told otherwise: ~/.cache/pipejax/jax-compilation."""
    return os.path.join(os.path.expanduser("~"), ".cache", "pipejax", "jax-compilation")


def compilation_cache_dir(setting: str | None) -> str | None:
    """The cache folder a setting names (the flag, the keyword or ``$PIPEJAX_COMPILATION_CACHE_DIR``): None
    (not set) gives the default, "" turns the cache off (None), anything else is the folder."""
    if setting is None:
        return default_compilation_cache_dir()
    return setting or None


def compilation_cache_dir_from_env(environ: Mapping[str, str]) -> str | None:
    """``compilation_cache_dir`` of ``$PIPEJAX_COMPILATION_CACHE_DIR`` in ``environ``. The worker reads no
    environment: the edges (the engine's ``engine_config``, the vLLM platform) pass theirs and hand the result
    down in ``WorkerConfig.compilation_cache_dir``."""
    return compilation_cache_dir(environ.get(CACHE_DIR_ENV))


def enable_compilation_cache(path: str) -> None:
    """JAX's persistent compilation cache (process-wide): a restart reuses the step programs the
    last start compiled for the same model, layout and buckets instead of compiling them again."""
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_CACHED_COMPILE_S)


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """Everything a stage worker needs; the same for every stage but ``stage``."""

    model: ModelSource  # a bare path is taken as ModelSource(path)
    stage: StageConfig
    tp_size: int
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()  # batching limits (the engine resolves max_model_len)
    receive_timeout_s: float = DEFAULT_RECEIVE_TIMEOUT_S
    # JAX's persistent compilation cache of this process (None: none)
    compilation_cache_dir: str | None = dataclasses.field(default_factory=default_compilation_cache_dir)
    step_trace_len: int = 0  # keep (pp_rank, step_id, start, end) of the last N steps (0: trace nothing)
    # how a CPU kernel numba has not built yet is waited for (runner.cpu.select.KERNEL_BUILDS; the engines
    # and the vLLM platform pass "background")
    cpu_kernel_build: str = "wait"
    # the dense kernel's tiles on CPU (runner.cpu.select.DENSE_TILES: "auto" measures; "amx" splits each weight at
    # every call rather than keeping its AMX tiles, 1.5x its bytes more; "vector" never uses AMX)
    cpu_dense_tiles: str = "auto"
    # Benchmarks of the schedule: each step of this stage takes at least this long, the part its real work leaves
    # spent asleep (no core used), as a step on a device of its own is waited for. 0: off (serving).
    simulated_step_s: float = 0.0

    def __post_init__(self):
        if isinstance(self.model, str):
            object.__setattr__(self, "model", ModelSource(self.model))


@dataclasses.dataclass(frozen=True)
class StageInfo:
    """Where a stage runs, for logs and the CLI."""

    pp_rank: int
    layers: tuple[int, int]
    devices: tuple[str, ...]
    host: str
    pid: int


class StageWorker:
    def __init__(
        self,
        config: WorkerConfig,
        devices: Sequence[jax.Device] | None = None,
        recv: ActivationTransport | None = None,
        send: ActivationTransport | None = None,
    ):
        """``devices``: the stage's TP devices (default: the first ``tp_size`` of this process).
        ``recv``/``send``: transports to the previous/next stage (None on the first/last)."""
        created = time.time()
        self._compile_base = compile_stats.current()
        self.config = config
        self.stage = config.stage
        if config.compilation_cache_dir:
            enable_compilation_cache(config.compilation_cache_dir)
        devices = list(devices if devices is not None else jax.local_devices()[: config.tp_size])
        if len(devices) != config.tp_size:
            listing = ", ".join(str(d) for d in jax.local_devices())
            raise ValueError(
                f"stage {self.stage.pp_rank} needs tp_size={config.tp_size} devices but got {len(devices)}; "
                f"this process has: {listing}"
            )
        self.devices = devices
        self.mesh = stage_mesh(devices)
        self.recv, self.send = recv, send
        self.model_config = config.model.model_config()
        self.limits = config.scheduler.for_model(self.model_config)
        self.runner: StageRunner | None = None
        # (pp_rank, step_id, start, end) of the last ``step_trace_len`` steps: bounded, off by default
        self.trace: deque[tuple[int, int, float, float]] = deque(maxlen=config.step_trace_len)
        self.bytes_sent = 0  # activation bytes sent to the next stage
        self.finished_step = -1  # the newest engine step (not a warm-up) this stage finished
        self.deferred: tuple | None = None  # (batch, logits, rows) of a step whose sampling waits (vLLM)
        # wall-clock (start, end) of each set-up phase that ran: "init", "kernels", "load", "warmup"
        self.setup_times: dict[str, tuple[float, float]] = {"init": (created, time.time())}

    # --- set-up, in the order an executor calls it ------------------------------------------

    def kv_cache_plan(self, stages_on_host: int = 1) -> KVCachePlan:
        """How many KV blocks this stage could hold, and why (``kv_sizing.plan_kv_cache`` on this process's
        memory). ``stages_on_host``: this engine's stages on this host, which share its RAM on CPU (with the
        stages of the ``cache.engines_on_host`` engines there)."""
        stats = self.devices[0].memory_stats() or {}
        device_free = stats["bytes_limit"] - stats.get("bytes_in_use", 0) if "bytes_limit" in stats else None
        return plan_kv_cache(
            self.config.cache,
            device_bytes_per_block=self.kv_bytes_per_block(),
            tp_size=self.config.tp_size,
            max_num_seqs=self.limits.max_num_seqs,
            max_model_len=self.limits.max_model_len,
            device_free_bytes=device_free,
            host_available_bytes=psutil.virtual_memory().available,
            stages_on_host=stages_on_host,
        )

    def available_kv_blocks(self, stages_on_host: int = 1) -> int:
        """The block count of ``kv_cache_plan``."""
        return self.kv_cache_plan(stages_on_host).num_blocks

    def load(self, num_blocks: int | None) -> None:
        """Load the stage's weights and allocate ``num_blocks`` KV blocks (the same on every stage);
        ``None`` loads only the weights (``allocate_kv_cache`` follows, sized with them in memory)."""
        cache = dataclasses.replace(self.config.cache, num_blocks=num_blocks)
        start = time.perf_counter()
        self.runner = StageRunner(
            self.config.model.path, self.mesh, self.stage, cache, self.model_config, self.config.model.seed,
            self.config.model.impl, scheduler=self.limits, kernel_build=self.config.cpu_kernel_build,
            dense_tiles=self.config.cpu_dense_tiles,
        )
        # the kernel choice (measured on a host's first start, remembered after) apart from the weights
        self.setup_times["kernels"] = self.runner.selection_span
        self.setup_times["load"] = (self.runner.selection_span[1], time.time())
        log.info("stage %d loaded in %.1fs (%s KV blocks)", self.stage.pp_rank, time.perf_counter() - start, num_blocks)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._require_runner().allocate_kv_cache(num_blocks)

    def kv_bytes_per_block(self) -> int:
        """Bytes one KV block (all the stage's layers, K and V) takes on each of the stage's devices."""
        return kv_bytes_per_block(self.model_config, self.stage, self.config.tp_size, self.config.cache.block_size)

    def warmup_batches(self, max_shapes: int = 16) -> list[ModelBatch]:
        """Dummy batches covering the common buckets: decode at every row bucket, prefill at every token bucket."""
        runner = self._require_runner()
        buckets, bs = runner.buckets, runner.block_size
        out = [warmup_batch(i, [(1, 0, 1)] * rows, bs) for i, rows in enumerate(buckets.rows)]
        for tokens in buckets.tokens:
            n = min(tokens, runner.max_model_len)
            out.append(warmup_batch(len(out), [(n, 0, n)], bs))
        return out[:max_shapes]

    def warmup(self, batches: Sequence[ModelBatch], progress: bool = True) -> float:
        """Compile ``batches``' shapes by running them."""
        start, started = time.perf_counter(), time.time()
        for batch in tqdm(batches, desc=f"compile stage {self.stage.pp_rank}", disable=not progress, leave=False):
            self.execute_model(batch)
        first = self.setup_times.get("warmup", (started,))[0]  # an executor may warm up one shape per call
        self.setup_times["warmup"] = (first, time.time())
        return time.perf_counter() - start

    # --- the step -------------------------------------------------------------------------------

    def execute_model(self, batch: ModelBatch, defer_sampling: bool = False) -> SamplerOutput | None:
        """One step of ``batch`` on this stage: the last stage's sampled tokens (None elsewhere). ``defer_sampling``
        (last stage): keep the step's logits for ``sample_deferred``, as vLLM's runner does while its scheduler
        computes the structured outputs' token bitmasks."""
        runner = self._require_runner()
        hidden, shape = None, runner.step_shape(batch)
        if not self.stage.is_first:
            assert self.recv is not None, "a non-first stage needs a receive transport"
            hidden = self.recv.receive(batch.step_id, runner.intermediate_spec(batch, shape),
                                       self.config.receive_timeout_s)
        start = time.perf_counter()  # the stage's own step: from its inputs in hand to its output sent
        if defer_sampling and self.stage.is_last:
            logits, shape = runner.forward_batch(batch, hidden, shape)
            self.deferred = (batch, logits, shape.rows)
            out = None
        else:
            out = runner.execute(batch, hidden, shape)
        if self.config.simulated_step_s:
            _hold_until(start + self.config.simulated_step_s, out)
        elif self.config.step_trace_len and not self.stage.is_last:
            jax.block_until_ready(out)  # traced: the step ends when its output exists, not once it is dispatched
        if not self.stage.is_last:
            assert self.send is not None, "a non-last stage needs a send transport"
            self.send.send(batch.step_id, out)
            self.bytes_sent += sum(int(v.nbytes) for v in out.values())
            out = None
        if batch.step_id < WARMUP_STEP_BASE:
            self.finished_step = max(self.finished_step, batch.step_id)
            if self.config.step_trace_len:
                self.trace.append((self.stage.pp_rank, batch.step_id, start, time.perf_counter()))
        return out

    def prefetch(self, batch: ModelBatch) -> None:
        """While an earlier step runs (another thread): start pulling ``batch``'s activations from the previous
        stage, so its step does not wait a round trip for data published while this stage was busy. A batch the
        step will refuse (beyond ``max_model_len``) is left to the step to report."""
        if self.recv is None or self.runner is None:
            return
        try:
            shape = self.runner.step_shape(batch)
        except ValueError:
            return
        self.recv.prefetch(batch.step_id, self.runner.intermediate_spec(batch, shape))

    def sample_deferred(self, bitmasks: Mapping[str, np.ndarray] | None = None) -> SamplerOutput:
        """The tokens of the step ``execute_model(..., defer_sampling=True)`` kept, each structured output's
        request limited to its ``bitmasks`` entry."""
        assert self.deferred is not None, "sample_deferred needs a step run with defer_sampling=True"
        (batch, logits, rows), self.deferred = self.deferred, None
        return self._require_runner().sample(batch, logits, rows, bitmasks)

    def close(self) -> None:
        """Close this stage's transports (idempotent): an executor's shutdown."""
        for transport in (self.recv, self.send):
            if transport is not None:
                transport.close()

    # --- introspection (what an executor's collective_rpc reads) ----------------------------------

    def step_trace(self) -> list[tuple[int, int, float, float]]:
        """(pp_rank, step_id, start, end) of the traced steps (warm-up steps are not traced): from the stage's inputs
        in hand (after a non-first stage's receive) to its output sent, on this process's ``time.perf_counter``."""
        return list(self.trace)

    def activation_bytes_sent(self) -> int:
        return self.bytes_sent

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks ``src -> dst`` (a host's copy-on-write of a shared prefix block)."""
        self._require_runner().copy_blocks(pairs)

    def num_compiled_shapes(self) -> int:
        """Step shapes this stage has compiled so far (warm-up included)."""
        return len(self._require_runner().compiled_shapes)

    def setup_timings(self) -> dict[str, tuple[float, float]]:
        return dict(self.setup_times)

    def kernel_selection(self) -> dict[str, str | None]:
        """Which formulation this stage runs per kernel ("cpu-kernel" or "xla"), its decode layers and few-row
        dots: what ``runner.cpu.select`` chose here (measured where asked "auto")."""
        sel = self._require_runner().selection
        return {f.name: getattr(sel, f.name) for f in dataclasses.fields(sel) if f.name != "measured"}

    def compile_stats(self) -> CompileStats:
        """The XLA programs this stage's process has built since the worker was created, and how many came from
        the persistent compilation cache."""
        return compile_stats.current() - self._compile_base

    def info(self) -> StageInfo:
        r = self.stage.layer_range(self.model_config)
        return StageInfo(
            pp_rank=self.stage.pp_rank,
            layers=(r.start, r.stop),
            devices=tuple(f"{d.platform}:{d.id}" for d in self.devices),
            host=socket.gethostname(),
            pid=os.getpid(),
        )

    def _require_runner(self) -> StageRunner:
        if self.runner is None:
            raise RuntimeError(f"stage {self.stage.pp_rank}: call load(num_blocks) before executing")
        return self.runner


def _hold_until(deadline: float, out) -> None:
    """A simulated step (``WorkerConfig.simulated_step_s``): the real work done, sleep out the rest of its time."""
    if out is not None:
        jax.block_until_ready(out)
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)
