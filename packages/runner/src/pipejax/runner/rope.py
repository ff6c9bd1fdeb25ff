"""Rotary position embeddings: the inverse frequencies (with Llama 3 scaling), the step's cos/sin tables, and
their rotation of queries and keys ([T, heads, D])."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pipejax.runner.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [D/2], with Llama 3 scaling when configured (computed on the host in fp32)."""
    D, rope = cfg.head_dim, cfg.rope
    inv_freq = 1.0 / (rope.theta ** (np.arange(0, D, 2, dtype=np.int64).astype(np.float32) / D))
    if rope.kind == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * np.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) / rope.factor * scaled + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


class RopeTables(NamedTuple):
    """cos and signed sin [T, 1, D] of the step's positions, computed once per step: in the unrolled decode layers
    XLA:CPU fused a cos of [T, D] into each [T, H, D] consumer, computing it again for every head of every layer."""

    cos: jax.Array
    sin: jax.Array  # -sin on the first half of D, +sin on the second: rotate-half's sign folded in


def rope_tables(positions: jax.Array, inv_freq: jax.Array, dtype) -> RopeTables:
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    return RopeTables(jnp.concatenate([cos, cos], axis=-1).astype(dtype)[:, None, :],
                      jnp.concatenate([-sin, sin], axis=-1).astype(dtype)[:, None, :])


def apply_rope(x: jax.Array, rope: RopeTables) -> jax.Array:
    """x [T, N, D] rotated (half-split layout, as Hugging Face): x * cos + swap_halves(x) * signed sin."""
    swapped = jnp.flip(x.reshape(*x.shape[:-1], 2, -1), axis=-2).reshape(x.shape)
    return x * rope.cos + swapped * rope.sin
