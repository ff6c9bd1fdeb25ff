"""Load one stage's parameters from a Hugging Face safetensors checkpoint (or a GGUF file, through
``gguf_file.GGUFIndex``).

Only the tensors the stage owns are read (memory-mapped), one parameter at a time and each in
chunks of at most ``CHUNK_BYTES``; every chunk is converted to the runner's layout and written into
the parameter's per-device shards, and its pages are released before the next is read. So no
process ever holds the full model, nor any tensor twice: besides the stage's own parameters, a
load holds one chunk (on the CPU backend the filled shard buffers become the device buffers). On float32
CPU stages the dense weights are written straight into panels (``panels.Panels``), chunk by chunk, too.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh

from pipejax.pp_utils import logical_sharding
from pipejax.runner.config import ModelConfig, StageConfig
from pipejax.runner.errors import CheckpointError
from pipejax.runner.model import (
    LAYER_PREFIX,
    ParamSpec,
    kv_heads_for_tp,
    layer_kinds,
    layer_rows,
    panel_spec,
    param_specs,
    stage_rules,
)
from pipejax.runner.panels import (
    DENSE_WEIGHTS,
    EXPERT_WEIGHTS,
    PANEL,
    PANEL_LAYOUTS,
    Panels,
    QuantizedPanels,
    own_order,
    panel_shape,
)
from pipejax.runner.quantized import (
    ON_THE_FLY,
    ON_THE_FLY_VOCABULARY,
    VOCABULARY_WEIGHTS,
    Format,
    Quantized,
    quantize_rows,
)
from pipejax.runner.safetensors_file import SafetensorsIndex

__all__ = ["CheckpointError", "SafetensorsIndex", "load_stage_params", "open_checkpoint"]

log = logging.getLogger(__name__)


# A converter turns rows [r0, r1) of a checkpoint tensor into (where they go in the runner's
# parameter, as slices of its dimensions after the stacked-layer one; their values).
Converter = Callable[[np.ndarray, int, int], tuple[tuple[slice, ...], np.ndarray]]


def _panel_rows(n: int) -> int:
    """Rows per chunk unit of an HF tensor whose rows become a weight's last output dim: whole panels
    (``panels.PANEL``) where they can be, so that a chunk lands on whole panels."""
    return PANEL if n % PANEL == 0 else 1


# Where a runner parameter's values come from: (HF name template, HF shape, rows per unit, rows of HF -> runner layout).
Source = tuple[str, tuple[int, ...], int, Converter]


def _hf_layer_tensors(cfg: ModelConfig, tp: int, kinds: tuple[bool, ...]) -> dict[str, tuple[Source, ...]]:
    """Runner param name -> the HF tensors it is made of (``qkv`` of three, ``gate_up`` of two).

    HF tensors are read in chunks of whole units along their first axis (one attention head's rows,
    or one KV group's query heads, for the head-shaped projections), so a chunk's place in the runner
    layout is a block.
    """
    E, F, H, D, K0 = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.head_dim, cfg.num_kv_heads
    K = kv_heads_for_tp(cfg, tp)
    G, repeat = H // K, K // K0
    whole = 1 << 62  # 1-D tensors (norms, biases) are read in one piece

    # Converters leave the contracted size to ``w`` (-1): a quantized weight's parts go through them too, with
    # fewer columns (packed nibbles, one scale per block).
    def query_groups(w, r0, r1):  # [n*G*D, E] -> [E, n, G, D]: KV groups' query heads, slots [0, G)
        n = (r1 - r0) // (G * D)
        return (slice(None), slice(r0 // (G * D), r0 // (G * D) + n), slice(0, G)), w.T.reshape(-1, n, G, D)

    def kv_slot(slot: int) -> Converter:  # [n*D, E] -> [E, n*repeat, 1, D] in a group's slot G (key) or G + 1
        def convert(w, r0, r1):
            heads = np.repeat(w.T.reshape(-1, (r1 - r0) // D, 1, D), repeat, axis=1)
            return (slice(None), slice(r0 // D * repeat, r1 // D * repeat), slice(slot, slot + 1)), heads

        return convert

    def half(c: int) -> Converter:  # [rows of F, E] -> [E, 1, rows]: gate (c = 0) or up (c = 1)
        return lambda w, r0, r1: ((slice(None), slice(c, c + 1), slice(r0, r1)), w.T[:, None, :])

    def bias(n: int, rep: int = 1) -> Converter:  # [n*D] -> [n*rep, D]
        return lambda b, r0, r1: ((), np.repeat(b.reshape(n, D), rep, axis=0))

    def same(w, r0, r1):
        return (), w

    def transpose(w, r0, r1):  # [out, in] -> [in, out]
        return (slice(None), slice(r0, r1)), w.T

    def o_proj(w, r0, r1):  # [E, H*D] -> [H, D, E]
        return (slice(None), slice(None), slice(r0, r1)), w.T.reshape(H, -1, r1 - r0)

    attn, mlp = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    e_rows, f_rows = _panel_rows(E), _panel_rows(F)  # chunks of whole panels of a weight's output columns
    table = {
        "input_norm": (("model.layers.{i}.input_layernorm.weight", (E,), whole, same),),
        "qkv": (
            (attn + "q_proj.weight", (H * D, E), G * D, query_groups),
            (attn + "k_proj.weight", (K0 * D, E), D, kv_slot(G)),
            (attn + "v_proj.weight", (K0 * D, E), D, kv_slot(G + 1)),
        ),
        "o": ((attn + "o_proj.weight", (E, H * D), e_rows, o_proj),),
        "post_norm": (("model.layers.{i}.post_attention_layernorm.weight", (E,), whole, same),),
        "gate_up": ((mlp + "gate_proj.weight", (F, E), f_rows, half(0)),
                    (mlp + "up_proj.weight", (F, E), f_rows, half(1))),
        "down": ((mlp + "down_proj.weight", (E, F), e_rows, transpose),),
    }
    if cfg.qkv_bias:
        table["q_bias"] = ((attn + "q_proj.bias", (H * D,), whole, bias(H)),)
        table["k_bias"] = ((attn + "k_proj.bias", (K0 * D,), whole, bias(K0, repeat)),)
        table["v_bias"] = ((attn + "v_proj.bias", (K0 * D,), whole, bias(K0, repeat)),)
    if cfg.qk_norm:
        table["q_norm"] = ((attn + "q_norm.weight", (D,), whole, same),)
        table["k_norm"] = ((attn + "k_norm.weight", (D,), whole, same),)
    if all(kinds):  # ``kinds``: per layer of the stage, whether its MLP is a MoE
        del table["gate_up"], table["down"]
    if any(kinds):
        table |= _hf_moe_tensors(cfg, half, transpose, whole)
    return table


def _hf_moe_tensors(cfg: ModelConfig, half, transpose, whole: int) -> dict[str, tuple[Source, ...]]:
    """The MoE MLP's weights (``moe.moe_param_shapes``) from transformers' per-expert tensors: Mixtral's
    ``block_sparse_moe.experts.{e}.w1/w3/w2``, Qwen's ``mlp.experts.{e}.gate_proj/up_proj/down_proj``."""
    moe, E = cfg.moe, cfg.hidden_size
    X, Fm, Fs = moe.num_experts, moe.intermediate_size, moe.shared_expert_size
    if cfg.architecture == "MixtralForCausalLM":
        block, gate, up, down = "model.layers.{i}.block_sparse_moe.", "w1", "w3", "w2"
    else:
        block, gate, up, down = "model.layers.{i}.mlp.", "gate_proj", "up_proj", "down_proj"

    def expert_half(e: int, c: int) -> Converter:  # [rows of Fm, E] -> [E, expert e, gate or up, rows]
        return lambda w, r0, r1: ((slice(None), slice(e, e + 1), slice(c, c + 1), slice(r0, r1)), w.T[:, None, None])

    def expert_down(e: int) -> Converter:  # [rows of E, Fm] -> expert e's [Fm, rows]
        return lambda w, r0, r1: ((slice(e, e + 1), slice(None), slice(r0, r1)), w.T[None])

    expert = block + "experts.{e}."
    table = {
        "router": ((block + "gate.weight", (X, E), whole, transpose),),
        "experts_gate_up": tuple((expert.replace("{e}", str(e)) + f"{name}.weight", (Fm, E), whole, expert_half(e, c))
                                 for e in range(X) for c, name in enumerate((gate, up))),
        "experts_down": tuple((expert.replace("{e}", str(e)) + f"{down}.weight", (E, Fm), whole, expert_down(e))
                              for e in range(X)),
    }
    if Fs:
        shared = block + "shared_expert."
        table["shared_gate_up"] = ((shared + "gate_proj.weight", (Fs, E), whole, half(0)),
                                   (shared + "up_proj.weight", (Fs, E), whole, half(1)))
        table["shared_down"] = ((shared + "down_proj.weight", (E, Fs), whole, transpose),)
        table["shared_gate"] = ((block + "shared_expert_gate.weight", (1, E), whole, lambda w, r0, r1: ((), w[0])),)
    return table


# The most bytes of a checkpoint tensor that loading reads (and converts) at a time: the transient
# memory of loading a stage, besides the stage's own parameters, is about twice this.
CHUNK_BYTES = 4 << 20

# A piece of a runner parameter: (where, as one slice per dimension; its values: one array, or for a weight kept
# quantized its parts (``quantized.Quantized``'s q, scale and offset), all placed by the same slices).
Piece = tuple[tuple[slice, ...], np.ndarray | tuple[np.ndarray, ...]]

# One checkpoint tensor of a runner parameter: (HF name, HF shape, rows per unit, converter, where its layer goes).
Read = tuple[str, tuple[int, ...], int, Converter, tuple[slice, ...]]


def _chunks(ckpt: SafetensorsIndex, read: Read, fmt: Format | None = None, block: int = 0) -> Iterator[Piece]:
    """A checkpoint tensor in chunks of whole ``unit`` rows, each converted and placed after ``prefix``. ``fmt``:
    as the parts of a weight kept quantized, in blocks of ``block`` elements of a row (a GGUF tensor in ``fmt``
    as the file stores it, anything else quantized here).

    Each chunk's pages are released once the caller has copied it (when asked for the next).
    """
    hf_name, hf_shape, unit, convert, prefix = read
    tensor = ckpt.read(hf_name, hf_shape)
    rows = hf_shape[0]
    row_bytes = max(1, tensor.nbytes // max(1, rows))
    step = rows if unit >= rows else max(unit, CHUNK_BYTES // row_bytes // unit * unit)
    stored = fmt is not None and getattr(tensor, "format", None) == fmt  # GGUF blocks taken as they are
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        if fmt is None:
            where, values = convert(tensor[r0:r1], r0, r1)
        else:
            parts = tensor.blocks(slice(r0, r1)) if stored else _quantized(tensor[r0:r1], fmt, block)
            converted = [convert(part, r0, r1) for part in parts if part is not None]
            where, values = converted[0][0], tuple(v for _, v in converted)
        yield (*prefix, *where), values
        ckpt.release(hf_name, (r0, r1))


def _quantized(rows: np.ndarray, fmt: Format, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Checkpoint rows [r, n] quantized (``quantize_rows``) with a scale per ``block`` elements of a row, or for a
    format of a scale per output channel (int8) one per row, repeated for each block of ``block`` (the attention
    output's [H, D, E] blocks its D: a row's scale once per head)."""
    if fmt.block:
        return quantize_rows(rows, fmt, block)
    q, scale, offset = quantize_rows(rows, fmt, rows.shape[1])
    return q, np.repeat(scale, rows.shape[1] // block, axis=1), offset


def _host_params(ckpt: SafetensorsIndex, cfg: ModelConfig, stage: StageConfig, tp: int
                 ) -> Iterator[tuple[str, list[Read]]]:
    """Yield (runner name, the checkpoint tensors it is made of), one parameter at a time, largest first.

    Their chunks (``_chunks``) cover the parameter exactly once. They may be views into the mapped files; the
    caller copies each before asking for the next one (its pages are released then).
    """
    V, E = cfg.vocab_size, cfg.hidden_size

    def rows(w, r0, r1):
        return (slice(r0, r1),), w

    def columns(w, r0, r1):  # [V, E] rows -> [E, V] columns
        return (slice(None), slice(r0, r1)), w.T

    if stage.has_embedding(cfg):
        yield "embed", [("model.embed_tokens.weight", (V, E), 1, rows, ())]
    if stage.is_last and not cfg.tie_word_embeddings:
        yield "lm_head", [("lm_head.weight", (V, E), _panel_rows(V), columns, ())]
    layers = stage.layer_range(cfg)
    for name, sources in _hf_layer_tensors(cfg, tp, layer_kinds(cfg, stage)).items():
        # row r of a stacked weight: its r-th layer (of its kind, for a MLP's: ``model.layer_rows``)
        yield f"layers.{name}", [(template.format(i=layers[i]), hf_shape, unit, convert, (slice(r, r + 1),))
                                 for r, i in enumerate(layer_rows(cfg, stage, name))
                                 for template, hf_shape, unit, convert in sources]
    if stage.is_last:
        yield "final_norm", [("model.norm.weight", (E,), E, lambda w, r0, r1: ((), w), ())]


def _page_aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised host array starting on a page boundary.

    The CPU backend adopts such an array as the device buffer instead of copying it (it needs
    64-byte alignment; numpy gives 16), so on CPU a parameter is never held twice.
    """
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + mmap.PAGESIZE, np.uint8)
    offset = -raw.ctypes.data % mmap.PAGESIZE
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


def _bounds(where: tuple[slice, ...], shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """[start, stop) per dimension of ``where`` (missing trailing dimensions are whole)."""
    return [(where[d] if d < len(where) else slice(None)).indices(n)[:2] for d, n in enumerate(shape)]


def _logical_view(panels: np.ndarray, lead: int, contracted: int) -> np.ndarray:
    """``panels`` (shaped as ``panels.panel_shape`` says) viewed in the weight's own layout with its last dim split
    in panels (``panels.own_order``), so that a piece of the weight is written where it belongs."""
    return panels.transpose(own_order(panels.ndim, lead, contracted))


class Target(NamedTuple):
    """A runner array that pieces are placed into: its shape, dtype and sharding, and ``panels``: (lead dims,
    contracted dims, the panel layout's sharding) of a dense weight to store in panels (``panels.Panels``), each
    shard filled straight into that layout."""

    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: Any
    panels: tuple[int, int, Any] | None = None


def _place(name: str, pieces: Iterator[Piece], targets: list[Target]) -> list[jax.Array]:
    """Assemble arrays on their devices from ``pieces`` (each piece's values: one per target, a lone array for one
    target), one piece in flight at a time.

    Each device's shard is filled in a host buffer and then handed to the device: on CPU that buffer becomes the
    device buffer (no copy), elsewhere it is copied and dropped.
    """
    fills = [_Fill(name, t) for t in targets]
    for where, values in pieces:
        for fill, part in zip(fills, (values,) if len(fills) == 1 else values, strict=True):
            fill.write(where, part)
        del values  # the chunk can go before the next one is read
    return [fill.array() for fill in fills]


class _Fill:
    """One target's per-device host buffers, filled piece by piece."""

    def __init__(self, name: str, target: Target):
        self.name, self.target = name, target
        shape = target.shape
        indices = target.sharding.addressable_devices_indices_map(shape)
        self.shards = {device: _bounds(index, shape) for device, index in indices.items()}
        local = {device: tuple(b - a for a, b in box) for device, box in self.shards.items()}
        if target.panels is None:
            self.buffers = {device: _page_aligned_empty(s, target.dtype) for device, s in local.items()}
            self.targets = self.buffers
        else:
            lead, contracted, _ = target.panels
            self.buffers = {device: _page_aligned_empty(panel_shape(s, lead, contracted), target.dtype)
                            for device, s in local.items()}
            self.targets = {device: _logical_view(b, lead, contracted) for device, b in self.buffers.items()}
        self.filled = dict.fromkeys(self.shards, 0)

    def write(self, where: tuple[slice, ...], values: np.ndarray) -> None:
        piece = _bounds(where, self.target.shape)
        values = values.reshape([b - a for a, b in piece])
        for device, box in self.shards.items():
            common = [(max(p0, s0), min(p1, s1)) for (p0, p1), (s0, s1) in zip(piece, box, strict=True)]
            if any(lo >= hi for lo, hi in common):
                continue
            into_shard = tuple(slice(lo - s0, hi - s0) for (lo, hi), (s0, _) in zip(common, box, strict=True))
            into_piece = tuple(slice(lo - p0, hi - p0) for (lo, hi), (p0, _) in zip(common, piece, strict=True))
            part = values[into_piece]
            if self.target.panels is not None:  # the last dim in whole panels (chunks and shards cut on panel bounds)
                lo, hi = into_shard[-1].start, into_shard[-1].stop
                assert lo % PANEL == 0 and hi % PANEL == 0, (self.name, lo, hi)
                into_shard = (*into_shard[:-1], slice(lo // PANEL, hi // PANEL))
                part = part.reshape(*part.shape[:-1], -1, PANEL)
            self.targets[device][into_shard] = part
            self.filled[device] += int(np.prod([hi - lo for lo, hi in common]))

    def array(self) -> jax.Array:
        for device, buffer in self.buffers.items():  # every element written (the buffers start uninitialised)
            assert self.filled[device] == buffer.size, (self.name, device, self.filled[device], buffer.size)
        arrays = [jax.device_put(buffer, device, may_alias=True) for device, buffer in self.buffers.items()]
        del self.buffers, self.targets
        shape, sharding = self.target.shape, self.target.sharding
        if self.target.panels is not None:
            shape, sharding = panel_shape(shape, *self.target.panels[:2]), self.target.panels[2]
        out = jax.make_array_from_single_device_arrays(shape, sharding, arrays)
        out.block_until_ready()
        return out


def open_checkpoint(path: str | Path) -> SafetensorsIndex:
    """The checkpoint at ``path`` by Hugging Face tensor names: safetensors, or a GGUF file (``GGUFIndex``,
    the same interface: tensors in Hugging Face layout, read by rows, dequantized)."""
    from pipejax.runner import gguf_file

    return gguf_file.GGUFIndex(path) if gguf_file.find_gguf(path) is not None else SafetensorsIndex(path)


def _panels_for(name: str, spec, sharding, mesh: Mesh, rules) -> tuple[int, int, Any] | None:
    """How ``name`` is stored in panels on ``mesh`` (``_place``'s ``panels``), or None to keep its own layout: a
    dense weight whose last dim, in every shard, is whole panels."""
    if name not in PANEL_LAYOUTS:
        return None
    lead, contracted = PANEL_LAYOUTS[name]
    if name in EXPERT_WEIGHTS and spec.shape[lead] % PANEL:
        return None
    packed = panel_spec(spec, lead, contracted)
    boxes = sharding.devices_indices_map(tuple(spec.shape)).values()
    if packed is None or any(_bounds(box, tuple(spec.shape))[-1][0] % PANEL for box in boxes):
        return None
    return lead, contracted, logical_sharding(mesh, packed.logical_axes, rules)


def use_panels(mesh: Mesh, cfg: ModelConfig) -> bool:
    """Whether a stage on ``mesh`` stores its dense weights in panels by default: where the CPU dense kernel
    runs its matmuls, on one CPU device in float32. (XLA's dot reads panels far slower at a decode step's rows:
    with tp > 1, where XLA's sharded dots run, the weights keep their own layout.)"""
    return mesh.devices.size == 1 and mesh.devices.flat[0].platform == "cpu" and cfg.dtype == "float32"


# The weights a stage can keep quantized: the dense projections, the LM head, and the embedding (dequantized by
# the rows it looks up). Norms, biases, a MoE's router and experts stay in float.
QUANTIZABLE = (*DENSE_WEIGHTS, "embed")


def _blocked_axis(name: str, ndim: int) -> int:
    """The axis a quantized weight's blocks run along, counted from the end: its last contracted one (the
    embedding's E, which the tied LM head contracts)."""
    if name == "embed":
        return -1
    lead = 1 if name.startswith(LAYER_PREFIX) else 0
    return -(ndim - lead - DENSE_WEIGHTS[name] + 1)


def _format(ckpt: SafetensorsIndex, name: str, reads: list[Read], quantization: str | None) -> Format | None:
    """The format ``name`` is kept in, or None for float. ``"gguf"``: the file's own where every tensor of the
    parameter (all its layers, q/k/v or gate/up alike) has one format pipejax keeps; float otherwise."""
    if quantization is None or name not in QUANTIZABLE:
        return None
    if quantization in ON_THE_FLY:
        return (ON_THE_FLY_VOCABULARY if name in VOCABULARY_WEIGHTS else ON_THE_FLY)[quantization]
    formats = {getattr(ckpt.read(hf_name, hf_shape), "format", None) for hf_name, hf_shape, *_ in reads}
    if len(formats) == 1 and None not in formats:
        return formats.pop()
    log.info("%s stays in float: its GGUF tensors are %s", name, sorted(str(f and f.name) for f in formats))
    return None


def _quantized_targets(name: str, spec, fmt: Format, sharding, mesh: Mesh, rules, panels: bool
                       ) -> tuple[list[Target], int]:
    """Where a weight kept in ``fmt`` goes (q, scale and, for Q4_1, offset: ``quantized.Quantized``) and its
    blocked axis; refused where its contracted axis, or a TP shard of it, is not whole blocks. ``panels``: each part
    in panels where the weight can be (``panels.QuantizedPanels``)."""
    axis, shape = _blocked_axis(name, len(spec.shape)), tuple(spec.shape)
    n = shape[axis]
    block = fmt.block_of(n)
    if n % block:
        raise CheckpointError(f"{name} ({list(shape)}) has {n} elements along its contracted axis, which is not "
                              f"whole blocks of {block} for {fmt.name}; use --quantization int8 (a scale per "
                              f"output channel) or float weights")
    shard = sharding.shard_shape(shape)[axis]
    if shard % block and block < n:  # (one scale for the whole axis is on every shard of it)
        tp = mesh.shape["tp"]
        raise CheckpointError(f"tensor_parallel_size={tp} splits {name}'s contracted axis of {n} into shards of "
                              f"{shard}, which cuts its {fmt.name} blocks of {block}; use a tp that divides "
                              f"{n // block} (its blocks), or --quantization int8")
    q_shape, s_shape, s_axes = list(shape), list(shape), list(spec.logical_axes)
    q_shape[axis], s_shape[axis] = n * fmt.bits // 8, n // block
    if n // block == 1:  # a scale per output channel: the same on every shard of the contracted axis
        s_axes[axis] = None
    parts = [(ParamSpec(tuple(q_shape), spec.logical_axes), fmt.dtype),
             (ParamSpec(tuple(s_shape), tuple(s_axes)), np.dtype(np.float32))]
    parts += parts[1:] if fmt.offset else []
    targets = []
    for part, dtype in parts:
        part_sharding = logical_sharding(mesh, part.logical_axes, rules)
        layout = _panels_for(name, part, part_sharding, mesh, rules) if panels else None
        targets.append(Target(part.shape, dtype, part_sharding, layout))
    if any(t.panels is None for t in targets):  # all in panels or none
        targets = [t._replace(panels=None) for t in targets]
    return targets, axis


def _tied_head(name: str, spec, cfg: ModelConfig) -> bool:
    """Whether ``name`` is a tied embedding that can be stored as the LM head's panels (its vocabulary whole panels):
    then the head's matmul runs on the CPU kernels, and the embedding's lookup reads the panels' columns."""
    return name == "embed" and cfg.tie_word_embeddings and spec.shape[0] % PANEL == 0


def _as_head(spec, reads: list[Read]) -> tuple[ParamSpec, list[Read]]:
    """The embedding [V, E] as the LM head [E, V]: its spec, and its reads with rows placed as columns."""
    V, E = spec.shape
    return ParamSpec((E, V), ("embed", "vocab")), [
        (hf_name, hf_shape, _panel_rows(V), lambda w, r0, r1: ((slice(None), slice(r0, r1)), w.T), prefix)
        for hf_name, hf_shape, _, _, prefix in reads]


def _load_quantized(ckpt: SafetensorsIndex, name: str, reads: list[Read], spec, fmt: Format, mesh: Mesh, rules,
                    cfg: ModelConfig, panels: bool) -> Quantized | QuantizedPanels:
    """Parameter ``name`` kept in ``fmt``: in panels where ``panels`` (a tied embedding as the LM head's: [E, V],
    its rows read as columns), else as ``quantized.Quantized``."""
    layout_of = name
    if panels and _tied_head(name, spec, cfg):
        layout_of, spec, reads = "lm_head", *_as_head(spec, reads)
    sharding = logical_sharding(mesh, spec.logical_axes, rules)
    targets, axis = _quantized_targets(layout_of, spec, fmt, sharding, mesh, rules, panels)
    block = fmt.block_of(spec.shape[axis])
    parts = _place(name, (p for read in reads for p in _chunks(ckpt, read, fmt, block)), targets)
    offset = parts[2] if fmt.offset else None
    if targets[0].panels is not None:
        return QuantizedPanels(parts[0], parts[1], offset, fmt)
    return Quantized(parts[0], parts[1], offset, fmt, axis)


def load_stage_params(
    path: str | Path, cfg: ModelConfig, stage: StageConfig, mesh: Mesh, panels: bool | None = None
) -> dict[str, jax.Array | Panels | Quantized]:
    """The stage's parameters as arrays sharded on ``mesh`` (its "tp" axis). ``panels``: store the dense
    weights in panels (``panels.Panels``); None: where ``use_panels`` says so. With ``cfg.quantization``, the
    weights ``QUANTIZABLE`` names are kept quantized (``quantized.Quantized``), in panels wherever ``use_panels``
    says (``panels.QuantizedPanels``, for the CPU quantized kernel: XLA's alternative writes each layer's float
    weight out at every step). Where the weights are in panels, a tied embedding is kept as the LM head's."""
    tp = mesh.shape["tp"]
    specs, rules = param_specs(cfg, stage, tp), stage_rules(cfg, stage, tp)
    dtype = np.dtype(ml_dtypes.bfloat16) if cfg.dtype == "bfloat16" else np.dtype(cfg.dtype)
    quantized_panels = use_panels(mesh, cfg)
    panels = quantized_panels if panels is None else panels
    params = {}
    with open_checkpoint(path) as ckpt:
        for name, reads in _host_params(ckpt, cfg, stage, tp):
            spec = specs[name]
            sharding = logical_sharding(mesh, spec.logical_axes, rules)
            if (fmt := _format(ckpt, name, reads, cfg.quantization)) is not None:
                params[name] = _load_quantized(ckpt, name, reads, spec, fmt, mesh, rules, cfg, quantized_panels)
                continue
            layout_of = name
            if panels and _tied_head(name, spec, cfg):  # kept as the LM head's panels [V / PANEL, E, PANEL]
                layout_of, spec, reads = "lm_head", *_as_head(spec, reads)
                sharding = logical_sharding(mesh, spec.logical_axes, rules)
            layout = _panels_for(layout_of, spec, sharding, mesh, rules) if panels else None
            assert layout is not None or layout_of == name, "a tied embedding laid out as the head, not in panels"
            pieces = (p for read in reads for p in _chunks(ckpt, read))
            (params[name],) = _place(name, pieces, [Target(tuple(spec.shape), dtype, sharding, layout)])
            if layout is not None:
                params[name] = Panels(params[name])
    missing = set(specs) - set(params)
    assert not missing, missing
    log.info(
        "stage %d/%d loaded layers %s (%d tensors) from %s",
        stage.pp_rank,
        stage.pp_size,
        stage.layer_range(cfg),
        len(params),
        path,
    )
    return params
