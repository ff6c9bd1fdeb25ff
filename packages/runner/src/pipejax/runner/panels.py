"""Dense weights and the dense op over them: ``dense`` multiplies by a weight in its own layout [*in, *out] or
stored in panels (``Panels``).

On CPU stages the dense weights are stored in panels of PANEL output columns: a weight [*lead, *in, *out]
as [*lead, *out[:-1], out[-1] / PANEL, *in, PANEL], so that a matmul streams each panel's columns for
every input row from contiguous memory (``cpu.dense_kernel``): at a decode step's few rows far faster than
XLA's dot reads a row-major weight, and at a prefill's many rows a little faster.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax

from pipejax.runner.quantized import Format, Quantized, dequantize

PANEL = 32
# The dense weights: name -> how many of their dimensions (after a layer weight's leading L) are contracted.
DENSE_WEIGHTS = {"layers.qkv": 1, "layers.o": 2, "layers.gate_up": 1, "layers.down": 1, "lm_head": 1}
# Every weight that can be stored in panels: name -> (leading dims, contracted dims). A Mixture-of-Experts layer's
# experts keep each expert's own panels (``moe.moe_mlp`` over ``Kernels.routed_experts``): gate/up [L, E, X, 2, Fm]
# as [L, X, 2, Fm / PANEL, E, PANEL], down [L, X, Fm, E] as [L, X, E / PANEL, Fm, PANEL].
PANEL_LAYOUTS = {**{name: (int(name.startswith("layers.")), contracted) for name, contracted in DENSE_WEIGHTS.items()},
                 "layers.experts_gate_up": (1, 1), "layers.experts_down": (2, 1), "layers.shared_gate_up": (1, 1),
                 "layers.shared_down": (1, 1)}
# Stored in panels only where their contracted dim is whole panels too: both of them, or neither (the kernel reads
# the pair; one of them in panels alone would be turned back into its own layout every step).
EXPERT_WEIGHTS = ("layers.experts_gate_up", "layers.experts_down")


def outputs_first(dims: tuple, lead: int, contracted: int) -> tuple:
    """Per-dimension values (sizes, logical axes) of a dense weight [*lead, *in, *out] in the order its panels
    keep them: [*lead, *out, *in]."""
    return (*dims[:lead], *dims[lead + contracted:], *dims[lead:lead + contracted])


def panel_shape(shape: tuple[int, ...], lead: int, contracted: int) -> tuple[int, ...]:
    """A dense weight's shape [*lead, *in, *out] in panels: [*lead, *out[:-1], out[-1] / PANEL, *in, PANEL]."""
    *lead_and_outs, last_out = outputs_first(shape, lead, contracted)[:len(shape) - contracted]
    return (*lead_and_outs, last_out // PANEL, *shape[lead:lead + contracted], PANEL)


def own_order(ndim: int, lead: int, contracted: int) -> tuple[int, ...]:
    """The transpose that views panels [*lead, *out[:-1], out[-1] / PANEL, *in, PANEL] (``ndim`` dims) in the
    weight's own order, its last dim split in panels: [*lead, *in, *out[:-1], out[-1] / PANEL, PANEL]."""
    outs = ndim - lead - contracted - 1
    ins = range(lead + outs, lead + outs + contracted)
    return (*range(lead), *ins, *range(lead, lead + outs), ndim - 1)


def own_layout(data: jax.Array, lead: int, contracted: int) -> jax.Array:
    """Panels back in the weight's own layout [*lead, *in, *out] (a copy: for XLA's formulations where no kernel
    reads the panels)."""
    own = data.transpose(own_order(data.ndim, lead, contracted))
    return own.reshape(*own.shape[:-2], own.shape[-2] * PANEL)


@jax.tree_util.register_pytree_node_class
class Panels:
    """A dense weight stored in panels (see PANEL); ``data`` is the array. A pytree node, so a layer scan or
    per-layer views slice ``data`` as they would the weight itself. With ``layer`` (a scalar index), ``data`` is
    every layer's [L, ...] and the weight is layer ``layer`` of them: the layer scan hands the dense kernel the
    whole stack and the index, as XLA would copy a dynamic slice of it into the kernel's own buffer. ``tiles``: the
    weight also split into AMX's bf16 tiles (``cpu.dense.weight_tiles``, [L, ...] as ``data``), which the dense
    kernel reads on AMX instead of splitting the weight at each call; None: not kept."""

    def __init__(self, data: jax.Array, layer: jax.Array | None = None, tiles: jax.Array | None = None):
        self.data, self.layer, self.tiles = data, layer, tiles

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.tiles is None else self.tiles.nbytes)

    def at(self, layer: jax.Array | int) -> Panels:
        """Layer ``layer`` of a stacked weight: the whole stack and the index, as the dense kernel reads them."""
        return Panels(self.data, layer, self.tiles)

    def columns(self, index: jax.Array) -> jax.Array:
        """Output columns ``index`` [T] of a weight [K, N] (no lead dims) as rows [T, K]: the tied embedding's
        lookup, when the embedding is kept as the LM head's panels."""
        return self.data[index // PANEL, :, index % PANEL]

    def tree_flatten(self):
        return (self.data, self.layer, self.tiles), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedPanels:
    """A dense weight kept quantized (``quantized.Quantized``) with each of its parts in panels, as ``Panels`` holds
    a float weight: ``q`` [*lead, *out[:-1], out[-1] / PANEL, *in', PANEL] (in': the contracted dims, the last one
    packed for 4-bit formats), ``scale`` and ``offset`` likewise with a block count for that dim. ``layer``: as
    ``Panels.layer``. What the CPU quantized kernel reads (``cpu.quantized_dense``)."""

    q: jax.Array
    scale: jax.Array
    offset: jax.Array | None
    fmt: Format = dataclasses.field(metadata={"static": True})
    layer: jax.Array | None = None

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.q, self.scale, self.offset) if a is not None)

    def at(self, layer) -> QuantizedPanels:
        """The whole stack, read at ``layer`` (see ``Panels.layer``)."""
        return dataclasses.replace(self, layer=layer)

    def columns(self, index: jax.Array, dtype) -> jax.Array:
        """Output columns ``index`` [T] of a weight [K, N] (no lead dims) dequantized as rows [T, K]: the tied
        embedding's lookup, when the embedding is kept as the LM head's panels."""
        panel, column = index // PANEL, index % PANEL
        offset = None if self.offset is None else self.offset[panel, :, column]
        return dequantize(Quantized(self.q[panel, :, column], self.scale[panel, :, column], offset, self.fmt, -1),
                          dtype)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """The gated MLP's activation: silu(gate) * up."""
    return jax.nn.silu(gate) * up


