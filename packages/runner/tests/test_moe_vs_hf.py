"""The MoE MLP (``runner.moe``) against transformers' own sparse blocks on the same weights, fp32: Qwen3-MoE
(top-k renormalised), Mixtral (always renormalised) and Qwen2-MoE (not renormalised, a gated shared expert),
alone and sharded over a 4-device stage mesh both ways (experts split over the devices, or each expert's width)."""

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


def test_a_moe_checkpoint_is_refused_by_name_until_its_layers_are_served():
    from pipejax.runner.config import ModelConfig

    with pytest.raises(ValueError, match="MixtralForCausalLM is a Mixture-of-Experts model"):
        ModelConfig.from_hf({**BLOCKS["MixtralForCausalLM"][1].to_dict(), "architectures": ["MixtralForCausalLM"]})
