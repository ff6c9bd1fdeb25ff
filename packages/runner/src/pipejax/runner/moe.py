"""A Mixture-of-Experts MLP (Qwen3-MoE, Mixtral, Qwen2-MoE), read top to bottom: sharding rules -> weights ->
routing -> experts -> the block.

Routing is transformers': router logits in the activations' dtype, softmax in fp32, the top k, renormalised where
the model asks (``MoeConfig.norm_topk_prob``). On a CPU stage of one device whose dense weights are in panels, each
expert's weights are too, and a kernel (``Kernels.routed_experts``) runs each expert on the rows routed to it only:
the routed FLOPs, reading only the experts some token chose. Elsewhere (TPU, tp > 1, XLA's dots chosen on CPU) the
experts run in one of two static formulations, chosen by the step's token count (both drop no token):
- few tokens (T k <= X / 4, ``GATHER_SHARE``: decode steps of small batches): each token's top k experts'
  weights are gathered, so the step reads T k experts, not all X;
- otherwise every token through every expert's gate/up projection, the activations scaled by the token's routing
  weight (0 off its top k), and one down projection that sums over experts and their widths together: two dense
  matmuls, at num_experts / top_k times the routed FLOPs, which suits small expert counts (``jax.lax.ragged_dot``
  measured 16x slower than a dense dot of the same rows on XLA:CPU).

Shapes: T tokens, E hidden, X experts, Fm an expert's width, Fs the shared expert's.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pipejax.pp_utils import ShardingRules
from pipejax.runner.config import MoeConfig, check_expert_parallel
from pipejax.runner.panels import Panels, dense, own_layout, swiglu

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
        # hidden-major, so that every expert's gate and up are one [E, X 2 Fm] matmul: XLA:CPU copied an expert-major
        # [X, E, 2, Fm] weight into this order before its dot every step (moe_gather_probe.py's "every expert": 1.5-4.8x
        # as long, 1-32 tokens)
        "experts_gate_up": ((E, X, 2, Fm), ("embed", "experts", None, "expert_mlp")),  # gate, then up
        "experts_down": ((X, Fm, E), ("experts", "expert_mlp", "embed")),
    }
    if Fs:
        shapes |= {
            "shared_gate_up": ((E, 2, Fs), ("embed", None, "mlp")),
            "shared_down": ((Fs, E), ("mlp", "embed")),
            "shared_gate": ((E,), ("embed",)),
        }
    return shapes


def top_experts(x: jax.Array, router: jax.Array, moe: MoeConfig) -> tuple[jax.Array, jax.Array]:
    """x [T, E] -> each token's top k experts: their weights [T, k] (fp32) and ids [T, k]."""
    logits = jnp.dot(x, router)  # [T, X], in x's dtype as transformers' router computes them
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, chosen = jax.lax.top_k(probs, moe.top_k)  # the lower index first among equal weights, as torch.topk
    if moe.norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top, chosen


def route(x: jax.Array, router: jax.Array, moe: MoeConfig) -> jax.Array:
    """x [T, E] -> each token's weight per expert [T, X] (fp32; 0 for the experts outside its top k)."""
    top, chosen = top_experts(x, router, moe)
    return jnp.zeros((x.shape[0], router.shape[1]), jnp.float32).at[jnp.arange(x.shape[0])[:, None], chosen].set(top)


def experts(x: jax.Array, gate_up: jax.Array, down: jax.Array, weights: jax.Array) -> jax.Array:
    """sum over experts of weight[t, x] * expert_x(token t): x [T, E], gate_up [E, X, 2, Fm], down [X, Fm, E]: two
    matmuls, each contracting its weight's leading dims in their stored order."""
    gate_and_up = jnp.einsum("te,excf->txcf", x, gate_up)
    act = swiglu(gate_and_up[:, :, 0], gate_and_up[:, :, 1])  # [T, X, Fm]
    act = act * weights[:, :, None].astype(act.dtype)
    # (x, f) contracted as a dot_general in down's stored order: jnp.einsum's own order made XLA:CPU copy every
    # expert's down weight each step (benchmarks/probes/moe_experts_probe.py: 136.2 -> 82.8 ms, 8 layers, 64 rows)
    return jax.lax.dot_general(act, down, (((1, 2), (0, 1)), ((), ())))


