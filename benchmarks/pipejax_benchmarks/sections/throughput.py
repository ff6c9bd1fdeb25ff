"""Offline output tokens/s of pipejax next to transformers' batched ``generate`` on the same checkpoint.

``c`` concurrent requests x 128 prompt tokens x 64 output tokens (random ids, ignore_eos, sampling at
temperature 1 on both sides), for c in 1, 2, 4, 8, 16, 32, 64 (--quick: 1, 16, 64); c = 64 is the
headline figure, also timed with greedy decoding on both sides. Each engine runs in a fresh process of its own,
started for this section: pipejax pp=1 tp=1 in-process with ``LLM(model)``'s defaults (one engine for every c,
compiled by an untimed run of each c), transformers one ``generate`` over all c prompts (fp32, CPU, its default
threads). The timed runs alternate between the two processes, so both see the same machine load; the ratio is
taken per repeat. The headline run's step trace splits pipejax's time into prefill steps, decode steps and the
engine around them. Without --quick, the headline workload also runs in bf16 on both sides (a reported row, no
goal).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from pipejax_benchmarks.sections.common import (
    INPUT_LEN,
    NUM_PROMPTS,
    OUTPUT_LEN,
    CpuMeter,
    EngineProcess,
    bench_model,
    compiled_shapes,
    engine_buckets,
    machine_rates,
    prompts,
    section_main,
    summary,
)


class BatchRecorder:
    """Wraps an engine's ``executor.execute_model`` to note each batch's composition and the padded
    shape it runs at (benchmark-side only)."""

    def __init__(self, llm):
        executor = llm.engine.executor
        self.batches: dict[int, dict[str, Any]] = {}
        self._inner = executor.execute_model
        executor.execute_model = self
        self._buckets, self._block_size = engine_buckets(llm), llm.engine.config.cache.block_size

    def __call__(self, batch):
        ctx = 0
        for r in batch.requests:  # sum over the step's tokens of the positions they attend to
            n, s = len(r.token_ids), r.start_position
            ctx += n * s + n * (n + 1) // 2
        self.batches[batch.step_id] = {
            "tokens": batch.num_tokens,
            "rows": len(batch.requests),
            "sampled": sum(1 for r in batch.requests if r.sample),
            "prefill": any(len(r.token_ids) > 1 for r in batch.requests),
            "attended": ctx,
            "shape": list(self._buckets.shape_of(batch, self._block_size)),
        }
        return self._inner(batch)


def _dims(cfg):
    E, F, H, K, D, V, L = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                           cfg.vocab_size, cfg.num_layers)
    return E, F, H, K, D, V, L, E * H * D + 2 * E * K * D + H * D * E + 3 * E * F


def step_flops(cfg, tokens: int, attended: int, sampled: int) -> float:
    """Useful FLOPs of a whole-model step: every layer weight once per token, the LM head once per
    sampled row, attention once per (token, position it attends to)."""
    E, F, H, K, D, V, L, per_layer = _dims(cfg)
    return 2.0 * tokens * L * per_layer + 2.0 * E * V * sampled + 4.0 * L * H * D * attended


def scored_slots(shape: list[int], block_size: int) -> int:
    """(query, context slot) pairs the padded step scores per head and layer: each prefill row's query chunks
    against the context they can see (``model.prefill_chunks``), each decode row against C = B x block_size
    slots (an upper bound: the CPU kernel reads only the row's visible slots); the prefill rows' context is
    their own Bp blocks where the shape has them."""
    from pipejax.runner.model import prefill_chunks

    _, P, Q, Rd, B, Bp = shape[:6]  # (a step that also returns prompt hidden states scores the same)
    C, Cp = B * block_size, (Bp or B) * block_size
    prefill = sum((hi - lo) * c_hi for lo, hi, c_hi in prefill_chunks(Q, Cp)) if P else 0
    return P * prefill + Rd * C


def executed_flops(cfg, shape: list[int], block_size: int) -> tuple[float, float]:
    """(all, attention) FLOPs the padded step runs: T tokens through the layers, the LM head on the
    P + Rd rows, attention over the ``scored_slots``."""
    T, P, Q, Rd = shape[:4]
    E, F, H, K, D, V, L, per_layer = _dims(cfg)
    attention = 4.0 * L * H * D * scored_slots(shape, block_size)
    return 2.0 * T * L * per_layer + 2.0 * E * V * (P + Rd) + attention, attention


def pipejax_run(llm, batch_prompts: list[list[int]], output_len: int = OUTPUT_LEN, greedy: bool = False) -> float:
    from pipejax.runner.batch import SamplingParams

    params = SamplingParams(temperature=0.0 if greedy else 1.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch_prompts], params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    return elapsed


class HFReference:
    """transformers' ``AutoModelForCausalLM.generate`` on the same checkpoint, on the CPU (fp32 unless asked)."""

    def __init__(self, path: str, dtype: str = "float32"):
        import torch
        import transformers

        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        self.threads = torch.get_num_threads()

    def run(self, batch_prompts: list[list[int]], output_len: int = OUTPUT_LEN, greedy: bool = False) -> float:
        torch = self.torch
        ids = torch.tensor(batch_prompts)
        sampling = ({"do_sample": False} if greedy else
                    {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0})
        start = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len, min_new_tokens=output_len,
                pad_token_id=0, **sampling,
            )
        elapsed = time.perf_counter() - start
        assert out.shape == (len(batch_prompts), len(batch_prompts[0]) + output_len)
        return elapsed


