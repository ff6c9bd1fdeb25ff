"""Dense matmuls of a CPU stage as a hand-written kernel: an XLA FFI custom call compiled by numba
(``cpu_dense_kernel``), over weights stored in panels (``model.Panels``).

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

from pipejax.runner.cpu_kernels import build_and_register

TARGET = "pipejax_panel_matmul"


@functools.cache
def _handler() -> Any:
    """Build and register the handler once (cached: it lives as long as the process); None (with a warning)
    where numba cannot build it."""
    return build_and_register(TARGET, "pipejax.runner.cpu_dense_kernel", "dense-matmul", "XLA's dot")


def prepare() -> bool:
    """Build (or load from numba's cache) the kernel now; whether it is available."""
    return _handler() is not None


def for_mesh(mesh: Mesh) -> Callable | None:
    """The kernel for a stage on ``mesh``: on one device; None (XLA's dot) over several (which ``use_panels``
    leaves in their own layout)."""
    return matmul if mesh.devices.size == 1 else None


def matmul(x: jax.Array, panels: jax.Array, layer: jax.Array | int = 0, gated: bool = False) -> jax.Array:
    """x [M, Kc] @ panels[layer] -> [M, P * PANEL], float32, for panels [L, P, Kc, PANEL] and a scalar
    ``layer`` (the whole stack goes in: a slice of it would be a copy). ``gated``: the first half of the panels
    a gate, the second its up projection, and the result silu(gate) * up [M, P / 2 * PANEL], computed while
    each pair of output tiles is still in cache (an MLP's gate_up: XLA would write both halves out and read them
    back)."""
    n = panels.shape[1] * panels.shape[3]
    if _handler() is None or x.dtype != jnp.float32 or panels.dtype != jnp.float32:
        y = jnp.einsum("mk,pkc->mpc", x, panels[layer]).reshape(x.shape[0], n)
        return jax.nn.silu(y[:, : n // 2]) * y[:, n // 2:] if gated else y
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], n // 2 if gated else n), jnp.float32))
    return call(x, panels, jnp.asarray(layer, jnp.int32), jnp.int32(gated))
