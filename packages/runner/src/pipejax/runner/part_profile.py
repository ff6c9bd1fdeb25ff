"""A model's parts timed on this host's devices: what ``pipejax plan --measure`` predicts a CPU layout's stages
from, where the FLOPs-and-bytes model is only a model.

Stages holding one or two of the model's decoder layers (the real checkpoint's, those layers only) are built on
``tp`` devices, and their decode steps timed at a few batch sizes, each request with ``context`` tokens cached:

- a middle stage of one layer, one per kind of layer (dense, MoE); its time is a layer plus a stage's fixed cost
  per step (inputs to the devices, dispatch);
- the first stage with one layer and with two: their difference is a layer, the rest of the one-layer first stage
  beyond the middle one is the embedding;
- the last stage with one layer: beyond the middle one, the final norm, the LM head and the sampler.

The same stages also time one prefill step of ``prefill_tokens`` (whole prompts of ``prompt_len`` tokens, as many
as fit; the engine's default step budget), split into parts the same way. A step is timed as the worker runs it:
its inputs put on the devices, the jitted forward until its output exists, and on the last stage the sampled
tokens on the host. Each figure is the median of ``repeats`` steps after one untimed. The cores a step keeps
busy (process CPU time over wall time) are kept too, and the parts' CPU seconds split from them as the times are
(``PartTimes.cpu``): stages that share a host's cores slow each other once together they want more than it has,
and a whole stage's layers want more cores than a one-layer stage's step shows.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from pipejax.pp_utils import stage_mesh
from pipejax.pp_utils.intermediate import IntermediateTensors
from pipejax.runner.batch import ModelBatch, SamplingParams, ScheduledRequest
from pipejax.runner.config import CacheConfig, ModelConfig, SchedulerConfig, StageConfig

BLOCK_SIZE = 16


@dataclasses.dataclass(frozen=True)
class PartTimes:
    """Seconds of one decode step's parts at ``rows`` requests: ``layer_s`` per decoder layer (each layer its
    kind's), ``first_s`` the embedding, ``last_s`` the final norm + LM head + sampler, ``overhead_s`` what every
    stage pays per step; ``busy_cores``: the cores a one-layer stage's step keeps busy on average. ``cpu``: the
    same parts' CPU seconds (the process's, every thread), where measured."""

    rows: int
    layer_s: tuple[float, ...]
    first_s: float
    last_s: float
    overhead_s: float
    busy_cores: float
    cpu: PartTimes | None = None

    def stage_s(self, start: int, stop: int, pp: int, rank: int) -> float:
        return (self.overhead_s + sum(self.layer_s[start:stop]) + (self.first_s if rank == 0 else 0.0)
                + (self.last_s if rank == pp - 1 else 0.0))

    def stage_cores(self, start: int, stop: int, pp: int, rank: int) -> float:
        """The cores a stage's step keeps busy: its parts' CPU seconds over their seconds. A whole stage's layers
        keep more cores busy than a one-layer stage's fixed cost does, so ``busy_cores`` would undercount it."""
        wall = self.stage_s(start, stop, pp, rank)
        if self.cpu is None or wall <= 0:
            return self.busy_cores
        return self.cpu.stage_s(start, stop, pp, rank) / wall


@dataclasses.dataclass(frozen=True)
class PartProfile:
    """``PartTimes`` measured at a few batch sizes on ``tp`` devices with ``context`` tokens cached per request;
    ``at(rows)`` interpolates between them (linearly; beyond the ends, the nearest two extended)."""

    tp: int
    context: int
    measured: tuple[PartTimes, ...]  # by rows, ascending
    source: str
    prefill: PartTimes | None = None  # one prefill step; its ``rows`` are the step's tokens

    def at(self, rows: int) -> PartTimes:
        pts = self.measured
        if len(pts) == 1:
            return pts[0]
        i = next((k for k in range(1, len(pts) - 1) if rows <= pts[k].rows), len(pts) - 1)
        a, b = pts[i - 1], pts[i]
        w = (rows - a.rows) / (b.rows - a.rows)

        return _mix(rows, a, b, w)