def torch_matmul_rate(repeats: int = 5) -> float:
    """FLOP/s of a 2048^3 fp32 matmul in torch (transformers' kernels), next to JAX's."""
    import statistics

    import torch

    from pipejax_benchmarks.sections.common import timed

    a = torch.ones(2048, 2048)
    return 2 * 2048**3 / statistics.median(timed(lambda: a @ a, repeats))


def trace_breakdown(llm, batches: dict[int, dict[str, Any]], wall: float, rates: dict[str, float]) -> dict[str, Any]:
    """Where a run's wall time went, from the stage step trace of its ``batches``: prefill steps (with
    the FLOP rate they reached, next to the measured matmul rate), decode steps, and the engine around them."""
    from pipejax.runner.inputs import pick

    cfg = llm.engine.model_config
    buckets = engine_buckets(llm)
    block_size = llm.engine.config.cache.block_size
    trace = [(s, end - start) for _, s, start, end in llm.engine.executor.step_trace() if s in batches]
    out: dict[str, Any] = {"wall_s": wall, "matmul_gflops": rates["flops"] / 1e9,
                           "torch_matmul_gflops": rates.get("torch_flops", float("nan")) / 1e9}
    for kind in ("prefill", "decode"):
        steps = [(batches[s], t) for s, t in trace if batches[s]["prefill"] == (kind == "prefill")]
        seconds = sum(t for _, t in steps)
        flops = sum(step_flops(cfg, b["tokens"], b["attended"], b["sampled"]) for b, _ in steps)
        E, F, H, K, D, V, L, _ = _dims(cfg)
        executed = [executed_flops(cfg, b["shape"], block_size) for b, _ in steps if b.get("shape")]
        out[kind] = {
            "steps": len(steps),
            "seconds": seconds,
            "tokens": sum(b["tokens"] for b, _ in steps),
            "padded_tokens": sum(pick(buckets.tokens, b["tokens"], "tokens") for b, _ in steps),
            "flops": flops,
            "attention_flops": sum(4.0 * L * H * D * b["attended"] for b, _ in steps),
            "executed_flops": sum(x for x, _ in executed) if executed else None,
            "executed_attention_flops": sum(a for _, a in executed) if executed else None,
            # fp32 attention scores of the [rows, heads, query, context] blocks, all layers
            "score_bytes": sum(4 * L * H * scored_slots(b["shape"], block_size) for b, _ in steps if b.get("shape")),
            "gflops_per_s": flops / seconds / 1e9 if seconds else 0.0,
            "median_step_ms": summary([t * 1e3 for _, t in steps])["median"],
        }
    out["engine_s"] = wall - out["prefill"]["seconds"] - out["decode"]["seconds"]
    # the dots as this engine runs them: the CPU dense kernel or XLA's dot, whichever its stage chose here
    dots = llm.engine.executor.collective_rpc("kernel_selection")[0]["dense_matmuls"]
    out["parts_floor"] = parts_floor(cfg, [batches[s] for s, _ in trace], rates["bandwidth"], dots=dots)
    return out


def parts_floor(cfg, steps: list[dict[str, Any]], bandwidth: float, repeats: int = 3,
                dots: str = "cpu-kernel") -> dict[str, Any]:
    """A floor for the run measured by running its parts, independent of the FLOP count and the 2048³ rate:
    the dense matmuls of each step's tokens as the engine runs them (every layer weight once; the LM head on the
    rows it sampled), timed alone over resident weights (``dense_matmuls.DenseMatmuls``) on ``dots`` ("cpu-kernel": the
    CPU dense kernel over weights in panels; "xla": XLA's dot); plus the K/V bytes each decode token reads once
    at the measured bandwidth."""
    from collections import Counter

    from dense_matmuls import DenseMatmuls  # the runner's benchmarks (common put them on the path)
    from machine_floor import kv_bytes

    matmuls = DenseMatmuls(cfg, panels=dots == "cpu-kernel")
    counts = Counter((b["tokens"], b["sampled"]) for b in steps)
    dots_s = {(t, s): matmuls.seconds(t, s, repeats) for t, s in counts}
    dense = sum(n * dots_s[key] for key, n in counts.items())
    kv_s = kv_bytes(cfg, 1, sum(b["attended"] for b in steps if not b["prefill"])) / bandwidth
    return {"dots_s": dense, "kv_s": kv_s, "seconds": dense + kv_s, "dots": dots,
            "shapes": [[t, s, n, dots_s[(t, s)]] for (t, s), n in sorted(counts.items())]}


