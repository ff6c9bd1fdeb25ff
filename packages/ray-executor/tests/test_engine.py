"""Engine behaviour on the built-in model: pipelining, abort, stop conditions, sampling, bad input."""

import jax
import pytest

from pipejax.ray_executor import LLM, SamplingParams
from pipejax.ray_executor.engine.request import Request
from pipejax.ray_executor.engine_args import resolve_model


@pytest.fixture(scope="module")
def llm_pp2():
    llm = LLM("builtin", pipeline_parallel_size=2, tensor_parallel_size=2, num_kv_blocks=160, block_size=16,
              warmup=False,
              step_trace_len=4096)
    yield llm
    llm.shutdown()


def test_two_batches_in_flight_and_stages_overlap(llm_pp2):
    engine = llm_pp2.engine
    engine.in_flight_trace.clear()
    llm_pp2.generate([f"prompt {i}" for i in range(8)], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert max(n for _, n in engine.in_flight_trace) == 2
    trace = engine.executor.step_trace()
    stage0 = [(s, a, b) for rank, s, a, b in trace if rank == 0]
    stage1 = [(s, a, b) for rank, s, a, b in trace if rank == 1]
    overlaps = [(s0, s1) for s0, a0, b0 in stage0 for s1, a1, b1 in stage1 if s0 != s1 and a0 < b1 and a1 < b0]
    assert overlaps, "stage 0 never ran a batch while stage 1 ran another"


def test_abort_frees_blocks_and_spares_others(llm_pp2):
    engine = llm_pp2.engine
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    alone = llm_pp2.generate(["keep me", "me too"], greedy)
    free_before = engine.scheduler.blocks.num_free
    engine.add_request("keep-0", "keep me", greedy)
    engine.add_request("victim", "abort me " * 10, greedy)
    engine.add_request("keep-1", "me too", greedy)
    done = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if steps == 6:
            aborted = engine.abort_request("victim")
            assert aborted is not None and aborted.outputs[0].finish_reason == "abort"
    assert engine.scheduler.blocks.num_free == free_before
    assert "victim" not in engine.scheduler.requests
    assert done["keep-0"].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert done["keep-1"].outputs[0].token_ids == alone[1].outputs[0].token_ids


def test_step_deltas_add_up_to_the_whole_output(llm_pp2):
    """Serving's form of a step: each request's deltas, concatenated, are what the offline API returns."""
    engine = llm_pp2.engine
    prompts = ["deltas one", "deltas two, longer"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    expected = {f"d{i}": out.outputs[0] for i, out in enumerate(llm_pp2.generate(prompts, params))}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"d{i}", prompt, params)
    tokens, text, logprobs, finish = {}, {}, {}, {}
    while engine.has_unfinished_requests():
        for d in engine.step_deltas():
            assert d.request_id not in finish, "a delta after the finishing one"
            tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
            text[d.request_id] = (text.get(d.request_id, "") + d.new_text)[: d.text_len]
            logprobs.setdefault(d.request_id, []).extend(d.new_logprobs)
            if d.finished:
                finish[d.request_id] = d.finish_reason
    for rid, want in expected.items():
        assert tokens[rid] == want.token_ids and text[rid] == want.text and finish[rid] == "length"
        assert [lp.sampled for lp in logprobs[rid]] == pytest.approx([lp.sampled for lp in want.logprobs], abs=1e-4)


def test_step_finished_returns_each_request_once_when_it_ends(llm_pp2):
    """The offline API's form of a step: no output until a request finishes, then the whole of it, once."""
    engine = llm_pp2.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    expected = llm_pp2.generate(["finished one", "finished two"], [params, short])
    engine.add_request("f0", "finished one", params)
    engine.add_request("f1", "finished two", short)
    seen, steps = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step_finished():
            assert out.finished
            seen.append((steps, out.request_id, out.outputs[0].token_ids))
        steps += 1
    assert [rid for _, rid, _ in seen] == ["f1", "f0"] and seen[0][0] < seen[1][0]
    assert {rid: ids for _, rid, ids in seen} == {"f0": expected[0].outputs[0].token_ids,
                                                  "f1": expected[1].outputs[0].token_ids}


def test_stop_conditions(llm_pp2):
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    (ref,) = llm_pp2.generate(["stop conditions"], free)
    tokens, text = ref.outputs[0].token_ids, ref.outputs[0].text
    assert ref.outputs[0].finish_reason == "length" and len(tokens) == 40

    stop_tok = tokens[5]
    first = tokens.index(stop_tok)
    (out,) = llm_pp2.generate(
        ["stop conditions"], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_tok])
    )
    assert out.outputs[0].token_ids == tokens[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_tok

    stop_str = next(text[i : i + 2] for i in range(4, len(text) - 2) if text[i : i + 2].isprintable())
    (out,) = llm_pp2.generate(["stop conditions"], SamplingParams(temperature=0, max_tokens=40, stop=[stop_str]))
    assert out.outputs[0].text == text[: text.index(stop_str)]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_str

    # EOS: the first end-of-sequence token of the unconstrained run ends the request there.
    eos_ids = llm_pp2.engine.eos_token_ids
    (out,) = llm_pp2.generate(["stop conditions"], SamplingParams(temperature=0, max_tokens=40))
    cut = next((i for i, t in enumerate(tokens) if t in eos_ids), None)
    if cut is None:
        assert out.outputs[0].token_ids == tokens and out.outputs[0].finish_reason == "length"
    else:
        assert out.outputs[0].token_ids == tokens[: cut + 1] and out.outputs[0].finish_reason == "stop"


def test_eos_ends_a_request():
    req = Request("r", [1, 2], SamplingParams(max_tokens=10), 10, frozenset({7}), tokenizer=None)
    req.append_token(5, None)
    assert not req.finished
    req.append_token(7, None)
    assert req.finished and req.finish_reason == "stop" and req.stop_reason == 7
    ignoring = Request("r", [1, 2], SamplingParams(max_tokens=2, ignore_eos=True), 2, frozenset({7}), tokenizer=None)
    ignoring.append_token(7, None)
    assert not ignoring.finished
    ignoring.append_token(7, None)
    assert ignoring.finish_reason == "length"


def test_seeded_sampling_is_reproducible_across_batches(llm_pp2):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm_pp2.generate(["seeded prompt"], seeded)[0].outputs[0].token_ids
    batched = llm_pp2.generate(
        ["other", "seeded prompt", "another one"],
        [SamplingParams(temperature=1.0, max_tokens=20), seeded, SamplingParams(temperature=0.7, max_tokens=9)],
    )
    assert batched[1].outputs[0].token_ids == alone
    n3 = llm_pp2.generate(["seeded prompt"], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16))[0]
    assert [o.index for o in n3.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in n3.outputs}) > 1


