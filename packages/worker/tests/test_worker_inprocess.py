"""Two StageWorkers in this process (pp=2, tp=2 on devices 0-1 and 2-3) linked by an
InProcessTransport: KV sizing, load, warm-up, and greedy decoding equal to transformers'."""

import dataclasses
import math
import os
import socket
from types import SimpleNamespace

import jax
import pytest
from worker_oracle import CACHE, LIMITS, MAX_NEW_TOKENS, PROMPTS, greedy_decode

import pipejax.worker.worker as worker_module
from pipejax.pp_utils import InProcessTransport
from pipejax.runner.batch import ModelBatch
from pipejax.runner.config import StageConfig
from pipejax.runner.runner import kv_bytes_per_block
from pipejax.worker import StageInfo, StageWorker, WorkerConfig

pytestmark = pytest.mark.timeout(120)


def make_pipeline(path, cache=CACHE, limits=LIMITS) -> list[StageWorker]:
    devices = jax.devices()
    link = InProcessTransport("stage 0")
    configs = [WorkerConfig(str(path), StageConfig(i, 2), tp_size=2, cache=cache, scheduler=limits, step_trace_len=64)
               for i in range(2)]
    return [
        StageWorker(configs[0], devices[0:2], send=link),
        StageWorker(configs[1], devices[2:4], recv=link),
    ]


def run_pipeline(workers: list[StageWorker], batch: ModelBatch):
    *firsts, last = workers
    for w in firsts:
        assert w.execute_model(batch) is None  # non-last stages answer nothing; they send
    return last.execute_model(batch)


def test_available_kv_blocks_explicit(checkpoint):
    for w in make_pipeline(checkpoint[0]):
        assert w.available_kv_blocks() == CACHE.num_blocks


def test_available_kv_blocks_from_memory(checkpoint):
    """The CPU budget (default) or an explicit fraction: a tiny model in host RAM gets what
    max_num_seqs x max_model_len can ever use."""
    useful = 1 + LIMITS.max_num_seqs * math.ceil(LIMITS.max_model_len / CACHE.block_size)
    for cache in (dataclasses.replace(CACHE, num_blocks=None), dataclasses.replace(CACHE, num_blocks=None,
                                                                                   memory_fraction=0.5)):
        for w in make_pipeline(checkpoint[0], cache):
            assert w.available_kv_blocks() == useful
            assert w.kv_cache_plan().source == ("cpu_budget" if cache.memory_fraction is None else "cpu_fraction")


def test_available_kv_blocks_follows_free_memory(checkpoint, monkeypatch):
    """On CPU an explicit fraction takes that share of the host's available RAM (measured by the worker)."""
    cache = dataclasses.replace(CACHE, num_blocks=None, memory_fraction=0.25)
    limits = dataclasses.replace(LIMITS, max_num_seqs=10_000, max_model_len=32)
    w = make_pipeline(checkpoint[0], cache, limits)[1]
    stage_bytes = 2 * kv_bytes_per_block(w.model_config, w.stage, 2, cache.block_size)  # tp=2 devices
    free = 100 * stage_bytes  # 100 of the stage's blocks
    monkeypatch.setattr(worker_module.psutil, "virtual_memory", lambda: SimpleNamespace(available=free))
    assert w.available_kv_blocks() == 25
    monkeypatch.setattr(worker_module.psutil, "virtual_memory", lambda: SimpleNamespace(available=0))
    with pytest.raises(ValueError, match="fewer than one request of max_model_len=32"):
        w.available_kv_blocks()


