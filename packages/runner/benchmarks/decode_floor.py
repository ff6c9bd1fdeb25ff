"""Decode-step time of the runner on the benchmark model, next to this machine's floor, part by part: the
benchmark report's ``decode`` section (which runs this script in its venv and renders its JSON).

    python packages/runner/benchmarks/decode_floor.py --json OUT [--repeats 3] [--quick]   # torch, numpy: references

floor = max(FLOPs / measured matmul rate, (weight bytes + K/V bytes the step reads) / measured resident
memory bandwidth), the rates measured in the same repeat as the steps (so both see the same load). One decode step:
``StageRunner.execute`` of ``batch`` requests with 128 tokens already cached (sampling at
temperature 1 included, until the tokens are on the host), pp=1 tp=1 on one CPU device.

The runner's default decode attention is timed (on CPU: the hand-written kernel of
``pipejax.runner.cpu.decode_attention``); at the headline batch the step is split into its parts (host inputs, the
jitted forward, sampling), the same parts with XLA's formulation of the decode attention are set next to them, and
set next to the same model's dense matmuls alone (every weight matrix once, same batch, one jit): the part of the
forward that is not the weights' matmuls is attention and the paged KV gather. The same matmuls in torch and in
numpy (OpenBLAS), each in a process of its own and in the same rounds, measure the 64-row matmul rate a second and
a third way; XLA's at 128 rows splits a pass over the weights into a part per row and a part per pass. The same
dense matmuls are timed as a loop over per-layer arrays and as a scan over the stacked weights, alternated, at
batch 1 and 64: the difference is the copy of each layer's weights that the scan's dynamic slice makes on XLA:CPU.
So the runner's decode steps on CPU run the layers unrolled over per-layer views of the weights
(``decode_layers``); that step is timed against the same step as a layer scan, alternated, with each one's first
step (its compile). The KV bytes the attention reads are reported next to the weights.

Also one 2048-token prefill step (16 fresh prompts x 128 tokens, the jitted forward): its useful FLOP rate
as a share of the matmul rate measured in the same repeat.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from typing import Any

from bench_support import EngineProcess, summary  # this folder's (run as a script)
from dense_matmuls import NumpyDenseMatmuls, TorchDenseMatmuls, dense_matmuls
from machine_floor import CONTEXT, kv_bytes, machine_rates, matmul_rate, step_cost, timed

HEADLINE_BATCH = 64
GOAL = 1.5
PREFILL_ROWS, PREFILL_LEN = 16, 128  # one 2048-token prefill step: 16 prompts x 128 tokens


class DecodeBench:
    def __init__(self, path: str, batches: list[int], decode_attention: str = "auto", decode_layers: str = "auto",
                 dense_matmuls: str = "auto", prefill_attention: str = "auto", few_row_dots: str = "auto",
                 quantization: str | None = None):
        import jax

        from pipejax.pp_utils import stage_mesh
        from pipejax.runner.config import CacheConfig, ModelConfig, SchedulerConfig, StageConfig
        from pipejax.runner.runner import StageRunner

        self.block = 16
        self.per_request = math.ceil((CONTEXT + 64) / self.block)
        cache = CacheConfig(block_size=self.block, num_blocks=1 + max(batches) * self.per_request)
        limits = SchedulerConfig(max_model_len=256, max_num_seqs=max(batches),
                                 max_num_batched_tokens=max(max(batches), PREFILL_ROWS * PREFILL_LEN))
        model = ModelConfig.from_pretrained(path, quantization=quantization)
        self.runner = StageRunner(path, stage_mesh(jax.devices()[:1]), StageConfig(), cache, model, scheduler=limits,
                                  decode_attention=decode_attention, decode_layers=decode_layers,
                                  dense_matmuls=dense_matmuls, prefill_attention=prefill_attention,
                                  few_row_dots=few_row_dots)
        self.cfg = self.runner.cfg
        self._ids = iter(range(10**9))

    def batch(self, size: int):
        from pipejax.runner.batch import ModelBatch, SamplingParams, ScheduledRequest

        sampling = SamplingParams(temperature=1.0)
        tables = [tuple(range(1 + i * self.per_request, 1 + (i + 1) * self.per_request)) for i in range(size)]
        reqs = tuple(ScheduledRequest(f"r{i}", (7 + i,), CONTEXT, tables[i], sampling) for i in range(size))
        return ModelBatch(next(self._ids), reqs)

    def step(self, size: int) -> None:
        self.runner.execute(self.batch(size))

    def compile_steps(self, sizes: list[int]) -> dict[int, float]:
        """Seconds of each size's first step, its compile included (the CPU kernel's own build is not: it is
        once per process, and comes before)."""
        from pipejax.runner.cpu import decode_attention as cpu_decode_attention

        if self.runner.decode_attention == "cpu-kernel":
            cpu_decode_attention.prepare()
        first = {}
        for size in sizes:
            start = time.perf_counter()
            self.step(size)
            first[size] = time.perf_counter() - start
        return first

    def prefill_forward(self):
        """A thunk running the jitted forward of one 2048-token prefill step (16 fresh prompts x 128 tokens)."""
        from pipejax.runner.batch import ModelBatch, SamplingParams, ScheduledRequest

        blocks = math.ceil(PREFILL_LEN / self.block)
        sampling = SamplingParams(temperature=1.0)
        reqs = tuple(ScheduledRequest(f"p{i}", tuple(range(5, 5 + PREFILL_LEN)), 0,
                                      tuple(range(1 + i * blocks, 1 + (i + 1) * blocks)), sampling)
                     for i in range(PREFILL_ROWS))
        shape, inputs = self.runner.prepare_inputs(ModelBatch(next(self._ids), reqs))
        return lambda: self.runner.forward(inputs, shape).block_until_ready()

    def parts(self, size: int, repeats: int) -> dict[str, Any]:
        """Median ms of the step's parts at ``size``: host inputs, jitted forward, sampling."""
        import jax

        r = self.runner
        times: dict[str, list[float]] = {"inputs": [], "forward": [], "sample": []}
        for _ in range(repeats + 1):
            batch = self.batch(size)
            t0 = time.perf_counter()
            shape, inputs = r.prepare_inputs(batch)
            jax.block_until_ready(inputs)
            t1 = time.perf_counter()
            logits = r.forward(inputs, shape)
            logits.block_until_ready()
            t2 = time.perf_counter()
            r.sample(batch, logits, shape.rows)
            t3 = time.perf_counter()
            for v, t in zip(times.values(), (t1 - t0, t2 - t1, t3 - t2), strict=True):
                v.append(t)
        return {k: statistics.median(v[1:]) * 1e3 for k, v in times.items()} | {"shape": list(shape)}


