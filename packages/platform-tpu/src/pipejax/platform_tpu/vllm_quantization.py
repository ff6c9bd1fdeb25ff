"""``vllm.LLM(quantization="int8" | "int4" | "gguf")`` on pipejax's platform: the names registered as vLLM quantization
methods (vLLM 0.32 has neither in float32, and no GGUF at all), each a config that only carries its name. vLLM
never builds its own layers on this platform: the stage worker reads ``model_config.quantization`` and pipejax's
loader quantizes the weights as it loads them (``pipejax.runner.quantized``). Registered by the platform's
``pre_register_and_update``, which vLLM calls before it checks an engine's arguments."""

from __future__ import annotations

from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE  # vLLM's dtypes by name: this layer imports no torch


class _PipejaxQuantization(QuantizationConfig):
    method = ""

    def get_name(self) -> str:
        return self.method

    def get_supported_act_dtypes(self) -> list:
        return [STR_DTYPE_TO_TORCH_DTYPE["float32"], STR_DTYPE_TO_TORCH_DTYPE["bfloat16"]]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # quantized at load, from float weights: nothing to read from the checkpoint

    @classmethod
    def from_config(cls, config: dict) -> _PipejaxQuantization:
        return cls()

    def get_quant_method(self, layer, prefix: str):
        return None  # vLLM's layers are never built on pipejax's platform


class Int8(_PipejaxQuantization):
    method = "int8"  # a scale per output channel


class Int4(_PipejaxQuantization):
    method = "int4"  # llama.cpp's Q4_0: blocks of 32


class Gguf(_PipejaxQuantization):
    method = "gguf"  # a GGUF file's Q8_0/Q4_0/Q4_1 blocks kept as they are (``vllm_gguf``: model="file.gguf")


def register() -> None:
    """Make the names known to vLLM (once per process)."""
    for config in (Int8, Int4, Gguf):
        if config.method not in QUANTIZATION_METHODS:
            register_quantization_config(config.method)(config)
