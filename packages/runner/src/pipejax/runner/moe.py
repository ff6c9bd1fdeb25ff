"""A Mixture-of-Experts MLP (Qwen3-MoE, Mixtral, Qwen2-MoE), read top to bottom: sharding rules -> weights ->
routing -> experts -> the block.

Routing is transformers': router logits in the activations' dtype, softmax in fp32, the top k, renormalised where
the model asks (``MoeConfig.norm_topk_prob``). The experts run as one dense formulation: every token through every
expert's gate/up projection, the activations scaled by the token's routing weight (0 off its top k), and one down
projection that sums over experts and their widths together. XLA compiles it to two matmuls with static shapes and
no token is ever dropped; it costs num_experts / top_k times the routed FLOPs, which suits the small expert counts
this formulation is for (a grouped dispatch serves many experts).

Shapes: T tokens, E hidden, X experts, Fm an expert's width, Fs the shared expert's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pipejax.pp_utils import ShardingRules
from pipejax.runner.config import MoeConfig, check_expert_parallel
from pipejax.runner.panels import swiglu

# --- sharding: tensor-parallel experts split each expert's width, expert parallelism whole experts ----------
TP_EXPERTS = ShardingRules({"expert_mlp": "tp", "mlp": "tp"})
EXPERT_PARALLEL = ShardingRules({"experts": "tp", "mlp": "tp"})


def moe_rules(expert_parallel: bool, num_experts: int, tp: int) -> ShardingRules:
    """The rules of a stage's MoE weights; expert parallelism needs whole experts on every device."""
    if expert_parallel:
        check_expert_parallel(num_experts, tp)
    return EXPERT_PARALLEL if expert_parallel else TP_EXPERTS


def moe_param_shapes(E: int, moe: MoeConfig) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
    """One MoE MLP's weights: name -> (shape, logical axes)."""
    X, Fm, Fs = moe.num_experts, moe.intermediate_size, moe.shared_expert_size
    shapes = {
        "router": ((E, X), ("embed", None)),
        "experts_gate_up": ((X, E, 2, Fm), ("experts", "embed", None, "expert_mlp")),  # gate, then up
        "experts_down": ((X, Fm, E), ("experts", "expert_mlp", "embed")),
    }
    if Fs:
        shapes |= {
            "shared_gate_up": ((E, 2, Fs), ("embed", None, "mlp")),
            "shared_down": ((Fs, E), ("mlp", "embed")),
            "shared_gate": ((E,), ("embed",)),
        }
    return shapes


def route(x: jax.Array, router: jax.Array, moe: MoeConfig) -> jax.Array:
    """x [T, E] -> each token's weight per expert [T, X] (fp32; 0 for the experts outside its top k)."""
    logits = jnp.dot(x, router)  # [T, X], in x's dtype as transformers' router computes them
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, chosen = jax.lax.top_k(probs, moe.top_k)  # the lower index first among equal weights, as torch.topk
    if moe.norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    rows = jnp.arange(x.shape[0])[:, None]
    return jnp.zeros_like(probs).at[rows, chosen].set(top)


def experts(x: jax.Array, gate_up: jax.Array, down: jax.Array, weights: jax.Array) -> jax.Array:
    """sum over experts of weight[t, x] * expert_x(token t): x [T, E], gate_up [X, E, 2, Fm], down [X, Fm, E]."""
    gate_and_up = jnp.einsum("te,xecf->ctxf", x, gate_up)
    act = swiglu(gate_and_up[0], gate_and_up[1])  # [T, X, Fm]
    act = act * weights[:, :, None].astype(act.dtype)
    return jnp.einsum("txf,xfe->te", act, down)


def moe_mlp(x: jax.Array, p: dict[str, jax.Array], moe: MoeConfig, residual: jax.Array) -> jax.Array:
    """residual + the MoE MLP of x (both [T, E]); ``p`` holds ``moe_param_shapes``' weights."""
    y = experts(x, p["experts_gate_up"], p["experts_down"], route(x, p["router"], moe))
    if moe.shared_expert_size:  # Qwen2-MoE: a dense expert every token takes, behind a sigmoid gate
        gate_and_up = jnp.einsum("te,ecf->ctf", x, p["shared_gate_up"])
        shared = jnp.dot(swiglu(gate_and_up[0], gate_and_up[1]), p["shared_down"])
        y = y + jax.nn.sigmoid(jnp.dot(x, p["shared_gate"]))[:, None] * shared
    return residual + y
