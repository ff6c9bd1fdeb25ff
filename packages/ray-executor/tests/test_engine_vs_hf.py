"""The whole engine (scheduler, batch queue, in-process executor, stages) against transformers' greedy generate."""

import pytest
from oracle import hf_greedy, make_checkpoint, mixed_prompts

from pipejax.ray_executor import LLM, SamplingParams

LAYOUTS = {  # name: (pp, tp, partition of the 6 layers: None even, "auto" balanced by modelled cost, or explicit)
    "pp1tp1": (1, 1, None),
    "pp2tp1-auto": (2, 1, "auto"),
    "pp2tp2": (2, 2, None),
    "pp4tp2": (4, 2, None),
    "pp3-uneven": (3, 1, "1,3,2"),
}
PROMPTS = mixed_prompts(16)
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
# Llama on every layout; under preemption Llama with the most batches in flight (4 stages) and the other
# architectures (which the runner's tests check under TP and PP) on one layout each. Compiles dominate: a
# preemption case (30 KV blocks: a cache of another shape) compiles every program anew, 15-43 s each from a cold
# compilation cache as in CI (2 CPUs), where a plain case after the first takes 5-13 s.
PLAIN = [("LlamaForCausalLM", layout) for layout in LAYOUTS]
PREEMPT = [("LlamaForCausalLM", "pp4tp2"), ("Qwen2ForCausalLM", "pp2tp2"), ("Qwen3ForCausalLM", "pp3-uneven")]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """arch -> (checkpoint folder, transformers' greedy outputs on PROMPTS), each made once."""
    made = {}

    def get(arch):
        if arch not in made:
            path = tmp_path_factory.mktemp(arch)
            made[arch] = path, hf_greedy(make_checkpoint(path, arch), PROMPTS, NEW_TOKENS)
        return made[arch]

    return get


def run_engine(path, layout: str, num_kv_blocks: int):
    pp, tp, partition = LAYOUTS[layout]
    llm = LLM(
        str(path),
        pipeline_parallel_size=pp,
        tensor_parallel_size=tp,
        pp_layer_partition=partition,
        block_size=8,
        num_kv_blocks=num_kv_blocks,
        warmup=False,
    )
    try:
        if partition == "auto":  # resolved once by the engine, to counts every stage gets
            resolved = llm.engine.config.parallel.pp_layer_partition
            assert isinstance(resolved, tuple) and sum(resolved) == 6, resolved
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
        # tracing is off by default: nothing kept per step
        assert not llm.engine.in_flight_trace and llm.engine.executor.step_trace() == []
        return [o.outputs[0].token_ids for o in outputs], llm.engine.scheduler
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch,layout", PLAIN, ids=[f"{a}-{lay}" for a, lay in PLAIN])
def test_greedy_matches_transformers(references, arch, layout):
    path, expected = references(arch)
    got, scheduler = run_engine(path, layout, num_kv_blocks=200)
    assert scheduler.num_preemptions == 0
    assert got == expected


@pytest.mark.parametrize("arch,layout", PREEMPT, ids=[f"{a}-{lay}" for a, lay in PREEMPT])
def test_greedy_matches_transformers_under_preemption(references, arch, layout):
    path, expected = references(arch)
    # 30 blocks of 8 tokens cannot hold 16 requests of up to 63 tokens: the scheduler must preempt.
    got, scheduler = run_engine(path, layout, num_kv_blocks=30)
    assert scheduler.num_preemptions > 0
    assert scheduler.blocks.num_free == 29  # everything given back
    assert got == expected


@pytest.mark.parametrize("backend,expert_parallel", [("uni", False), ("ray", True)])
def test_a_moe_model_matches_transformers_under_preemption(tmp_path, backend, expert_parallel):
    """Mixtral (8 experts, top 2; transformers saves it with per-expert tensors) through the whole engine at pp=2 x
    tp=2, 16 prompts chunked and preempted: greedy equal. In process each expert's FFN is split over the stage's 2
    devices; on Ray stage actors with expert parallelism, each device holds 4 whole experts."""
    import torch
    import transformers
    from oracle import TINY

    torch.manual_seed(0)
    config = transformers.MixtralConfig(**{**TINY, "num_hidden_layers": 4, "intermediate_size": 48,
                                           "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None})
    model = transformers.MixtralForCausalLM(config).float().eval()
    with torch.no_grad():  # spread the router so that the chosen experts vary from token to token
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(tmp_path)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    expected = hf_greedy(model, PROMPTS, NEW_TOKENS)
    llm = LLM(str(tmp_path), pipeline_parallel_size=2, tensor_parallel_size=2, block_size=8, num_kv_blocks=30,
              max_num_batched_tokens=64, warmup=False, distributed_executor_backend=backend,
              enable_expert_parallel=expert_parallel)
    try:
        assert llm.engine.config.worker_config(1).stage.expert_parallel is expert_parallel
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
        assert llm.engine.scheduler.num_preemptions > 0
    finally:
        llm.shutdown()
    assert got == expected


def test_expert_parallelism_over_a_tp_that_does_not_divide_the_experts_is_refused_before_any_stage_starts(tmp_path):
    import transformers
    from oracle import TINY

    transformers.MixtralConfig(**{**TINY, "num_local_experts": 6, "num_experts_per_tok": 2},
                               architectures=["MixtralForCausalLM"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by tensor_parallel_size=4; use a tp that"):
        LLM(str(tmp_path), tensor_parallel_size=4, enable_expert_parallel=True, warmup=False)
