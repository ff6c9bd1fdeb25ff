"""``memory_probe``: a stage's memory beyond its weights and KV, from fresh probe processes. The fit over the
probes' figures is checked on given ones; a real probe of the tiny checkpoint shows what a process holds."""

import pytest

from pipejax.worker import memory_probe
from pipejax.worker.memory_probe import StageMemory, kind_of, measure_stage_memory

MIB = 2**20


def test_the_probes_split_into_a_process_part_a_part_per_kind_and_a_part_per_layer(monkeypatch):
    # given: each stage's load leaves 280 MiB beside its weights and KV; its steps add its kind's own + 3 MiB a layer
    own = {"first": 20, "middle": 10, "last": 90, "whole": 100}
    layers = {"first": 1, "middle": 1, "last": 1, "whole": 12}

    def probe(path, kind, tp, rows, max_model_len, batched, timeout_s):
        weights, kv = 50 * MIB * layers[kind], 4 * MIB * layers[kind]
        loaded = 190 * MIB + 280 * MIB + weights + kv
        return {"runtime": 190 * MIB, "loaded": loaded, "peak": loaded + (own[kind] + 3 * layers[kind]) * MIB,
                "layers": layers[kind], "weights": weights, "kv": kv}

    monkeypatch.setattr(memory_probe, "_run_probe", probe)
    got = measure_stage_memory("unused", tp=1, rows=8, max_model_len=256, max_num_batched_tokens=512)
    assert got.process_bytes == pytest.approx(470 * MIB)  # the runtime and what loading leaves behind
    assert got.layer_bytes == pytest.approx(3 * MIB)
    # 'whole' holds the first stage's and the last's own parts: 20 + 90 - 10, measured as 100 here
    assert got.kind_bytes == pytest.approx({k: v * MIB for k, v in own.items()})
    assert got.stage_bytes(pp=4, rank=2, layers=7) == pytest.approx((10 + 21) * MIB)
    assert [kind_of(3, r) for r in range(3)] == ["first", "middle", "last"] and kind_of(1, 0) == "whole"


def test_a_probe_of_the_tiny_checkpoint_measures_its_process(checkpoint):
    got = measure_stage_memory(checkpoint[0], tp=1, rows=4, max_model_len=128, max_num_batched_tokens=128)
    assert isinstance(got, StageMemory) and got.tp == 1 and "fresh processes" in got.source
    # the interpreter, JAX's libraries and the CPU kernels: far more than the tiny checkpoint's weights
    assert 100 * MIB < got.process_bytes < 2048 * MIB
    assert set(got.kind_bytes) == set(memory_probe.KINDS) and all(v >= 0 for v in got.kind_bytes.values())
    # a whole stage serving 32x the KV (64 rows of the model's 256 tokens): its peak is the runtime, its weights
    # and KV, and its own part as measured at 4 rows of 128, within 15%
    bigger = memory_probe._run_probe(str(checkpoint[0]), "whole", 1, 64, 256, 128, 120)
    assert bigger["kv"] > 8 * MIB
    predicted = got.process_bytes + bigger["weights"] + bigger["kv"] + got.stage_bytes(1, 0, bigger["layers"])
    assert bigger["peak"] == pytest.approx(predicted, rel=0.15)


def test_a_failing_probe_names_the_stage_kind(checkpoint):
    with pytest.raises(RuntimeError, match="the edge stage's memory probe failed"):
        memory_probe._run_probe(str(checkpoint[0]), "edge", 1, 4, 128, 128, 60)
