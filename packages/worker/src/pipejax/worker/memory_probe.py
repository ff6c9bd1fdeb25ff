"""A stage's resident memory measured in fresh processes: what ``pipejax plan --measure`` predicts a CPU stage
process's memory from, where the weights and the KV cache are only part of it.

Each probe is a fresh Python process on ``tp`` simulated CPU devices, for one kind of stage (``KINDS``): ``first``
(the embedding and one layer), ``middle`` (one layer), ``last`` (one layer, the final norm, the LM head and the
sampler) and ``whole`` (pp = 1: every layer). It starts JAX's backend, loads the stage of the real checkpoint
(``StageWorker.load``: its weights and a KV cache for ``rows`` requests of ``max_model_len``), then compiles the
engine's warm-up shapes (``StageWorker.warmup_batches``) and runs a prefill step of ``max_num_batched_tokens`` and a
decode step of ``rows`` requests with their contexts cached. It reports its peak RSS after loading and at the end.

- A process's own part (``process_bytes``, once per process): the peak after loading less the weights and the KV:
  the interpreter, JAX's libraries, the CPU kernels and what loading leaves behind.
- A stage's own part: what its steps add, its kind's (``kind_bytes``) plus ``layer_bytes`` per layer it holds: a
  decode step's layers are unrolled, so its programs grow with them. The whole stage holds the first stage's and
  the last stage's own parts, not the middle one's, so the four probes give the per-layer part.

    python -m pipejax.worker.memory_probe PATH KIND TP ROWS MAX_MODEL_LEN MAX_NUM_BATCHED_TOKENS   # one probe
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# longest first: the whole stage compiles every layer (42 s of SmolLM2's 75 s of probes at tp=3 on 2 cores), so the
# other three run beside it rather than after it
KINDS = ("whole", "last", "first", "middle")
PROBE_TIMEOUT_S = 600.0


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """A stage process's memory beyond its weights and KV, measured. ``process_bytes``: once per process (the
    runtime, the CPU kernels, what loading leaves behind); ``kind_bytes``: per stage by kind (``KINDS``), its
    programs and temporaries apart from its layers; ``layer_bytes``: per decoder layer of a stage (a decode step's
    layers are unrolled, so its programs grow with them)."""

    tp: int
    process_bytes: float
    kind_bytes: dict[str, float]
    layer_bytes: float
    source: str

    def stage_bytes(self, pp: int, rank: int, layers: int) -> float:
        """A stage's own memory beyond its weights and KV."""
        return self.kind_bytes[kind_of(pp, rank)] + self.layer_bytes * layers


def kind_of(pp: int, rank: int) -> str:
    if pp == 1:
        return "whole"
    return "first" if rank == 0 else "last" if rank == pp - 1 else "middle"


def measure_stage_memory(path: str | Path, tp: int, rows: int, max_model_len: int, max_num_batched_tokens: int,
                         timeout_s: float = PROBE_TIMEOUT_S) -> StageMemory:
    """One probe process per kind of stage (see the module's docstring), at most ``os.cpu_count()`` at once, for
    ``rows`` requests of at most ``max_model_len`` tokens in prefill steps of ``max_num_batched_tokens``."""
    def run(kind: str) -> dict[str, float]:
        return _run_probe(str(path), kind, tp, rows, max_model_len, max_num_batched_tokens, timeout_s)

    with ThreadPoolExecutor(max_workers=max(1, min(len(KINDS), os.cpu_count() or 1))) as pool:
        found = dict(zip(KINDS, pool.map(run, KINDS), strict=True))
    steps = {kind: max(0.0, p["peak"] - p["loaded"]) for kind, p in found.items()}
    layers = found["whole"]["layers"]
    # steps(kind, L) = kind's own + L x a layer's; the whole stage has the first's and the last's own, not the middle's
    per_layer = max(0.0, (steps["whole"] - steps["first"] - steps["last"] + steps["middle"]) / max(layers - 1, 1))
    kinds = {kind: max(0.0, steps[kind] - per_layer * found[kind]["layers"]) for kind in KINDS}
    process = statistics.median(p["loaded"] - p["weights"] - p["kv"] for p in found.values())
    return StageMemory(tp, process, kinds, per_layer,
                       source=f"measured in fresh processes on this host (tp={tp}, {rows} rows of {max_model_len} "
                              f"tokens, {max_num_batched_tokens}-token prefill steps)")


