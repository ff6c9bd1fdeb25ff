"""``pipejax bench throughput``: offline throughput in vLLM's format, next to transformers' batched
``generate`` on the same checkpoint, measured in the same run."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def _prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, min(vocab, 256)) for _ in range(length)] for _ in range(num)]


def _pipejax_run(llm, prompts, output_len: int) -> tuple[float, int, int]:
    from pipejax.runner.batch import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True, seed=None)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return elapsed, sum(map(len, prompts)), out_tokens


def _hf_run(model_path: str, prompts, output_len: int, batch_size: int) -> float:
    """Seconds for transformers (fp32, CPU) to generate ``output_len`` tokens for every prompt."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(prompts), batch_size):
            ids = torch.tensor(prompts[i : i + batch_size])
            model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len, min_new_tokens=output_len,
                do_sample=False, pad_token_id=0,
            )
    return time.perf_counter() - start


def hf_batch_size(max_num_seqs: int, num_prompts: int) -> int:
    """transformers' batch where ``--hf-batch-size`` is not given: pipejax's concurrency in the same run
    (every prompt at once, up to the engine's ``max_num_seqs``), so both sides batch alike."""
    return min(max_num_seqs, num_prompts)


def run_throughput(args: argparse.Namespace, make_llm) -> int:
    llm = make_llm(args)
    vocab = llm.engine.model_config.vocab_size
    prompts = _prompts(args.num_prompts, args.input_len, vocab)
    _pipejax_run(llm, prompts, args.output_len)  # compiles every bucket this workload meets
    runs = [_pipejax_run(llm, prompts, args.output_len) for _ in range(args.repeats)]
    times = sorted(r[0] for r in runs)
    elapsed = statistics.median(times)
    in_tokens, out_tokens = runs[0][1], runs[0][2]
    config = llm.engine.config
    layout = f"pp={config.parallel.pipeline_parallel_size} tp={config.parallel.tensor_parallel_size}"
    print(f"pipejax ({layout}, {args.num_prompts} requests x {args.input_len} in x {args.output_len} out, "
          f"median of {args.repeats}, {times[0]:.2f}-{times[-1]:.2f}s)")
    print(
        f"Throughput: {args.num_prompts / elapsed:.2f} requests/s, {(in_tokens + out_tokens) / elapsed:.2f} "
        f"total tokens/s, {out_tokens / elapsed:.2f} output tokens/s"
    )
    result = {
        "layout": layout, "requests_per_s": args.num_prompts / elapsed, "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (in_tokens + out_tokens) / elapsed, "seconds": times,
    }
    model_path, max_num_seqs = config.model.path, config.scheduler.max_num_seqs
    llm.shutdown()
    if not args.no_hf:
        hf_batch = args.hf_batch_size or hf_batch_size(max_num_seqs, args.num_prompts)
        hf_elapsed = _hf_run(model_path, prompts, args.output_len, hf_batch)
        hf_tps = args.num_prompts * args.output_len / hf_elapsed
        print(f"transformers generate (batch {hf_batch}, fp32): {hf_tps:.2f} output tokens/s")
        print(f"ratio pipejax / transformers output tokens/s: {out_tokens / elapsed / hf_tps:.2f}x")
        result.update(hf_output_tokens_per_s=hf_tps, hf_batch_size=hf_batch, ratio=out_tokens / elapsed / hf_tps)
    if getattr(args, "output_json", None):
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
