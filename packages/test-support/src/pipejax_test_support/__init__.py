"""pipejax's test oracle: tiny Hugging Face checkpoints made by transformers itself, and transformers'
logits and greedy generation on them, and on GGUF files as transformers reads them. Shared by every layer's tests
(imports no pipejax layer)."""

from pipejax_test_support.gguf_oracle import hf_model_from_gguf, smollm2_gguf
from pipejax_test_support.hf_oracle import (
    ARCHS,
    TINY,
    fake_quantize_,
    hf_greedy,
    hf_logits,
    hf_prompt_logprobs,
    make_hf_checkpoint,
)

__all__ = ["ARCHS", "TINY", "fake_quantize_", "hf_greedy", "hf_logits", "hf_model_from_gguf", "hf_prompt_logprobs",
           "make_hf_checkpoint", "smollm2_gguf"]
