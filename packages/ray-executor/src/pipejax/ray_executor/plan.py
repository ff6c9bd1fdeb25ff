"""``pipejax plan``: every valid pp x tp x dp layout of a model on some hosts, each with its predicted stage step
times, bubble, KV blocks, throughput and latency, ranked; and the command that serves the best one.

A model from FLOPs and bytes, not a measurement. Each stage's decode step is a roofline: the larger of its
arithmetic at the device's peak rate and its memory traffic (its weights once, plus the KV its rows read) at the
device's bandwidth, plus two all-reduces per layer where tp > 1 and a fixed cost per step (dispatch, the
activation's hop). Layers are split by ``balanced_partition`` over the model's modelled part costs
(``ModelConfig.part_costs``), within each stage's memory. With ``k`` batches in flight (at most pp, at most the
rows an engine runs) a round of k steps takes ``max(k x slowest stage, one batch's trip through every stage)``;
the stages are busy for ``k x sum(stage times) / pp`` of it, and the rest is the bubble. Throughput is output
tokens over a wave of requests: each engine's rows' prompts prefilled, then their outputs decoded.

Where the devices come from: a TPU generation's published per-chip figures (``TpuGeneration``), or, for the
CPU's simulated devices, this host measured (a resident matmul and a resident read), shared by the devices
a layout uses on it. Either can be overridden (``--device-memory-gib``, ``--device-tflops``,
``--device-bandwidth-gbs``) to plan for hosts not at hand.

Measured instead of modelled (``--measure``, this host's CPU devices): the model's own parts timed here
(``MeasuredParts``: a layer of each kind, the embedding, the head and sampler, a stage's fixed cost, at the batch
sizes the layouts run, and in a prefill step; ``runner.part_profile``) give each stage's step times and the split;
stages that share the host's cores slow each other by the cores they want together (the cores a step keeps busy,
measured) over the cores there are.

Memory: a stage holds its weights and the KV its rows need at ``max_model_len`` (the engine's own sizing rule),
within what the weights leave. Measured (``--measure``), also its compiled programs and temporaries, and each
process that holds stages its runtime (``MeasuredParts.memory``: ``worker.memory_probe``'s fresh-process probes).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import time

from pipejax.platform_tpu.hardware import Hardware
from pipejax.platform_tpu.layout import LayoutError, check_layout
from pipejax.pp_utils.balance import PartCosts, balanced_partition
from pipejax.pp_utils.config import ParallelConfig
from pipejax.runner.config import ModelConfig, SchedulerConfig

GIB = 2**30
# Assumed, not measured (no TPU at hand): one all-reduce of a decode step's rows, latency-bound; a stage step's
# dispatch and activation hop on TPU hosts.
COLLECTIVE_S = 10e-6
TPU_STEP_OVERHEAD_S = 0.5e-3
# A stage step's fixed cost on a CPU host: assumed. BENCHMARKS.md's Ray step (pp1 tp1, batch 32 decode) is 59.9 ms
# against the in-process executor's 55.7, ~4 ms more; plan_check's in-process runs pay less than that.
CPU_STEP_OVERHEAD_S = 2e-3
MAX_HOSTS_TRIED = 4096  # when nothing fits: the smallest number of such hosts that would
# A Ray actor's own memory beyond a plain process's, measured here: 245 MiB RSS after importing JAX and pipejax
# and starting the CPU backend in an actor, 186 MiB in a plain process.
RAY_ACTOR_BYTES = 59 * 2**20
USABLE_MEMORY = 0.9  # of a stage's memory, for weights and KV together (the rest: XLA's workspace, activations)
BLOCK_SIZE = 16
PREFILL_CHUNK_TOKENS = SchedulerConfig.max_num_batched_tokens  # a prefill step's tokens: `pipejax serve`'s budget


@dataclasses.dataclass(frozen=True)
class Workload:
    """What the layout must serve: ``concurrency`` requests at once over all engines, each of ``prompt_len``
    tokens in and ``output_len`` out, none longer than ``max_model_len``."""

    max_model_len: int
    concurrency: int = 64
    prompt_len: int = 512
    output_len: int = 128

    def __post_init__(self):
        for name in ("max_model_len", "concurrency", "prompt_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.prompt_len + self.output_len > self.max_model_len:
            raise ValueError(f"prompt_len + output_len = {self.prompt_len + self.output_len} exceeds max_model_len="
                             f"{self.max_model_len}; raise --max-model-len or shorten the workload")


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One device: its memory, peak rate and bandwidth. ``shared_host``: the devices of a host share one pool of
    cores, bandwidth and RAM (simulated CPU devices): a layout's stages on a host split the host's rates by the
    devices they use, and the memory figures are the host's."""

    memory_bytes: float
    flops: float
    bandwidth: float
    source: str
    shared_host: bool = False
    step_overhead_s: float = TPU_STEP_OVERHEAD_S
    parts: MeasuredParts | None = None  # the model's parts measured on these devices: stage times from them


