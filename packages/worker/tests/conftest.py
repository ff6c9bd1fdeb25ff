import os

# Simulated devices must be configured before JAX is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402
from worker_oracle import MAX_NEW_TOKENS, PROMPTS, hf_greedy, make_llama_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """(path, transformers model) of a tiny Llama checkpoint saved by transformers."""
    path = tmp_path_factory.mktemp("tiny-llama")
    return path, make_llama_checkpoint(path)


@pytest.fixture(scope="session")
def hf_expected(checkpoint):
    """transformers' greedy continuation of every prompt in ``PROMPTS``."""
    return hf_greedy(checkpoint[1], PROMPTS, MAX_NEW_TOKENS)
