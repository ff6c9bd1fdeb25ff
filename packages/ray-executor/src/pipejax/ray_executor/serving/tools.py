"""Tool calls in chat completions, shaped as OpenAI's API shapes them.

``tool_choice`` (default "auto" when ``tools`` are given):
- a named function: the answer is that function's arguments, held to its ``parameters`` schema by structured
  outputs; the message carries one tool call (finish reason "stop", as OpenAI answers a forced function);
- "required": the answer is a JSON array of one or more ``{"name", "arguments"}`` objects, each held to its
  function's schema (one call at most with ``parallel_tool_calls=false``); finish reason "tool_calls";
- "auto": the model answers freely; calls it writes in the Hermes format its template taught it
  (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as Qwen2.5, Hermes and SmolLM3 write them) become
  tool calls and the text around them the content; finish reason "tool_calls" when there is one;
- "none": the tools are not rendered and the model answers in text.

Streamed (``stream=true``), the same answer arrives as ``tool_calls`` deltas (``ToolStream``).

The chat template renders ``tools``; a template that never reads them is refused (400), since the model would
not know the tools it is asked to call.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from pipejax.ray_executor.serving.openai_protocol import APIError
from pipejax.runner.batch import StructuredOutputs

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class ToolChoice:
    """A request's ``tools`` and ``tool_choice``, checked: what the answer is held to and how it is read back."""

    def __init__(self, tools: list[dict[str, Any]] | None, choice: str | dict[str, Any] | None, parallel: bool):
        self.functions: dict[str, dict[str, Any]] = {}
        for i, tool in enumerate(tools or []):
            function = tool.get("function") if isinstance(tool, dict) else None
            if tool.get("type", "function") != "function" or not isinstance(function, dict) or not function.get("name"):
                raise APIError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                                    f"'parameters': {{...}}}}}}", "tools")
            self.functions[function["name"]] = function.get("parameters") or {"type": "object"}
        self.parallel = parallel
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name")
            if name not in self.functions:
                raise APIError(400, f"tool_choice names the function {name!r}, which is not among tools "
                                    f"{sorted(self.functions)}", "tool_choice")
            self.mode, self.named = "named", name
        else:
            self.mode, self.named = choice or ("auto" if self.functions else "none"), None
            if self.mode not in ("none", "auto", "required"):
                raise APIError(400, f"tool_choice={choice!r} is not 'none', 'auto', 'required' or "
                                    f"{{'type': 'function', 'function': {{'name': ...}}}}", "tool_choice")
            if self.mode != "none" and not self.functions:
                raise APIError(400, f"tool_choice={choice!r} needs tools", "tool_choice")

    @property
    def active(self) -> bool:
        """Whether the model sees the tools (rendered by its template) and may call them."""
        return self.mode != "none"

    def template_tools(self, tools: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        return tools if self.active else None

    def constraint(self) -> StructuredOutputs | None:
        """The grammar a forced call is held to (None for "auto" and "none")."""
        if self.mode == "named":
            return StructuredOutputs(json=self.functions[self.named], disable_any_whitespace=True)
        if self.mode == "required":
            call = [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                     "required": ["name", "arguments"], "additionalProperties": False}
                    for name, schema in self.functions.items()]
            array = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
            if not self.parallel:
                array["maxItems"] = 1
            return StructuredOutputs(json=array, disable_any_whitespace=True)
        return None

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message for the model's ``text``, and the finish reason to report."""
        if self.mode == "named":
            return _message(None, [(self.named, text)]), finish_reason
        if self.mode == "required":
            calls = _json_or_none(text)
            if not isinstance(calls, list):  # cut short by max_tokens: no whole call to report
                return _message(text, []), finish_reason
            return _message(None, [(c["name"], json.dumps(c["arguments"])) for c in calls]), "tool_calls"
        if self.mode == "auto":
            calls = []
            for found in HERMES_CALL.findall(text):
                call = _json_or_none(found)
                if isinstance(call, dict) and call.get("name") in self.functions:
                    calls.append((call["name"], json.dumps(call.get("arguments", {}))))
            if calls:
                content = HERMES_CALL.sub("", text).strip()
                return _message(content or None, calls), "tool_calls"
        return _message(text, []), finish_reason