def _mix(rows: int, a: PartTimes, b: PartTimes, w: float) -> PartTimes:
    def mix(x: float, y: float) -> float:
        return max(0.0, x + w * (y - x))

    cpu = _mix(rows, a.cpu, b.cpu, w) if a.cpu is not None and b.cpu is not None else None
    return PartTimes(rows, tuple(mix(x, y) for x, y in zip(a.layer_s, b.layer_s, strict=True)),
                     mix(a.first_s, b.first_s), mix(a.last_s, b.last_s), mix(a.overhead_s, b.overhead_s),
                     mix(a.busy_cores, b.busy_cores), cpu)


def layer_kinds(model: ModelConfig) -> tuple[str, ...]:
    return tuple("moe" if model.moe is not None and model.moe.is_sparse(i) else "dense"
                 for i in range(model.num_layers))


def profile_parts(path: str | Path, model: ModelConfig, tp: int, rows: Sequence[int], context: int,
                  repeats: int = 7, devices: Sequence[jax.Device] | None = None, prompt_len: int | None = None,
                  prefill_tokens: int = SchedulerConfig.max_num_batched_tokens, **runner_options) -> PartProfile:
    """The parts of ``model`` (checkpoint at ``path``) timed on ``tp`` of ``devices`` (default: this process's
    JAX devices) at each of ``rows`` requests of ``context`` cached tokens; with ``prompt_len``, also a prefill
    step of whole prompts of that length (``prefill_tokens`` at most). ``runner_options``: ``StageRunner``'s
    kernel choices (default: as the engine chooses them here)."""
    from pipejax.runner.runner import StageRunner

    n = model.num_layers
    if n < 3:
        raise ValueError(f"a model of {n} layers has no middle stage to time a layer in; profile_parts needs >= 3")
    devices = list(devices if devices is not None else jax.devices())
    if len(devices) < tp:
        raise ValueError(f"tp={tp} needs {tp} devices, this process has {len(devices)}; set XLA_FLAGS="
                         f"--xla_force_host_platform_device_count={tp} (CPU) before JAX starts")
    rows = sorted(set(rows))
    mesh = stage_mesh(devices[:tp])
    prompts = max(1, prefill_tokens // prompt_len) if prompt_len else 0
    per_request = math.ceil((max(context, prompt_len or 0) + 1) / BLOCK_SIZE)
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=1 + max(*rows, prompts) * per_request)
    limits = SchedulerConfig(max_model_len=per_request * BLOCK_SIZE, max_num_seqs=max(*rows, prompts),
                             max_num_batched_tokens=max(max(rows), BLOCK_SIZE, prompts * (prompt_len or 0)))
    kinds = layer_kinds(model)

    def stage(first: int, count: int) -> StageConfig:  # the stage holding layers first .. first + count - 1
        before, after = first, n - first - count
        parts = [p for p in (before, count, after) if p]
        return StageConfig(pp_rank=1 if before else 0, pp_size=len(parts), partition=tuple(parts))

    middle = {k: next((i for i in range(1, n - 1) if kinds[i] == k), None) for k in dict.fromkeys(kinds)}
    stages = {"first1": stage(0, 1), "first2": stage(0, 2), "last1": stage(n - 1, 1)}
    stages.update({f"middle-{k}": stage(i, 1) for k, i in middle.items() if i is not None})
    times: dict[str, dict[int, tuple[float, float]]] = {}
    prefill_times: dict[str, tuple[float, float]] = {}
    for name, config in stages.items():
        runner = StageRunner(path, mesh, config, cache, model, scheduler=limits, **runner_options)
        times[name] = {r: _time_steps(runner, _decode_requests(r, context, per_request), repeats) for r in rows}
        if prompts:
            prefill_times[name] = _time_steps(runner, _prefill_requests(prompts, prompt_len, per_request), repeats)
        # every stage runs what the first one chose here ("auto" measures at each start, and may differ)
        chosen = runner.selection
        runner_options = {"dense_matmuls": chosen.dense_matmuls, "decode_attention": chosen.decode_attention,
                          "prefill_attention": chosen.prefill_attention, "decode_layers": chosen.decode_layers,
                          "few_row_dots": runner.few_row_dots or "auto", **runner_options}
        del runner
    measured = tuple(_parts_at(r, {k: v[r] for k, v in times.items()}, kinds, middle, model) for r in rows)
    prefill = _parts_at(prompts * prompt_len, prefill_times, kinds, middle, model) if prompts else None
    cpu = f"{os.cpu_count()} CPUs" if devices[0].platform == "cpu" else devices[0].device_kind
    return PartProfile(tp, context, measured,
                       source=f"this host's {devices[0].platform} devices, measured ({cpu}; tp={tp}, {context} "
                              f"tokens cached, rows {', '.join(map(str, rows))})", prefill=prefill)


