"""Where one step's time goes: a stage of the checkpoint at PATH (pp1 tp1, one CPU device, the CPU kernels forced),
warmed up, then 5 steps under ``jax.profiler``: the step's wall time, XLA's ops by total time, and the CPU kernels'
FFI calls by their position in a layer (``--calls``: the kernel calls of one layer in order; the MoE benchmark
model's are qkv, attention, o, the routed experts; a call after the last layer's is the LM head's).

- ``--step prefill`` (default): prompts of 128 tokens, ``--tokens / 128`` of them in one step (512: one step of
  the engine's default budget);
- ``--step decode``: ``--rows`` requests (default 64) each with 128 prompt tokens already prefilled, one token each.

    XLA_FLAGS=--xla_force_host_platform_device_count=1 python benchmarks/probes/step_profile.py PATH \
        [--step prefill|decode] [--tokens 512] [--rows 64] [--calls qkv attention o experts]
        [--dense-tiles auto|vector|amx]
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
PROMPT = 128  # tokens per prompt
BLOCK = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--step", choices=["prefill", "decode"], default="prefill")
    parser.add_argument("--tokens", type=int, default=512, help="prefill: tokens in the step (whole prompts of 128)")
    parser.add_argument("--rows", type=int, default=64, help="decode: requests in the step")
    parser.add_argument("--calls", nargs="+", default=["qkv", "attention", "o", "experts"])
    parser.add_argument("--dense-tiles", choices=["auto", "vector", "amx", "amx-kept"], default="auto",
                        help="the dense kernel's tiles (StageRunner's dense_tiles)")
    args = parser.parse_args()
    import jax

    from pipejax.pp_utils import stage_mesh
    from pipejax.runner.batch import ModelBatch, SamplingParams, ScheduledRequest
    from pipejax.runner.config import CacheConfig, ModelConfig, SchedulerConfig, StageConfig
    from pipejax.runner.runner import StageRunner

    prompts = args.tokens // PROMPT if args.step == "prefill" else args.rows
    per_request = PROMPT // BLOCK + 4  # blocks: the prompt and the decode steps after it
    limits = SchedulerConfig(max_model_len=2 * PROMPT, max_num_seqs=max(64, prompts),
                             max_num_batched_tokens=max(512, args.tokens))
    runner = StageRunner(args.path, stage_mesh(jax.devices()[:1]), StageConfig(),
                         CacheConfig(block_size=BLOCK, num_blocks=prompts * per_request + 1),
                         ModelConfig.from_pretrained(args.path), scheduler=limits, dense_matmuls="cpu-kernel",
                         dense_tiles=args.dense_tiles,
                         prefill_attention="cpu-kernel", decode_attention="cpu-kernel")
    ids = iter(range(10**9))
    greedy = SamplingParams(temperature=0.0)

    def blocks(i: int) -> tuple[int, ...]:
        return tuple(range(1 + i * per_request, 1 + (i + 1) * per_request))

    def prefill(first: int, count: int) -> None:
        runner.execute(ModelBatch(next(ids), tuple(
            ScheduledRequest(f"r{i}", tuple(range(100 + i, 100 + i + PROMPT)), 0, blocks(i), greedy)
            for i in range(first, first + count))))

    position = [PROMPT]

    def decode() -> None:
        runner.execute(ModelBatch(next(ids), tuple(
            ScheduledRequest(f"r{i}", (5 + i,), position[0], blocks(i), greedy) for i in range(prompts))))
        position[0] = PROMPT + (position[0] - PROMPT + 1) % 4  # stays within the requests' blocks

    if args.step == "decode":
        for first in range(0, prompts, 4):  # their prompts, 4 a step
            prefill(first, min(4, prompts - first))
        step, what = decode, f"decode step ({prompts} rows)"
    else:
        step, what = (lambda: prefill(0, prompts)), f"prefill step ({prompts * PROMPT} tokens)"
    for _ in range(3):
        step()
    start = time.perf_counter()
    for _ in range(STEPS):
        step()
    amx, kept = runner.selection.dense_amx_rows, runner.selection.dense_kept_rows
    tiles = [f"AMX's kept tiles from {kept} rows"] * (kept is not None) + [f"AMX tiles from {amx} rows"] * (
        amx is not None)
    print(f"{what}: {(time.perf_counter() - start) / STEPS * 1e3:.1f} ms (dense kernel on "
          f"{', '.join(tiles) or 'the FMA tiles'})")
    folder = tempfile.mkdtemp(prefix="pipejax-step-profile-")
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
    per_step = len(kernel_calls) // STEPS
    in_layers = per_step - per_step % len(args.calls)  # the rest: after the last layer (the LM head)
    by_call = collections.defaultdict(list)
    for i, (_, ns) in enumerate(kernel_calls):
        at = i % per_step
        by_call[args.calls[at % len(args.calls)] if at < in_layers else "head"].append(ns / 1e6)
    for name, ms in by_call.items():
        print(f"kernel call '{name}': median {statistics.median(ms):.2f} ms, {sum(ms) / STEPS:.2f} ms/step")


if __name__ == "__main__":
    main()
