"""Per-layer views of a CPU stage's stacked layer weights, for decode steps whose layers are unrolled.

On XLA:CPU a dot cannot read one layer of a stacked [L, ...] weight in place: the layer scan's dynamic slice
copies every layer's weights before its dots read them, each step (``benchmarks/probes/layer_loop_bench.py``). A
decode step is bound by reading its weights, so that copy is a large share of it. Here each layer of each
stacked weight becomes an array of its own that aliases the stacked one's memory: the CPU backend adopts a
64-byte-aligned host array as a device buffer without copying it, and a stacked weight's layers start at
multiples of its layer size. Nothing is duplicated; the stacked arrays stay for the prefill steps' scan.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from pipejax.runner.config import ModelConfig, StageConfig
from pipejax.runner.model import LAYER_PREFIX, per_layer_weights, stacked_layers
from pipejax.runner.panels import Panels, QuantizedPanels
from pipejax.runner.quantized import Quantized

# A layer slice this small may be copied (a norm or bias vector whose layer size is not a multiple of the 64
# bytes the CPU backend needs to adopt it); a larger one that is not aliased is an error, not a second copy.
MAX_COPIED_BYTES = 64 << 10


def _layers_of(w: jax.Array) -> list[jax.Array]:
    """``w`` [L, ...] as L arrays [...] over the same memory, each sharded as ``w`` is past its first axis."""
    spec = w.sharding.spec if isinstance(w.sharding, NamedSharding) else PartitionSpec()
    sharding = NamedSharding(w.sharding.mesh, PartitionSpec(*tuple(spec)[1:]))
    layers: list[list[jax.Array]] = [[] for _ in range(w.shape[0])]
    for shard in w.addressable_shards:
        host = np.asarray(shard.data)  # the device buffer itself on CPU (read-only), not a copy
        if host.ctypes.data != shard.data.unsafe_buffer_pointer():
            raise RuntimeError("the device buffer is not host memory")
        for i, out in enumerate(layers):
            view = jax.device_put(host[i], shard.device, may_alias=True)
            if view.unsafe_buffer_pointer() != host[i].ctypes.data and host[i].nbytes > MAX_COPIED_BYTES:
                raise RuntimeError(f"layer {i} of a {w.shape} weight ({host[i].nbytes} bytes) was copied, not aliased")
            out.append(view)
    return [jax.make_array_from_single_device_arrays(w.shape[1:], sharding, arrays) for arrays in layers]


def _layers(w: jax.Array | Panels | Quantized) -> list:
    if isinstance(w, Panels):
        tiles = [None] * w.data.shape[0] if w.tiles is None else _layers_of(w.tiles)
        return [Panels(v, None, t) for v, t in zip(_layers_of(w.data), tiles, strict=True)]
    if isinstance(w, (Quantized, QuantizedPanels)):  # each of its parts by layers
        parts = [None if a is None else _layers_of(a) for a in (w.q, w.scale, w.offset)]
        return [dataclasses.replace(w, q=q, scale=s, offset=None if parts[2] is None else parts[2][i])
                for i, (q, s) in enumerate(zip(parts[0], parts[1], strict=True))]
    return _layers_of(w)


def per_layer(params: dict[str, jax.Array | Panels], cfg: ModelConfig, stage: StageConfig) -> dict:
    """``params`` with its stacked ``layers.*`` weights replaced by ``"layers"``: one dict per layer of arrays
    aliasing them (CPU devices only; raises where a layer larger than ``MAX_COPIED_BYTES`` would be copied)."""
    views = {name: _layers(w) for name, w in stacked_layers(params).items()}
    out = {name: w for name, w in params.items() if not name.startswith(LAYER_PREFIX)}
    out["layers"] = per_layer_weights(views, cfg, stage)
    return out
