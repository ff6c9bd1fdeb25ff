"""pipejax.torchax_bridge: Hugging Face PyTorch models (Llama, Qwen2, ...) run in JAX through torchax
as a runner model implementation, one pipeline stage each, over the runner's paged KV cache.

The runner finds it through the ``pipejax.model_impls`` entry point ``torchax``
(``model_impl="torchax"``); nothing imports it directly. Names are loaded lazily, so importing the
package does not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "TORCHAX_IMPL": "impl",
    "TorchStageParams": "impl",
    "load_stage_params": "impl",
    "stage_forward": "impl",
    "ATTENTION_NAME": "attention",
    "PagedKV": "attention",
    "paged_attention_forward": "attention",
    "SUPPORTED_ARCHITECTURES": "stage_model",
    "TorchParamSpec": "stage_model",
    "build_stage_module": "stage_model",
    "stage_hf_config": "stage_model",
    "stage_param_specs": "stage_model",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
