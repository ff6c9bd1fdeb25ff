"""Mixture-of-Experts models against transformers, fp32: the MoE MLP (``runner.moe``) against transformers' own
sparse blocks on the same weights -- Qwen3-MoE (top-k renormalised), Mixtral (always renormalised) and Qwen2-MoE
(not renormalised, a gated shared expert) -- alone and sharded over a 4-device stage mesh both ways (experts split
over the devices, or each expert's width); then whole tiny checkpoints transformers saved, served by the stage
model at pp x tp: logits and greedy decode."""

import jax
import numpy as np
import pytest
import torch
import transformers
from transformers.models.mixtral import modeling_mixtral
from transformers.models.qwen2_moe import modeling_qwen2_moe
from transformers.models.qwen3_moe import modeling_qwen3_moe

from pipejax.pp_utils import logical_sharding, stage_mesh
from pipejax.runner.config import MoeConfig
from pipejax.runner.moe import moe_mlp, moe_param_shapes, moe_rules

E, FM, X, K = 32, 16, 8, 2
BLOCKS = {
    "Qwen3MoeForCausalLM": (modeling_qwen3_moe.Qwen3MoeSparseMoeBlock, transformers.Qwen3MoeConfig(
        hidden_size=E, moe_intermediate_size=FM, num_experts=X, num_experts_per_tok=K, norm_topk_prob=True)),
    "MixtralForCausalLM": (modeling_mixtral.MixtralSparseMoeBlock, transformers.MixtralConfig(
        hidden_size=E, intermediate_size=FM, num_local_experts=X, num_experts_per_tok=K)),
    "Qwen2MoeForCausalLM": (modeling_qwen2_moe.Qwen2MoeSparseMoeBlock, transformers.Qwen2MoeConfig(
        hidden_size=E, moe_intermediate_size=FM, num_experts=X, num_experts_per_tok=K, norm_topk_prob=False,
        shared_expert_intermediate_size=24)),
}


def _ours(block: torch.nn.Module) -> dict[str, np.ndarray]:
    """The block's weights in ``moe_param_shapes``' layout."""
    sd = {k: v.detach().numpy() for k, v in block.state_dict().items()}
    gate_up = sd["experts.gate_up_proj"]  # [X, 2 Fm, E]: gate rows, then up rows
    p = {"router": sd["gate.weight"].T,
         "experts_gate_up": gate_up.reshape(X, 2, FM, E).transpose(0, 3, 1, 2),
         "experts_down": sd["experts.down_proj"].transpose(0, 2, 1)}  # [X, E, Fm] -> [X, Fm, E]
    if "shared_expert_gate.weight" in sd:
        p["shared_gate_up"] = np.stack([sd["shared_expert.gate_proj.weight"].T, sd["shared_expert.up_proj.weight"].T],
                                       axis=1)
        p["shared_down"] = sd["shared_expert.down_proj.weight"].T
        p["shared_gate"] = sd["shared_expert_gate.weight"][0]
    return p


@pytest.mark.parametrize("arch", list(BLOCKS))
def test_moe_mlp_matches_transformers_alone_and_sharded(arch):
    cls, config = BLOCKS[arch]
    torch.manual_seed(0)
    block = cls(config).eval()
    for param in block.parameters():  # transformers leaves some of them empty until a checkpoint fills them
        torch.nn.init.normal_(param, std=0.2)
    moe = MoeConfig.from_hf(arch, config.to_dict())
    x = np.random.default_rng(1).standard_normal((11, E)).astype(np.float32)
    with torch.no_grad():
        want = block(torch.from_numpy(x)[None])[0].numpy()
    p = _ours(block)
    assert {k: v.shape for k, v in p.items()} == {k: s for k, (s, _) in moe_param_shapes(E, moe).items()}
    step = jax.jit(lambda x, p: moe_mlp(x, p, moe, residual=0 * x))
    got = np.asarray(step(x, p))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    mesh = stage_mesh(jax.devices()[:4])
    for expert_parallel in (True, False):
        rules = moe_rules(expert_parallel, X, 4)
        axes = {k: a for k, (_, a) in moe_param_shapes(E, moe).items()}
        placed = {k: jax.device_put(v, logical_sharding(mesh, axes[k], rules)) for k, v in p.items()}
        sharded = np.asarray(step(jax.device_put(x, logical_sharding(mesh, (None, None), rules)), placed))
        np.testing.assert_allclose(sharded, want, rtol=1e-4, atol=1e-5)


