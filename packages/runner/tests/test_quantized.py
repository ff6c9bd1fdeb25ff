"""Weights kept quantized (``quantized``): GGUF blocks taken as the file stores them, against the gguf package's
dequantization bit for bit and against transformers on SmolLM2's Q4_1 file; int8/int4 quantized at load, against
transformers running the same quantized-then-dequantized weights; and the errors that name the fix."""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from hf_oracle import ChainedStages, greedy_generate, hf_greedy, hf_logits, make_hf_checkpoint, prefill_batch
from pipejax_test_support import fake_quantize_

from pipejax.pp_utils import stage_mesh
from pipejax.runner import gguf_file
from pipejax.runner.checkpoint import CheckpointError, load_stage_params
from pipejax.runner.config import ModelConfig, StageConfig
from pipejax.runner.errors import GGUFError
from pipejax.runner.quantized import Q4_0, Q8_0, Quantized, dequantize, fake_quantize, pack_nibbles, unpack_nibbles
from pipejax.runner.tokenizer import Tokenizer

TEXTS = ["The capital of France is", "Once upon a time, there was a little"]


def _random_blocks(qtype: QType, rows: int, n: int, rng) -> np.ndarray:
    """Raw GGUF rows of ``qtype``: random bytes (every int8 and nibble value, -128 included), scales (and Q4_1's
    minima) chosen to include 0, the float16 extremes and subnormals."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, n // block, size), dtype=np.uint8)
    halves = np.array([0.0, -0.0, 65504.0, -65504.0, 6e-8, 1.0, -0.0123], np.float16)
    for at in (0, 2) if qtype == QType.Q4_1 else (0,):
        chosen = halves[rng.integers(0, len(halves), raw.shape[:2])]
        raw[..., at:at + 2] = chosen[..., None].view(np.uint8).reshape(*raw.shape[:2], 2)
    raw[0, 0, 2:] = 0  # a block of zero values
    raw[1, 0, 2:] = 0xFF  # q = -1 (8-bit) / nibbles 15
    if qtype == QType.Q8_0:
        raw[2, 0, 2:] = 0x80  # q = -128, past what a quantizer writes
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_0, QType.Q4_1], ids=lambda q: q.name)
def test_gguf_blocks_unpack_to_the_gguf_packages_values_bit_for_bit(qtype):
    rng = np.random.default_rng(0)
    raw = _random_blocks(qtype, 6, 128, rng)
    want = gguf.quants.dequantize(raw, qtype).reshape(6, 128)
    q, scale, offset = gguf_file.GGUFTensor(raw, qtype, (6, 128), None).blocks(slice(0, 6))
    w = Quantized(q, scale, offset, gguf_file.GGUF_FORMATS[qtype], -1)
    np.testing.assert_array_equal(dequantize(w, np.float32, np), want)  # numpy
    got = jax.jit(lambda w: dequantize(w))(jax.tree.map(jnp.asarray, w))  # XLA, as a step runs it
    np.testing.assert_array_equal(np.asarray(got), want)
    if qtype != QType.Q8_0:
        nibbles = unpack_nibbles(q, -1, np)
        assert nibbles.min() >= 0 and nibbles.max() <= 15
        np.testing.assert_array_equal(pack_nibbles(nibbles, -1), q)


def test_int4_is_llama_cpps_q4_0_and_q8_0():
    w = np.random.default_rng(1).standard_normal((8, 96)).astype(np.float32)
    w[2] = 0  # a zero block: scale 0
    want = gguf.quants.dequantize(gguf.quants.quantize(w, QType.Q4_0), QType.Q4_0)
    np.testing.assert_array_equal(fake_quantize(w, Q4_0, 32), want)
    # and its embedding and LM head, Q8_0
    want = gguf.quants.dequantize(gguf.quants.quantize(w, QType.Q8_0), QType.Q8_0)
    np.testing.assert_array_equal(fake_quantize(w, Q8_0, 32), want)


# --- SmolLM2-135M's Q4_1 file kept quantized, against transformers dequantizing the same file -----------------


@pytest.fixture(scope="module")
def prompts(smollm2):
    tokenizer = Tokenizer.from_pretrained(smollm2)
    return [tokenizer.encode(t) for t in TEXTS]


LAYOUTS = [(1, 1), (2, 3), (3, 1)]  # pp in {1, 2, 3} x tp in {1, 3}, each pp once


@pytest.mark.parametrize("pp,tp", LAYOUTS, ids=[f"pp{p}tp{t}" for p, t in LAYOUTS])
def test_smollm2_kept_quantized_matches_transformers(smollm2, hf_model, prompts, pp, tp):
    """On one device the weights are in panels for the CPU quantized kernel (the tied embedding as the LM head's);
    over tp > 1 they keep their own layout and XLA dequantizes them into its sharded dots."""
    stages = ChainedStages(smollm2, pp, tp, quantization="gguf")
    held = {name: type(w).__name__ for name, w in stages.stages[0].params.items()}
    kind = "QuantizedPanels" if tp == 1 else "Quantized"
    assert held["embed"] == held["layers.qkv"] == held["layers.down"] == kind, held
    for want, have in zip(hf_logits(hf_model, prompts), stages.logits(prefill_batch(prompts)), strict=True):
        rel = np.abs(have - want).max() / np.abs(want).max()
        assert rel < 1e-4, f"max relative logit error {rel:.2e}"
    if pp > 1:  # greedy decoding through the decode steps' path too
        assert greedy_generate(stages, prompts, 8) == hf_greedy(hf_model, prompts, 8)


def test_smollm2_resident_weights_near_the_files_bytes(smollm2):
    """Q4_1 kept with float32 scales and minima: 6 bits a weight where the file has 5; every other tensor
    (embedding Q8_0, norms) as the file holds it."""
    cfg = ModelConfig.from_pretrained(smollm2, quantization="gguf")
    params = load_stage_params(smollm2, cfg, StageConfig(), stage_mesh(jax.devices()[:1]))
    held = sum(w.nbytes for w in params.values())
    in_file = sum(t.n_bytes for t in gguf_file.open_reader(smollm2).tensors.values())
    assert held <= 1.3 * in_file, (held, in_file)
    assert held < 0.25 * 4 * sum(np.prod(t.dims) for t in gguf_file.open_reader(smollm2).tensors.values())


# --- int8 / int4 quantized at load, against transformers on the same fake-quantized weights ---------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Llama with every contracted size a multiple of 32 (head_dim 32), so int4's blocks fit."""
    path = tmp_path_factory.mktemp("tiny")
    make_hf_checkpoint(path, "LlamaForCausalLM", hidden_size=128, intermediate_size=128, num_attention_heads=4,
                       tie_word_embeddings=False)
    return path


# tp = 1: in panels, for the CPU quantized kernel; tp > 1: XLA's sharded dots over the dequantized weights
@pytest.mark.parametrize("quantization,pp,tp", [("int8", 2, 2), ("int8", 1, 1), ("int4", 1, 2), ("int4", 3, 1)])
def test_quantized_at_load_matches_fake_quantized_transformers(tiny, quantization, pp, tp):
    import transformers

    oracle = fake_quantize_(transformers.AutoModelForCausalLM.from_pretrained(tiny).eval(), quantization)
    oracle.generation_config.eos_token_id = None
    prompts = [[5, 9, 12, 7, 30, 3], [40, 2, 8, 77, 11, 13, 90, 21, 4]]
    stages = ChainedStages(tiny, pp, tp, quantization=quantization)
    formats = {name: stage.params[name].fmt.name for stage in stages.stages for name in ("embed", "lm_head",
                                                                                          "layers.down")
               if name in stage.params}
    # int4 keeps the embedding and the LM head at 8 bits, as llama.cpp's 4-bit files do
    assert formats == ({"embed": "int8", "lm_head": "int8", "layers.down": "int8"} if quantization == "int8" else
                       {"embed": "q8_0", "lm_head": "q8_0", "layers.down": "q4_0"}), formats
    for want, have in zip(hf_logits(oracle, prompts), stages.logits(prefill_batch(prompts)), strict=True):
        assert np.abs(have - want).max() / np.abs(want).max() < 1e-4
    assert greedy_generate(stages, prompts, 6) == hf_greedy(oracle, prompts, 6)


# --- bad input --------------------------------------------------------------------------------------------------


def test_int8_on_an_already_quantized_gguf_names_the_tensor_and_the_fix(smollm2):
    with pytest.raises(GGUFError, match=r"token_embd.weight.*Q8_0.*--quantization gguf"):
        ModelConfig.from_pretrained(smollm2, quantization="int8")


def test_gguf_quantization_of_a_safetensors_checkpoint_is_refused(tiny):
    with pytest.raises(ValueError, match="int8 or int4"):
        ModelConfig.from_pretrained(tiny, quantization="gguf")
    with pytest.raises(ValueError, match="one of gguf, int8, int4"):
        ModelConfig.from_pretrained(tiny, quantization="fp8")


def test_blocks_that_do_not_fit_are_named(tiny, tmp_path):
    odd = tmp_path / "odd"
    make_hf_checkpoint(odd, "LlamaForCausalLM", hidden_size=128, intermediate_size=112, num_attention_heads=4)
    with pytest.raises(CheckpointError, match=r"layers.down.*112.*blocks of 32.*--quantization int8"):
        load_stage_params(odd, ModelConfig.from_pretrained(odd, quantization="int4"), StageConfig(),
                          stage_mesh(jax.devices()[:1]))
    # tp = 2 cuts an MLP of 96 into shards of 48: down's int4 blocks of 32 would be split across devices
    split = tmp_path / "split"
    make_hf_checkpoint(split, "LlamaForCausalLM", hidden_size=128, intermediate_size=96, num_attention_heads=4)
    with pytest.raises(CheckpointError, match=r"tensor_parallel_size=2 splits layers.down.*use a tp that divides 3"):
        load_stage_params(split, ModelConfig.from_pretrained(split, quantization="int4"), StageConfig(),
                          stage_mesh(jax.devices()[:2]))


def test_quantization_is_the_jax_models_only(tiny):
    from pipejax.runner.config import ModelSource

    with pytest.raises(ValueError, match="model_impl='jax'"):
        ModelSource(str(tiny), quantization="int8", impl="torchax").model_config()
    assert ModelSource(str(tiny), quantization="int8").model_config().quantization == "int8"
