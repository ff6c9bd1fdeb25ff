"""One pipeline stage of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3), read top to bottom:
sharding rules -> parameter specs -> building blocks -> paged attention -> stage forward. The step's shape and
inputs are in ``step_inputs``, the dense weights (in panels or not) and their matmul in ``panels``, rotary
embeddings in ``rope``.

Shapes: T tokens of one ragged step (padded), R request rows (padded: P prefill rows, then Rd
decode rows), Q the longest prefill query (padded), C = blocks per row x block size (context
slots), E hidden, H query heads, K KV heads (after replication for TP), G = H / K, D head dim,
F MLP width, V vocab, L stage layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pipejax.pp_utils import ShardingRules
from pipejax.runner.config import ModelConfig, StageConfig
from pipejax.runner.moe import moe_mlp, moe_param_shapes, moe_rules
from pipejax.runner.panels import PANEL, Panels, QuantizedPanels, dense, outputs_first, panel_shape
from pipejax.runner.quantized import Quantized, dequantize
from pipejax.runner.rope import RopeTables, apply_rope, rope_inv_freq, rope_tables
from pipejax.runner.step_inputs import StepInputs, StepShape

# --- sharding: logical axes -> the stage mesh's "tp" axis -------------------------------------
# Column-parallel q/k/v/gate/up (heads, mlp), row-parallel o/down, vocab-parallel embedding and
# LM head. Everything else is replicated.
RULES = ShardingRules({"heads": "tp", "kv_heads": "tp", "mlp": "tp", "vocab": "tp"})


def stage_rules(cfg: ModelConfig, stage: StageConfig, tp: int) -> ShardingRules:
    """The stage's rules: ``RULES``, and for a Mixture-of-Experts model its experts' (``moe.moe_rules``): each
    expert split over its width, or with ``stage.expert_parallel`` whole experts per device."""
    if cfg.moe is None:
        return RULES
    return ShardingRules({**RULES.rules, **moe_rules(stage.expert_parallel, cfg.moe.num_experts, tp).rules})


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    logical_axes: tuple[str | None, ...]


def panel_spec(spec: ParamSpec, lead: int, contracted: int) -> ParamSpec | None:
    """``spec`` of a dense weight ([*lead, *in, *out]: ``lead`` leading dims, ``contracted`` input dims) as
    panels (``panels.panel_shape``), or None where its last output dim is not a whole number of panels."""
    if spec.shape[-1] % PANEL:
        return None
    return ParamSpec(panel_shape(spec.shape, lead, contracted),
                     (*outputs_first(spec.logical_axes, lead, contracted), None))


def kv_heads_for_tp(cfg: ModelConfig, tp: int) -> int:
    """KV heads after replication: with tp > num_kv_heads each device holds one (repeated) KV head."""
    if cfg.num_heads % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide num_attention_heads={cfg.num_heads}; "
            f"use a tp that divides {cfg.num_heads}"
        )
    if tp <= cfg.num_kv_heads:
        if cfg.num_kv_heads % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide num_key_value_heads={cfg.num_kv_heads}; "
                f"use a tp that divides {cfg.num_kv_heads} or a multiple of it"
            )
        return cfg.num_kv_heads
    if tp % cfg.num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp} > num_key_value_heads={cfg.num_kv_heads} must be a multiple of it "
            f"so KV heads can be replicated evenly"
        )
    return tp


def param_specs(cfg: ModelConfig, stage: StageConfig, tp: int) -> dict[str, ParamSpec]:
    """The stage's parameters: flat names -> shape and logical axes. Layer params are stacked [L, ...]."""
    E, F, V, H, D = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_heads, cfg.head_dim
    K = kv_heads_for_tp(cfg, tp)
    L = len(stage.layer_range(cfg))
    specs = {
        "layers.input_norm": ParamSpec((L, E), (None, "embed")),
        # q, k and v as one weight (one dot): per KV head, its G = H / K query heads, then its key, then its
        # value, so a TP shard of KV heads holds whole groups. gate and up likewise, [E, 2, F]: one dot where
        # there were three (on XLA:CPU each dot of a few-row decode step costs more than its bytes).
        "layers.qkv": ParamSpec((L, E, K, H // K + 2, D), (None, "embed", "kv_heads", None, None)),
        "layers.o": ParamSpec((L, H, D, E), (None, "heads", None, "embed")),
        "layers.post_norm": ParamSpec((L, E), (None, "embed")),
    }
    if cfg.qkv_bias:
        specs["layers.q_bias"] = ParamSpec((L, H, D), (None, "heads", None))
        specs["layers.k_bias"] = ParamSpec((L, K, D), (None, "kv_heads", None))
        specs["layers.v_bias"] = ParamSpec((L, K, D), (None, "kv_heads", None))
    if cfg.qk_norm:
        specs["layers.q_norm"] = ParamSpec((L, D), (None, None))
        specs["layers.k_norm"] = ParamSpec((L, D), (None, None))
    kinds = layer_kinds(cfg, stage)  # each kind's MLP weights are stacked over its own layers (``layer_rows``)
    if dense_layers := kinds.count(False):
        specs["layers.gate_up"] = ParamSpec((dense_layers, E, 2, F), (None, "embed", None, "mlp"))
        specs["layers.down"] = ParamSpec((dense_layers, F, E), (None, "mlp", "embed"))
    if moe_layers := kinds.count(True):  # a MoE's MLP: router, experts (and a shared expert)
        specs |= {f"layers.{name}": ParamSpec((moe_layers, *shape), (None, *axes))
                  for name, (shape, axes) in moe_param_shapes(E, cfg.moe).items()}
    if stage.has_embedding(cfg):
        specs["embed"] = ParamSpec((V, E), ("vocab", "embed"))
    if stage.is_last:
        specs["final_norm"] = ParamSpec((E,), ("embed",))
        if not cfg.tie_word_embeddings:
            specs["lm_head"] = ParamSpec((E, V), ("embed", "vocab"))
    return specs


def layer_kinds(cfg: ModelConfig, stage: StageConfig) -> tuple[bool, ...]:
    """Per layer of the stage: whether its MLP is a Mixture of Experts (Qwen2-MoE's decoder_sparse_step and
    mlp_only_layers mix them with dense MLPs)."""
    return tuple(cfg.moe is not None and cfg.moe.is_sparse(i) for i in stage.layer_range(cfg))


DENSE_MLP_WEIGHTS = ("gate_up", "down")


def layer_rows(cfg: ModelConfig, stage: StageConfig, name: str) -> tuple[int, ...]:
    """The stage's layers (0-based within it) whose weights the stacked weight ``name`` (as ``stacked_layers``
    names it) holds, in row order: every layer, or for an MLP weight the layers of its kind."""
    kinds = layer_kinds(cfg, stage)
    if name in DENSE_MLP_WEIGHTS or (cfg.moe is not None and name in moe_param_shapes(cfg.hidden_size, cfg.moe)):
        return tuple(i for i, sparse in enumerate(kinds) if sparse == (name not in DENSE_MLP_WEIGHTS))
    return tuple(range(len(kinds)))


def per_layer_weights(rows: dict[str, Sequence], cfg: ModelConfig, stage: StageConfig) -> list[dict]:
    """One dict per layer of the stage, from each stacked weight's rows (by ``stacked_layers``' names)."""
    layers: list[dict] = [{} for _ in stage.layer_range(cfg)]
    for name, ws in rows.items():
        for row, i in enumerate(layer_rows(cfg, stage, name)):
            layers[i][name] = ws[row]
    return layers


def kv_cache_spec(cfg: ModelConfig, stage: StageConfig, tp: int, num_blocks: int, block_size: int) -> ParamSpec:
    """One of the two caches (K or V): [L, num_blocks, block_size, K, D], sharded over KV heads.

    Blocks stay whole in memory so that attention gathers [block_size, K, D] runs, not single slots.
    """
    L = len(stage.layer_range(cfg))
    shape = (L, num_blocks, block_size, kv_heads_for_tp(cfg, tp), cfg.head_dim)
    return ParamSpec(shape, (None, None, None, "kv_heads", None))


LAYER_PREFIX = "layers."  # the stacked [L, ...] layer weights' names in ``param_specs``


def stacked_layers(params: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The stacked layer weights of ``params``, by their names without ``LAYER_PREFIX`` (e.g. "q", "down")."""
    return {name.removeprefix(LAYER_PREFIX): w for name, w in params.items() if name.startswith(LAYER_PREFIX)}


# --- building blocks ---------------------------------------------------------------------------


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    dtype = x.dtype
    x = x.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return weight * x.astype(dtype)


class Kernels(NamedTuple):
    """A backend's substitutes for parts of this file's XLA formulation (None: the formulation here). The CPU
    backend's come from ``pipejax.runner.cpu.select``; every other backend runs this file as it reads."""

    dense: Callable | None = None  # a matmul over weights in panels, norming x, rotating heads where asked (``dense``)
    quantized_dense: Callable | None = None  # a matmul over weights kept quantized in panels (``QuantizedPanels``)
    decode_attention: Callable | None = None  # replaces ``decode_attention`` (see ``paged_attention``)
    prefill_attention: Callable | None = None  # replaces ``prefill_attention`` (see ``paged_attention``)
    routed_experts: Callable | None = None  # a MoE layer's experts over their panels (``moe.routed_in_panels``)


NO_KERNELS = Kernels()


def in_kernel(w, kernels: Kernels) -> bool:
    """Whether the backend's dense kernel computes the product with ``w``, and so norms x and rotates heads itself
    (``Kernels.dense`` takes ``norm`` and ``rotary``)."""
    return kernels.dense is not None and isinstance(w, Panels)


def project(x: jax.Array, w, contracted: int, kernels: Kernels, norm: tuple[jax.Array, float] | None = None,
            **how) -> jax.Array:
    """``panels.dense`` with the backend's kernel for the way ``w`` is stored (``how``: gated, residual, and where
    ``in_kernel`` rotary), of x RMS-normed with ``norm`` (weight, eps) where given: by the dense kernel as it reads x,
    else here."""
    if norm is not None and not in_kernel(w, kernels):
        x, norm = rms_norm(x, *norm), None
    kernel = kernels.quantized_dense if isinstance(w, QuantizedPanels) else kernels.dense
    return dense(x, w, contracted, kernel, norm=norm, **how)


def mlp(x: jax.Array, p: dict[str, jax.Array], residual: jax.Array, kernels: Kernels = NO_KERNELS,
        norm: tuple[jax.Array, float] | None = None) -> jax.Array:
    """residual + the MLP of x (both [T, E]), RMS-normed with ``norm`` (weight, eps) first where given."""
    act = project(x, p["gate_up"], 1, kernels, norm=norm, gated=True)  # swiglu(gate, up) [T, F]
    return project(act, p["down"], 1, kernels, residual=residual)


def embed(table: jax.Array | Panels | Quantized | QuantizedPanels, token_ids: jax.Array, dtype) -> jax.Array:
    """The embedding rows of ``token_ids`` [T] -> [T, E] (of a table kept quantized: those rows dequantized; kept as
    the tied LM head's panels [E, V]: those columns)."""
    if isinstance(table, QuantizedPanels):
        return table.columns(token_ids, dtype)
    if isinstance(table, Panels):
        return table.columns(token_ids).astype(dtype)
    if isinstance(table, Quantized):
        return dequantize(table.rows(token_ids), dtype)
    return table[token_ids].astype(dtype)


# --- paged attention over one ragged batch ----------------------------------------------------


def _visible(ctx: jax.Array, q_pos: jax.Array, sliding_window: int | None) -> jax.Array:
    """Causal (and sliding-window) mask of context slots ``ctx`` for query positions ``q_pos`` (broadcast)."""
    visible = ctx <= q_pos
    if sliding_window is not None:
        visible &= ctx > q_pos - sliding_window
    return visible


# At most 4 query chunks: more chunks skip more of the causal triangle, but each adds to the compile of every
# prefill shape, and past 4 the compile grew faster than the attention shrank (XLA:CPU, 16 x 128 tokens).
PREFILL_QUERY_CHUNKS = 4
PREFILL_MIN_CHUNK = 16  # query tokens; smaller chunks cost more in per-matmul overhead than they skip


def prefill_chunks(query_len: int, context: int) -> list[tuple[int, int, int]]:
    """(lo, hi, c_hi) per query chunk of a right-aligned prefill row: slots [lo, hi) attend to context
    slots [0, c_hi). A right-aligned row's slot i is at most position C - Q + i, so c_hi = C - Q + hi (at
    least 1: a chunk below that is padding in every row)."""
    step = max(PREFILL_MIN_CHUNK, -(-query_len // PREFILL_QUERY_CHUNKS))
    chunks = []
    for lo in range(0, query_len, step):
        hi = min(lo + step, query_len)
        chunks.append((lo, hi, min(context, max(1, context - query_len + hi))))
    return chunks


def prefill_attention(q, k_layer, v_layer, query_start, start_pos, block_tables, query_len, sliding_window):
    """Rows of up to ``query_len`` tokens, right-aligned (a row's last token sits in query slot Q - 1, so
    ``query_start``/``start_pos`` are those of slot 0 and may be negative for a short row). Each row's
    context is gathered once [R, K, C, D]; the queries sharing a KV head are one matmul operand (GQA), and
    the query slots go in chunks that each score only the context a right-aligned row can see from them:
    chunk [lo, hi) ends at context slot C - Q + hi, which skips most of the causal triangle a dense
    [Q, C] block computes and throws away (``benchmarks/probes/prefill_attention_share.py`` measures it).
    q [T, H, D], k_layer/v_layer [N, block_size, K, D]. Returns [R, Q, H, D]."""
    T, H, D = q.shape
    _, block_size, K, _ = k_layer.shape
    R, B = block_tables.shape
    C, G = B * block_size, H // K
    cols = jnp.arange(query_len)
    q_rows = q[jnp.clip(query_start[:, None] + cols[None, :], 0, T - 1)].reshape(R, query_len, K, G, D)
    q_rows = q_rows.transpose(0, 2, 1, 3, 4) * (D**-0.5)  # [R, K, Q, G, D]
    keys = k_layer[block_tables].reshape(R, C, K, D).transpose(0, 2, 1, 3)  # [R, K, C, D]
    values = v_layer[block_tables].reshape(R, C, K, D).transpose(0, 2, 1, 3)
    q_pos = jnp.maximum(start_pos[:, None] + cols[None, :], 0)  # [R, Q]; padding slots see slot 0 (no NaN)
    outs = []
    for lo, hi, c_hi in prefill_chunks(query_len, C):
        scores = jnp.einsum("rkmd,rkcd->rkmc", q_rows[:, :, lo:hi].reshape(R, K, (hi - lo) * G, D),
                            keys[:, :, :c_hi], preferred_element_type=jnp.float32)
        visible = _visible(jnp.arange(c_hi)[None, None, :], q_pos[:, lo:hi, None], sliding_window)  # [R, m, c]
        visible = jnp.repeat(visible, G, axis=1)[:, None]  # [R, 1, m * G, c], in the queries' (slot, group) order
        probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1).astype(values.dtype)
        out = jnp.einsum("rkmc,rkcd->rkmd", probs, values[:, :, :c_hi])
        outs.append(out.reshape(R, K, hi - lo, G, D))
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=2)  # [R, K, Q, G, D]
    return out.transpose(0, 2, 1, 3, 4).reshape(R, query_len, H, D)


def decode_attention(q, k_layer, v_layer, query_start, start_pos, block_tables, sliding_window):
    """Rows of one token. Scores are a multiply-reduce over the block-table gather, which XLA fuses,
    so each row's K/V is streamed once instead of being copied into a contiguous [R, C, K, D] first
    (the step is bound by reading K/V, not by FLOPs). Returns [R, H, D]."""
    _, H, D = q.shape
    _, block_size, K, _ = k_layer.shape
    R, B = block_tables.shape
    f32 = jnp.float32
    q_rows = q[query_start].reshape(R, 1, 1, K, H // K, D).astype(f32) * (D**-0.5)
    keys = k_layer[block_tables][:, :, :, :, None, :]  # [R, B, block_size, K, 1, D]
    scores = jnp.sum(q_rows * keys.astype(f32), axis=-1)  # [R, B, block_size, K, G]
    ctx = jnp.arange(B * block_size).reshape(1, B, block_size, 1, 1)
    scores = jnp.where(_visible(ctx, start_pos[:, None, None, None, None], sliding_window), scores, -jnp.inf)
    scores = scores - jnp.max(scores, axis=(1, 2), keepdims=True)
    probs = jnp.exp(scores)
    probs = probs / jnp.sum(probs, axis=(1, 2), keepdims=True)
    values = v_layer[block_tables][:, :, :, :, None, :]
    out = jnp.sum(probs[..., None] * values.astype(f32), axis=(1, 2))  # [R, K, G, D]
    return out.astype(q.dtype).reshape(R, H, D)


def paged_attention(
    q: jax.Array,  # [T, H, D]
    k_cache: jax.Array,  # [L, N, block_size, K, D], already holding this step's keys
    v_cache: jax.Array,  # [L, N, block_size, K, D]
    layer: jax.Array,  # scalar index into L
    inp: StepInputs,
    shape: StepShape,
    sliding_window: int | None,
    kernels: Kernels = NO_KERNELS,
    heads: int | None = None,
) -> jax.Array:
    """Causal attention of every token against its own request's cached context. Returns [T, H, D].
    ``kernels.decode_attention`` replaces ``decode_attention``, ``kernels.prefill_attention`` ``prefill_attention``
    (each over the whole cache and a layer index). ``heads``: q is a layer's qkv [T, K (G + 2), D] with H = ``heads``
    query heads, which the decode kernel reads where they are (a decode-only step on one device only)."""
    _, H, D = q.shape
    P = shape.prefill_rows
    if heads is not None and (P or kernels.decode_attention is None):
        raise ValueError("only the decode kernel of a decode-only step reads the query heads out of qkv")
    parts = []
    if P:
        rows = slice(0, P)
        tables = inp.block_tables[rows, : shape.prefill_blocks or shape.blocks]
        if kernels.prefill_attention is not None:  # the whole cache goes in, as for the decode kernel
            out = kernels.prefill_attention(q, k_cache, v_cache, layer, inp.row_query_start[rows],
                                            inp.row_start_pos[rows], tables, shape.query, sliding_window)
            out = out.astype(q.dtype)
        else:
            out = prefill_attention(q, k_cache[layer], v_cache[layer], inp.row_query_start[rows],
                                    inp.row_start_pos[rows], tables, shape.query, sliding_window)
        parts.append(out.reshape(P * shape.query, H, D))
    if shape.decode_rows:
        rows = slice(P, P + shape.decode_rows)
        query_start, start_pos, tables = inp.row_query_start[rows], inp.row_start_pos[rows], inp.block_tables[rows]
        if kernels.decode_attention is not None:  # the whole cache goes in: a layer slice would be a copy
            # a decode-only step's rows are its tokens in order (``build_step_inputs``; a padding row reads its own
            # padding token, not token 0): no gather, which XLA:CPU runs as a slow scalar loop fused with the rope
            q_rows = q[query_start] if P else q
            given = () if heads is None else (heads,)
            out = kernels.decode_attention(q_rows, k_cache, v_cache, layer, tables, start_pos, sliding_window, *given)
            parts.append(out.astype(q.dtype))
        else:
            parts.append(decode_attention(q, k_cache[layer], v_cache[layer], query_start, start_pos, tables,
                                          sliding_window))
    out = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    return out[inp.token_out] if P else out  # decode only: the rows are the tokens (padding tokens' rows their own)


class LayerContext(NamedTuple):
    """What every decoder layer of one step reads besides its weights and the cache."""

    inp: StepInputs
    cfg: ModelConfig
    rope: RopeTables
    shape: StepShape
    block_size: int
    kernels: Kernels


def attention(
    x: jax.Array,  # [T, E], before the layer's input norm
    p: dict[str, jax.Array],
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    ctx: LayerContext,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The attention of x [T, E] (normed by the layer's input norm) before its output projection ([T, H, D]), and the
    caches with the step's K/V."""
    cfg, inp = ctx.cfg, ctx.inp
    # the dense kernel rotates q and k as it writes them, where nothing comes between the product and the rotation;
    # it runs on one device, where no KV head is replicated: each KV head's group is its query heads, k and v
    rotary = in_kernel(p["qkv"], ctx.kernels) and not (cfg.qkv_bias or cfg.qk_norm)
    group = cfg.num_heads // cfg.num_kv_heads + 2
    how = {"rotary": (ctx.rope, group, group - 1)} if rotary else {}
    qkv = project(x, p["qkv"], 1, ctx.kernels, norm=(p["input_norm"], cfg.rms_norm_eps), **how)  # [T, K, G + 2, D]
    G = qkv.shape[2] - 2  # query heads per KV head
    q = qkv[:, :, :G].reshape(qkv.shape[0], -1, qkv.shape[-1])  # [T, H, D]: query head g of KV head k is k * G + g
    k, v = qkv[:, :, G], qkv[:, :, G + 1]  # [T, K, D]
    if cfg.qkv_bias:
        q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
    if cfg.qk_norm:
        q, k = rms_norm(q, p["q_norm"], cfg.rms_norm_eps), rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    if not rotary:
        q, k = apply_rope(q, ctx.rope), apply_rope(k, ctx.rope)
    block, offset = inp.slot_mapping // ctx.block_size, inp.slot_mapping % ctx.block_size
    k_cache = k_cache.at[layer, block, offset].set(k.astype(k_cache.dtype))
    v_cache = v_cache.at[layer, block, offset].set(v.astype(v_cache.dtype))
    if rotary and not ctx.shape.prefill_rows and ctx.kernels.decode_attention is not None:
        # a decode-only step: the kernel reads the query heads out of qkv itself (XLA would copy them out first)
        whole = qkv.reshape(qkv.shape[0], -1, qkv.shape[-1])
        out = paged_attention(whole, k_cache, v_cache, layer, inp, ctx.shape, cfg.sliding_window, ctx.kernels,
                              heads=q.shape[1])
    else:
        out = paged_attention(q, k_cache, v_cache, layer, inp, ctx.shape, cfg.sliding_window, ctx.kernels)
    return out, k_cache, v_cache


def decoder_layer(x, p, k_cache, v_cache, layer, ctx: LayerContext):
    out, k_cache, v_cache = attention(x, p, k_cache, v_cache, layer, ctx)
    # x + o(out): (h, d) contracted in the weight's memory order (jnp.einsum orders them (d, h), and XLA then
    # copies o transposed every step; a scan's dynamic slice hides that copy, per-layer views do not).
    x = project(out, p["o"], 2, ctx.kernels, residual=x)
    norm = (p["post_norm"], ctx.cfg.rms_norm_eps)
    if "router" in p:
        return moe_mlp(rms_norm(x, *norm), p, ctx.cfg.moe, x, kernels=ctx.kernels), k_cache, v_cache
    return mlp(x, p, x, ctx.kernels, norm=norm), k_cache, v_cache


# --- the stage -----------------------------------------------------------------------------------


def _rows(w: jax.Array | Panels | Quantized) -> list:
    """A stacked weight's layers (panels: the whole stack and a layer index, as the dense kernel reads them)."""
    if isinstance(w, Panels):
        return [w.at(i) for i in range(w.data.shape[0])]
    if isinstance(w, QuantizedPanels):
        return [w.at(i) for i in range(w.q.shape[0])]
    if isinstance(w, Quantized):
        return [jax.tree.map(lambda a, i=i: a[i], w) for i in range(w.q.shape[0])]
    return list(w)


def stage_forward(
    params: dict[str, jax.Array],
    kv_cache: tuple[jax.Array, jax.Array],  # ([L, N, block_size, K, D], same)
    inp: StepInputs,
    hidden_in: jax.Array | None,  # [T, E] from the previous stage; None on the first stage
    *,
    cfg: ModelConfig,
    stage: StageConfig,
    shape: StepShape,
    block_size: int,
    kernels: Kernels = NO_KERNELS,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Run the stage's layers. Returns (hidden [T, E] on non-last stages | logits [R, V] on the last, cache).
    ``params``: as ``param_specs`` names them (stacked layer weights, read by a scan), or with the stacked
    weights replaced by ``"layers"``: a list of per-layer dicts (``cpu.layer_views.per_layer``), read in turn.
    ``kernels``: a backend's substitutes for parts of the formulation here (``Kernels``)."""
    if stage.is_first:
        x = embed(params["embed"], inp.token_ids, jnp.dtype(cfg.dtype))  # [T, E]
    else:
        x = hidden_in
    rope = rope_tables(inp.positions, jnp.asarray(rope_inv_freq(cfg)), x.dtype)
    ctx = LayerContext(inp, cfg, rope, shape, block_size, kernels)

    def layer(carry, p, idx):
        x, k_all, v_all = carry
        return decoder_layer(x, p, k_all, v_all, idx, ctx)

    carry = (x, *kv_cache)
    if "layers" not in params and len(set(layer_kinds(cfg, stage))) > 1:  # dense and MoE MLPs: no one scan body
        rows = {n: _rows(w) for n, w in stacked_layers(params).items()}
        params = {n: w for n, w in params.items() if not n.startswith(LAYER_PREFIX)}
        params["layers"] = per_layer_weights(rows, cfg, stage)
    if "layers" in params:  # one array per layer and weight (``cpu.layer_views.per_layer``): the layers in turn
        for i, p in enumerate(params["layers"]):
            carry = layer(carry, p, i)
    else:  # stacked [L, ...] weights: a scan over the layers
        num_layers = kv_cache[0].shape[0]
        scanned = stacked_layers(params)
        # The dense kernel reads its layer's panels out of the whole stack: the scan would slice them into copies.
        whole = {n: w for n, w in scanned.items() if isinstance(w, Panels)} if kernels.dense is not None else {}
        if kernels.quantized_dense is not None:
            whole |= {n: w for n, w in scanned.items() if isinstance(w, QuantizedPanels)}
        scanned = {n: w for n, w in scanned.items() if n not in whole}

        def step(c, xs):
            p, idx = xs
            return layer(c, {**p, **{n: w.at(idx) for n, w in whole.items()}}, idx), None

        carry, _ = jax.lax.scan(step, carry, (scanned, jnp.arange(num_layers)))
    x, k_all, v_all = carry
    if not stage.is_last:
        return x, (k_all, v_all)
    logits = lm_head(x[inp.sample_index], params, cfg, kernels)  # [R, V]
    if shape.prompt_hidden:  # and every token's final hidden states, for prompt logprobs (``prompt_logprobs``)
        return (logits, x), (k_all, v_all)
    return logits, (k_all, v_all)


def lm_head(x: jax.Array, params: dict[str, jax.Array], cfg: ModelConfig, kernels: Kernels = NO_KERNELS) -> jax.Array:
    """Float32 logits [n, V] of final hidden states x [n, E]: the final norm, then the LM head (the tied embedding
    where tied)."""
    if cfg.tie_word_embeddings:
        table = params["embed"]  # [V, E], or as the head's panels [E, V] already
        head = table if isinstance(table, Panels | QuantizedPanels) else (
            dequantize(table, x.dtype) if isinstance(table, Quantized) else table).T  # [E, V]
    else:
        head = params["lm_head"]
    return project(x, head, 1, kernels, norm=(params["final_norm"], cfg.rms_norm_eps)).astype(jnp.float32)

