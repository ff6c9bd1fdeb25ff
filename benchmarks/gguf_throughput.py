"""One pipejax throughput probe of SmolLM2 (the GGUF file): ``LLM`` pp1 tp1 fp32, greedy, ignore_eos.

Run by packages/runner/benchmarks/gguf_bench.py in a fresh process per measurement (next to its
transformers and llama.cpp probes); prints one JSON line. The workload runs once untimed (compiling every
bucket it meets), then once timed. ``--quantization gguf`` keeps the file's Q8_0/Q4_1 tensors quantized
(``LLM(quantization="gguf")``); without it they are dequantized to fp32 as they load:

    python benchmarks/gguf_throughput.py MODEL PROMPTS_JSON OUTPUT_LEN [--quantization gguf]
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("PIPEJAX_CPU_KERNEL_BUILD", "wait")  # one formulation throughout the timed runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("prompts", help="JSON file: a list of prompts, each a list of token ids")
    parser.add_argument("output_len", type=int)
    parser.add_argument("--quantization", default=None, help="LLM(quantization=...): e.g. gguf (default: float)")
    args = parser.parse_args()
    model, output_len = args.model, args.output_len
    with open(args.prompts) as f:
        prompts = json.load(f)

    from pipejax.ray_executor import LLM, SamplingParams

    start = time.perf_counter()
    # max_model_len bounds the KV cache to the workload (the default sizes it for 8192-token contexts).
    max_model_len = max(256, max(map(len, prompts), default=0) + output_len)
    llm = LLM(model=model, pipeline_parallel_size=1, tensor_parallel_size=1, dtype="float32",
              max_num_seqs=max(len(prompts), 1), max_model_len=max_model_len, quantization=args.quantization)
    startup = time.perf_counter() - start
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(requests, params)  # warm-up: the same workload, untimed
    start = time.perf_counter()
    outputs = llm.generate(requests, params)
    elapsed = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    llm.shutdown()
    print(json.dumps({"seconds": elapsed, "output_tokens": sum(map(len, tokens)), "startup_s": startup,
                      "quantization": args.quantization, "tokens": tokens}))


if __name__ == "__main__":
    main()