def _run_probe(path: str, kind: str, tp: int, rows: int, max_model_len: int, batched: int,
               timeout_s: float) -> dict[str, float]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=_with_device_count(os.environ.get("XLA_FLAGS", ""), tp))
    cmd = [sys.executable, "-m", __name__, path, kind, str(tp), str(rows), str(max_model_len), str(batched)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the {kind} stage's memory probe did not finish in {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"the {kind} stage's memory probe failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _with_device_count(flags: str, count: int) -> str:
    kept = [f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join([*kept, f"--xla_force_host_platform_device_count={count}"])


def peak_rss(pid: int | str = "self") -> int:
    """A process's RSS high-water mark in bytes (default: this one's). VmHWM starts afresh at exec; getrusage's
    ru_maxrss carries over exec from the spawning process, so a bigger parent would hide the figure."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _probe(path: str, kind: str, tp: int, rows: int, max_model_len: int, batched: int) -> dict[str, float]:
    """The body of one probe process."""
    import jax
    import numpy as np

    from pipejax.pp_utils.intermediate import IntermediateTensors
    from pipejax.runner.batch import ModelBatch, SamplingParams, ScheduledRequest
    from pipejax.runner.config import CacheConfig, ModelSource, SchedulerConfig, StageConfig
    from pipejax.worker.worker import StageWorker, WorkerConfig

    jax.block_until_ready(jax.device_put(jax.numpy.zeros(1)))
    runtime = peak_rss()
    n = ModelSource(path).model_config().num_layers
    stage = {"whole": StageConfig(0, 1), "first": StageConfig(0, 2, partition=(1, n - 1)),
             "middle": StageConfig(1, 3, partition=(1, 1, n - 2)), "last": StageConfig(1, 2, partition=(n - 1, 1))}
    limits = SchedulerConfig(max_model_len=max_model_len, max_num_seqs=rows, max_num_batched_tokens=batched)
    worker = StageWorker(WorkerConfig(path, stage[kind], tp_size=tp, scheduler=limits, compilation_cache_dir=None),
                         devices=jax.devices()[:tp])
    max_model_len = worker.limits.max_model_len  # at most the model's own
    block = CacheConfig().block_size
    worker.load(1 + rows * math.ceil(max_model_len / block))
    runner = worker.runner
    loaded = peak_rss()
    context = max_model_len - 1
    table = tuple(range(1, 1 + math.ceil(max_model_len / block)))
    prompt = min(batched, max_model_len)
    steps = [*worker.warmup_batches(),
             ModelBatch(1, (ScheduledRequest("p", (3,) * prompt, 0, table, SamplingParams(temperature=1.0)),)),
             ModelBatch(2, tuple(ScheduledRequest(f"d{i}", (3,), context, table, SamplingParams(temperature=1.0))
                                 for i in range(rows)))]
    rng = np.random.default_rng(0)
    for batch in steps:
        hidden = None
        if not runner.stage.is_first:
            spec = runner.intermediate_spec(batch).tensors["hidden_states"]
            hidden = IntermediateTensors({"hidden_states": jax.device_put(
                rng.standard_normal(spec.shape).astype(spec.dtype), spec.sharding)})
        jax.block_until_ready(runner.execute(batch, hidden))
    leaves = jax.tree.leaves(runner.params)
    layers = len(worker.stage.layer_range(worker.model_config))
    return {"runtime": runtime, "loaded": loaded, "peak": peak_rss(), "layers": layers,
            "weights": float(sum(getattr(p, "nbytes", 0) for p in leaves)),
            "kv": float(sum(c.nbytes for c in jax.tree.leaves(runner.kv_cache)))}


if __name__ == "__main__":
    path_, kind_, tp_, rows_, len_, batched_ = sys.argv[1:7]
    print(json.dumps(_probe(path_, kind_, int(tp_), int(rows_), int(len_), int(batched_))), flush=True)
