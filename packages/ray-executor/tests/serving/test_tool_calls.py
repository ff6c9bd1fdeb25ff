"""Tool calls through `pipejax serve` and the official openai client, on a tiny random checkpoint whose chat
template renders tools (Hermes style) and whose tokenizer has one token per byte: a forced call's arguments
validate against the function's schema, "required" calls name the given functions with valid arguments, and bad
tool requests get a 400 naming the field while the server goes on. The "auto" mode's reading of Hermes-format
calls is checked on the text directly (a random model never writes one).
"""

import json
import re

import jsonschema
import openai
import pytest
from oracle import make_checkpoint, write_byte_tokenizer
from server_utils import serving

from pipejax.ray_executor.serving.tools import ToolChoice, ToolStream

pytestmark = pytest.mark.timeout(600)

HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these tools:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
    "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools")
    make_checkpoint(path, "LlamaForCausalLM", seed=3, max_position_embeddings=2048)  # one token per byte
    write_byte_tokenizer(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": HERMES_TEMPLATE, "eos_token": "</s>"}))
    args = ["--model", str(path), "--served-model-name", "tiny", "--num-kv-blocks", "256"]
    with serving(args, path / "serve.log") as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_named_function_gets_arguments_that_validate(client):
    plain = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4)
    for seed in range(4):
        got = client.chat.completions.create(
            model="tiny", messages=ASK, tools=[WEATHER, TIME], temperature=1.0, seed=seed, max_tokens=64,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = got.choices[0]
        assert choice.finish_reason == "stop" and choice.message.content is None, choice
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
    assert got.usage.prompt_tokens > plain.usage.prompt_tokens + 100  # the template rendered the tools


def test_required_calls_name_given_functions_with_valid_arguments(client):
    names = set()
    for seed in range(4):
        got = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                             temperature=1.0, seed=seed, max_tokens=120, parallel_tool_calls=False)
        choice = got.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls  # parallel_tool_calls=False: exactly one
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        names.add(call.function.name)
    assert names <= set(SCHEMAS)


def _streamed_calls(stream) -> tuple[dict[int, dict], str, str | None]:
    """The tool calls (index -> name, id, arguments), the content and the finish reason a chat stream carries."""
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": None, "id": None, "arguments": ""})
                call["name"] = call["name"] or (delta.function.name if delta.function else None)
                call["id"] = call["id"] or delta.id
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""
            finish = choice.finish_reason or finish
    return calls, content, finish


def test_tool_calls_stream_as_openai_streams_them(client):
    """stream=true: a named function's arguments arrive as they are written, "required" calls once whole; the
    openai client's chunks add up to calls that validate, with the finish reason of the whole answer."""
    for seed in range(2):
        named = client.chat.completions.create(
            model="tiny", messages=ASK, tools=[WEATHER, TIME], temperature=1.0, seed=seed, max_tokens=64, stream=True,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        calls, content, finish = _streamed_calls(named)
        assert finish == "stop" and content == "" and list(calls) == [0], (calls, content, finish)
        assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
        jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS["get_weather"])
        required = client.chat.completions.create(
            model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0, seed=seed,
            max_tokens=120, parallel_tool_calls=False, stream=True)
        calls, content, finish = _streamed_calls(required)
        assert finish == "tool_calls" and list(calls) == [0], (calls, content, finish)
        jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS[calls[0]["name"]])


def test_bad_tool_requests_get_400_and_the_server_goes_on(client):
    bad = {
        "not among tools": dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
        "tool_choice='sometimes'": dict(tools=[WEATHER], tool_choice="sometimes"),
        "tools[0] must be": dict(tools=[{"type": "function", "function": {}}]),
        "needs tools": dict(tool_choice="required"),
        "already sets the answer's format": dict(tools=[WEATHER], tool_choice="required",
                                                  response_format={"type": "json_object"}),
    }
    for expected, extra in bad.items():
        with pytest.raises(openai.BadRequestError, match=re.escape(expected)):
            client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, **extra)
    none = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="none",
                                          max_tokens=4)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content is not None


def test_auto_reads_hermes_calls_and_keeps_the_text_around_them():
    tools = ToolChoice([WEATHER, TIME], "auto", parallel=True)
    text = ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": 1}}</tool_call>')
    message, finish = tools.message(text, "stop")
    assert finish == "tool_calls" and message["content"] == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": 1})]
    message, finish = tools.message("Just text, <tool_call>{not json}</tool_call>", "length")
    assert finish == "length" and message == {"role": "assistant", "content": "Just text, <tool_call>{not json}"
                                                                               "</tool_call>"}


def test_auto_calls_stream_as_the_whole_answer_reads():
    """Fed a few characters at a time (a tag split across pieces included), "auto" streams the text around the calls
    as content and each whole <tool_call> as one call: together, what ``ToolChoice.message`` reads from the whole."""
    tools = ToolChoice([WEATHER, TIME], "auto", parallel=True)
    text = ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
            '</tool_call> and <tool_call>{"name": "get_time", "arguments": {"zone": 1}}</tool_call> <tool_')
    for step in (1, 3, 7, len(text)):
        stream = ToolStream(tools)
        deltas = [d for i in range(0, len(text), step) for d in stream.feed(text[i:i + step])]
        last, finish = stream.finish("stop")
        deltas += last
        content = "".join(d.get("content", "") for d in deltas)
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert finish == "tool_calls" and content == "Let me check.  and  <tool_", (step, deltas)
        assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            (0, "get_weather", {"city": "Paris", "unit": "celsius"}), (1, "get_time", {"zone": 1})]
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    stream = ToolStream(tools)  # no call, and a call that is not one: text as it was, the model's finish reason
    deltas = stream.feed("Just text, <tool_call>{not json}</tool_call> <tool_call>{\"name\"")
    last, finish = stream.finish("length")
    assert finish == "length" and "".join(d["content"] for d in deltas + last) == (
        'Just text, <tool_call>{not json}</tool_call> <tool_call>{"name"')