def prefill_flops(cfg) -> float:
    """Useful FLOPs of the 2048-token prefill step: every token through every layer's matmuls, causal attention
    (each token against the positions before it), the LM head on each prompt's last token."""
    E, F, H, K, D, L = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.num_layers)
    tokens = PREFILL_ROWS * PREFILL_LEN
    matmuls = 2 * tokens * L * (E * H * D + 2 * E * K * D + H * D * E + 3 * E * F)
    attention = 4 * L * PREFILL_ROWS * H * D * PREFILL_LEN * (PREFILL_LEN + 1) / 2
    return matmuls + attention + 2 * PREFILL_ROWS * E * cfg.vocab_size


def kv_gather(cfg, rows: int, blocks: int, block_size: int, repeats: int) -> float:
    """Seconds to gather, for every layer, ``rows`` x ``blocks`` whole K and V blocks from a paged cache
    laid out as the runner's ([layers, blocks, block_size, kv heads, head dim]) by a block table, and sum
    each over its slots: the attention's reads with almost none of its arithmetic (one jit)."""
    import jax
    import jax.numpy as jnp

    L, K, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    n = 1 + rows * blocks
    k_cache = jnp.ones((L, n, block_size, K, D), jnp.float32)
    v_cache = jnp.ones((L, n, block_size, K, D), jnp.float32)
    tables = jnp.arange(1, n, dtype=jnp.int32)[::-1].reshape(rows, blocks)  # every block once, not in order

    @jax.jit
    def run(k_cache, v_cache, tables):
        def layer(acc, i):
            return acc + k_cache[i][tables].sum(axis=(1, 2)) + v_cache[i][tables].sum(axis=(1, 2)), None

        return jax.lax.scan(layer, jnp.zeros((rows, K, D), jnp.float32), jnp.arange(L))[0]

    return statistics.median(timed(lambda: run(k_cache, v_cache, tables).block_until_ready(), repeats))


