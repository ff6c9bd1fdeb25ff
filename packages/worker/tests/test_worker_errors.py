"""User mistakes and a silent previous stage get clear errors, not hangs."""

import time

import jax
import pytest
from worker_oracle import CACHE, GREEDY, LIMITS

from pipejax.pp_utils import InProcessTransport, TransportTimeout
from pipejax.runner.batch import ModelBatch, ScheduledRequest
from pipejax.runner.config import StageConfig
from pipejax.worker import StageWorker, WorkerConfig

pytestmark = pytest.mark.timeout(60)

BATCH = ModelBatch(7, (ScheduledRequest("r0", (1, 5, 9), 0, (1,), GREEDY),))


def test_tp_size_larger_than_devices_lists_them(checkpoint):
    config = WorkerConfig(str(checkpoint[0]), StageConfig(0, 1), tp_size=16, cache=CACHE, scheduler=LIMITS)
    with pytest.raises(ValueError, match="tp_size=16") as e:
        StageWorker(config)
    assert all(f"cpu:{i}" in str(e.value) for i in range(len(jax.local_devices())))


def test_tp_size_not_matching_given_devices(checkpoint):
    config = WorkerConfig(str(checkpoint[0]), StageConfig(0, 1), tp_size=2, cache=CACHE, scheduler=LIMITS)
    with pytest.raises(ValueError, match=r"tp_size=2 devices but got 3") as e:
        StageWorker(config, jax.devices()[:3])
    assert "cpu:7" in str(e.value)


def test_execute_before_load(checkpoint):
    w = StageWorker(
        WorkerConfig(str(checkpoint[0]), StageConfig(0, 1), tp_size=1, cache=CACHE, scheduler=LIMITS, step_trace_len=8)
    )
    with pytest.raises(RuntimeError, match=r"stage 0: call load\(num_blocks\) before executing"):
        w.execute_model(BATCH)
    with pytest.raises(RuntimeError, match=r"load\(num_blocks\)"):
        w.warmup_batches()
    assert w.step_trace() == []


def test_silent_previous_stage_times_out_naming_the_step(checkpoint):
    config = WorkerConfig(
        str(checkpoint[0]), StageConfig(1, 2), tp_size=2, cache=CACHE, scheduler=LIMITS, receive_timeout_s=0.5,
        step_trace_len=8,
    )
    w = StageWorker(config, jax.devices()[2:4], recv=InProcessTransport("stage 0"))
    w.load(CACHE.num_blocks)
    start = time.monotonic()
    with pytest.raises(TransportTimeout, match=r"step 7: no activations from stage 0 after 0\.5s"):
        w.execute_model(BATCH)
    assert time.monotonic() - start < 5
    assert w.step_trace() == []  # a failed step is not recorded
    assert w.finished_step == -1  # nor counted as finished (the executor's hung-stage check reads it)


@pytest.mark.parametrize(("trace_len", "traced"), [(0, []), (2, [8, 9])])
def test_step_trace_is_opt_in_and_keeps_only_the_last_steps(checkpoint, trace_len, traced):
    config = WorkerConfig(
        str(checkpoint[0]), StageConfig(0, 1), tp_size=1, cache=CACHE, scheduler=LIMITS, step_trace_len=trace_len
    )
    w = StageWorker(config)
    w.load(CACHE.num_blocks)
    for step in (7, 8, 9):
        w.execute_model(ModelBatch(step, BATCH.requests))
    assert [step for _, step, _, _ in w.step_trace()] == traced
    assert w.finished_step == 9  # kept whether or not steps are traced
    w.warmup(w.warmup_batches()[:1], progress=False)
    assert w.finished_step == 9  # warm-up steps are not the engine's