def gathered_experts(x: jax.Array, gate_up: jax.Array, down: jax.Array, top: jax.Array, chosen: jax.Array
                     ) -> jax.Array:
    """``experts`` for few tokens: each token's top k experts' weights gathered (``top_experts``' top / chosen
    [T, k]), so a decode step of T k routes reads T k experts, not all X."""
    gate_and_up = jnp.einsum("te,etkcf->tkcf", x, gate_up[:, chosen])  # [T, k, 2, Fm]
    act = swiglu(gate_and_up[:, :, 0], gate_and_up[:, :, 1]) * top[..., None].astype(x.dtype)
    return jnp.einsum("tkf,tkfe->te", act, down[chosen])


# Gather the routed experts' weights where a step's routes (tokens x top_k) are at most this share of the experts.
# ``python benchmarks/probes/moe_gather_probe.py`` (2-core EPYC with AVX-512, one XLA:CPU device, experts alone):
# gathering won 2.1-5.8x at routes / experts <= 1/8 and 1.2-1.9x at 1/4, was even (0.76-1.13x) at 1/2 and lost
# (0.17-0.67x) from 1 on, for 64 experts top 4, 128 top 8 and 16 top 2.
GATHER_SHARE = 1 / 4


def routed_in_panels(kernel: Callable, x: jax.Array, gate_up: Panels, down: Panels, top: jax.Array,
                     chosen: jax.Array, residual: jax.Array) -> jax.Array:
    """residual + the routed experts of x, by ``kernel`` (``Kernels.routed_experts``) reading each chosen expert's
    panels in place: [X, 2, Fm / PANEL, E, PANEL] and [X, E / PANEL, Fm, PANEL], or every layer's of them with the
    layer's index (``Panels.layer``)."""
    stacked = gate_up.layer is not None
    first = gate_up.layer * gate_up.data.shape[1] if stacked else 0
    gu = gate_up.data.reshape(-1, gate_up.data.shape[-4] * gate_up.data.shape[-3], *gate_up.data.shape[-2:])
    return kernel(x, gu, down.data.reshape(-1, *down.data.shape[-3:]), first, chosen, top, residual)


def _own_layout(w: jax.Array | Panels, lead: int) -> jax.Array:
    """An expert weight in its own layout (``lead``: its leading dims, past the layers'): panels no kernel reads
    are turned back (a copy, every step)."""
    if not isinstance(w, Panels):
        return w
    return own_layout(w.data if w.layer is None else w.data[w.layer], lead, 1)


def moe_mlp(x: jax.Array, p: dict[str, jax.Array], moe: MoeConfig, residual: jax.Array,
            gather: bool | None = None, kernels=None) -> jax.Array:
    """residual + the MoE MLP of x (both [T, E]); ``p`` holds ``moe_param_shapes``' weights. ``kernels``: a
    backend's (``model.Kernels``): with experts in panels, its ``routed_experts`` computes only the routed rows of
    each expert. Otherwise ``gather``: run ``gathered_experts`` or the dense ``experts``; None: by the step's routes
    (static: T is the padded step's)."""
    dense_kernel, routed = (None, None) if kernels is None else (kernels.dense, kernels.routed_experts)
    if moe.shared_expert_size:  # Qwen2-MoE: a dense expert every token takes, behind a sigmoid gate
        act = dense(x, p["shared_gate_up"], 1, dense_kernel, gated=True)
        shared = jax.nn.sigmoid(jnp.dot(x, p["shared_gate"]))[:, None] * dense(act, p["shared_down"], 1, dense_kernel)
    gate_up, down = p["experts_gate_up"], p["experts_down"]
    if isinstance(gate_up, Panels) and routed is not None:
        top, chosen = top_experts(x, p["router"], moe)
        return routed_in_panels(routed, x, gate_up, down, top, chosen,
                                residual + shared if moe.shared_expert_size else residual)
    gate_up, down = _own_layout(gate_up, 0), _own_layout(down, 1)
    if gather is None:
        gather = x.shape[0] * moe.top_k <= GATHER_SHARE * moe.num_experts
    if gather:
        y = gathered_experts(x, gate_up, down, *top_experts(x, p["router"], moe))
    else:
        y = experts(x, gate_up, down, route(x, p["router"], moe))
    return residual + (y + shared if moe.shared_expert_size else y)
