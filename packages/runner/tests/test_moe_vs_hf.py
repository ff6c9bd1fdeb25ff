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
from pipejax.runner.panels import Panels

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
         "experts_gate_up": gate_up.reshape(X, 2, FM, E).transpose(3, 0, 1, 2),
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
    p = _ours(block)
    assert {k: v.shape for k, v in p.items()} == {k: s for k, (s, _) in moe_param_shapes(E, moe).items()}
    mesh = stage_mesh(jax.devices()[:4])
    for tokens, gather in ((11, False), (3, True)):  # every expert on every token; each token's experts gathered
        step = jax.jit(lambda x, p, gather=gather: moe_mlp(x, p, moe, residual=0 * x, gather=gather))
        x = np.random.default_rng(tokens).standard_normal((tokens, E)).astype(np.float32)
        with torch.no_grad():
            want = block(torch.from_numpy(x)[None])[0].numpy()
        np.testing.assert_allclose(np.asarray(step(x, p)), want, rtol=1e-4, atol=1e-5)
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
# (Qwen's experts and shared expert whole panels of 32 columns: on one CPU device they are stored in panels for the
# routed-experts kernel; Mixtral's 48 are not, and keep their own layout there)
MODELS = {  # arch -> what its tiny config adds to TINY (4 layers, 8 experts, top 2)
    "Qwen3MoeForCausalLM": dict(moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                head_dim=24),
    "MixtralForCausalLM": dict(intermediate_size=48, num_local_experts=8, num_experts_per_tok=2, sliding_window=None),
    "Qwen2MoeForCausalLM": dict(moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                                shared_expert_intermediate_size=32),
}
# Qwen2-MoE whose layers mix dense MLPs (layers 0 and 2: decoder_sparse_step=2) and MoE ones (1 and 3)
MIXED = "Qwen2MoeForCausalLM-mixed"
MODELS[MIXED] = {**MODELS["Qwen2MoeForCausalLM"], "decoder_sparse_step": 2, "intermediate_size": 56}
WIDTH = {arch: c.get("moe_intermediate_size", c.get("intermediate_size")) for arch, c in MODELS.items()}
MOE_PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(20, 45))]


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    from pipejax_test_support.hf_oracle import TINY

    made = {}

    def get(arch):
        if arch not in made:
            path = tmp_path_factory.mktemp(arch)
            cls = arch.removesuffix("-mixed")
            config_cls = getattr(transformers, cls.replace("ForCausalLM", "Config"))
            torch.manual_seed(0)
            model = getattr(transformers, cls)(config_cls(**{**TINY, "num_hidden_layers": 4, **MODELS[arch]}))
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


# (arch, pp, tp, layer split, expert parallel): pairwise over pp {1, 2, 3} x tp {1, 2, 4} x EP on/off
MODEL_CASES = [("Qwen3MoeForCausalLM", 2, 2, None, False), ("Qwen3MoeForCausalLM", 2, 2, None, True),
               ("MixtralForCausalLM", 2, 1, None, False), ("MixtralForCausalLM", 1, 4, None, False),
               ("MixtralForCausalLM", 1, 4, None, True), ("Qwen3MoeForCausalLM", 3, 1, (1, 2, 1), True),
               ("Qwen2MoeForCausalLM", 2, 2, None, False), ("Qwen2MoeForCausalLM", 3, 2, (2, 1, 1), True),
               # stages that mix dense and MoE layers: on one CPU device (panels, unrolled decode), and sharded
               (MIXED, 2, 1, None, False), (MIXED, 2, 2, (3, 1), True)]


def _case_id(arch, pp, tp, split, ep) -> str:
    layout = f"pp{pp}tp{tp}" + ("-" + "".join(map(str, split)) if split else "") + ("-ep" if ep else "")
    return f"{arch.replace('ForCausalLM', '')}-{layout}"


