"""Tokenizer of a Hugging Face checkpoint folder, without transformers.

Wraps a `tokenizers.Tokenizer` (tokenizer.json) with what tokenizer_config.json,
generation_config.json and config.json add: BOS handling, stop token ids, the chat template.
Behaviour follows transformers 5 (`TokenizersBackend`), which the tests use as the oracle.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import tokenizers
from tokenizers import processors

# A UTF-8 character is at most 4 bytes, so at most 3 tokens can hold an incomplete tail.
_MAX_HELD_TOKENS = 3
# Prompt tokens decoded ahead of the first generated token, for context-dependent decoders.
_PROMPT_CONTEXT_TOKENS = 5


def _read_json(path: pathlib.Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_content(token: str | dict | None) -> str | None:
    """tokenizer_config stores special tokens as strings or as serialized AddedTokens."""
    return token.get("content") if isinstance(token, dict) else token


def _as_id_set(value: int | Sequence[int] | None) -> set[int]:
    if value is None:
        return set()
    return {value} if isinstance(value, int) else set(value)


def _compile_chat_template(template: str):
    """Compiles a chat template in a sandbox with the helpers HF templates expect."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; HF's does not.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


class Tokenizer:
    """Encodes, decodes and renders chats for one checkpoint; build with `from_pretrained`."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: dict[str, str],
        eos_token_ids: Iterable[int],
        bos_token_id: int | None,
        chat_template: str | None = None,
    ):
        self.backend = backend
        self.special_tokens = special_tokens  # e.g. {"bos_token": "<s>", "eos_token": "</s>"}
        self.eos_token_ids = frozenset(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self._compiled_template = None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> Tokenizer:
        """From a checkpoint folder (tokenizer.json, ...) or a GGUF file's metadata."""
        from pipejax.runner import gguf_file

        if gguf_file.find_gguf(path) is not None:
            parts = gguf_file.tokenizer_parts(path)
            _apply_bos_eos_flags(parts.backend, parts.add_special, parts.special_tokens)
            return cls(parts.backend, parts.special_tokens, parts.eos_token_ids, parts.bos_token_id,
                       parts.chat_template)
        folder = pathlib.Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(
                f"{folder} has no tokenizer.json; pipejax reads only fast (tokenizers) tokenizers"
            )
        backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        tokenizer_config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        special_tokens = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            content = _token_content(tokenizer_config.get(key, special_map.get(key)))
            if content is not None:
                special_tokens[key] = content
        _apply_bos_eos_flags(backend, tokenizer_config, special_tokens)

        model_config = _read_json(folder / "config.json")
        generation_config = _read_json(folder / "generation_config.json")
        eos_ids = _as_id_set(generation_config.get("eos_token_id"))
        eos_ids |= _as_id_set(model_config.get("eos_token_id"))
        if "eos_token" in special_tokens:
            eos_ids |= _as_id_set(backend.token_to_id(special_tokens["eos_token"]))
        bos_id = None
        if "bos_token" in special_tokens:
            bos_id = backend.token_to_id(special_tokens["bos_token"])
        if bos_id is None:
            bos_id = generation_config.get("bos_token_id", model_config.get("bos_token_id"))
        return cls(backend, special_tokens, eos_ids, bos_id, _read_chat_template(folder, tokenizer_config))

    @property
    def vocab_size(self) -> int:
        """Token count including added tokens (the model's embedding may be larger)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; the post-processor adds BOS etc. when `add_special_tokens`.

        A prompt rendered by `apply_chat_template` usually holds BOS already: encode it with
        `add_special_tokens=False`, as HF's `apply_chat_template(tokenize=True)` does.
        """
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the chat template reads ``tools`` (a template that does not would drop them silently); parsed
        once, at the first request that sends tools."""
        import jinja2.meta

        if self.chat_template is None:
            return False
        env = _compile_chat_template(self.chat_template).environment
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(self.chat_template))

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Renders `messages` with the checkpoint's chat template, as HF does (no tokenizing)."""
        if self.chat_template is None:
            raise ValueError(
                "this tokenizer has no chat_template (tokenizer_config.json or "
                "chat_template.jinja); send a plain prompt instead of chat messages"
            )
        if self._compiled_template is None:
            self._compiled_template = _compile_chat_template(self.chat_template)
        variables = {**self.special_tokens, "tools": None, "documents": None, **kwargs}
        return self._compiled_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )


