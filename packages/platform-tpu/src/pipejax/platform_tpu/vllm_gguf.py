"""``vllm.LLM(model="model.gguf")`` and ``vllm serve model.gguf`` on pipejax's platform.

vLLM 0.32 has no GGUF support: before it builds its ``ModelConfig`` it reads the model's config.json
through transformers, then its tokenizer and generation_config.json. The platform gives it the
file's Hugging Face folder instead (``pipejax.runner.gguf_folder``: those files made from the
file's metadata, beside a link to the file). It does so at the one step where vLLM itself replaces
the model it was given by another, ``maybe_override_with_speculators``, which
``EngineArgs.create_engine_config`` calls right after the platform's ``pre_register_and_update``
(where ``install`` runs). The stages then load the file itself (``stage_model_path``): dequantized,
or kept as it is with ``quantization="gguf"``.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def install() -> None:
    """Have vLLM's engine arguments take a .gguf file as the model (once per process)."""
    from vllm.engine import arg_utils

    original = arg_utils.maybe_override_with_speculators
    if getattr(original, "pipejax_gguf", False):
        return

    @functools.wraps(original)
    def with_gguf_folder(model, tokenizer, *args, **kwargs):
        if isinstance(model, str | os.PathLike) and str(model).endswith(".gguf") and Path(model).is_file():
            folder = str(gguf_folder_of(model))
            log.info("pipejax: vLLM reads the config and tokenizer of %s from %s", model, folder)
            tokenizer = folder if tokenizer is None or str(tokenizer) == str(model) else tokenizer
            model = folder
        return original(model, tokenizer, *args, **kwargs)

    with_gguf_folder.pipejax_gguf = True
    arg_utils.maybe_override_with_speculators = with_gguf_folder


def gguf_folder_of(path: str | os.PathLike) -> Path:
    from pipejax.runner.builtin_model import cache_dir_from_env
    from pipejax.runner.gguf_folder import hf_folder

    return hf_folder(path, cache_dir_from_env(os.environ))


def stage_model_path(model: str) -> str | None:
    """The GGUF file the stages load when vLLM's model is a folder holding one (the folder ``install`` gave vLLM,
    or any other): its real path, which each host reads as it would a model folder. None for other models."""
    from pipejax.runner.gguf_file import find_gguf

    gguf = find_gguf(model) if Path(model).is_dir() else None
    return str(gguf.resolve()) if gguf is not None else None
