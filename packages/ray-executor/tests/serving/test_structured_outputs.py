"""Structured outputs through `pipejax serve` on the default model (SmolLM2-135M-Instruct, pp=2), driven by the
official openai client: outputs sampled at temperature 1 follow their JSON schema, regex or choice, constrained
and free requests share batches, and invalid grammars get a 400 naming the field while the server goes on.

One server for the module (~1 min to start on 2 cores).
"""

import concurrent.futures
import json
import re

import jsonschema
import openai
import pytest
from server_utils import serving

from pipejax.runner.default_model import DEFAULT_MODEL_NAME as MODEL

pytestmark = pytest.mark.timeout(600)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                 "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "home"],
    "additionalProperties": False,
}
REGEX = r"(yes|no)-[0-9]{3}"
CHOICE = ["red", "green", "blue"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serving(["-pp", "2", "--num-kv-blocks", "1024", "--max-num-seqs", "64"], log, timeout=400) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def _chat(client, content: str, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          **kwargs).choices[0]


def test_fifty_json_schema_answers_at_temperature_1_validate_next_to_regex_choice_and_free(client):
    plain = dict(temperature=0, max_tokens=24)
    alone = _chat(client, "Name three colours.", **plain).message.content
    asks = [("json", dict(response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
                          temperature=1.0, seed=i, max_tokens=160)) for i in range(50)]
    asks += [("regex", dict(extra_body={"structured_outputs": {"regex": REGEX}}, temperature=1.0, seed=i,
                            max_tokens=16)) for i in range(6)]
    asks += [("choice", dict(extra_body={"structured_outputs": {"choice": CHOICE}}, temperature=1.0, seed=i,
                             max_tokens=16)) for i in range(6)]
    asks += [("free", plain)] * 2
    with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:  # all in flight together: mixed batches
        answers = list(pool.map(lambda a: (a[0], _chat(client, "Describe one user of a web site.", **a[1])
                                           if a[0] != "free" else _chat(client, "Name three colours.", **a[1])),
                                asks))
    for kind, choice in answers:
        text = choice.message.content
        if kind == "json":
            assert choice.finish_reason == "stop", (choice.finish_reason, text)
            jsonschema.validate(json.loads(text), PERSON)
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), text
        elif kind == "choice":
            assert text in CHOICE, text
        else:
            assert text == alone, (text, alone)  # a plain request is unchanged by its constrained neighbours
    assert len({c.message.content for k, c in answers if k == "json"}) > 40  # sampled, not one answer repeated


def test_json_object_and_vllms_fields_on_completions(client):
    got = client.completions.create(model=MODEL, prompt="A JSON object describing a cat:", max_tokens=96,
                                    temperature=0.7, seed=1, extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(got.choices[0].text), dict), got.choices[0].text
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4}
    got = client.completions.create(model=MODEL, prompt="Some numbers:", max_tokens=48, temperature=1.0,
                                    extra_body={"structured_outputs": {"json": schema,
                                                                       "disable_any_whitespace": True}})
    text = got.choices[0].text
    jsonschema.validate(json.loads(text), schema)
    assert " " not in text and "\n" not in text, text
    grammar = 'start: "The answer is " ("one" | "two") "."'
    got = client.completions.create(model=MODEL, prompt="Q: 1 + 1?", max_tokens=16, temperature=1.0,
                                    extra_body={"structured_outputs": {"grammar": grammar}})
    assert got.choices[0].text in ("The answer is one.", "The answer is two."), got.choices[0].text


def test_invalid_grammars_and_unrenderable_tools_get_400_and_the_server_goes_on(client):
    bad = {
        "structured_outputs.json": {"structured_outputs": {"json": {"type": "nonsense"}}},
        "structured_outputs.regex": {"structured_outputs": {"regex": "(unclosed"}},
        "must name exactly one": {"structured_outputs": {"regex": "a", "choice": ["a"]}},
        "['whitespace_pattern'] are not supported": {"structured_outputs": {"json": {}, "whitespace_pattern": " "}},
        "response_format.json_schema.schema": {"response_format": {"type": "json_schema", "json_schema": {}}},
        "response_format.type='xml'": {"response_format": {"type": "xml"}},
    }
    for expected, extra in bad.items():
        with pytest.raises(openai.BadRequestError, match=re.escape(expected)):
            client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=extra)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="does not render tools"):  # SmolLM2's template has none
        _chat(client, "x", tools=[tool], max_tokens=4)
    ok = client.completions.create(model=MODEL, prompt="Still", max_tokens=8, temperature=1.0,
                                   extra_body={"structured_outputs": {"choice": ["here", "there"]}})
    assert ok.choices[0].text in ("here", "there")
