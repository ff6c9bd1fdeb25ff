"""Where one prefill step's time goes: a stage of the checkpoint at PATH (pp1 tp1, one CPU device, the CPU kernels
forced), 4 prompts x 128 tokens (one 512-token step), warmed up, then 5 steps under ``jax.profiler``: the step's
wall time, XLA's ops by total time, and the CPU kernels' FFI calls by their position in a layer (``--calls``: the
kernel calls of one layer in order; the MoE benchmark model's are qkv, attention, o, the routed experts).

    XLA_FLAGS=--xla_force_host_platform_device_count=1 python benchmarks/probes/prefill_step_profile.py PATH \
        [--calls qkv attention o experts]
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import statistics
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

STEPS = 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--calls", nargs="+", default=["qkv", "attention", "o", "experts"])
    args = parser.parse_args()
    import jax

    from pipejax.pp_utils import stage_mesh
    from pipejax.runner.batch import ModelBatch, SamplingParams, ScheduledRequest
    from pipejax.runner.config import CacheConfig, ModelConfig, SchedulerConfig, StageConfig
    from pipejax.runner.runner import StageRunner

    limits = SchedulerConfig(max_model_len=256, max_num_seqs=64, max_num_batched_tokens=512)
    runner = StageRunner(args.path, stage_mesh(jax.devices()[:1]), StageConfig(),
                         CacheConfig(block_size=16, num_blocks=4 * 16 + 1), ModelConfig.from_pretrained(args.path),
                         scheduler=limits, dense_matmuls="cpu-kernel", prefill_attention="cpu-kernel",
                         decode_attention="cpu-kernel")
    ids = iter(range(10**9))

    def step():
        reqs = tuple(ScheduledRequest(f"r{i}", tuple(range(100 + i, 228 + i)), 0,
                                      tuple(range(1 + i * 16, 1 + (i + 1) * 16)), SamplingParams(temperature=0.0))
                     for i in range(4))
        runner.execute(ModelBatch(next(ids), reqs))

    for _ in range(3):
        step()
    start = time.perf_counter()
    for _ in range(STEPS):
        step()
    print(f"prefill step (512 tokens): {(time.perf_counter() - start) / STEPS * 1e3:.1f} ms")
    folder = tempfile.mkdtemp(prefix="pipejax-prefill-profile-")
    options = jax.profiler.ProfileOptions()
    options.host_tracer_level, options.python_tracer_level = 3, 0
    jax.profiler.start_trace(folder, profiler_options=options)
    for _ in range(STEPS):
        step()
    jax.profiler.stop_trace()
    data = jax.profiler.ProfileData.from_file(glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)[0])
    totals, kernel_calls = collections.Counter(), []
    for plane in data.planes:
        for line in plane.lines:
            if line.name == "python":
                continue
            for ev in line.events:
                totals[re.sub(r"\.\d+$", "", ev.name)] += ev.duration_ns
                if ev.name.startswith("ffi_call"):
                    kernel_calls.append((ev.start_ns, ev.duration_ns))
    for name, ns in totals.most_common(8):
        print(f"{ns / 1e6 / STEPS:9.2f} ms/step  {name}")
    kernel_calls.sort()
    by_call = collections.defaultdict(list)
    for i, (_, ns) in enumerate(kernel_calls):
        by_call[args.calls[i % len(args.calls)]].append(ns / 1e6)
    for name, ms in by_call.items():
        print(f"kernel call '{name}': median {statistics.median(ms):.2f} ms, {sum(ms) / STEPS:.2f} ms/step")


if __name__ == "__main__":
    main()
