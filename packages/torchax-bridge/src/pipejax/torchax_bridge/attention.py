"""Attention of a transformers PyTorch model through the runner's paged KV cache.

transformers calls the attention function registered under ``ATTENTION_NAME`` in every
attention layer with the projected, rotated query/key/value. Ours leaves torch for JAX: it
writes this step's keys and values into the runner's paged cache (pad tokens go to the reserved
block 0) and runs the runner's ``paged_attention``. The cache is a jit argument that the stage
forward has to return, but the attention output goes on through ``o_proj``, so the updated cache
leaves through a side channel: the ``PagedKV`` object the stage forward passes to the model as
the keyword argument ``paged_kv`` (transformers hands extra keyword arguments down to attention)
and reads back after the model returns.

Shapes (as ``pipejax.runner.model``): T tokens of the padded ragged step, H query heads,
K0 KV heads of the checkpoint, K KV heads of the cache (K0 repeated for TP > K0), D head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from torchax.interop import jax_view, torch_view
from transformers import AttentionInterface

from pipejax.runner.model import paged_attention
from pipejax.runner.step_inputs import StepInputs, StepShape

ATTENTION_NAME = "pipejax_paged"


class PagedKV:
    """One stage step's paged cache and paging metadata; ``attend`` updates the cache in place."""

    def __init__(
        self,
        kv_cache: tuple[jax.Array, jax.Array],  # ([L, N, block_size, K, D], same)
        inputs: StepInputs,
        shape: StepShape,
        block_size: int,
    ):
        self.k_cache, self.v_cache = kv_cache
        self.inputs = inputs
        self.shape = shape
        self.block_size = block_size

    @property
    def kv_cache(self) -> tuple[jax.Array, jax.Array]:
        return self.k_cache, self.v_cache

    def attend(
        self,
        layer: int,
        q: jax.Array,  # [T, H, D]
        k: jax.Array,  # [T, K0, D]
        v: jax.Array,  # [T, K0, D]
        scaling: float | None,
        sliding_window: int | None,
    ) -> jax.Array:
        """Write k/v of ``layer`` into the cache, then attend. Returns [T, H, D]."""
        K, D = self.k_cache.shape[3], q.shape[-1]
        repeat = K // k.shape[1]  # the runner replicates KV heads when TP > K0
        if repeat > 1:
            k, v = jnp.repeat(k, repeat, axis=1), jnp.repeat(v, repeat, axis=1)  # [T, K, D]
        slots = self.inputs.slot_mapping
        block, offset = slots // self.block_size, slots % self.block_size
        self.k_cache = self.k_cache.at[layer, block, offset].set(k.astype(self.k_cache.dtype))
        self.v_cache = self.v_cache.at[layer, block, offset].set(v.astype(self.v_cache.dtype))
        if scaling is not None and scaling != D**-0.5:  # paged_attention scales by D**-0.5
            q = q * jnp.asarray(scaling * D**0.5, q.dtype)
        return paged_attention(
            q,
            self.k_cache,
            self.v_cache,
            layer,
            self.inputs,
            self.shape,
            sliding_window,
        )


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, K0, T, D]
    value: torch.Tensor,  # [1, K0, T, D]
    attention_mask: torch.Tensor | None,  # None: the paged attention masks from positions
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract; returns ([1, T, H, D], no attention weights)."""
    paged: PagedKV | None = kwargs.get("paged_kv")
    if paged is None:
        raise ValueError(
            f"attention implementation {ATTENTION_NAME!r} needs the keyword argument paged_kv=PagedKV(...); "
            "call the model through pipejax.torchax_bridge.stage_forward"
        )
    q, k, v = (jax_view(t)[0].transpose(1, 0, 2) for t in (query, key, value))  # [T, heads, D]
    out = paged.attend(module.layer_idx, q, k, v, scaling, kwargs.get("sliding_window"))
    return torch_view(out[None]), None  # [1, T, H, D]


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
