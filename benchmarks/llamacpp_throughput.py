"""One llama.cpp throughput probe (llama-cpp-python) of a GGUF file: greedy, EOS ignored; prints one JSON line.

pipejax's CPU peer, run by packages/runner/benchmarks/gguf_bench.py (its ``llamacpp`` side, concurrency 1) in a
fresh process per measurement, next to the pipejax and transformers probes. Needs only llama-cpp-python (and the
numpy it depends on), so it can run under another interpreter than the driver's (gguf_bench.py
--llamacpp-python).

    python benchmarks/llamacpp_throughput.py MODEL PROMPTS_JSON OUTPUT_LEN [--threads 2] [--n-ctx 512]
    python benchmarks/llamacpp_throughput.py MODEL --text "Once upon a time" 128

PROMPTS_JSON: a list of prompts, each a list of token ids (as given: no BOS added) or a string (tokenized by the
model's tokenizer, BOS as its GGUF metadata says). The prompts run one after another (llama.cpp's one sequence,
the KV cache cleared between them), not as a batch. Each one: ``Llama.eval`` of the prompt, then OUTPUT_LEN
times the argmax of the last logits (greedy: temperature 0, top_k 1), fed back with ``eval``: exactly OUTPUT_LEN
new tokens whatever they are (no stop on EOS). The workload runs once untimed (the mmap'ed weights paged in),
then once timed, prefill included, as the other probes time theirs. Output: ``load_s`` (``Llama(...)``),
``seconds`` (the timed pass), ``output_tokens``, ``tokens`` (per prompt), ``prompt_tokens``, ``threads``,
``version``, ``system_info`` (the CPU features llama.cpp was built with).
"""

from __future__ import annotations

import argparse
import json
import time


def greedy(llm, prompt: list[int], output_len: int, n_vocab: int) -> list[int]:
    """``output_len`` new tokens after ``prompt``, each the argmax of the previous position's logits."""
    import llama_cpp
    import numpy as np

    llm.reset()
    out: list[int] = []
    batch = prompt
    for _ in range(output_len):
        llm.eval(batch)  # logits for the batch's last token only (logits_all=False)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        batch = [int(np.argmax(logits))]
        out.append(batch[0])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="the .gguf file")
    parser.add_argument("prompts", nargs="?", help="JSON file: a list of prompts (token id lists or strings)")
    parser.add_argument("output_len", type=int, help="new tokens per prompt")
    parser.add_argument("--text", default=None, help="one text prompt instead of PROMPTS_JSON")
    parser.add_argument("--threads", type=int, default=2, help="n_threads and n_threads_batch")
    parser.add_argument("--n-ctx", type=int, default=512)
    parser.add_argument("--no-warmup", action="store_true", help="time the first pass")
    args = parser.parse_args()
    if (args.prompts is None) == (args.text is None):
        parser.error("give PROMPTS_JSON or --text, not both")
    if args.text is not None:
        prompts = [args.text]
    else:
        with open(args.prompts) as f:
            prompts = json.load(f)

    import llama_cpp

    start = time.perf_counter()
    llm = llama_cpp.Llama(model_path=args.model, n_threads=args.threads, n_threads_batch=args.threads,
                          n_ctx=args.n_ctx, verbose=False)
    load_s = time.perf_counter() - start
    ids = [llm.tokenize(p.encode()) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
    longest = max(map(len, ids)) + args.output_len
    if longest > args.n_ctx:
        parser.error(f"a prompt and its {args.output_len} new tokens take {longest} positions > --n-ctx {args.n_ctx}")
    n_vocab = llm.n_vocab()

    def workload() -> list[list[int]]:
        return [greedy(llm, p, args.output_len, n_vocab) for p in ids]

    if not args.no_warmup:
        workload()
    start = time.perf_counter()
    tokens = workload()
    seconds = time.perf_counter() - start
    info = llama_cpp.llama_print_system_info()
    print(json.dumps({"load_s": load_s, "seconds": seconds, "output_tokens": sum(map(len, tokens)),
                      "tokens": tokens, "prompt_tokens": sum(map(len, ids)), "threads": args.threads,
                      "version": llama_cpp.__version__,
                      "system_info": info.decode() if isinstance(info, bytes) else str(info)}))


if __name__ == "__main__":
    main()