def test_logprobs(llm_pp2):
    (out,) = llm_pp2.generate(["logprobs"], SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True))
    lps = out.outputs[0].logprobs
    assert len(lps) == 5
    for token, lp in zip(out.outputs[0].token_ids, lps, strict=True):
        assert len(lp.top) == 3 and lp.top[0][0] == token  # greedy: the sampled token is the best one
        assert lp.sampled == pytest.approx(lp.top[0][1]) and lp.sampled <= 0


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ("x" * 5000, SamplingParams(max_tokens=4), "prompt has 50\\d\\d tokens but max_model_len=2048"),
        ("", SamplingParams(max_tokens=4), "prompt is empty"),
        ({"prompt_token_ids": []}, SamplingParams(max_tokens=4), "prompt is empty"),
        ({"prompt_token_ids": [1, 99999]}, SamplingParams(max_tokens=4), "outside the vocabulary"),
    ],
)
def test_bad_prompt_is_rejected_and_engine_keeps_serving(llm_pp2, prompt, params, match):
    engine = llm_pp2.engine
    engine.add_request("good", "still served", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outputs] == ["good"] and len(outputs[0].outputs[0].token_ids) == 8
    # a bad prompt in a list rejects the whole call and leaves nothing queued
    with pytest.raises(ValueError, match=match):
        llm_pp2.generate(["fine", prompt], params)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_tokens": 0}, "max_tokens=0 must be an integer >= 1"),
        ({"max_tokens": -3}, "max_tokens=-3"),
        ({"temperature": -1}, "temperature=-1"),
        ({"top_p": 0}, "top_p=0"),
        ({"top_k": -5}, "top_k=-5"),
        ({"min_p": 2}, "min_p=2"),
        ({"n": 0}, "n=0"),
        ({"temperature": float("nan")}, "temperature=nan"),
    ],
)
def test_invalid_sampling_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_unknown_model_path(tmp_path):
    with pytest.raises(ValueError, match=f"model '{tmp_path / 'nope'}' is not a folder holding a Hugging Face"):
        resolve_model(str(tmp_path / "nope"))


