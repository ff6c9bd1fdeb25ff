"""Output tokens/s of pipejax's ``LLM`` against transformers' batched ``generate`` on a Mixture-of-Experts model
(issue 40).

    python benchmarks/moe_throughput.py --json OUT [--repeats 3] [--levels 1 64] [--checkpoint DIR] [--dense-twin]
        [--max-num-batched-tokens N] [--tiny]

The model: a Qwen3-MoE checkpoint of random weights made by transformers (fp32, ``save_pretrained``; the runner
benchmarks' ``moe_models``: hidden 512, 8 layers, 8 experts of width 1024, top 2; 123M parameters, 48M active),
in a temporary folder unless ``--checkpoint`` names one (made there if it holds none). The workload and the two
sides are the throughput section's (``pipejax_benchmarks.sections.throughput``): c requests x 128 prompt tokens
(random ids) -> 64 output tokens, ignore_eos, greedy on both sides; pipejax with ``LLM(model)``'s defaults (pp=1
tp=1, in-process), compiled by an untimed run of each c; transformers one ``generate`` over the c prompts (fp32,
its default threads and MoE experts implementation). Each side in a fresh process of its own; the timed runs
alternate between them (who goes first alternating too) and the ratio is taken per repeat. Goal: >= 2x at c = 1
and 64. Next to each pipejax run: its time in prefill steps and in decode steps (the stage step trace). With
``--dense-twin``, a third side in the rotation: pipejax on the dense model of the same active parameters (the MoE's
hidden size, layers and heads, an FFN of top_k x the expert width), which bounds what the MoE can reach.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # pipejax_benchmarks (and, through it, the runner's)
from pipejax_benchmarks.sections.common import (  # noqa: E402
    INPUT_LEN,
    OUTPUT_LEN,
    EngineProcess,
    load_average,
    summary,
)
from pipejax_benchmarks.sections.throughput import HFSide, PipejaxSide  # noqa: E402

GOAL = 2.0


class PipejaxMoeSide(PipejaxSide):
    """The throughput section's pipejax side; each greedy run also split into its prefill and decode steps."""

    def run_split(self, c: int) -> dict[str, Any]:
        executor = self.llm.engine.executor
        before = len(executor.step_trace())
        out = self.run(c, greedy=True)
        steps = [(self.recorder.batches[s]["prefill"], end - start)
                 for _, s, start, end in executor.step_trace()[before:] if s in self.recorder.batches]
        decode = [t for prefill, t in steps if not prefill]
        return out | {"prefill_s": sum(t for prefill, t in steps if prefill), "decode_s": sum(decode),
                      "decode_steps": len(decode), "decode_step_ms": statistics.median(decode) * 1e3 if decode else 0}


class HFMoeSide(HFSide):
    def info(self) -> dict[str, Any]:
        return super().info() | {"experts_implementation": self.hf.model.config._experts_implementation}