@pytest.mark.parametrize("arch,pp,tp,split,ep", MODEL_CASES, ids=[_case_id(*c) for c in MODEL_CASES])
def test_moe_models_match_transformers(moe_checkpoints, arch, pp, tp, split, ep):
    """Logits within 1e-4 relative, and greedy decode token-identical, at pp x tp: each expert split over tp, or
    with expert parallelism whole experts per device (each device then holds num_experts / tp of them)."""
    from hf_oracle import ChainedStages, greedy_generate, prefill_batch
    from pipejax_test_support import hf_greedy, hf_logits

    path, model = moe_checkpoints(arch)
    stages = ChainedStages(path, pp, tp, split, num_blocks=80, expert_parallel=ep)
    expert_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    moe_layers = sum(stage.params["layers.router"].shape[0] for stage in stages.stages)
    fm = WIDTH[arch]
    for stage in stages.stages:
        held = {}  # each device holds its stage's share of the experts, 1 / tp of it (whole experts with EP)
        for name in ("layers.experts_gate_up", "layers.experts_down"):
            for shard in getattr(stage.params[name], "data", stage.params[name]).addressable_shards:
                held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
        share = stage.params["layers.router"].shape[0] / moe_layers / tp
        assert set(held.values()) == {expert_bytes * share}, (held, expert_bytes, share)
        experts = stage.params["layers.experts_down"]  # [MoE layers, X, Fm, E]; in panels [.., X, E / 32, Fm, 32]
        if isinstance(experts, Panels):
            assert tp == 1 and experts.data.shape[1:] == (8, 2, fm, 32)
        else:
            assert {s.data.shape[1:] for s in experts.addressable_shards} == {
                (8 // tp, fm, 64) if ep else (8, fm // tp, 64)}
        if arch == MIXED:  # each kind's MLP weights stacked over its own layers
            layers = stage.stage.layer_range(stage.cfg)
            stacked = getattr(experts, "data", experts).shape
            assert stacked[0] == len([i for i in layers if i % 2]), (layers, stacked)
            down = stage.params.get("layers.down")  # in panels on one CPU device
            dense = len([i for i in layers if not i % 2])
            assert (down is None) if not dense else getattr(down, "data", down).shape[0] == dense
    got = stages.logits(prefill_batch(MOE_PROMPTS))
    for want, have in zip(hf_logits(model, MOE_PROMPTS), got, strict=True):
        assert np.abs(have - want).max() / np.abs(want).max() < 1e-4
    stages = ChainedStages(path, pp, tp, split, num_blocks=80, expert_parallel=ep)  # a fresh KV cache
    assert greedy_generate(stages, MOE_PROMPTS, 12, chunk=4) == hf_greedy(model, MOE_PROMPTS, 12)


# (arch, pp, decode layers): the dense kernel forced on one CPU device per stage
ROUTED_CASES = [("Qwen3MoeForCausalLM", 2, "unrolled"), (MIXED, 1, "scan")]


@pytest.mark.parametrize("arch,pp,layers", ROUTED_CASES, ids=[f"{a}-pp{p}-{d}" for a, p, d in ROUTED_CASES])
def test_routed_experts_kernel_matches_transformers(moe_checkpoints, arch, pp, layers):
    """With the CPU dense kernel, each expert's gate/up and down are stored in panels and the routed-experts kernel
    computes only the rows routed to each expert (a shared expert's MLP on the dense kernel): logits within 1e-4
    relative, and greedy decode token-identical, through decode layers unrolled and scanned, and a stage that mixes
    dense and MoE layers."""
    from hf_oracle import ChainedStages, greedy_generate, prefill_batch
    from pipejax_test_support import hf_greedy, hf_logits

    path, model = moe_checkpoints(arch)

    def chained():
        return ChainedStages(path, pp, 1, num_blocks=80, dense_matmuls="cpu-kernel", decode_layers=layers)

    stages = chained()
    for stage in stages.stages:
        assert stage.selection.kernels(stage.mesh).routed_experts is not None
        for name in ("layers.experts_gate_up", "layers.experts_down") + (
                ("layers.shared_gate_up", "layers.shared_down") if "Qwen2" in arch else ()):
            assert isinstance(stage.params[name], Panels), name
    got = stages.logits(prefill_batch(MOE_PROMPTS))
    for want, have in zip(hf_logits(model, MOE_PROMPTS), got, strict=True):
        assert np.abs(have - want).max() / np.abs(want).max() < 1e-4
    assert greedy_generate(chained(), MOE_PROMPTS, 12, chunk=4) == hf_greedy(model, MOE_PROMPTS, 12)


def test_each_kind_of_mlp_is_stacked_over_its_own_layers(moe_checkpoints):
    from pipejax.runner.config import ModelConfig, StageConfig
    from pipejax.runner.model import layer_rows, param_specs

    _, model = moe_checkpoints(MIXED)
    cfg = ModelConfig.from_hf({**model.config.to_dict(), "mlp_only_layers": [3]})
    assert [cfg.moe.is_sparse(i) for i in range(4)] == [False, True, False, False]
    stage = StageConfig(0, 1)
    specs = param_specs(cfg, stage, 1)
    assert specs["layers.router"].shape[0] == 1 and specs["layers.gate_up"].shape[:2] == (3, 64)
    assert layer_rows(cfg, stage, "router") == (1,) and layer_rows(cfg, stage, "down") == (0, 2, 3)
    assert layer_rows(cfg, stage, "qkv") == (0, 1, 2, 3)
    assert "layers.router" not in param_specs(cfg, StageConfig(0, 4), 1)  # a stage of one dense layer


def test_an_unknown_moe_architecture_is_refused_naming_those_that_load():
    from pipejax.runner.config import ModelConfig

    hf = {"architectures": ["DeepseekV3ForCausalLM"], "n_routed_experts": 16, "num_experts_per_tok": 2}
    with pytest.raises(ValueError, match=r"unsupported architecture \['DeepseekV3ForCausalLM'\]; .*"
                                         r"MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM"):
        ModelConfig.from_hf(hf)


def test_experts_in_panels_without_the_routed_kernel():
    """Experts stored in panels where no routed kernel runs (numba could not build it): turned back into their own
    layout, the same results as the experts stored so, stacked with a layer index and alone."""
    from pipejax.runner.panels import panel_shape

    moe = MoeConfig(num_experts=4, top_k=2, intermediate_size=32, norm_topk_prob=True)
    rng = np.random.default_rng(0)
    p = {n: rng.standard_normal((2, *s), np.float32) * 0.3 for n, (s, _) in moe_param_shapes(64, moe).items()}

    def in_panels(w, lead):  # [L, *lead, in, *out] -> [L, *lead, *out[:-1], out[-1] / 32, in, 32]
        outs = w.ndim - 2 - lead
        split = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
        order = (*range(1 + lead), *range(2 + lead, 2 + lead + outs), 1 + lead, split.ndim - 1)
        return np.ascontiguousarray(split.transpose(order))

    stacked = {**p, "experts_gate_up": Panels(in_panels(p["experts_gate_up"], 0), 1),
               "experts_down": Panels(in_panels(p["experts_down"], 1), 1)}
    assert stacked["experts_gate_up"].data.shape == (2, *panel_shape((64, 4, 2, 32), 0, 1))
    x = rng.standard_normal((5, 64)).astype(np.float32)
    for gather in (True, False):
        want = moe_mlp(x, {n: w[1] for n, w in p.items()}, moe, 0 * x, gather=gather)
        layer = {n: (w if isinstance(w, Panels) else w[1]) for n, w in stacked.items()}
        np.testing.assert_allclose(np.asarray(moe_mlp(x, layer, moe, 0 * x, gather=gather)), np.asarray(want),
                                   rtol=1e-5, atol=1e-6)
        alone = {**layer, "experts_gate_up": Panels(layer["experts_gate_up"].data[1]),
                 "experts_down": Panels(layer["experts_down"].data[1])}
        np.testing.assert_allclose(np.asarray(moe_mlp(x, alone, moe, 0 * x, gather=gather)), np.asarray(want),
                                   rtol=1e-5, atol=1e-6)
