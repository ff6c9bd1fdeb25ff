"""Weights kept quantized: the formats, their packing, and the XLA formulation that reads them.

A quantized weight has a float weight's logical shape w [*lead, *in, *out] and is held as
- ``q``: one integer per element: int8 for the 8-bit formats, a nibble 0..15 for the 4-bit ones;
- ``scale`` (float32): ``w``'s shape with the blocked axis (the last contracted one, of n elements) cut to one
  entry per block of ``block`` elements along it;
- ``offset`` (float32, like ``scale``): Q4_1's block minimum.

``w = scale * q`` (int8, Q8_0), ``scale * (q - 8)`` (Q4_0), ``scale * q + offset`` (Q4_1): llama.cpp's formulas, so a
GGUF file's blocks are taken as they are. Nibbles go two to a byte along the blocked axis, as GGUF stores them:
byte j of a block of 32 holds element j in its low half and element j + 16 in its high half. Blocks run along
the contraction because GGUF lays them out so (and a matmul can apply one scale to a partial sum); a TP shard
of a contracted axis must then hold whole blocks.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32  # the elements per scale of GGUF's Q8_0/Q4_0/Q4_1, and of int4


@dataclasses.dataclass(frozen=True)
class Format:
    """A quantized weight type: ``bits`` per element; ``block`` elements per scale along the blocked axis (0: the
    whole axis, a scale per output channel); an ``offset`` per block (Q4_1); ``zero``, the integer that stands
    for 0.0 where there is no offset (8 for Q4_0's unsigned nibbles)."""

    name: str
    bits: int
    block: int
    offset: bool = False
    zero: int = 0

    def block_of(self, n: int) -> int:
        """Elements per scale along a blocked axis of ``n``."""
        return self.block or n

    @property
    def bytes_per_weight(self) -> float:
        """What a weight kept in this format takes, its float32 scale (and offset) shared by a block (a scale per
        output channel left out)."""
        return self.bits / 8 + (4 * (1 + self.offset) / self.block if self.block else 0)

    @property
    def dtype(self) -> np.dtype:
        """What ``q`` is stored as: int8, or bytes of two nibbles."""
        return np.dtype(np.int8 if self.bits == 8 else np.uint8)


INT8 = Format("int8", 8, 0)  # a scale per output channel, symmetric
Q8_0 = Format("q8_0", 8, BLOCK)
Q4_0 = Format("q4_0", 4, BLOCK, zero=8)  # also what --quantization int4 makes
Q4_1 = Format("q4_1", 4, BLOCK, offset=True)
FORMATS = {f.name: f for f in (INT8, Q8_0, Q4_0, Q4_1)}

# What ``--quantization int8|int4`` makes (``config.QUANTIZATION_CHOICES``), and of the token embedding and the LM
# head: int4 keeps those at 8 bits (Q8_0), as llama.cpp's own 4-bit files keep them at 6-8 bits (at 4 bits,
# SmolLM2's tied head moved its largest logit by 0.64 of itself: ``benchmarks/probes/quantization_drift.py``).
ON_THE_FLY = {"int8": INT8, "int4": Q4_0}
ON_THE_FLY_VOCABULARY = {"int8": INT8, "int4": Q8_0}
VOCABULARY_WEIGHTS = ("embed", "lm_head")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Quantized:
    """A weight kept quantized (see the module's docstring). A pytree whose children are ``q``, ``scale`` and
    ``offset``, so a layer scan or per-layer views slice them as they would a float weight: ``axis`` (the blocked
    one) counts from the end, and a leading layer axis comes and goes without changing it."""

    q: jax.Array
    scale: jax.Array
    offset: jax.Array | None
    fmt: Format = dataclasses.field(metadata={"static": True})
    axis: int = dataclasses.field(metadata={"static": True})  # negative

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's shape."""
        shape = list(self.q.shape)
        shape[self.axis] *= 8 // self.fmt.bits
        return tuple(shape)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.q, self.scale, self.offset) if a is not None)

    def rows(self, index: jax.Array) -> Quantized:
        """Rows ``index`` of the first axis (an embedding lookup), still quantized (the axis must not be the
        blocked one)."""
        assert self.axis % self.q.ndim != 0
        offset = None if self.offset is None else self.offset[index]
        return Quantized(self.q[index], self.scale[index], offset, self.fmt, self.axis)