def _parts_at(rows: int, t: dict[str, tuple[float, float]], kinds: tuple[str, ...], middle: dict[str, int | None],
              model: ModelConfig) -> PartTimes:
    """The parts from the stages' (step seconds, cores busy) at one batch size (see the module's docstring); their
    CPU seconds split the same way."""
    cpu = _split(rows, {k: (s * cores, 0.0) for k, (s, cores) in t.items()}, kinds, middle, model)
    return dataclasses.replace(_split(rows, t, kinds, middle, model), cpu=cpu)


def _split(rows: int, t: dict[str, tuple[float, float]], kinds: tuple[str, ...], middle: dict[str, int | None],
           model: ModelConfig) -> PartTimes:
    ref = kinds[1]  # layer 1 is in the first two-layer stage and is the reference kind's middle stage
    overhead = max(t[f"middle-{ref}"][0] - max(t["first2"][0] - t["first1"][0], 0.0), 0.0)
    per_kind = {k: max(t[f"middle-{k}"][0] - overhead, 0.0) for k, i in middle.items() if i is not None}
    work = model.part_costs().layer_time  # a kind never in the middle: the modelled ratio to one measured
    for k in kinds:
        if k not in per_kind:
            j, i = kinds.index(k), kinds.index(ref)
            per_kind[k] = per_kind[ref] * work[j] / work[i]
    layer_s = tuple(per_kind[k] for k in kinds)
    return PartTimes(rows, layer_s, first_s=max(t["first1"][0] - overhead - layer_s[0], 0.0),
                     last_s=max(t["last1"][0] - overhead - layer_s[-1], 0.0), overhead_s=overhead,
                     busy_cores=statistics.median(v[1] for v in t.values()))


def _decode_requests(rows: int, context: int, per_request: int) -> tuple[ScheduledRequest, ...]:
    sampling = SamplingParams(temperature=1.0)
    return tuple(ScheduledRequest(f"r{i}", (7 + i,), context,
                                  tuple(range(1 + i * per_request, 1 + (i + 1) * per_request)), sampling)
                 for i in range(rows))


def _prefill_requests(prompts: int, prompt_len: int, per_request: int) -> tuple[ScheduledRequest, ...]:
    sampling = SamplingParams(temperature=1.0)
    return tuple(ScheduledRequest(f"p{i}", tuple((7 * i + j) % 200 + 3 for j in range(prompt_len)), 0,
                                  tuple(range(1 + i * per_request, 1 + (i + 1) * per_request)), sampling)
                 for i in range(prompts))


def _time_steps(runner, reqs: tuple[ScheduledRequest, ...], repeats: int) -> tuple[float, float]:
    """(median seconds, mean cores busy) of ``repeats`` steps of ``reqs`` (after one untimed)."""
    rng = np.random.default_rng(0)
    seconds, wall, cpu = [], 0.0, 0.0
    for k in range(repeats + 1):
        batch = ModelBatch(k, reqs)
        hidden = None
        if not runner.stage.is_first:
            spec = runner.intermediate_spec(batch).tensors["hidden_states"]
            hidden = IntermediateTensors({"hidden_states": jax.device_put(
                rng.standard_normal(spec.shape).astype(spec.dtype), spec.sharding)})
            jax.block_until_ready(hidden["hidden_states"])
        c0, t0 = time.process_time(), time.perf_counter()
        out = runner.execute(batch, hidden)
        if not runner.stage.is_last:
            jax.block_until_ready(out["hidden_states"])
        dt = time.perf_counter() - t0
        if k:
            seconds.append(dt)
            wall += dt
            cpu += time.process_time() - c0
    return statistics.median(seconds), cpu / wall if wall else 0.0