class ToolStream:
    """One choice's answer streamed as OpenAI streams tool calls: each piece of text becomes ``delta``s of
    ``content`` and of ``tool_calls`` (read back as ``ToolChoice.message`` reads the whole answer).

    - a named function: its arguments stream as they are written, after a first delta naming the call;
    - "required": the array is read once whole, at the end (a partial call is not a call yet), one delta per call;
    - "auto": text streams as content, except what may be the start of ``<tool_call>``, held until it is not;
      a whole ``<tool_call>…</tool_call>`` becomes one delta with the call (or, not a call, the text as it was).
    """

    def __init__(self, tools: ToolChoice):
        self.tools = tools
        self.pending = ""  # text read but not yet streamed
        self.in_call = False  # "auto": inside <tool_call>
        self.calls = 0  # tool calls streamed

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas ``text`` (the answer's next piece) streams now."""
        mode = self.tools.mode
        if mode == "named":
            if not text:
                return []
            delta = {"index": 0, "function": {"arguments": text}}
            if not self.calls:
                self.calls = 1
                delta = _call(0, self.tools.named, text)
            return [{"tool_calls": [delta]}]
        self.pending += text
        return self._auto() if mode == "auto" else [] if mode == "required" else self._content(len(self.pending))

    def finish(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The last deltas once the answer is whole, and the finish reason to report."""
        if self.tools.mode == "required":
            message, reason = self.tools.message(self.pending, finish_reason)
            self.pending = ""
            calls = message.get("tool_calls") or []
            if not calls:
                return [{"content": message["content"]}] if message["content"] else [], reason
            return [{"tool_calls": [{"index": i, **call}]} for i, call in enumerate(calls)], reason
        if self.in_call:  # cut short inside a call: the text as it was
            self.pending, self.in_call = CALL_OPEN + self.pending, False
        deltas = self._content(len(self.pending))
        return deltas, "tool_calls" if self.calls and self.tools.mode == "auto" else finish_reason

    def _auto(self) -> list[dict[str, Any]]:
        deltas = []
        while True:
            if not self.in_call:
                at = self.pending.find(CALL_OPEN)
                if at < 0:  # keep back a tail that may be the start of <tool_call>
                    keep = next((n for n in range(len(CALL_OPEN) - 1, 0, -1) if self.pending.endswith(CALL_OPEN[:n])),
                                0)
                    return deltas + self._content(len(self.pending) - keep)
                deltas += self._content(at)
                self.pending, self.in_call = self.pending[len(CALL_OPEN):], True
            else:
                end = self.pending.find(CALL_CLOSE)
                if end < 0:
                    return deltas
                raw, self.pending, self.in_call = self.pending[:end], self.pending[end + len(CALL_CLOSE):], False
                call = _json_or_none(raw.strip())
                if isinstance(call, dict) and call.get("name") in self.tools.functions:
                    arguments = json.dumps(call.get("arguments", {}))
                    deltas.append({"tool_calls": [_call(self.calls, call["name"], arguments)]})
                    self.calls += 1
                else:
                    deltas.append({"content": CALL_OPEN + raw + CALL_CLOSE})

    def _content(self, upto: int) -> list[dict[str, Any]]:
        text, self.pending = self.pending[:upto], self.pending[upto:]
        return [{"content": text}] if text else []


def _call(index: int, name: str, arguments: str) -> dict[str, Any]:
    return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _message(content: str | None, calls: list[tuple[str, str]]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{k: v for k, v in _call(i, name, arguments).items() if k != "index"}
                                 for i, (name, arguments) in enumerate(calls)]
    return message