def test_stages_on_one_host_share_its_memory(checkpoint, monkeypatch):
    """A stage in its own process (a Ray actor) shares the host's RAM with the other stages there (and
    with those of the other engines on the host): each gets its share of the budget."""
    cache = dataclasses.replace(CACHE, num_blocks=None)
    limits = dataclasses.replace(LIMITS, max_num_seqs=10_000_000)
    w = make_pipeline(checkpoint[0], cache, limits)[1]
    monkeypatch.setattr(worker_module.psutil, "virtual_memory", lambda: SimpleNamespace(available=100 << 30))
    alone = w.available_kv_blocks(stages_on_host=1)
    assert alone * w.kv_cache_plan().stage_bytes_per_block <= 4 << 30  # the default budget, 4 GiB
    assert w.available_kv_blocks(stages_on_host=2) == alone // 2
    shared = dataclasses.replace(w.config, cache=dataclasses.replace(cache, engines_on_host=2))
    w2 = StageWorker(shared, jax.devices()[2:4])
    assert w2.available_kv_blocks(stages_on_host=2) == alone // 4


def test_pipeline_greedy_equals_transformers(checkpoint, hf_expected):
    workers = make_pipeline(checkpoint[0])
    num_blocks = min(w.available_kv_blocks() for w in workers)  # every stage gets the same count
    for w in workers:
        w.load(num_blocks)
        assert w.runner is not None and w.runner.num_blocks == num_blocks

    batches = workers[0].warmup_batches()
    assert batches and all(b.step_id >= worker_module.WARMUP_STEP_BASE for b in batches)
    before = workers[0].compile_stats()
    for w in workers:  # stage 0 sends every warm-up step first; stage 1 then receives them
        seconds = w.warmup(batches, progress=False)
        assert seconds > 0
        assert len(w.runner.compiled_shapes) == len(batches)
        assert w.step_trace() == []  # warm-up steps are not traced
        assert {"init", "kernels", "load", "warmup"} <= set(w.setup_timings())
        chosen = w.kernel_selection()  # tp=2 stages: XLA's sharded dots, never the one-device dense kernel
        assert chosen["dense_matmuls"] == "xla" and chosen["decode_attention"] in ("xla", "cpu-kernel"), chosen
    built = workers[0].compile_stats() - before  # both stages' programs: they share this process
    assert built.programs >= 2 * len(batches) and 0 <= built.cache_hits <= built.programs and built.seconds > 0
    warm_shapes = [set(w.runner.compiled_shapes) for w in workers]

    outputs = greedy_decode(lambda b: run_pipeline(workers, b), PROMPTS, MAX_NEW_TOKENS)
    assert outputs == hf_expected

    for w, warm in zip(workers, warm_shapes, strict=True):
        # Only the ragged prefill step needed a new shape: warm-up covered the decode bucket.
        assert len(w.runner.compiled_shapes - warm) == 1
        assert [step for _, step, _, _ in w.trace] == list(range(MAX_NEW_TOKENS))
        assert all(rank == w.stage.pp_rank and start <= end for rank, _, start, end in w.trace)


def test_info(checkpoint):
    w0, w1 = make_pipeline(checkpoint[0])
    assert w0.info() == StageInfo(0, (0, 2), ("cpu:0", "cpu:1"), socket.gethostname(), os.getpid())
    assert w1.info() == StageInfo(1, (2, 4), ("cpu:2", "cpu:3"), socket.gethostname(), os.getpid())


def test_a_simulated_step_takes_its_set_time_and_computes_the_same(checkpoint, hf_expected):
    """``simulated_step_s`` (the schedule benchmark's stages): each step lasts at least that long, from the stage's
    inputs in hand to its output sent, and computes what a plain step does."""
    simulated = 0.03
    workers = [StageWorker(dataclasses.replace(w.config, simulated_step_s=simulated), w.devices, w.recv, w.send)
               for w in make_pipeline(checkpoint[0])]
    for w in workers:
        w.load(CACHE.num_blocks)
    outputs = greedy_decode(lambda b: run_pipeline(workers, b), PROMPTS, MAX_NEW_TOKENS)
    assert outputs == hf_expected
    spans = [end - start for w in workers for _, _, start, end in w.step_trace()]
    assert len(spans) == 2 * MAX_NEW_TOKENS, spans
    assert min(spans) >= simulated, min(spans)
