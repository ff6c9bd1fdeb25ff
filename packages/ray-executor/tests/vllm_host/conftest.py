import os

import pytest

os.environ.setdefault("PIPEJAX_PLATFORM", "cpu")  # before vLLM resolves its platform: pipejax's
pytest.importorskip("vllm", reason="the vLLM-host tests run in the `vllm` nox session (vLLM built from source)")


@pytest.fixture(scope="session", autouse=True)
def shared_compilation_cache(tmp_path_factory):
    """One JAX compilation cache for every engine process of the run: a step program compiled by
    one engine (same model, layout and shapes) loads in the next instead of compiling again."""
    os.environ["PIPEJAX_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.mktemp("jax-compilation-cache"))
