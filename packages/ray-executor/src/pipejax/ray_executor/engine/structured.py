"""Structured outputs in pipejax's engine: each constrained request's grammar, compiled by llguidance.

llguidance (guidance-ai's Rust grammar engine, one of vLLM's structured-output backends) is chosen over xgrammar
because it depends on nothing else: xgrammar pulls torch and triton into the serving path, which pipejax keeps
free of torch. It compiles JSON schemas, regexes, choices and Lark/GBNF grammars, and computes a batch's
next-token bitmasks on its own threads (3.5-3.6 ms per step for 64 JSON rows of SmolLM2's 49152 tokens on 2 cores:
benchmarks/probes/constrained_step.py), in vLLM's layout, which the last stage's sampler applies as it applies vLLM's.

A request's matcher advances with each token it samples (``Request.append_token``); the scheduler asks for the
bitmasks of the rows it schedules, which the engine computes while the batches already in flight run.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import llguidance
import llguidance.numpy as llnp
import numpy as np

from pipejax.runner.batch import StructuredOutputs
from pipejax.runner.tokenizer import Tokenizer


class Grammars:
    """Compiles requests' structured outputs for one model's tokenizer and fills their bitmasks."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: Sequence[int]):
        self._tokenizer, self.vocab_size, self._eos = tokenizer, vocab_size, sorted(eos_token_ids)
        self._ll: llguidance.LLTokenizer | None = None  # built at the first constrained request (~0.2 s)
        self._executor = llguidance.LLExecutor()

    def matcher(self, request_id: str, spec: StructuredOutputs) -> llguidance.LLMatcher:
        """A fresh matcher for ``spec``; ``ValueError`` naming the field and llguidance's reason if it is invalid."""
        if self._tokenizer is None:
            raise ValueError(f"request {request_id!r}: structured_outputs need the model's tokenizer.json")
        try:
            grammar = _grammar(spec)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"request {request_id!r}: structured_outputs.{spec.kind} is invalid: {exc}") from None
        matcher = llguidance.LLMatcher(self._tokenizer_ll(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"request {request_id!r}: structured_outputs.{spec.kind} is invalid: "
                             f"{matcher.get_error().strip()}")
        return matcher

    def bitmasks(self, matchers: Sequence[llguidance.LLMatcher]) -> np.ndarray:
        """i32[len(matchers), ceil(V / 32)]: each matcher's allowed next tokens (llguidance's threads)."""
        masks = llnp.allocate_token_bitmask(len(matchers), self.vocab_size)
        llnp.fill_next_token_bitmask_par(self._executor, list(zip(matchers, range(len(matchers)), strict=True)),
                                         masks)
        return masks

    def _tokenizer_ll(self) -> llguidance.LLTokenizer:
        if self._ll is None:
            self._ll = llguidance.LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                              eos_token=self._eos or None)
        return self._ll


def _grammar(spec: StructuredOutputs) -> str:
    """llguidance's grammar for ``spec`` (JSON as compact as asked: vLLM's ``disable_any_whitespace``)."""
    options = {"whitespace_flexible": not spec.disable_any_whitespace}
    if spec.json is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(json.loads(spec.json), defaults=options)
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return llguidance.grammar_from("choice", list(spec.choice))
    return llguidance.grammar_from("grammar", spec.grammar)