def dense(x: jax.Array, w: jax.Array | Panels, contracted: int, kernel: Callable | None = None,
          gated: bool = False, residual: jax.Array | None = None, norm: tuple | None = None,
          rotary: tuple | None = None) -> jax.Array:
    """x [T, *in] @ w ([*in, *out], or those in panels) -> [T, *out]. ``kernel``: a matmul of x [T, prod(in)]
    with layer ``layer`` of panels [L, out / PANEL, prod(in), PANEL] (``model.Kernels.dense``), used for weights
    in panels. ``gated``: w's outputs are [2, *rest] (gate, up), and the result swiglu(gate, up) [T, *rest].
    ``residual`` [T, *out]: the result is residual + x @ w (the kernel adds it in place). A weight kept quantized
    (``quantized.Quantized``) is dequantized into the dot; in panels (``QuantizedPanels``) ``kernel`` is the
    quantized one (``model.Kernels.quantized_dense``). ``norm``: (weight, eps) of an RMS norm the kernel applies to x
    as it reads it; ``rotary``: (tables, group, rotated) of rotary embeddings it applies to the result's heads
    (``cpu.dense.matmul``): both only for weights in panels with a kernel (``model.project`` does them otherwise)."""
    if (norm is not None or rotary is not None) and not (kernel is not None and isinstance(w, Panels)):
        raise ValueError("only a dense kernel over weights in panels norms x or rotates heads itself")
    if isinstance(w, Quantized):
        w = dequantize(w, x.dtype)
    if isinstance(w, QuantizedPanels):
        return _quantized_panels(x, w, contracted, kernel, gated, residual)
    if not isinstance(w, Panels):
        y = jax.lax.dot_general(x, w, ((tuple(range(1, contracted + 1)), tuple(range(contracted))), ((), ())))
        y = swiglu(y[:, 0], y[:, 1]) if gated else y
        return y if residual is None else residual + y
    data = w.data  # [*out[:-1], out[-1] / PANEL, *in, PANEL], or [L, ...] of those with ``w.layer``
    outs = data.shape[int(w.layer is not None): data.ndim - contracted - 1]
    out_shape = (x.shape[0], *outs[:-1], outs[-1] * PANEL)
    if kernel is not None:
        flat = x.reshape(x.shape[0], -1)  # [T, Kc]
        layers, layer = (1, 0) if w.layer is None else (data.shape[0], w.layer)
        flat_residual = None if residual is None else residual.reshape(x.shape[0], -1)
        tiles = {} if w.tiles is None else {"tiles": w.tiles.reshape(layers, -1, *w.tiles.shape[-2:])}
        extra = {name: v for name, v in (("norm", norm), ("rotary", rotary)) if v is not None}
        y = kernel(flat, data.reshape(layers, -1, flat.shape[1], PANEL), layer, gated, flat_residual, **tiles,
                   **extra)
        return y.reshape((out_shape[0], *out_shape[2:]) if gated else out_shape)
    if w.layer is not None:
        data = data[w.layer]
    ins = tuple(range(len(outs), len(outs) + contracted))
    y = jax.lax.dot_general(x, data, ((tuple(range(1, contracted + 1)), ins), ((), ())))  # [T, *outs, PANEL]
    y = y.reshape(out_shape)
    y = swiglu(y[:, 0], y[:, 1]) if gated else y
    return y if residual is None else residual + y


