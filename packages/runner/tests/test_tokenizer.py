import json
import shutil

import pytest
import transformers

from pipejax.runner.builtin_model import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    EOT_TOKEN_ID,
    ensure_builtin_model,
)
from pipejax.runner.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  \n\ttabs\r\n",
    "héllo wörld — ñ, 日本語のテキスト, Ελληνικά, עברית",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇺🇦 e\u0301",
    "\x00 control \x7f and \ufffd replacement",
    "",
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "  What is 2+2? 🤔 "},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "Thanks"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_builtin_model("default", cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_is_byte_exact_with_one_bos(tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids[0] == BOS_TOKEN_ID and BOS_TOKEN_ID not in ids[1:]
    assert tokenizer.encode(text, add_special_tokens=False) == ids[1:]
    assert len(ids) == 1 + len(text.encode())  # one token per byte
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>" + text


def test_special_token_text_is_parsed_and_skipped(tokenizer):
    ids = tokenizer.encode("a<|eot_id|>b", add_special_tokens=False)
    assert ids == [ord("a"), EOT_TOKEN_ID, ord("b")]
    assert tokenizer.decode(ids) == "ab"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "a<|eot_id|>b"


def test_ids_and_metadata(tokenizer):
    assert tokenizer.bos_token_id == BOS_TOKEN_ID
    assert tokenizer.eos_token_ids == {EOS_TOKEN_ID, EOT_TOKEN_ID}
    assert tokenizer.vocab_size == 320
    assert tokenizer.token_to_id("<|reserved_0|>") == EOT_TOKEN_ID + 1


def test_matches_transformers(tokenizer, hf_tokenizer):
    for text in TEXTS:
        assert tokenizer.encode(text) == hf_tokenizer(text)["input_ids"]
        assert tokenizer.encode(text, add_special_tokens=False) == hf_tokenizer.encode(
            text, add_special_tokens=False
        )
        ids = hf_tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert tokenizer.eos_token_ids >= {hf_tokenizer.eos_token_id}
    assert len(hf_tokenizer) == tokenizer.vocab_size
    for generation_prompt in (True, False):
        ours = tokenizer.apply_chat_template(CHAT, add_generation_prompt=generation_prompt)
        theirs = hf_tokenizer.apply_chat_template(
            CHAT, tokenize=False, add_generation_prompt=generation_prompt
        )
        assert ours == theirs
        hf_ids = hf_tokenizer.apply_chat_template(
            CHAT, tokenize=True, add_generation_prompt=generation_prompt
        )["input_ids"]
        assert tokenizer.encode(ours, add_special_tokens=False) == hf_ids
    assert ours.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
    assert "What is 2+2? 🤔<|eot_id|>" in ours


def test_chat_template_errors(tokenizer, model_dir, tmp_path):
    with pytest.raises(Exception, match="Unknown role tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no chat_template"):
        Tokenizer.from_pretrained(tmp_path).apply_chat_template(CHAT)
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    assert Tokenizer.from_pretrained(tmp_path).apply_chat_template(CHAT) == (
        "<|begin_of_text|>You are terse."
    )


@pytest.mark.parametrize(
    "flags",
    [{"add_bos_token": True}, {}, {"add_bos_token": False}, {"add_bos_token": True, "add_eos_token": True}],
)
def test_tokenizer_json_post_processor_decides_bos_like_transformers(model_dir, tmp_path, flags):
    # transformers 5 ignores add_bos_token/add_eos_token when tokenizer.json exists.
    copy_tokenizer(model_dir, tmp_path, flags)
    ours = Tokenizer.from_pretrained(tmp_path).encode("hi")
    assert ours == transformers.AutoTokenizer.from_pretrained(tmp_path)("hi")["input_ids"]
    assert ours == [BOS_TOKEN_ID, ord("h"), ord("i")]


def test_flags_build_the_missing_post_processor(model_dir, tmp_path):
    copy_tokenizer(model_dir, tmp_path, {}, post_processor=None)
    assert Tokenizer.from_pretrained(tmp_path).encode("hi") == [ord("h"), ord("i")]
    copy_tokenizer(model_dir, tmp_path, {"add_bos_token": True, "add_eos_token": True}, post_processor=None)
    tokenizer = Tokenizer.from_pretrained(tmp_path)
    assert tokenizer.encode("hi") == [BOS_TOKEN_ID, ord("h"), ord("i"), EOS_TOKEN_ID]
    assert tokenizer.encode("hi", add_special_tokens=False) == [ord("h"), ord("i")]


def copy_tokenizer(model_dir, target, flags, **tokenizer_json_overrides):
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config.pop("add_bos_token")
    config.pop("add_eos_token")
    (target / "tokenizer_config.json").write_text(json.dumps({**config, **flags}))
    tokenizer_json = json.loads((model_dir / "tokenizer.json").read_text())
    (target / "tokenizer.json").write_text(json.dumps({**tokenizer_json, **tokenizer_json_overrides}))
    shutil.copy(model_dir / "special_tokens_map.json", target / "special_tokens_map.json")


def test_incremental_detokenizer_holds_split_characters(tokenizer):
    text = "a😀 wörld 👍🏽!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids=tokenizer.encode("prompt: "))
    deltas = [detokenizer.add([token]) for token in ids]
    assert "".join(deltas) == text == detokenizer.text
    assert not any("\ufffd" in delta for delta in deltas)
    assert deltas[:5] == ["a", "", "", "", "😀"]  # the 4 bytes of 😀 are 4 tokens
    assert detokenizer.token_ids == ids
    assert detokenizer.flush() == ""


def test_incremental_detokenizer_chunks_specials_and_flush(tokenizer):
    ids = tokenizer.encode("x👍", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.add(ids[:3]) == "x"
    assert detokenizer.add([EOT_TOKEN_ID]) == ""
    assert detokenizer.add(ids[3:]) == "👍"
    # A generation that stops mid-character: flush releases the bytes as U+FFFD.
    assert detokenizer.add(ids[1:3]) == ""
    assert detokenizer.flush() == "\ufffd"
    # Invalid bytes that can never complete are not held back forever.
    stray = IncrementalDetokenizer(tokenizer)
    emitted = "".join(stray.add([0x80]) for _ in range(6))
    assert emitted == "\ufffd" * 3 and stray.flush() == "\ufffd" * 3
    # Several tokens at once: whole characters go out, the unfinished tail waits.
    several = IncrementalDetokenizer(tokenizer)
    assert several.add(tokenizer.encode("abc😀", add_special_tokens=False)[:-2]) == "abc"