def run(args: argparse.Namespace) -> dict[str, Any]:
    batches = [HEADLINE_BATCH] if args.quick else [1, 16, HEADLINE_BATCH]
    steps = 5 if args.quick else 10
    bench = DecodeBench(bench_model(), batches)
    cfg = bench.cfg
    first_step_s = bench.compile_steps(batches)
    prefill = bench.prefill_forward()
    prefill()  # compile
    per_repeat: dict[int, list[dict[str, float]]] = {b: [] for b in batches}
    rates_all, prefill_share, prefill_ms, prefill_repeats = [], [], [], []
    for _ in range(args.repeats):
        # The 2048³ rate between the prefill and the decode steps and after the steps, the higher one taken: this
        # host's speed swings between phases of seconds (one run's probes read 104, 107 and 180 GFLOP/s), and a
        # probe in a slow phase would put the floor above steps timed in a fast one. The prefill is timed before
        # the bandwidth probe: right after its GiB arrays it ran 14% slower (1943 against 1705 ms, four rounds
        # alternated in one process, 2026-12-03), which would measure the probe, not the step. Its own rate is the
        # higher of the 2048³ probes right before and right after it: the probe after the bandwidth probe and the
        # decode steps read 168 GFLOP/s where the one right after a 2281 ms prefill read 90 (2026-12-03 14:20 UTC).
        rate_before_prefill = matmul_rate(3)
        t = statistics.median(timed(prefill, 3))
        rates = machine_rates(3)  # its 2048³ probe comes first: right after the prefill
        step_s = {b: statistics.median(timed(lambda b=b: bench.step(b), steps)) for b in batches}
        rates["flops_before"], rates["flops_after"] = rates["flops"], matmul_rate(3)
        rates["flops"] = max(rates["flops_before"], rates["flops_after"])
        rates_all.append(rates)
        prefill_rate = max(rate_before_prefill, rates["flops_before"])
        prefill_ms.append(t * 1e3)
        prefill_share.append(prefill_flops(cfg) / t / prefill_rate)
        prefill_repeats.append({"step_ms": t * 1e3, "gflops_before": rate_before_prefill / 1e9,
                                "gflops_after": rates["flops_before"] / 1e9, "share": prefill_share[-1]})
        for b in batches:
            flops, weights = step_cost(cfg, b)
            compute, memory = flops / rates["flops"], (weights + kv_bytes(cfg, b, CONTEXT + 1)) / rates["bandwidth"]
            per_repeat[b].append({"step_ms": step_s[b] * 1e3, "floor_ms": max(compute, memory) * 1e3,
                                  "compute_ms": compute * 1e3, "memory_ms": memory * 1e3})
    decode = {}
    for b, reps in per_repeat.items():
        decode[b] = {k: summary([r[k] for r in reps]) for k in reps[0]}
        decode[b]["ratio"] = summary([r["step_ms"] / r["floor_ms"] for r in reps])
        decode[b]["bound"] = "compute" if decode[b]["compute_ms"]["median"] >= decode[b]["memory_ms"]["median"] \
            else "memory"
    b = HEADLINE_BATCH
    parts = bench.parts(b, steps)
    # The model's dense matmuls as a loop over per-layer arrays, and read through a scan over stacked weights as
    # the runner's layer loop reads them, alternated (three rounds: one sample swung 90 -> 147 ms on a noisy host).
    # torch's and numpy's matmuls at the headline batch, each in a process of its own, in the same rounds; each
    # library's 64-row rate is taken as a share of the 2048³ rate timed in its round (the machine's speed swings
    # between rounds). XLA's at twice the rows too: t(rows) = fixed + rows x per-row splits a pass over the weights
    # into what more rows cost and what every pass costs whatever its rows.
    layer_loop = {n: {"per_layer_ms": [], "scan_ms": [], "kernel_ms": []} for n in batches if n in (1, HEADLINE_BATCH)}
    lib_ms: dict[str, list[float]] = {"torch": [], "numpy": []}
    shares: dict[str, list[float]] = {"jax": [], "torch": [], "numpy": [], "kernel": []}
    double_ms, fixed_ms = [], []
    matmul_params = (step_cost(cfg, 1)[0] - 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * CONTEXT) / 2
    matmul_flops = 2 * b * matmul_params
    with EngineProcess(TorchDenseMatmuls, cfg) as torch_dots, EngineProcess(NumpyDenseMatmuls, cfg) as numpy_dots:
        others = {"torch": torch_dots, "numpy": numpy_dots}
        for _ in range(3):
            for n, times in layer_loop.items():
                times["per_layer_ms"].append(dense_matmuls(cfg, n, steps) * 1e3)
                times["scan_ms"].append(dense_matmuls(cfg, n, steps, scan=True) * 1e3)
                times["kernel_ms"].append(dense_matmuls(cfg, n, steps, panels=True) * 1e3)
            double_ms.append(dense_matmuls(cfg, 2 * b, steps) * 1e3)
            fixed_ms.append(2 * layer_loop[b]["per_layer_ms"][-1] - double_ms[-1])
            for lib, proc in others.items():
                lib_ms[lib].append(proc.call("seconds", b, b, steps) * 1e3)
            square = matmul_rate(3)
            shares["jax"].append(matmul_flops / (layer_loop[b]["per_layer_ms"][-1] / 1e3) / square)
            shares["kernel"].append(matmul_flops / (layer_loop[b]["kernel_ms"][-1] / 1e3) / square)
            for lib, times in lib_ms.items():
                shares[lib].append(matmul_flops / (times[-1] / 1e3) / square)
    layer_loop = {n: {k: summary(v) for k, v in times.items()} for n, times in layer_loop.items()}
    dense_ms = layer_loop[b]["per_layer_ms"]["median"]
    gather_ms = kv_gather(cfg, b, parts["shape"][4], bench.block, steps) * 1e3
    from pipejax.runner.cpu import dots as cpu_dots

    bench_layers, bench_dots, bench_dense = bench.runner.decode_layers, bench.runner.few_row_dots, \
        bench.runner.dense_matmuls
    slots = parts["shape"][4] * bench.block
    # The runner's decode step with its layers unrolled over per-layer views of the weights (its default on CPU)
    # against the same step as a layer scan over the stacked weights, alternated; and each one's first step.
    layers_ab = None
    if bench.runner.decode_layers == "unrolled":
        scan = DecodeBench(bench_model(), batches, decode_layers="scan")
        scan_first_s = scan.compile_steps(list(layer_loop))
        ab: dict[int, dict[str, list[float]]] = {n: {"unrolled_ms": [], "scan_ms": []} for n in layer_loop}
        for _ in range(3):
            for n, times in ab.items():
                times["unrolled_ms"].append(statistics.median(timed(lambda n=n: bench.step(n), steps)) * 1e3)
                times["scan_ms"].append(statistics.median(timed(lambda n=n: scan.step(n), steps)) * 1e3)
        layers_ab = {n: {k: summary(v) for k, v in times.items()} | {"unrolled_first_s": first_step_s[n],
                                                                       "scan_first_s": scan_first_s[n]}
                     for n, times in ab.items()}
        del scan
    # The runner's decode step with its dense matmuls on the CPU dense kernel over weights in panels (its default on
    # CPU) against XLA's dot over the weights as [in, out], alternated; and the 2048-token prefill forward both
    # ways ("prefill").
    dense_ab = None
    if bench.runner.dense_matmuls == "cpu-kernel":
        xla_dots = DecodeBench(bench_model(), batches, dense_matmuls="xla")
        xla_dots.compile_steps(batches)
        xla_prefill = xla_dots.prefill_forward()
        xla_prefill()  # compile
        ab = {n: {"kernel_ms": [], "xla_ms": []} for n in [*batches, "prefill"]}
        for _ in range(3):
            for n, times in ab.items():
                ours, theirs = (prefill, xla_prefill) if n == "prefill" else (lambda n=n: bench.step(n),
                                                                              lambda n=n: xla_dots.step(n))
                reps = 3 if n == "prefill" else steps
                times["kernel_ms"].append(statistics.median(timed(ours, reps)) * 1e3)
                times["xla_ms"].append(statistics.median(timed(theirs, reps)) * 1e3)
        dense_ab = {n: {k: summary(v) for k, v in times.items()} for n, times in ab.items()}
        del xla_dots, xla_prefill
    # The prefill forward with its attention on the CPU prefill kernel (the runner's default on CPU) against XLA's
    # formulation (a block-table gather, then YNNPACK's small batched matmuls), alternated.
    attention_ab = None
    if bench.runner.prefill_attention == "cpu-kernel":
        xla_attention = DecodeBench(bench_model(), [b], prefill_attention="xla")
        xla_attention_prefill = xla_attention.prefill_forward()
        xla_attention_prefill()  # compile
        times = {"kernel_ms": [], "xla_ms": []}
        for _ in range(3):
            times["kernel_ms"].append(statistics.median(timed(prefill, 3)) * 1e3)
            times["xla_ms"].append(statistics.median(timed(xla_attention_prefill, 3)) * 1e3)
        attention_ab = {k: summary(v) for k, v in times.items()}
        del xla_attention, xla_attention_prefill
    # The same step with XLA's formulation of the decode attention (the block-table gather), side by side.
    xla_parts = None
    if bench.runner.decode_attention != "xla":
        del bench
        xla = DecodeBench(bench_model(), [b], decode_attention="xla")
        xla.step(b)  # compile
        xla_parts = xla.parts(b, steps)
        del xla
    result = {
        "context": CONTEXT,
        "matmul_gflops": summary([r["flops"] / 1e9 for r in rates_all]),  # per repeat: max(before, after)
        "matmul_gflops_before_after": [[r["flops_before"] / 1e9, r["flops_after"] / 1e9] for r in rates_all],
        "memory_gbps": summary([r["bandwidth"] / 1e9 for r in rates_all]),
        "numpy_gbps": summary([r["numpy_bandwidth"] / 1e9 for r in rates_all]),
        "numpy_copy_gbps": summary([r["numpy_copy_bandwidth"] / 1e9 for r in rates_all]),
        "memory_vs_numpy": summary([r["bandwidth"] / r["numpy_bandwidth"] for r in rates_all]),
        "decode": decode,
        "prefill": {"tokens": PREFILL_ROWS * PREFILL_LEN, "rows": PREFILL_ROWS, "step_ms": summary(prefill_ms),
                    "gflops": prefill_flops(cfg) / 1e9, "share_of_matmul_rate": summary(prefill_share),
                    "repeats": prefill_repeats},
        "parts_ms": parts,
        "decode_attention": "cpu-kernel" if xla_parts is not None else "xla",
        "xla_attention_parts_ms": xla_parts,
        "dense_matmuls_ms": dense_ms,
        "torch_dense_matmuls_ms": summary(lib_ms["torch"]),
        "numpy_dense_matmuls_ms": summary(lib_ms["numpy"]),
        "dense_matmuls_2x_ms": summary(double_ms),  # XLA, 2 x the headline rows, same rounds
        "dense_matmuls_fixed_ms": summary(fixed_ms),  # 2 t(64) - t(128), per round
        "matmul_share_64": {lib: summary(v) for lib, v in shares.items()},  # of the 2048³ rate, same round
        "layer_loop_ms": layer_loop,
        "decode_layers": bench_layers,
        "dense_matmuls": bench_dense,  # the runner's choice: "cpu-kernel" (weights in panels) or "xla"
        "kernel_dense_matmuls_ms": layer_loop[b]["kernel_ms"],  # the CPU dense kernel over panels, same rounds
        "dense_kernel_vs_xla": dense_ab,  # the runner's decode step both ways, alternated
        "prefill_attention_vs_xla": attention_ab,  # the prefill forward, its attention both ways, alternated
        "few_row_dots": bench_dots,
        "few_row_dots_rows": list(cpu_dots.FEW_ROWS),
        "unrolled_vs_scan": layers_ab,
        "first_step_s": first_step_s,
        "kv_gather_ms": gather_ms,
        "weight_bytes": step_cost(cfg, b)[1],
        "matmul_params": matmul_params,
        "kv_bytes_needed": kv_bytes(cfg, b, CONTEXT + 1),
        "kv_bytes_gathered": kv_bytes(cfg, b, slots),
        "kv_slots_gathered": slots,
    }
    return result


def bench_model() -> str:
    """The 124M-parameter fp32 benchmark checkpoint (generated on first use)."""
    from pipejax.runner.builtin_model import cache_dir_from_env, ensure_builtin_model

    return str(ensure_builtin_model("bench", cache_dir_from_env(os.environ)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="write the figures here")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (median and min-max reported)")
    parser.add_argument("--quick", action="store_true", help="the headline batch only, fewer steps")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    with open(args.json, "w") as f:
        json.dump(run(args), f, indent=1)


if __name__ == "__main__":
    main()