def unpack_nibbles(packed, axis: int, xp=jnp):
    """Bytes of two nibbles [..., n / 2, ...] along ``axis`` -> the nibbles [..., n, ...] (GGUF's order in blocks
    of 32: a byte's low nibble is element j of its block, its high nibble element j + 16)."""
    axis %= packed.ndim
    shape = packed.shape
    halves = packed.reshape(*shape[:axis], shape[axis] // 16, 1, 16, *shape[axis + 1:])
    nibbles = xp.concatenate([halves & 15, halves >> 4], axis=axis + 1)
    return nibbles.reshape(*shape[:axis], shape[axis] * 2, *shape[axis + 1:])


def pack_nibbles(nibbles: np.ndarray, axis: int) -> np.ndarray:
    """The inverse of ``unpack_nibbles`` (numpy; ``nibbles`` in 0..15, whole blocks of 32 along ``axis``)."""
    axis %= nibbles.ndim
    shape = nibbles.shape
    blocks = nibbles.astype(np.uint8).reshape(*shape[:axis], shape[axis] // 32, 2, 16, *shape[axis + 1:])
    low, high = np.take(blocks, 0, axis=axis + 1), np.take(blocks, 1, axis=axis + 1)
    return (low | (high << 4)).reshape(*shape[:axis], shape[axis] // 2, *shape[axis + 1:])


def dequantize(w: Quantized, dtype=jnp.float32, xp=jnp):
    """The float weight (``xp``: jnp, or np for a reference). In a jitted step XLA fuses this into the dot's
    operand where the backend can (TPU); XLA:CPU writes the float weight out first."""
    q = unpack_nibbles(w.q, w.axis, xp) if w.fmt.bits == 4 else w.q
    axis = w.axis % q.ndim
    blocks = w.scale.shape[axis]
    per_block = q.reshape(*q.shape[:axis], blocks, q.shape[axis] // blocks, *q.shape[axis + 1:])
    values = per_block.astype(np.float32)
    if w.fmt.zero:
        values = values - np.float32(w.fmt.zero)
    values = values * xp.expand_dims(w.scale, axis + 1)
    if w.offset is not None:
        values = values + xp.expand_dims(w.offset, axis + 1)
    return values.reshape(q.shape).astype(dtype)


# --- quantizing float weights (numpy, at load), in a checkpoint's [rows, n] layout ------------------------------


def quantize_rows(w: np.ndarray, fmt: Format, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Float rows [r, n] -> (q [r, n] (nibbles packed: [r, n / 2]), scale [r, n / block], offset or None), each
    block of ``block`` elements of a row quantized alone. int8 and Q8_0: the scale maps the block's largest
    magnitude to 127; Q8_0 and Q4_0 as llama.cpp quantizes them (Q4_0: the signed extreme maps to -8; both keep
    the scale in float16)."""
    w = np.asarray(w, np.float32)
    r, n = w.shape
    blocks = w.reshape(r, n // block, block)
    if fmt.bits == 8:
        scale = np.abs(blocks).max(axis=-1) / np.float32(127)
        inverse = np.divide(1, scale, out=np.zeros_like(scale), where=scale != 0)
        x = blocks * inverse[..., None]
        if fmt is Q8_0:  # as llama.cpp quantizes it: halves rounded away from zero, the scale kept in float16
            a = np.abs(x)
            q = np.sign(x) * (np.floor(a) + np.floor(2 * (a - np.floor(a))))
            scale = scale.astype(np.float16)
        else:
            q = np.rint(x)
        q = np.clip(q, -127, 127).astype(np.int8)
        return q.reshape(r, n), scale.astype(np.float32), None
    if fmt is not Q4_0:
        raise ValueError(f"pipejax quantizes float weights to int8 and int4 (Q4_0), not {fmt.name}")
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    scale = (extreme / np.float32(-8)).astype(np.float32)
    inverse = np.divide(1, scale, out=np.zeros_like(scale), where=scale != 0)
    nibbles = np.minimum(15, (blocks * inverse[..., None] + np.float32(8.5)).astype(np.int8)).astype(np.uint8)
    # the scale kept as a GGUF file keeps it (float16), so int4 is Q4_0 exactly as llama.cpp quantizes
    return pack_nibbles(nibbles.reshape(r, n), -1), scale.astype(np.float16).astype(np.float32), None


def fake_quantize(w: np.ndarray, fmt: Format, block: int) -> np.ndarray:
    """``w`` [r, n] quantized (``quantize_rows``) and back: the weights a quantized model computes with."""
    q, scale, offset = quantize_rows(w, fmt, block)
    return dequantize(Quantized(q, scale, offset, fmt, -1), np.float32, np)
