"""Dense matmuls of a CPU stage as a hand-written kernel: an XLA FFI custom call compiled by numba
(``cpu_dense_kernel``), over weights stored in panels (``panels.Panels``).

At a decode step's few rows XLA:CPU's dot runs well below its square-matmul rate, and the step is mostly its
dense matmuls. The kernel reads each panel of a weight as one contiguous stream and keeps every output tile
in registers; at a prefill step's many rows it runs a little faster than XLA's dot too. Like the
decode-attention kernel it is built at the first step traced on a CPU stage (cached on disk by numba); where
numba cannot build it, a warning says so and XLA's dot reads the panels.
Used for float32 weights on single-device stages (``checkpoint.use_panels``); with tp > 1 the weights keep their
own layout for XLA's sharded dots (XLA's dot reads panels as fast at a prefill's rows, far slower at a decode
step's).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from pipejax.runner.cpu import isa
from pipejax.runner.cpu.build import build_and_register
from pipejax.runner.model import rms_norm
from pipejax.runner.panels import Panels, swiglu
from pipejax.runner.rope import RopeTables, apply_rope

KERNEL = "pipejax.runner.cpu.dense_kernel"  # the numba module that builds the handler
TARGET = "pipejax_panel_matmul"


@functools.cache
def _handler() -> Any:
    """Build and register the handler once (cached: it lives as long as the process); None (with a warning)
    where numba cannot build it."""
    return build_and_register(TARGET, KERNEL, "dense-matmul", "XLA's dot")


def prepare() -> bool:
    """Build (or load from numba's cache) the kernel now; whether it is available."""
    return _handler() is not None


def for_mesh(mesh: Mesh, amx_rows: int | None = None, kept_rows: int | None = None,
             xla_rows: int | None = None) -> Callable | None:
    """The kernel for a stage on ``mesh``: on one device; None (XLA's dot) over several (which ``use_panels``
    leaves in their own layout). ``amx_rows``: calls of that many rows or more run on AMX's tiles, splitting the
    weight; ``kept_rows``: calls from that many rows (below ``amx_rows``) on the weight's kept tiles; ``xla_rows``:
    calls of that many rows or more run XLA's dot over the panels (``matmul``)."""
    if mesh.devices.size != 1:
        return None
    if xla_rows is not None:
        return functools.partial(matmul, xla_rows=xla_rows)
    if amx_rows is None and kept_rows is None:
        return matmul
    if not amx_ready():
        raise RuntimeError("the dense kernel was asked to run on AMX's tiles, which this process cannot use")
    return functools.partial(matmul, amx_rows=amx_rows, kept_rows=kept_rows)


def keep_tiles(params: dict) -> dict:
    """``params`` with every dense weight in panels (not a MoE's routed experts) also kept as AMX's tiles
    (``weight_tiles``, 1.5x its panels' bytes), for ``matmul``'s ``kept_rows``."""
    def kept(name, w):
        if not isinstance(w, Panels) or w.tiles is not None or "experts" in name or tiles_shape(w.data.shape) is None:
            return w
        return Panels(w.data, w.layer, weight_tiles(w.data).block_until_ready())  # one at a time: no second peak

    return {name: kept(name, w) for name, w in params.items()}


def amx_ready() -> bool:
    """Whether this process can run the kernel's AMX path: numba's target has AMX's bf16 tiles and Linux granted
    this process their state (asked here, once)."""
    return isa.amx() and isa.grant_amx()


# What a kernel call computes (its int32 mode operand): x @ w; silu(gate) * up; residual + x @ w, written over the
# residual (a decoder layer's o and down projections); residual + a Mixture-of-Experts layer's routed experts.
PLAIN, GATED, ADD, ROUTED, SPLIT = 0, 1, 2, 3, 4  # SPLIT: a weight's panels -> its AMX tiles (``weight_tiles``)
AMX = 8  # a flag on PLAIN, GATED or ADD: the call runs on AMX's bf16 tiles at fp32 accuracy (``amx_kernel``)
TILED = 16  # a flag with AMX: the weight's tiles come split already (``weight_tiles``), an operand after the mode
NORMED = 32  # a flag on PLAIN, GATED or ADD: x is RMS-normed first; its weight [Kc] and eps follow (after the tiles)
# a flag on PLAIN: the result's query and key heads rotated (rotary embeddings) at the end; the tables cos and signed
# sin [M, D], the heads a group has and how many of them at its start rotate (int32) follow (after the norm's)
ROTARY = 64
# the largest weight the AMX path splits into its tiles per call (6 bytes a weight): an LM head stays on the FMA tiles
AMX_MAX_TILE_BYTES = 64 << 20


def matmul(x: jax.Array, panels: jax.Array, layer: jax.Array | int = 0, gated: bool = False,
           residual: jax.Array | None = None, amx_rows: int | None = None, kept_rows: int | None = None,
           tiles: jax.Array | None = None, xla_rows: int | None = None,
           norm: tuple[jax.Array, float] | None = None, rotary: tuple[RopeTables, int, int] | None = None
           ) -> jax.Array:
    """x [M, Kc] @ panels[layer] -> [M, P * PANEL], float32, for panels [L, P, Kc, PANEL] and a scalar
    ``layer`` (the whole stack goes in: a slice of it would be a copy). ``gated``: the first half of the panels
    a gate, the second its up projection, and the result silu(gate) * up [M, P / 2 * PANEL], computed while
    each pair of output tiles is still in cache (an MLP's gate_up: XLA would write both halves out and read them
    back). ``residual`` [M, P * PANEL]: the result is residual + x @ w, the kernel adding each output tile to the
    residual in place (XLA's add would read the product back from memory written by another thread).
    ``amx_rows``: with at least that many rows (and a contraction of whole blocks of 32, a weight within
    ``AMX_MAX_TILE_BYTES`` as tiles), the call runs on AMX's tiles (``for_mesh`` checks that it can), splitting the
    weight into them. ``tiles``: the weight's tiles kept (``weight_tiles``, [L, ...] as ``panels``), which a call
    of ``kept_rows`` rows or more (and fewer than ``amx_rows``) reads instead. ``xla_rows``: a call of that many
    rows or more is XLA's dot over the panels (where it measured faster than the kernel at a prefill's rows).
    ``norm``: (weight [Kc], eps): x is RMS-normed first (``model.rms_norm``), by the kernel as it reads x.
    ``rotary``: (tables, group, rotated): the result is heads of D = the tables' width in groups of ``group`` (a
    layer's qkv: per KV head its query heads, its key, its value), and the first ``rotated`` heads of each group are
    rotated (``rope.apply_rope``) by the kernel once the product is done (not with ``gated`` or ``residual``)."""
    n = panels.shape[1] * panels.shape[3]
    if gated and residual is not None:
        raise ValueError("a gated matmul takes no residual")
    if (_handler() is None or x.dtype != jnp.float32 or panels.dtype != jnp.float32
            or (xla_rows is not None and x.shape[0] >= xla_rows)):
        x = x if norm is None else rms_norm(x, *norm)
        y = jnp.einsum("mk,pkc->mpc", x, panels[layer]).reshape(x.shape[0], n)
        y = y if rotary is None else _rotated(y, *rotary)
        y = swiglu(y[:, : n // 2], y[:, n // 2:]) if gated else y
        return y if residual is None else residual + y
    layer = jnp.asarray(layer, jnp.int32)
    kc = panels.shape[2]
    m = x.shape[0]
    kept = tiles is not None and kept_rows is not None and m >= kept_rows and (amx_rows is None or m < amx_rows)
    flags = AMX | TILED if kept else AMX if (amx_rows is not None and m >= amx_rows and kc % 32 == 0
                                             and n * kc * 6 <= AMX_MAX_TILE_BYTES) else 0
    given = (tiles,) if kept else ()
    if norm is not None:
        flags |= NORMED
        given += (norm[0].astype(jnp.float32), jnp.float32(norm[1]))
    if rotary is not None:
        if gated or residual is not None:
            raise ValueError("a rotated matmul is neither gated nor added to a residual")
        tables, group, rotated = rotary
        flags |= ROTARY
        given += (*(t.reshape(m, -1).astype(jnp.float32) for t in tables), jnp.int32(group), jnp.int32(rotated))
    if residual is not None:
        call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(residual.shape, jnp.float32),
                                input_output_aliases={4 + len(given): 0})
        return call(x, panels, layer, jnp.int32(ADD | flags), *given, residual.astype(jnp.float32))
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], n // 2 if gated else n), jnp.float32))
    return call(x, panels, layer, jnp.int32((GATED if gated else PLAIN) | flags), *given)


def _rotated(y: jax.Array, tables: RopeTables, group: int, rotated: int) -> jax.Array:
    """``matmul``'s ``rotary`` in XLA: y [M, N] as [M, N / (group D), group, D], the first ``rotated`` heads of each
    group rotated."""
    heads = y.reshape(y.shape[0], -1, group, tables.cos.shape[-1])
    turned = apply_rope(heads[:, :, :rotated].reshape(y.shape[0], -1, heads.shape[-1]), tables)
    return heads.at[:, :, :rotated].set(turned.reshape(heads[:, :, :rotated].shape)).reshape(y.shape)


def tiles_shape(panels_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The shape of ``weight_tiles`` for panels of ``panels_shape`` ([*lead, P, Kc, PANEL]): [*lead, P, Kc / 32,
    6 x 512] (3 bf16 pieces x 2 halves of 16 columns, a 16 x 32 tile each); None where Kc is no whole number of
    blocks of 32 (such a weight stays on the FMA tiles)."""
    *lead, kc, _ = panels_shape
    return None if kc % 32 else (*lead, kc // 32, 6 * 512)


@jax.jit
def weight_tiles(panels: jax.Array) -> jax.Array:
    """``panels`` [*lead, P, Kc, PANEL] float32 split once into AMX's tiles (``amx_kernel.split_panels``), uint16
    [*lead, P, Kc / 32, 6 x 512]: kept beside the panels, a call on AMX's tiles reads them instead of splitting the
    weight again (6 bytes a weight; needs the kernel built here and a CPU with AMX)."""
    if _handler() is None or not amx_ready():
        raise RuntimeError("a weight's AMX tiles need the dense kernel built here and a CPU with AMX's bf16 tiles")
    flat = panels.reshape(-1, *panels.shape[-3:])  # [L P, ...]: the handler splits every panel in turn
    out = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((*flat.shape[:2], flat.shape[2] // 32, 6 * 512), jnp.uint16))
    tiles = out(flat[:1, :1, :32, :1], flat, jnp.int32(0), jnp.int32(SPLIT))
    return tiles.reshape(tiles_shape(panels.shape))


def routed_experts(x: jax.Array, gate_up: jax.Array, down: jax.Array, first: jax.Array | int, chosen: jax.Array,
                   weights: jax.Array, residual: jax.Array) -> jax.Array:
    """residual + sum over j of weights[t, j] * expert chosen[t, j]'s MLP of x[t] -> [T, E], for x [T, E] and
    each token's top k experts ``chosen`` [T, k] (ids from 0) with their ``weights`` [T, k]: a Mixture-of-Experts
    layer's experts, each computing only the rows routed to it (``moe.moe_mlp``). The experts' weights in panels,
    every layer's stacked: gate/up [L X, 2 Fm / PANEL, E, PANEL] (each expert's gate panels, then its up panels),
    down [L X, E / PANEL, Fm, PANEL]; the layer's expert e is at ``first`` + e. The kernel sorts the routes by
    expert, runs each expert's rows through its gate/up panels (silu(gate) * up while the tiles are in cache), then
    its down panels, and adds each token's routes to the residual in place, in expert order. (No XLA fallback: a
    stage stores the experts in panels only where this kernel was built, ``Selection.kernels``.)"""
    if _handler() is None:
        raise RuntimeError("the CPU dense kernel could not be built here: the routed experts need it")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(residual.shape, jnp.float32), input_output_aliases={7: 0})
    return call(x, gate_up, jnp.asarray(first, jnp.int32), jnp.int32(ROUTED), down, chosen.astype(jnp.int32),
                weights.astype(jnp.float32), residual.astype(jnp.float32))

