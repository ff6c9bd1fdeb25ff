"""Peak RSS of one pp=2 stage worker next to the full model's weight bytes: the benchmark report's ``memory``
section (which runs this script in its venv and renders its JSON).

    python packages/worker/benchmarks/stage_memory.py --json OUT [--repeats 3]

Each probe is a fresh process: it imports JAX and pipejax and initialises the CPU backend (the
process baseline, its peak RSS then), builds a ``StageWorker`` for one stage and loads it (weights
plus a 65-block KV cache), and records the peak RSS again; then it runs one decode and one prefill
step (two compiles) and records the peak once more. Growth = peak - baseline; the goal compares
the load growth of the larger stage with 0.6 x the whole checkpoint's weight bytes. The whole
model (pp=1) is probed the same way as a reference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runner" / "benchmarks"))
from bench_support import summary  # noqa: E402 (the runner's benchmark helpers: worker sits on the runner)

GOAL = 0.6
KV_BLOCKS = 65


def bench_model() -> str:
    """The 124M-parameter fp32 benchmark checkpoint (generated on first use, where pipejax's engines put it)."""
    from pipejax.runner.builtin_model import cache_dir_from_env, ensure_builtin_model

    return str(ensure_builtin_model("bench", cache_dir_from_env(os.environ)))


def weight_bytes(model_path: str) -> int:
    """Bytes of every tensor in the checkpoint (the full model's weights)."""
    total = 0
    for file in Path(model_path).glob("*.safetensors"):  # 8-byte header length, JSON header, data
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(t["data_offsets"][1] - t["data_offsets"][0] for k, t in header.items() if k != "__metadata__")
    return total


def probe(path: str, rank: int, size: int) -> None:
    """The body of one probe process: prints one JSON line."""
    import jax
    import numpy as np

    from pipejax.pp_utils import IntermediateTensors
    from pipejax.runner.batch import ModelBatch, SamplingParams, ScheduledRequest
    from pipejax.runner.config import CacheConfig, SchedulerConfig, StageConfig
    from pipejax.worker import StageWorker, WorkerConfig
    from pipejax.worker.memory_probe import peak_rss as peak

    jax.device_put(jax.numpy.zeros(1)).block_until_ready()
    base = peak()
    cache = CacheConfig(block_size=16, num_blocks=KV_BLOCKS)
    limits = SchedulerConfig(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256)
    worker = StageWorker(WorkerConfig(path, StageConfig(rank, size), tp_size=1, cache=cache, scheduler=limits))
    worker.load(KV_BLOCKS)
    jax.block_until_ready((worker.runner.params, worker.runner.kv_cache))
    loaded = peak()
    runner = worker.runner
    greedy = SamplingParams(temperature=0)
    for step, n in enumerate((128, 1)):  # a prefill, then a decode step
        reqs = (ScheduledRequest("r", (1,) * n, 0 if n > 1 else 128, tuple(range(1, 10)), greedy),)
        batch = ModelBatch(step, reqs)
        hidden = None
        if rank > 0:
            spec = runner.intermediate_spec(batch).tensors["hidden_states"]
            hidden = IntermediateTensors({"hidden_states": jax.device_put(np.zeros(spec.shape, np.float32))})
        jax.block_until_ready(runner.execute(batch, hidden))
    print(json.dumps({
        "base": base, "loaded": loaded, "served": peak(),
        "param_bytes": int(sum(p.nbytes for p in runner.params.values())),
        "kv_bytes": int(sum(c.nbytes for c in runner.kv_cache)),
        "largest_param_bytes": int(max(p.nbytes for p in runner.params.values())),
    }), flush=True)


def run_probe(path: str, rank: int, size: int) -> dict[str, Any]:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, __file__, "--probe", path, str(rank), str(size)],
                          capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe {rank}/{size} failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(repeats: int) -> dict[str, Any]:
    path = bench_model()
    full = weight_bytes(path)
    probes = {"stage 0 of pp=2": (0, 2), "stage 1 of pp=2": (1, 2), "whole model (pp=1)": (0, 1)}
    raw: dict[str, list[dict]] = {k: [] for k in probes}
    for _ in range(repeats):
        for name, (rank, size) in probes.items():
            raw[name].append(run_probe(path, rank, size))
    out: dict[str, Any] = {"full_weight_bytes": full, "kv_blocks": KV_BLOCKS, "goal": GOAL, "probes": {}}
    for name, runs in raw.items():
        out["probes"][name] = {
            "base_mb": summary([r["base"] / 2**20 for r in runs]),
            "load_growth_mb": summary([(r["loaded"] - r["base"]) / 2**20 for r in runs]),
            "served_growth_mb": summary([(r["served"] - r["base"]) / 2**20 for r in runs]),
            "param_mb": runs[0]["param_bytes"] / 2**20,
            "kv_mb": runs[0]["kv_bytes"] / 2**20,
            "largest_param_mb": runs[0]["largest_param_bytes"] / 2**20,
            "ratio": summary([(r["loaded"] - r["base"]) / full for r in runs]),
        }
    worst = max(("stage 0 of pp=2", "stage 1 of pp=2"), key=lambda k: out["probes"][k]["ratio"]["median"])
    out["worst_stage"] = worst
    return out


if __name__ == "__main__":
    if "--probe" in sys.argv:
        i = sys.argv.index("--probe")
        probe(sys.argv[i + 1], int(sys.argv[i + 2]), int(sys.argv[i + 3]))
    else:
        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        parser.add_argument("--repeats", type=int, default=3, help="fresh processes per probe (default 3)")
        parser.add_argument("--json", required=True, help="where to write the figures")
        args = parser.parse_args()
        Path(args.json).write_text(json.dumps(run(args.repeats), indent=1))