def has_tokenizer(path: str | os.PathLike) -> bool:
    """Whether ``path`` carries a tokenizer pipejax reads (tokenizer.json, or a GGUF file's metadata)."""
    from pipejax.runner import gguf_file

    return (pathlib.Path(path) / "tokenizer.json").is_file() or gguf_file.find_gguf(path) is not None


def _apply_bos_eos_flags(
    backend: tokenizers.Tokenizer, tokenizer_config: dict, special_tokens: dict[str, str]
) -> None:
    """Adds BOS/EOS only through the tokenizer.json post-processor, never twice.

    transformers 5 ignores add_bos_token/add_eos_token from tokenizer_config.json whenever
    tokenizer.json exists: its post-processor (Llama-3 style TemplateProcessing) decides. Only
    when there is no post-processor do the flags build one, as Llama's tokenizer class does.
    """
    if backend.post_processor is not None:
        return
    bos, eos = special_tokens.get("bos_token"), special_tokens.get("eos_token")
    add_bos = bool(tokenizer_config.get("add_bos_token", False)) and bos is not None
    add_eos = bool(tokenizer_config.get("add_eos_token", False)) and eos is not None
    if not (add_bos or add_eos):
        return
    single = f"{f'{bos}:0 ' if add_bos else ''}$A:0{f' {eos}:0' if add_eos else ''}"
    pair = f"{single}{f' {bos}:1' if add_bos else ''} $B:1{f' {eos}:1' if add_eos else ''}"
    special = [(bos, backend.token_to_id(bos))] if add_bos else []
    special += [(eos, backend.token_to_id(eos))] if add_eos else []
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=special
    )


def _read_chat_template(folder: pathlib.Path, tokenizer_config: dict) -> str | None:
    """chat_template.jinja (transformers 5) wins over tokenizer_config's chat_template, which
    may also be a list of named templates (then "default" is used)."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {entry["name"]: entry["template"] for entry in template}
        template = named.get("default")
    return template


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text deltas for streaming.

    Decodes a short window of recent tokens rather than the whole output, and holds back text
    that ends in U+FFFD (an incomplete UTF-8 sequence split across byte tokens) until the
    sequence completes. `flush` releases whatever is still held at the end of a request.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        self._ids = context  # prompt context, then generated ids
        self._context_len = len(context)
        self._prefix_offset = 0  # start of the decoding window
        self._read_offset = len(context)  # end of the text already emitted
        self._prefix_text = self._decode(context)
        self.text = ""  # all text emitted so far

    @property
    def token_ids(self) -> list[int]:
        """The generated ids seen so far (without the prompt context)."""
        return self._ids[self._context_len :]

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def add(self, token_ids: Iterable[int]) -> str:
        """Appends generated ids; returns the newly completed text (may be empty)."""
        token_ids = list(token_ids)
        self._ids.extend(token_ids)
        return self._emit(force=False)

    def flush(self) -> str:
        """Returns held-back text, with U+FFFD for any bytes that never formed a character."""
        return self._emit(force=True)

    def _emit(self, force: bool) -> str:
        # Emit up to the last token that ends a whole character, holding at most the last
        # _MAX_HELD_TOKENS tokens: U+FFFD further back than that is a byte error, not a split.
        end = len(self._ids)
        if end == self._read_offset:
            return ""
        while True:
            window_text = self._decode(self._ids[self._prefix_offset : end])
            if force or not window_text.endswith("\ufffd") or len(self._ids) - end >= _MAX_HELD_TOKENS:
                break
            end -= 1
            if end == self._read_offset:
                return ""
        if len(window_text) <= len(self._prefix_text):
            return ""
        delta = window_text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, end
        self._prefix_text = self._decode(self._ids[self._prefix_offset : end])
        self.text += delta
        return delta