def test_routing_follows_each_architectures_normalisation():
    hf = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "norm_topk_prob": False}
    raw, mixtral = MoeConfig.from_hf("Qwen2MoeForCausalLM", hf), MoeConfig.from_hf(
        "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 8})
    assert not raw.norm_topk_prob and mixtral.norm_topk_prob
    sparse = MoeConfig.from_hf("Qwen2MoeForCausalLM", {**hf, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert [sparse.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]


def test_expert_parallelism_needs_whole_experts_per_device():
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by tensor_parallel_size=4"):
        moe_rules(True, 6, 4)
    assert moe_rules(False, 6, 4).mesh_axis("expert_mlp") == "tp"


# --- whole models: transformers' tiny MoE checkpoints (per-expert tensors on disk), served by the stage model ----
MODELS = {  # arch -> what its tiny config adds to TINY (4 layers, 8 experts, top 2)
    "Qwen3MoeForCausalLM": dict(moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                head_dim=24),
    "MixtralForCausalLM": dict(intermediate_size=48, num_local_experts=8, num_experts_per_tok=2, sliding_window=None),
    "Qwen2MoeForCausalLM": dict(moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                                shared_expert_intermediate_size=40),
}
MOE_PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(20, 45))]


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    from pipejax_test_support.hf_oracle import TINY

    made = {}

    def get(arch):
        if arch not in made:
            path = tmp_path_factory.mktemp(arch)
            config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
            torch.manual_seed(0)
            model = getattr(transformers, arch)(config_cls(**{**TINY, "num_hidden_layers": 4, **MODELS[arch]}))
            model = model.float().eval()
            with torch.no_grad():  # spread the router so the top-k choice differs from token to token
                for name, p in model.named_parameters():
                    if name.endswith("gate.weight") or "norm" in name:
                        p.add_(torch.randn_like(p) * 0.3)
            model.save_pretrained(path, safe_serialization=True, max_shard_size="200KB")
            model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
            made[arch] = path, model
        return made[arch]

    return get


MODEL_CASES = [("Qwen3MoeForCausalLM", 2, 2), ("MixtralForCausalLM", 2, 1),
               ("MixtralForCausalLM", 1, 4), ("Qwen2MoeForCausalLM", 2, 2)]


@pytest.mark.parametrize("arch,pp,tp", MODEL_CASES, ids=[f"{a}-pp{p}tp{t}" for a, p, t in MODEL_CASES])
def test_moe_models_match_transformers(moe_checkpoints, arch, pp, tp):
    """Logits within 1e-4 relative, and greedy decode token-identical, at pp x tp (experts split over tp)."""
    from hf_oracle import ChainedStages, greedy_generate, prefill_batch
    from pipejax_test_support import hf_greedy, hf_logits

    path, model = moe_checkpoints(arch)
    stages = ChainedStages(path, pp, tp, num_blocks=80)
    assert all("layers.router" in s.params for s in stages.stages)
    got = stages.logits(prefill_batch(MOE_PROMPTS))
    for want, have in zip(hf_logits(model, MOE_PROMPTS), got, strict=True):
        assert np.abs(have - want).max() / np.abs(want).max() < 1e-4
    stages = ChainedStages(path, pp, tp, num_blocks=80)  # a fresh KV cache for the decode
    assert greedy_generate(stages, MOE_PROMPTS, 12, chunk=4) == hf_greedy(model, MOE_PROMPTS, 12)


def test_a_stage_mixing_dense_and_moe_layers_is_refused_by_name(moe_checkpoints, tmp_path):
    from pipejax.runner.config import ModelConfig, StageConfig
    from pipejax.runner.model import param_specs

    _, model = moe_checkpoints("Qwen2MoeForCausalLM")
    cfg = ModelConfig.from_hf({**model.config.to_dict(), "decoder_sparse_step": 2})
    assert [cfg.moe.is_sparse(i) for i in range(4)] == [False, True, False, True]
    with pytest.raises(ValueError, match="stage 0 holds layers 0-1, some with dense MLPs and some with experts"):
        param_specs(cfg, StageConfig(0, 2), 1)
    assert "layers.gate_up" in param_specs(cfg, StageConfig(0, 4), 1)  # a stage of one dense layer
    assert "layers.router" in param_specs(cfg, StageConfig(1, 4), 1)