class PipejaxSide:
    """pipejax's side, in its own process: an ``LLM`` (pp=1 tp=1 in-process, its defaults) that compiled every
    shape the ``levels`` meet by an untimed run of each, whole (with the defaults' prefill chunks, a run of 8
    output tokens met fewer mixed prefill + decode shapes than one of 64)."""

    def __init__(self, path: str, levels: list[int], dtype: str | None = None, engine_args: dict | None = None):
        from pipejax.ray_executor.llm import LLM

        start = time.perf_counter()
        # the settings a user gets: LLM(model) with its defaults (the KV cache, batching limits and kernels are
        # its own choices) unless ``engine_args`` names some; only the step trace is kept, for the breakdown
        self.llm = LLM(path, warmup=False, **({"dtype": dtype} if dtype else {}), **(engine_args or {}),
                       step_trace_len=1 << 14)
        self.engine_args = engine_args or {}
        self.build_s = time.perf_counter() - start
        self.recorder = BatchRecorder(self.llm)
        self.prompts = prompts(NUM_PROMPTS, INPUT_LEN, self.llm.engine.model_config.vocab_size)
        start = time.perf_counter()
        for c in levels:  # the whole run: which mixed prefill + decode steps occur depends on its length
            pipejax_run(self.llm, self.prompts[:c])
        pipejax_run(self.llm, self.prompts[:max(levels)], greedy=True)
        self.warm_s = time.perf_counter() - start
        self.compiled_before = compiled_shapes(self.llm)

    def run(self, c: int, breakdown: bool = False, greedy: bool = False) -> dict[str, Any]:
        """One timed run of ``c`` prompts: seconds, this process's cores, and (``breakdown``) where the time
        went, with the machine's rates measured right after."""
        meter = CpuMeter().start()
        n_before = len(self.llm.engine.executor.step_trace())
        seconds = pipejax_run(self.llm, self.prompts[:c], greedy=greedy)
        out: dict[str, Any] = {"seconds": seconds, "meter": meter.stop()}
        if breakdown:
            recent = {s for _, s, _, _ in self.llm.engine.executor.step_trace()[n_before:]}
            batches = {s: b for s, b in self.recorder.batches.items() if s in recent}
            out["breakdown"] = trace_breakdown(self.llm, batches, seconds, machine_rates())
        return out

    def info(self) -> dict[str, Any]:
        buckets = engine_buckets(self.llm)
        limits, cache = self.llm.engine.config.scheduler, self.llm.engine.executor.kv_cache
        settings = ", ".join(f"{k}={v}" for k, v in self.engine_args.items()) or "defaults"
        return {"build_s": self.build_s, "warm_runs_s": self.warm_s, "settings": f"LLM(model) {settings}",
                "max_num_seqs": limits.max_num_seqs, "max_num_batched_tokens": limits.max_num_batched_tokens,
                "kv_cache": cache.describe(), "kernels": self.llm.engine.executor.collective_rpc("kernel_selection")[0],
                "smallest_buckets": {"tokens": buckets.tokens[0], "rows": buckets.rows[0]},
                "shapes_compiled_during_timed_runs": compiled_shapes(self.llm) - self.compiled_before}

    def close(self) -> None:
        self.llm.shutdown()


class HFSide:
    """transformers' side, in its own process (warmed up by a short ``generate``)."""

    def __init__(self, path: str, levels: list[int], dtype: str = "float32"):
        self.hf = HFReference(path, dtype)
        self.prompts = prompts(NUM_PROMPTS, INPUT_LEN, self.hf.model.config.vocab_size)
        self.hf.run(self.prompts[:2], 4)
        self.hf.run(self.prompts[:2], 4, greedy=True)

    def run(self, c: int, greedy: bool = False) -> dict[str, Any]:
        meter = CpuMeter().start()
        seconds = self.hf.run(self.prompts[:c], greedy=greedy)
        return {"seconds": seconds, "meter": meter.stop()}

    def info(self) -> dict[str, Any]:
        return {"hf_threads": self.hf.threads, "torch_matmul_gflops": torch_matmul_rate() / 1e9}


