"""The runner against Hugging Face transformers (fp32, CPU) on checkpoints transformers saves itself."""

import numpy as np
import pytest
from hf_oracle import ARCHS, ChainedStages, greedy_generate, hf_greedy, hf_logits, make_hf_checkpoint, prefill_batch

from pipejax.runner.panels import Panels

# pp x tp <= 8 on 8 simulated devices; pp=3 uses an explicit uneven partition of the 6 layers.
LAYOUTS = [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (3, 1), (3, 2), (4, 1), (4, 2)]
PARTITION = {3: "1,3,2"}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(20, 45)), [17] * 13]

# Pairwise, not the full product (which took half of this package's tests): Llama on every layout, and each
# other architecture where it differs from Llama -- Qwen2's q/k/v biases and Qwen3's q/k norms and head_dim
# 24 under TP and PP, on both decode attention paths. Mistral is Llama plus a sliding window here, which
# ``test_sliding_window_decode_matches_generate`` checks on both paths.
LOGIT_CASES = [("LlamaForCausalLM", pp, tp) for pp, tp in LAYOUTS] + [
    (arch, pp, tp) for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") for pp, tp in [(1, 4), (2, 2), (3, 2)]
] + [("MistralForCausalLM", 1, 1)]
assert {arch for arch, _, _ in LOGIT_CASES} == set(ARCHS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> (checkpoint folder, transformers model), each made once."""
    made = {}

    def get(arch):
        if arch not in made:
            path = tmp_path_factory.mktemp(arch)
            made[arch] = path, make_hf_checkpoint(path, arch)
        return made[arch]

    return get


@pytest.mark.parametrize("arch,pp,tp", LOGIT_CASES, ids=[f"{a}-pp{p}tp{t}" for a, p, t in LOGIT_CASES])
def test_logits_match_transformers(checkpoints, arch, pp, tp):
    path, model = checkpoints(arch)
    expected = hf_logits(model, PROMPTS)
    got = ChainedStages(path, pp, tp, PARTITION.get(pp)).logits(prefill_batch(PROMPTS))
    for prompt, want, have in zip(PROMPTS, expected, got, strict=True):
        rel = np.abs(have - want).max() / np.abs(want).max()
        assert rel < 1e-4, f"prompt of {len(prompt)} tokens: max relative logit error {rel:.2e}"


# Decode rows attend with the CPU kernel ("cpu-kernel", the default here) or XLA's formulation (TPU, bf16); decode
# steps run the layers unrolled over per-layer views of the weights (the default on CPU) or as a scan (elsewhere);
# their dense matmuls run on the CPU dense kernel over weights in panels (the default here) or on XLA's dot, whose
# 4-row decode steps run on YNNPACK or XLA's own dot (``cpu_dots``: measured by default), all tested here.
DECODE = {  # id: (pp, tp, chunk, attention, layers, dense matmuls (the kernel: tp = 1 only), dots)
    "pp1tp1-eigen": (1, 1, None, "cpu-kernel", "unrolled", "xla", "eigen"),
    "pp2tp1-chunk4-kernels": (2, 1, 4, "cpu-kernel", "unrolled", "cpu-kernel", "ynnpack"),
    "pp2tp2-chunk4-ynnpack": (2, 2, 4, "cpu-kernel", "unrolled", "xla", "ynnpack"),
    "pp4tp2-chunk5-eigen": (4, 2, 5, "cpu-kernel", "unrolled", "xla", "eigen"),
    "pp1tp1-xla-scan-ynnpack": (1, 1, None, "xla", "scan", "xla", "ynnpack"),
    "pp2tp2-chunk4-xla-scan-eigen": (2, 2, 4, "xla", "scan", "xla", "eigen"),
}
DECODE_CASES = [("LlamaForCausalLM", name) for name in DECODE] + [
    (arch, name) for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
    for name in ("pp2tp1-chunk4-kernels", "pp2tp2-chunk4-xla-scan-eigen")
]


@pytest.mark.parametrize("arch,case", DECODE_CASES, ids=[f"{a}-{c}" for a, c in DECODE_CASES])
def test_greedy_decode_matches_generate(checkpoints, arch, case):
    pp, tp, chunk, attention, layers, dense, dots = DECODE[case]
    path, model = checkpoints(arch)
    expected = hf_greedy(model, PROMPTS, 32)
    stages = ChainedStages(path, pp, tp, num_blocks=80, decode_attention=attention, decode_layers=layers,
                           dense_matmuls=dense, few_row_dots=dots)
    assert [(s.decode_attention, s.decode_layers, s.dense_matmuls, s.few_row_dots) for s in stages.stages] == [
        (attention, layers, dense, dots)] * pp
    assert greedy_generate(stages, PROMPTS, 32, chunk=chunk) == expected


# Every dense weight a whole number of panels (head_dim 32, F 128, V 256): decode steps' matmuls all run on the
# CPU dense kernel over them (tp = 1), the LM head's too: its own weight, or a tied embedding kept as the head's
# panels (and looked up by their columns); "xla" keeps the weights' own layout.
PANEL_FRIENDLY = dict(hidden_size=128, num_attention_heads=4, intermediate_size=128, vocab_size=256)


def _amx_here() -> bool:
    from pipejax.runner.cpu import dense

    return dense.amx_ready()


@pytest.mark.parametrize("pp,tp,chunk,dense,tied,tiles", [
    (1, 1, None, "cpu-kernel", False, "auto"), (2, 1, 4, "cpu-kernel", True, "auto"), (1, 1, 4, "xla", True, "auto"),
    pytest.param(1, 1, 4, "cpu-kernel", True, "amx",
                 marks=pytest.mark.skipif(not _amx_here(), reason="no AMX bf16 tiles on this CPU")),
    pytest.param(2, 1, 4, "cpu-kernel", False, "amx-kept",
                 marks=pytest.mark.skipif(not _amx_here(), reason="no AMX bf16 tiles on this CPU")),
    (2, 1, 4, "auto", True, "xla-rows")],
    ids=["pp1tp1-kernel", "pp2tp1-chunk4-tied", "pp1tp1-xla-tied", "pp1tp1-chunk4-tied-amx", "pp2tp1-chunk4-amx-kept",
         "pp2tp1-chunk4-tied-xla-rows"])
def test_greedy_decode_with_weights_in_panels_matches_generate(tmp_path, monkeypatch, pp, tp, chunk, dense, tied,
                                                               tiles):
    """Greedy decode over weights in panels matches transformers': on the dense kernel (its tiles as measured, or
    every dense matmul on AMX's bf16 tiles at fp32 accuracy where the CPU has them: "amx" splitting the weight at
    each call, "amx-kept" over its tiles kept from load, the decode steps' per-layer views included), or XLA's dot;
    "xla-rows": a verdict that the kernel runs the decode rows (4) and XLA's dot over the panels the prefill steps
    (from 5 rows)."""
    if tiles == "xla-rows":
        from pipejax.runner.cpu import select as sel

        won = {"decode": {"kernel": 1.0, "xla": 2.0}, "prefill": {"kernel": 1.0, "xla": 2.0}}
        monkeypatch.setattr(sel, "measure", lambda shapes, names: {
            n: {"choice": "cpu-kernel" if n == "dense_matmuls" else "xla", **won} for n in names})
        monkeypatch.setattr(sel, "xla_rows_choice", lambda figures, decode_rows: 5)
        for name, fake in (("_in_process", {}), ("_remembered", lambda path: {}), ("_remember", lambda *a: None)):
            monkeypatch.setattr(sel, name, fake)  # this verdict is neither read nor written anywhere else
    model = make_hf_checkpoint(tmp_path, "LlamaForCausalLM", **PANEL_FRIENDLY, tie_word_embeddings=tied)
    expected = hf_greedy(model, PROMPTS, 32)
    stages = ChainedStages(tmp_path, pp, tp, num_blocks=80, dense_matmuls=dense,
                           dense_tiles="auto" if tiles == "xla-rows" else tiles)
    dense = "cpu-kernel" if tiles == "xla-rows" else dense
    assert [s.dense_matmuls for s in stages.stages] == [dense] * pp
    if tiles == "xla-rows":
        assert [s.selection.dense_xla_rows for s in stages.stages] == [5] * pp
    if tiles == "amx":
        assert [s.selection.dense_amx_rows for s in stages.stages] == [1] * pp
    if tiles == "amx-kept":  # every dense weight keeps its tiles, and the decode layers' views alias them
        assert all(w.tiles is not None for s in stages.stages for w in s.params.values() if isinstance(w, Panels))
        assert all(w.tiles is not None for s in stages.stages for layer in s._decode_params["layers"]
                   for w in layer.values() if isinstance(w, Panels))
    layers = ["layers.down", "layers.gate_up", "layers.o", "layers.qkv"] if dense == "cpu-kernel" else []
    for s in stages.stages:  # every dense weight in panels where the kernel runs; none otherwise
        # the LM head's weight, or the tied embedding wherever a stage holds it (the first stage's too)
        head = (["embed"] if s.stage.has_embedding(s.cfg) else []) if tied else ["lm_head"] if s.stage.is_last else []
        want = sorted(layers + head * (dense == "cpu-kernel"))
        assert sorted(n for n, w in s.params.items() if isinstance(w, Panels)) == want
    assert greedy_generate(stages, PROMPTS, 32, chunk=chunk) == expected


@pytest.mark.parametrize("arch,pp,tp,chunk", [("LlamaForCausalLM", 1, 1, None), ("LlamaForCausalLM", 2, 2, 4),
                                               ("MistralForCausalLM", 1, 1, 4)],
                         ids=["llama-pp1tp1", "llama-pp2tp2-chunk4", "mistral-window8-chunk4"])
def test_prefill_attention_kernel_matches_generate(tmp_path, arch, pp, tp, chunk):
    """The CPU prefill-attention kernel (head dim 32, GQA 4/2), on whole prompts and on chunks after earlier
    context, under shard_map at tp = 2, and with a window shorter than the prompts."""
    window = {"sliding_window": 8} if arch == "MistralForCausalLM" else {}
    model = make_hf_checkpoint(tmp_path, arch, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, **window)
    expected = hf_greedy(model, PROMPTS, 16)
    stages = ChainedStages(tmp_path, pp, tp, num_blocks=80, prefill_attention="cpu-kernel")
    assert [s.prefill_attention for s in stages.stages] == ["cpu-kernel"] * pp
    assert greedy_generate(stages, PROMPTS, 16, chunk=chunk) == expected


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


def test_prefill_beside_deeper_decode_rows_matches_generate(checkpoints):
    """A short prompt arriving while a long one decodes: the step's block tables are as wide as the decode
    row needs (B), and the prefill row's attention reads only its own bucket of them (``prefill_blocks``)."""
    path, model = checkpoints("LlamaForCausalLM")
    prompts = [list(range(3, 75)), [9, 8, 7, 6, 5]]  # 72 tokens: 12 blocks of 8 at decode; 5 tokens: the 8-block bucket
    expected = hf_greedy(model, prompts, 16)
    stages = ChainedStages(path, 2, 2, num_blocks=40)
    assert greedy_generate(stages, prompts, 16, arrivals=[0, 3]) == expected
    mixed = [s for s in stages.stages[0].compiled_shapes if s.prefill_rows and s.decode_rows]
    assert mixed and all(0 < s.prefill_blocks < s.blocks for s in mixed), mixed