def test_layout_larger_than_devices():
    fits = r"tensor_parallel_size=4 .* 8 devices.*fits: .*devices in this process: cpu:0, .*cpu:7"
    with pytest.raises(ValueError, match=fits):
        LLM("builtin", pipeline_parallel_size=4, tensor_parallel_size=4, warmup=False)
    assert len(jax.devices()) == 8


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=14, ignore_eos=True, logprobs=1),
], ids=["greedy", "seeded-sampling"])
def test_a_resumed_request_goes_on_where_it_stopped(llm_pp2, params):
    """A request moved from a lost engine: given the tokens it had, it generates the rest exactly as the whole run
    did (greedy and seeded sampling), sends only the rest, and its text joins the earlier text."""
    engine = llm_pp2.engine
    whole = llm_pp2.generate(["resume me, please"], params)[0].outputs[0]
    cut = 5
    earlier_text = engine.tokenizer.decode(whole.token_ids[:cut])
    engine.add_request("resumed", "resume me, please", params, resume_token_ids=whole.token_ids[:cut])
    tokens, text = [], earlier_text
    while engine.has_unfinished_requests():
        for d in engine.step_deltas():
            tokens += d.new_token_ids
            text = (text + d.new_text)[: d.text_len]
            if d.new_logprobs is not None:
                assert len(d.new_logprobs) == len(d.new_token_ids)
    assert whole.token_ids[:cut] + tokens == whole.token_ids and text == whole.text
    with pytest.raises(ValueError, match="already complete"):
        engine.add_request("over", "resume me, please", params, resume_token_ids=whole.token_ids)


def test_a_requests_token_slice_spans_its_prompt_and_output_without_joining_them():
    req = Request("r", [1, 2, 3, 4], SamplingParams(), max_tokens=10, eos_token_ids=frozenset(), tokenizer=None)
    req.output_token_ids = [5, 6, 7]
    joined = [1, 2, 3, 4, 5, 6, 7]
    assert all(req.token_ids(a, b) == tuple(joined[a:b]) for a in range(8) for b in range(a, 8))


def test_a_constrained_request_resumes_where_it_was_lost_and_refuses_resume_tokens_off_its_grammar(llm_pp2):
    """A request moved from a lost engine (``resume_token_ids``) goes on in its grammar from the tokens it had:
    its output equals the uninterrupted one; resume tokens the grammar refuses are a ValueError naming them."""
    import re

    from pipejax.ray_executor import StructuredOutputs

    engine = llm_pp2.engine
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputs(regex="[a-d]{8}"))
    whole = llm_pp2.generate(["spell a word"], params)[0].outputs[0]
    assert re.fullmatch("[a-d]{8}", whole.text) and whole.finish_reason == "stop", whole
    engine.add_request("resumed", "spell a word", params, resume_token_ids=whole.token_ids[:3])
    finished = []
    while engine.has_unfinished_requests():
        finished += engine.step_finished()
    (resumed,) = finished
    assert resumed.outputs[0].token_ids == whole.token_ids and resumed.outputs[0].text == whole.text
    with pytest.raises(ValueError, match="resume_token_ids do not follow its structured_outputs"):
        engine.add_request("off-grammar", "spell a word", params, resume_token_ids=[ord("z")])
    assert not engine.has_unfinished_requests()