def measure(path: str, levels: list[int], repeats: int, twin: str | None = None,
            engine_args: dict | None = None) -> dict[str, Any]:
    """Each side's timed runs, alternating (``twin``: also pipejax on the dense model of the same active
    parameters, a third side in the rotation; ``engine_args``: ``LLM`` arguments of both pipejax sides, instead of
    its defaults)."""
    pj: dict[int, list[dict[str, Any]]] = {c: [] for c in levels}
    ref: dict[int, list[float]] = {c: [] for c in levels}
    twin_runs: dict[int, list[dict[str, Any]]] = {c: [] for c in levels}
    with contextlib.ExitStack() as stack:
        sides = {"pj": stack.enter_context(EngineProcess(PipejaxMoeSide, path, levels, None, engine_args)),
                 "hf": stack.enter_context(EngineProcess(HFMoeSide, path, levels))}
        if twin:
            sides["twin"] = stack.enter_context(EngineProcess(PipejaxMoeSide, twin, levels, None, engine_args))
        names = list(sides)
        for r in range(repeats):
            for c in sorted(levels, reverse=True):
                shift = (r + c) % len(names)
                for who in names[shift:] + names[:shift]:
                    if who == "hf":
                        ref[c].append(sides["hf"].call("run", c, True)["seconds"])
                    else:
                        (pj if who == "pj" else twin_runs)[c].append(sides[who].call("run_split", c))
        pj_info, hf_info = sides["pj"].call("info"), sides["hf"].call("info")
    out: dict[str, Any] = {"levels": levels, "pipejax_tps": {}, "hf_tps": {}, "ratio": {}, "pipejax_steps": {}}
    if twin:
        out |= {"dense_twin": twin, "twin_tps": {}, "twin_over_hf": {}, "moe_over_twin": {}}
    for c in levels:
        tps = [c * OUTPUT_LEN / run["seconds"] for run in pj[c]]
        hf_tps = [c * OUTPUT_LEN / s for s in ref[c]]
        if twin:  # per round: the dense twin against transformers' MoE, and pipejax's MoE against the twin
            twin_tps = [c * OUTPUT_LEN / run["seconds"] for run in twin_runs[c]]
            out["twin_tps"][c] = summary(twin_tps)
            out["twin_over_hf"][c] = summary([t / h for t, h in zip(twin_tps, hf_tps, strict=True)])
            out["moe_over_twin"][c] = summary([m / t for m, t in zip(tps, twin_tps, strict=True)])
        out["pipejax_tps"][c], out["hf_tps"][c] = summary(tps), summary(hf_tps)
        out["ratio"][c] = summary([a / b for a, b in zip(tps, hf_tps, strict=True)])
        out["pipejax_steps"][c] = {k: summary([run[k] for run in pj[c]])
                                   for k in ("seconds", "prefill_s", "decode_s", "decode_step_ms")}
        out["pipejax_steps"][c]["decode_steps"] = pj[c][0]["decode_steps"]
    cores = {c: summary([run["meter"]["cores"] for run in pj[c]]) for c in levels}
    out["engine"] = {k: pj_info[k] for k in ("settings", "max_num_seqs", "max_num_batched_tokens", "kv_cache",
                                             "kernels", "build_s", "warm_runs_s", "shapes_compiled_during_timed_runs")}
    out["pipejax_cores_busy"] = cores
    out["transformers"] = hf_info
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="write the figures here")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each side (median and min-max)")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 64], help="concurrencies (at most 64)")
    parser.add_argument("--checkpoint", default=None, help="the model's folder (made there when it has no model)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model: a smoke run")
    parser.add_argument("--dense-twin", action="store_true",
                        help="also pipejax on the dense model of the same active parameters (its FFN top_k x the "
                             "expert width; made next to the MoE checkpoint): what the MoE's tok/s is bounded by")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="the pipejax sides' token budget per step (default: LLM's own)")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from moe_models import MoeSizes, make_checkpoint  # the runner's benchmarks (common put them on the path)

    sizes = MoeSizes.tiny() if args.tiny else MoeSizes()
    folder = Path(args.checkpoint or tempfile.mkdtemp(prefix="pipejax-moe-"))
    try:
        if not (folder / "config.json").exists():
            make_checkpoint(folder, sizes)
        twin = folder / "dense-twin" if args.dense_twin else None
        if twin is not None and not (twin / "config.json").exists():
            make_checkpoint(twin, sizes, dense=True)
        result = {"load_start": load_average(), "sizes": vars(sizes), "parameters": sizes.counts(),
                  "workload": {"input_len": INPUT_LEN, "output_len": OUTPUT_LEN, "greedy": True}, "goal": GOAL}
        engine_args = {"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else None
        result |= measure(str(folder), args.levels, args.repeats, twin and str(twin), engine_args)
        result["load_end"] = load_average()
    finally:
        if not args.checkpoint:
            shutil.rmtree(folder, ignore_errors=True)
    print("| c | pipejax output tok/s | transformers output tok/s | ratio | pipejax prefill / decode s (step ms) |")
    print("|---:|---:|---:|---:|---|")
    for c in args.levels:
        p, h, r, s = (result[k][c] for k in ("pipejax_tps", "hf_tps", "ratio", "pipejax_steps"))
        print(f"| {c} | {p['median']:.1f} [{p['min']:.1f}-{p['max']:.1f}] | {h['median']:.1f} [{h['min']:.1f}-"
              f"{h['max']:.1f}] | {r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}] | {s['prefill_s']['median']:.2f}"
              f" / {s['decode_s']['median']:.2f} ({s['decode_step_ms']['median']:.1f}) |")
    if args.dense_twin:
        print("\n| c | pipejax dense twin tok/s | twin / transformers' MoE | pipejax MoE / twin |")
        print("|---:|---:|---:|---:|")
        for c in args.levels:
            t, th, mt = (result[k][c] for k in ("twin_tps", "twin_over_hf", "moe_over_twin"))
            print(f"| {c} | {t['median']:.1f} [{t['min']:.1f}-{t['max']:.1f}] | {th['median']:.2f}x [{th['min']:.2f}-"
                  f"{th['max']:.2f}] | {mt['median']:.2f}x [{mt['min']:.2f}-{mt['max']:.2f}] |")
    Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