def run(args: argparse.Namespace) -> dict[str, Any]:
    levels = [1, 16, NUM_PROMPTS] if args.quick else [1, 2, 4, 8, 16, 32, NUM_PROMPTS]
    path = bench_model()
    # Each engine in a fresh process of its own (torch's and XLA's runtimes never share one), built and
    # warmed up before any timed run; the timed runs alternate between them.
    with EngineProcess(PipejaxSide, path, levels) as pj_side, EngineProcess(HFSide, path, levels) as hf_side:
        pj: dict[int, list[float]] = {c: [] for c in levels}
        ref: dict[int, list[float]] = {c: [] for c in levels}
        cores: dict[str, list[dict[str, float]]] = {"pj": [], "hf": []}  # at the headline concurrency
        breakdown, breakdown_low = None, None
        greedy: dict[str, list[float]] = {"pj": [], "hf": []}  # the headline concurrency, greedy on both sides
        for r in range(args.repeats):
            for c in sorted(levels, reverse=True):
                first_pj = (r + c) % 2 == 0  # alternate who goes first
                for who in ("pj", "hf") if first_pj else ("hf", "pj"):
                    traced = who == "pj" and c in (NUM_PROMPTS, levels[0]) and r == args.repeats - 1
                    out = pj_side.call("run", c, traced) if who == "pj" else hf_side.call("run", c)
                    (pj if who == "pj" else ref)[c].append(c * OUTPUT_LEN / out["seconds"])
                    if traced and c == NUM_PROMPTS:
                        breakdown = out["breakdown"]
                    elif traced:
                        breakdown_low = out["breakdown"]
                    if c == NUM_PROMPTS:
                        cores[who].append(out["meter"])
            for who in ("hf", "pj") if r % 2 == 0 else ("pj", "hf"):
                out = pj_side.call("run", NUM_PROMPTS, False, True) if who == "pj" else \
                    hf_side.call("run", NUM_PROMPTS, True)
                greedy[who].append(NUM_PROMPTS * OUTPUT_LEN / out["seconds"])
        pj_info, hf_info = pj_side.call("info"), hf_side.call("info")
    if breakdown:
        breakdown["torch_matmul_gflops"] = hf_info["torch_matmul_gflops"]
    result: dict[str, Any] = {
        "workload": {"requests": NUM_PROMPTS, "input_len": INPUT_LEN, "output_len": OUTPUT_LEN},
        "levels": levels,
        "pipejax_tps": {c: summary(v) for c, v in pj.items()},
        "hf_tps": {c: summary(v) for c, v in ref.items()},
        "ratio": {c: summary([a / b for a, b in zip(pj[c], ref[c], strict=True)]) for c in levels},
        "engine": {"layout": "pp=1 tp=1 (in-process)", **{k: pj_info[k] for k in (
            "settings", "max_num_seqs", "max_num_batched_tokens", "kv_cache", "kernels", "build_s", "warm_runs_s")}},
        "processes": "each engine in a fresh process of its own, the timed runs alternating between them",
        "hf_threads": hf_info["hf_threads"],
        "cores_busy": {"pipejax": summary([c["cores"] for c in cores["pj"]]),
                       "transformers": summary([c["cores"] for c in cores["hf"]])},
        "machine_busy": {"pipejax": summary([c["machine_busy"] for c in cores["pj"]]),
                         "transformers": summary([c["machine_busy"] for c in cores["hf"]])},
        "greedy": {"pipejax_tps": summary(greedy["pj"]), "hf_tps": summary(greedy["hf"]),
                   "ratio": summary([a / b for a, b in zip(greedy["pj"], greedy["hf"], strict=True)])},
        "breakdown": breakdown,
        "breakdown_low": breakdown_low,  # at the lowest concurrency
        "smallest_buckets": pj_info["smallest_buckets"],
        "shapes_compiled_during_timed_runs": pj_info["shapes_compiled_during_timed_runs"],
    }
    if not args.quick:
        result["bf16"] = bf16_pair(path, 1)  # one run each: a reported row (pipejax bf16 is slow)
    return result


def bf16_pair(path: str, repeats: int) -> dict[str, Any]:
    """The headline workload in bf16 on both sides, alternating (a reported row, no goal): torch's bf16
    matmuls use the CPU's AMX units, XLA:CPU has no AMX path, so this compares kernels more than engines."""
    pj, ref = [], []
    with (EngineProcess(PipejaxSide, path, [NUM_PROMPTS], "bfloat16") as pj_side,
          EngineProcess(HFSide, path, [NUM_PROMPTS], "bfloat16") as hf_side):
        for r in range(repeats):
            for who in ("pj", "hf") if r % 2 == 0 else ("hf", "pj"):
                side, tps = (pj_side, pj) if who == "pj" else (hf_side, ref)
                tps.append(NUM_PROMPTS * OUTPUT_LEN / side.call("run", NUM_PROMPTS)["seconds"])
    return {"pipejax_tps": summary(pj), "hf_tps": summary(ref),
            "ratio": summary([a / b for a, b in zip(pj, ref, strict=True)])}


if __name__ == "__main__":
    section_main(run, __doc__)