def _quantized_panels(x: jax.Array, w: QuantizedPanels, contracted: int, kernel: Callable | None, gated: bool,
                      residual: jax.Array | None) -> jax.Array:
    """``dense`` over a weight kept quantized in panels: the kernel over layer ``w.layer`` of the [L, P, K', PANEL]
    stack, or (no kernel) that layer dequantized and XLA's dot."""
    lead = int(w.layer is not None)
    outs = w.q.shape[lead:w.q.ndim - contracted - 1]
    out_shape = (x.shape[0], *outs[:-1], outs[-1] * PANEL)
    flat = x.reshape(x.shape[0], -1)  # [T, K]
    layers, layer = (w.q.shape[0], w.layer) if lead else (1, 0)
    panels = math.prod(outs)
    q, scale, offset = (None if a is None else a.reshape(layers, panels, -1, PANEL) for a in (w.q, w.scale, w.offset))
    flat_residual = None if residual is None else residual.reshape(x.shape[0], -1)
    if kernel is not None:
        # int8's scale per output channel is one per head of the attention output's (H, D): blocks of D
        fmt = dataclasses.replace(w.fmt, block=flat.shape[1] // scale.shape[2])
        y = kernel(flat, q, scale, offset, fmt, layer, gated, flat_residual)
        return y.reshape((out_shape[0], *out_shape[2:]) if gated else out_shape)
    weight = Quantized(q[layer], scale[layer], None if offset is None else offset[layer], w.fmt, -2)
    y = jax.numpy.einsum("mk,pkc->mpc", flat, dequantize(weight, x.dtype)).reshape(out_shape)
    y = swiglu(y[:, 0], y[:, 1]) if gated else y
    return y if residual is None else residual + y
