"""A GGUF file as a Hugging Face checkpoint folder, for hosts that read only such folders.

vLLM 0.32 has no GGUF support: it reads a model's config.json, tokenizer files and
generation_config.json itself before pipejax's worker loads a weight. ``hf_folder`` writes those
three from the file's metadata (the same config and tokenizer pipejax builds for itself) beside a
link to the file, whose tensors pipejax's loader then reads (``gguf_file.find_gguf`` takes a folder
that holds one .gguf and no safetensors). Made once per file version, under a cache folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from pipejax.runner import gguf_file
from pipejax.runner.tokenizer import Tokenizer

FOLDERS = "gguf-hf"  # under the cache folder the caller names


def hf_folder(path: str | os.PathLike, cache_dir: str | os.PathLike) -> Path:
    """The folder standing for GGUF file ``path`` (made on first use under ``cache_dir``/gguf-hf, one per path,
    size and modification time, so an edited file gets a new one)."""
    gguf = gguf_file.find_gguf(path)
    if gguf is None:
        raise ValueError(f"{str(path)!r} is not a GGUF file")
    gguf = gguf.resolve()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = Path(cache_dir) / FOLDERS / f"{gguf.stem}-{key}"
    if folder.is_dir():
        return folder
    staging = folder.with_name(f"{folder.name}.{os.getpid()}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        write_hf_files(gguf, staging)
        (staging / gguf.name).symlink_to(gguf)
        os.rename(staging, folder)  # whole or absent: a concurrent maker's folder wins
    except OSError:
        if not folder.is_dir():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def write_hf_files(gguf: Path, folder: Path) -> None:
    """config.json, tokenizer.json, tokenizer_config.json and generation_config.json of ``gguf`` into ``folder``."""
    config = gguf_file.hf_config(gguf_file.open_reader(gguf), gguf)
    tokenizer = Tokenizer.from_pretrained(gguf)  # BOS/EOS flags already in its post-processor
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer.special_tokens,
                        "model_max_length": config["max_position_embeddings"]}
    if tokenizer.chat_template is not None:
        tokenizer_config["chat_template"] = tokenizer.chat_template
    generation = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": sorted(tokenizer.eos_token_ids)}
    for name, content in (("config.json", config), ("tokenizer_config.json", tokenizer_config),
                          ("generation_config.json", generation)):
        (folder / name).write_text(json.dumps(content, indent=2))
