"""The runner against Hugging Face transformers (fp32, CPU) on checkpoints transformers saves itself."""

import numpy as np
import pytest
from hf_oracle import ARCHS, ChainedStages, greedy_generate, hf_greedy, hf_logits, make_hf_checkpoint, prefill_batch

# pp x tp <= 8 on 8 simulated devices; pp=3 uses an explicit uneven partition of the 6 layers.
LAYOUTS = [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (3, 1), (3, 2), (4, 1), (4, 2)]
PARTITION = {3: "1,3,2"}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(20, 45)), [17] * 13]


@pytest.fixture(scope="module", params=sorted(ARCHS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = make_hf_checkpoint(path, request.param)
    return path, model


@pytest.mark.parametrize("pp,tp", LAYOUTS, ids=[f"pp{p}tp{t}" for p, t in LAYOUTS])
def test_logits_match_transformers(checkpoint, pp, tp):
    path, model = checkpoint
    expected = hf_logits(model, PROMPTS)
    got = ChainedStages(path, pp, tp, PARTITION.get(pp)).logits(prefill_batch(PROMPTS))
    for prompt, want, have in zip(PROMPTS, expected, got, strict=True):
        rel = np.abs(have - want).max() / np.abs(want).max()
        assert rel < 1e-4, f"prompt of {len(prompt)} tokens: max relative logit error {rel:.2e}"


# Decode rows attend with the CPU kernel ("cpu-kernel", the default here) or XLA's formulation (TPU, bf16); decode
# steps run the layers unrolled over per-layer views of the weights (the default on CPU) or as a scan (elsewhere);
# the 4-row decode steps' dots run on YNNPACK or XLA's own dot (``cpu_dots``: measured by default), both tested here.
@pytest.mark.parametrize(
    "pp,tp,chunk,attention,layers,dots",
    [(1, 1, None, "cpu-kernel", "unrolled", "eigen"), (2, 2, 4, "cpu-kernel", "unrolled", "ynnpack"),
     (4, 2, 5, "cpu-kernel", "unrolled", "eigen"), (1, 1, None, "xla", "scan", "ynnpack"),
     (2, 2, 4, "xla", "scan", "eigen")],
    ids=["pp1tp1-eigen", "pp2tp2-chunk4-ynnpack", "pp4tp2-chunk5-eigen", "pp1tp1-xla-scan-ynnpack",
         "pp2tp2-chunk4-xla-scan-eigen"],
)
def test_greedy_decode_matches_generate(checkpoint, pp, tp, chunk, attention, layers, dots):
    path, model = checkpoint
    expected = hf_greedy(model, PROMPTS, 32)
    stages = ChainedStages(path, pp, tp, num_blocks=80, decode_attention=attention, decode_layers=layers,
                           few_row_dots=dots)
    assert [(s.decode_attention, s.decode_layers, s.few_row_dots) for s in stages.stages] == [
        (attention, layers, dots)] * pp
    assert greedy_generate(stages, PROMPTS, 32, chunk=chunk) == expected


@pytest.mark.parametrize(
    "chunk,attention,layers", [(None, "cpu-kernel", "unrolled"), (4, "cpu-kernel", "unrolled"), (4, "xla", "scan")],
    ids=["whole-prompts", "chunk4", "chunk4-xla-scan"],
)
def test_sliding_window_decode_matches_generate(tmp_path, chunk, attention, layers):
    """Mistral with a window shorter than the prompts and the decode: both attention paths (the
    prefill rows' dense one and the decode rows' streaming one) must drop the same old positions."""
    model = make_hf_checkpoint(tmp_path, "MistralForCausalLM", sliding_window=8)
    expected = hf_greedy(model, PROMPTS, 24)
    stages = ChainedStages(tmp_path, 1, 1, num_blocks=80, decode_attention=attention, decode_layers=layers)
    got = greedy_generate(stages, PROMPTS, 24, chunk=chunk)
    assert got == expected