@dataclasses.dataclass(frozen=True)
class LayoutPrediction:
    pp: int
    tp: int
    dp: int
    partition: tuple[int, ...]
    stage_time_s: tuple[float, ...]  # one decode step of one batch in flight, per stage
    stage_weight_bytes: tuple[float, ...]  # the stage's weights over all its devices
    kv_blocks: int  # per stage: what ``rows`` requests of max_model_len need, within the fullest stage's room
    rows: int  # requests an engine runs at once (its share of the concurrency, as its KV allows)
    in_flight: int  # batches in flight per engine
    bubble: float  # share of stage time idle
    throughput: float  # output tokens/s, every engine together
    tpot_s: float  # time per output token of one request
    ttft_s: float  # the prompt's prefill through every stage, alone
    backend: str
    # per stage: its weights, its KV and (measured) its programs' and temporaries' memory
    stage_memory_bytes: tuple[float, ...] = ()
    # measured: each process of an engine that holds stages ('uni': one, 'ray': one per stage), its runtime and
    # its stages' memory
    process_memory_bytes: tuple[float, ...] = ()

    @property
    def devices(self) -> int:
        return self.pp * self.tp * self.dp


def tpu_device(hw: Hardware) -> DeviceSpec:
    """A TPU device (a chip's TensorCore as JAX shows it) from the generation's published figures."""
    from pipejax.platform_tpu.hardware import generation

    gen = generation(hw.generation or "v5e")
    cores = gen.cores_per_chip
    return DeviceSpec(memory_bytes=gen.hbm_gb * 1e9 / cores, flops=gen.bf16_tflops * 1e12 / cores,
                      bandwidth=gen.hbm_gb_s * 1e9 / cores,
                      source=f"TPU {gen.name}, published per-chip figures ({gen.hbm_gb:g} GB HBM, "
                             f"{gen.bf16_tflops:g} bf16 TFLOP/s, {gen.hbm_gb_s:g} GB/s)")


class MeasuredParts:
    """The model's parts timed on this host's devices (``runner.part_profile.profile_parts``), once per tp, at
    the batch sizes a workload of ``concurrency`` requests runs (1, a quarter, a half and all of them), each
    request with ``context`` tokens cached; ``cores``: the host's. ``memory(tp)``: a stage process's memory beyond
    its weights and KV, measured in fresh processes (``worker.memory_probe``) for ``concurrency`` requests of
    ``max_model_len`` tokens."""

    def __init__(self, path: str, model: ModelConfig, concurrency: int, context: int, prompt_len: int | None = None,
                 repeats: int = 15, max_model_len: int | None = None):
        self.path, self.model, self.context, self.prompt_len, self.repeats = path, model, context, prompt_len, repeats
        self.concurrency, self.max_model_len = concurrency, max_model_len or 2 * context
        self.rows = sorted({1, max(1, concurrency // 4), max(1, concurrency // 2), concurrency})
        self.cores = len(os.sched_getaffinity(0))
        self._by_tp: dict = {}
        self._memory: dict = {}

    def __call__(self, tp: int):
        if tp not in self._by_tp:
            from pipejax.runner.part_profile import profile_parts

            self._by_tp[tp] = profile_parts(self.path, self.model, tp, self.rows, self.context, self.repeats,
                                            prompt_len=self.prompt_len)
        return self._by_tp[tp]

    def memory(self, tp: int):
        if tp not in self._memory:
            from pipejax.worker.memory_probe import measure_stage_memory

            self._memory[tp] = measure_stage_memory(self.path, tp, self.concurrency, self.max_model_len,
                                                    PREFILL_CHUNK_TOKENS)
        return self._memory[tp]


def measure_cpu_host(seconds: float = 0.3) -> DeviceSpec:
    """This host, measured: fp32 matmul rate (1024^3, resident operands) and read bandwidth (a resident 256 MiB
    array summed), each the best of repeated runs after a warm-up; its available RAM. Shared by its devices."""
    import jax
    import jax.numpy as jnp

    def best(fn, *args) -> float:
        fn(*args).block_until_ready()
        times, end = [], time.monotonic() + seconds
        while time.monotonic() < end or len(times) < 3:
            t = time.perf_counter()
            fn(*args).block_until_ready()
            times.append(time.perf_counter() - t)
        return min(times)

    n = 1024
    a = jnp.ones((n, n), jnp.float32) + 0  # materialised before timing
    flops = 2 * n**3 / best(jax.jit(jnp.matmul), a, a)
    big = jnp.ones((64, 1 << 20), jnp.float32) + 0
    bandwidth = big.nbytes / best(jax.jit(jnp.sum), big)
    memory = _available_ram()
    return DeviceSpec(memory_bytes=memory, flops=flops, bandwidth=bandwidth, shared_host=True,
                      step_overhead_s=CPU_STEP_OVERHEAD_S,
                      source=f"this host, measured: {flops / 1e9:.0f} fp32 GFLOP/s, {bandwidth / 1e9:.1f} GB/s read, "
                             f"{memory / GIB:.1f} GiB RAM available")


def hosts_from_ray(nodes: list[dict], device_resource: str) -> tuple[Hardware, float | None]:
    """The hosts a live Ray cluster offers (``ray.nodes()``): its TPU nodes (chips and generation as Ray lists
    them), else its nodes declaring ``device_resource`` (simulated CPU devices), with the smallest node's memory
    on CPU (None on TPU: HBM comes from the generation). Hosts are taken as identical: the smallest one counts."""
    from pipejax.platform_tpu.platform import TpuPlatform

    alive = [n for n in nodes if n.get("Alive")]
    tpus = [h for h in (TpuPlatform.ray_node_hardware(n["Resources"]) for n in alive) if h is not None]
    if tpus:
        return dataclasses.replace(min(tpus, key=lambda h: h.chips_per_host), num_hosts=len(tpus)), None
    cpus = [n for n in alive if n["Resources"].get(device_resource, 0) >= 1]
    if not cpus:
        raise ValueError(f"the Ray cluster lists no node with TPU chips or '{device_resource}' devices "
                         f"({len(alive)} alive); start its nodes with `ray start --resources "
                         f"'{{\"{device_resource}\": 8}}'` (CPU) or on TPU hosts, or give --hosts instead")
    devices = min(int(n["Resources"][device_resource]) for n in cpus)
    memory = min(float(n["Resources"].get("memory", 0)) for n in cpus) or None
    return Hardware("cpu", num_hosts=len(cpus), chips_per_host=devices), memory


def _available_ram() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def plan(model: ModelConfig, hw: Hardware, device: DeviceSpec, work: Workload,
         memory_fraction: float = USABLE_MEMORY) -> list[LayoutPrediction]:
    """Every layout of ``model`` that fits ``hw``, best first (output tokens/s, then time per token).
    ``memory_fraction``: the share of a stage's memory that weights and KV may take together. Raises
    ``ValueError`` naming the smallest resources that would fit where no layout does."""
    if work.max_model_len > model.max_position_embeddings:
        raise ValueError(f"max_model_len={work.max_model_len} exceeds the model's {model.max_position_embeddings} "
                         f"positions; use --max-model-len <= {model.max_position_embeddings}")
    found, reasons = [], []
    for pp, tp, dp, backend in _candidates(model, hw, reasons):
        try:
            found.append(_predict(model, hw, device, work, pp, tp, dp, backend, memory_fraction))
        except ValueError as exc:
            reasons.append(f"pp={pp} tp={tp} dp={dp}: {exc}")
    if not found:
        raise ValueError(_nothing_fits(model, hw, device, work, memory_fraction, reasons))
    return sorted(found, key=lambda p: (-p.throughput, p.tpot_s, p.devices))


def predict(model: ModelConfig, hw: Hardware, device: DeviceSpec, work: Workload, pp: int, tp: int, dp: int = 1,
            memory_fraction: float = USABLE_MEMORY, backend: str | None = None) -> LayoutPrediction:
    """The prediction for one layout (checked as ``plan`` checks it; a ``ValueError`` or ``LayoutError`` where it
    does not fit); ``backend``: the executor it runs on (None: as the platform chooses)."""
    from pipejax.runner.model import kv_heads_for_tp

    kv_heads_for_tp(model, tp)
    checked = check_layout(ParallelConfig(pipeline_parallel_size=pp, tensor_parallel_size=tp, data_parallel_size=dp,
                                          distributed_executor_backend=backend), hw)
    return _predict(model, hw, device, work, pp, tp, dp, checked.distributed_executor_backend, memory_fraction)


def _candidates(model: ModelConfig, hw: Hardware, reasons: list[str]):
    from pipejax.runner.model import kv_heads_for_tp

    for tp in range(1, hw.devices_per_host + 1):
        try:
            kv_heads_for_tp(model, tp)
        except ValueError as exc:
            reasons.append(str(exc))
            continue
        for pp in range(1, min(model.num_layers, hw.total_devices // tp) + 1):
            for dp in range(1, hw.total_devices // (pp * tp) + 1):
                try:
                    checked = check_layout(ParallelConfig(pipeline_parallel_size=pp, tensor_parallel_size=tp,
                                                          data_parallel_size=dp), hw)
                except LayoutError:
                    break  # a larger dp fits no better
                yield pp, tp, dp, checked.distributed_executor_backend


def _predict(model: ModelConfig, hw: Hardware, device: DeviceSpec, work: Workload, pp: int, tp: int, dp: int,
             backend: str, memory_fraction: float) -> LayoutPrediction:
    costs = model.part_costs()
    share = _host_share(hw, device, pp, tp, dp)  # of one device's figures a stage's device gets
    stage_memory = device.memory_bytes * tp * (share if device.shared_host else 1.0) * memory_fraction
    kv_token_layer = _kv_bytes_per_token(model, tp) / model.num_layers
    # room beside the weights for one longest request's KV, on a stage of an even share of the layers
    limit = stage_memory - kv_token_layer * work.max_model_len * math.ceil(model.num_layers / pp)
    partition = balanced_partition(costs, pp, max(limit, 0.0))
    bounds = [sum(partition[:r]) for r in range(pp + 1)]
    weights = tuple(costs.stage_bytes(bounds[r], bounds[r + 1], pp, r) for r in range(pp))
    kv_room = min((stage_memory - weights[r]) / (kv_token_layer * partition[r]) for r in range(pp))  # tokens
    kv_blocks = int(kv_room // BLOCK_SIZE)
    context = work.prompt_len + work.output_len
    blocks_per_request = math.ceil(context / BLOCK_SIZE)
    wanted = math.ceil(work.concurrency / dp)
    rows = min(wanted, kv_blocks // blocks_per_request)
    if rows < 1:
        raise ValueError(f"no room for one request's KV ({context} tokens) beside the weights")
    in_flight = min(pp, rows)
    batch = math.ceil(rows / in_flight)
    mean_context = work.prompt_len + work.output_len / 2
    flops, bandwidth = device.flops * tp * share, device.bandwidth * tp * share
    if device.parts is not None:  # measured: split by the parts' times at this batch, then size the KV again
        part = device.parts(tp).at(batch)
        measured = dataclasses.replace(costs, layer_time=part.layer_s, first_time=part.first_s,
                                       last_time=part.last_s)
        partition = balanced_partition(measured, pp, max(limit, 0.0))
        bounds = [sum(partition[:r]) for r in range(pp + 1)]
        weights = tuple(costs.stage_bytes(bounds[r], bounds[r + 1], pp, r) for r in range(pp))
        kv_blocks = int(min((stage_memory - weights[r]) / (kv_token_layer * partition[r]) for r in range(pp))
                        // BLOCK_SIZE)
        rows = min(rows, kv_blocks // blocks_per_request)
        if rows < 1:
            raise ValueError(f"no room for one request's KV ({context} tokens) beside the weights")
        in_flight = min(pp, rows)
        part = device.parts(tp).at(math.ceil(rows / in_flight))
        # the cores a stage's step keeps busy: its parts' CPU time over their time (its layers keep more busy than
        # a one-layer stage's fixed cost), the mean over the stages
        cores = statistics.mean(part.stage_cores(bounds[r], bounds[r + 1], pp, r) for r in range(pp))
        slowdown = _shared_cores_slowdown(hw, device, cores, min(in_flight, pp) * dp)
        times = tuple(part.stage_s(bounds[r], bounds[r + 1], pp, r) * slowdown for r in range(pp))
        measured_prefill = device.parts(tp).prefill
    else:
        times = tuple(_stage_step(costs, model, bounds[r], bounds[r + 1], pp, r, tp, batch, mean_context, flops,
                                  bandwidth, device.step_overhead_s) for r in range(pp))
        measured_prefill = None
    # the cache allocated: what the rows need at max_model_len (as the engine sizes it), within the room there is
    kv_blocks = min(kv_blocks, 1 + rows * math.ceil(work.max_model_len / BLOCK_SIZE))
    memory = device.parts.memory(tp) if device.parts is not None else None
    stage_memory = tuple(weights[r] + kv_blocks * BLOCK_SIZE * kv_token_layer * partition[r]
                         + (memory.stage_bytes(pp, r, partition[r]) if memory else 0.0) for r in range(pp))
    process_memory: tuple[float, ...] = ()
    if memory is not None:  # 'uni': one process holds every stage; 'ray': a Ray actor per stage
        process_memory = ((memory.process_bytes + sum(stage_memory),) if backend == "uni"
                          else tuple(memory.process_bytes + RAY_ACTOR_BYTES + m for m in stage_memory))
    rnd = max(in_flight * max(times), sum(times))  # k batches' steps, or one batch's trip through every stage
    bubble = 1 - in_flight * sum(times) / (pp * rnd)
    # a wave of requests: every engine's prompts prefilled in steps of ``chunk`` tokens, k of them in flight over the
    # stages as decode steps are, then their outputs decoded
    served = min(work.concurrency, dp * rows)
    prompt_tokens = math.ceil(served / dp) * work.prompt_len  # one engine's
    if measured_prefill is not None:  # a step of ``rows`` tokens, measured; taken as linear in tokens
        chunk = measured_prefill.rows
        chunk_times = [measured_prefill.stage_s(bounds[r], bounds[r + 1], pp, r) * slowdown for r in range(pp)]
        ttft = sum(chunk_times) / chunk * work.prompt_len
    else:
        def prefill_s(tokens: int, r: int) -> float:
            return max(2 * _stage_params(costs, bounds[r], bounds[r + 1], pp, r) * tokens / flops,
                       (weights[r] - (costs.first_bytes if r == 0 else 0.0)) / bandwidth) + device.step_overhead_s

        chunk = PREFILL_CHUNK_TOKENS
        chunk_times = [prefill_s(chunk, r) for r in range(pp)]
        ttft = sum(prefill_s(work.prompt_len, r) for r in range(pp))
    wave = _prefill_wave(chunk_times, chunk, prompt_tokens) + work.output_len * rnd
    return LayoutPrediction(pp, tp, dp, partition, times, weights, kv_blocks, rows, in_flight, bubble,
                            throughput=served * work.output_len / wave, tpot_s=rnd, ttft_s=ttft, backend=backend,
                            stage_memory_bytes=stage_memory, process_memory_bytes=process_memory)


def _shared_cores_slowdown(hw: Hardware, device: DeviceSpec, busy_cores: float, busy_stages: int) -> float:
    """How much slower a measured stage step runs when ``busy_stages`` stages (over every engine) step at once,
    spread over the hosts: each wants the cores its step kept busy when measured alone, and beyond a shared host's
    cores they slow each other."""
    if not device.shared_host:
        return 1.0
    wanted = min(busy_cores, device.parts.cores)  # a step's measured CPU time over its wall time, at most the host's
    return max(1.0, math.ceil(busy_stages / hw.num_hosts) * wanted / device.parts.cores)


def _prefill_wave(chunk_times: list[float], chunk: int, prompt_tokens: int) -> float:
    """Seconds to prefill ``prompt_tokens`` in steps of ``chunk`` tokens taking ``chunk_times`` on the stages, up
    to one step per stage in flight (as decode steps are)."""
    steps = math.ceil(prompt_tokens / chunk)
    k = min(len(chunk_times), steps)
    return steps / k * max(k * max(chunk_times), sum(chunk_times))


def _host_share(hw: Hardware, device: DeviceSpec, pp: int, tp: int, dp: int) -> float:
    """On a shared host, how many devices' worth of its rates one stage device gets: the host's rates split over
    the devices the layout uses on it (all of them: a layout of 2 devices on an 8-device host gets 4x each)."""
    if not device.shared_host:
        return 1.0
    used = min(pp * tp * dp, hw.devices_per_host) if hw.num_hosts == 1 else min(
        hw.devices_per_host, math.ceil(pp * tp * dp / hw.num_hosts))
    return 1.0 / used


def _kv_bytes_per_token(model: ModelConfig, tp: int = 1) -> float:
    """K and V of one token over every layer and every device of a stage (KV heads repeat where tp exceeds
    them)."""
    size = 2 if model.dtype == "bfloat16" else 4
    return 2 * model.num_layers * max(model.num_kv_heads, tp) * model.head_dim * size


def _stage_params(costs: PartCosts, start: int, stop: int, pp: int, rank: int) -> float:
    return costs.stage_time(start, stop, pp, rank)  # the modelled time is the parameters a step multiplies by


def _stage_step(costs: PartCosts, model: ModelConfig, start: int, stop: int, pp: int, rank: int, tp: int,
                rows: int, context: float, flops: float, bandwidth: float, overhead: float) -> float:
    layers = stop - start
    params = _stage_params(costs, start, stop, pp, rank)
    attention = 4 * rows * context * model.num_heads * model.head_dim * layers
    kv_read = rows * context * _kv_bytes_per_token(model, tp) / model.num_layers * layers
    compute = (2 * params * rows + attention) / flops
    lookup = costs.first_bytes if rank == 0 else 0.0  # the embedding is a lookup: a step reads rows of it
    memory = (costs.stage_bytes(start, stop, pp, rank) - lookup + kv_read) / bandwidth
    collectives = 2 * layers * COLLECTIVE_S if tp > 1 else 0.0
    return max(compute, memory) + collectives + overhead


def _nothing_fits(model: ModelConfig, hw: Hardware, device: DeviceSpec, work: Workload, memory_fraction: float,
                  reasons: list[str]) -> str:
    if reasons and all("tensor_parallel_size" in r and "divide" in r for r in reasons):
        return f"no tensor-parallel size fits {hw.describe()}: {reasons[0]}"
    costs = model.part_costs()
    weights = costs.stage_bytes(0, model.num_layers, 1, 0)
    kv = _kv_bytes_per_token(model) * (work.prompt_len + work.output_len)
    what = (f"{model.num_layers} layers, {weights / GIB:.2f} GiB of weights + {kv / GIB:.2f} GiB of KV for one "
            f"request of {work.prompt_len + work.output_len} tokens")
    hosts = hw.num_hosts * 2
    while hosts <= MAX_HOSTS_TRIED:
        bigger = dataclasses.replace(hw, num_hosts=hosts)
        try:
            best = plan(model, bigger, device, work, memory_fraction)[0]
        except ValueError:
            hosts *= 2
            continue
        low = hosts // 2 + 1
        while low < hosts:  # the fewest hosts between the last that failed and the first that fits
            mid = (low + hosts) // 2
            try:
                best = plan(model, dataclasses.replace(hw, num_hosts=mid), device, work, memory_fraction)[0]
                hosts = mid
            except ValueError:
                low = mid + 1
        return (f"no layout fits {hw.describe()} ({what}); the smallest that would: {hosts} such hosts "
                f"(pp={best.pp} tp={best.tp}), or devices with more memory")
    return f"no layout fits {hw.describe()} ({what}), nor {MAX_HOSTS_TRIED} such hosts: use devices with more memory"


def commands(best: LayoutPrediction, model_arg: str | None, model_path: str, work: Workload,
             quantization: str | None = None) -> dict[str, str]:
    """The exact commands that serve ``best``: pipejax's own server (its KV blocks given: the engine's own sizing
    rule need not be the plan's) and vLLM on pipejax's stages (vLLM sizes the cache itself). ``model_arg``: the
    model as the user named it (None: the default), ``model_path`` the file or folder it resolved to;
    ``quantization``: the weights kept quantized (vLLM takes pipejax's int8 / int4 by the same name)."""
    split = ",".join(map(str, best.partition))
    ray = " --distributed-executor-backend ray" if best.backend == "ray" else ""
    limits = f" --max-model-len {work.max_model_len} --max-num-seqs {best.rows}"
    quantized = f" --quantization {quantization}" if quantization else ""
    pipejax = (f"pipejax serve{f' --model {model_arg}' if model_arg else ''} -pp {best.pp} -tp {best.tp} -dp {best.dp}"
               + (f" --pp-layer-partition {split}" if best.pp > 1 else "") + ray + limits
               + f" --num-kv-blocks {best.kv_blocks}" + quantized)
    vllm = ((f"VLLM_PP_LAYER_PARTITION={split} " if best.pp > 1 else "")
            + f"vllm serve {model_path} --pipeline-parallel-size {best.pp} --tensor-parallel-size {best.tp}"
            + (f" --data-parallel-size {best.dp}" if best.dp > 1 else "") + ray + limits
            + (quantized if quantization != "gguf" else ""))
    return {"pipejax": pipejax, "vllm": vllm}


def table(found: list[LayoutPrediction], top: int) -> str:
    """The ranked layouts: ``stage GiB`` is the largest stage's weights and KV over all its devices (and,
    measured, its programs' memory); ``proc GiB`` (measured only) the largest process an engine holds stages in."""
    shown = found[:top]
    splits = [",".join(map(str, p.partition)) for p in shown]
    stages = ["/".join(f"{t * 1e3:.2f}" for t in p.stage_time_s) for p in shown]
    ws, wt = max(5, *map(len, splits)), max(8, *map(len, stages))
    measured = any(p.process_memory_bytes for p in shown)
    lines = [f"{'rank':>4} {'pp':>3} {'tp':>3} {'dp':>3} {'split':<{ws}} {'stage ms':<{wt}} {'bubble':>6} "
             f"{'KV blk':>7} {'rows':>5} {'tok/s':>9} {'TPOT ms':>8} {'TTFT ms':>8} {'stage GiB':>9}"
             + (f" {'proc GiB':>8}" if measured else "")]
    for i, (p, split, times) in enumerate(zip(shown, splits, stages, strict=True), start=1):
        proc = f" {max(p.process_memory_bytes) / GIB:>8.2f}" if p.process_memory_bytes else ""
        lines.append(f"{i:>4} {p.pp:>3} {p.tp:>3} {p.dp:>3} {split:<{ws}} {times:<{wt}} {p.bubble:>6.0%} "
                     f"{p.kv_blocks:>7} {p.rows:>5} {p.throughput:>9.1f} {p.tpot_s * 1e3:>8.2f} "
                     f"{p.ttft_s * 1e3:>8.1f} {max(p.stage_memory_bytes) / GIB:>9.2f}" + proc)
    return "\n".join(lines)


def to_json(found: list[LayoutPrediction], device: DeviceSpec, hw: Hardware, work: Workload,
            best_commands: dict[str, str]) -> str:
    return json.dumps({
        "hardware": hw.describe(), "device": device.source, "workload": dataclasses.asdict(work),
        "layouts": [{**dataclasses.asdict(p), "devices": p.devices} for p in found], "best_commands": best_commands,
    }, indent=2)
