"""Models from a GGUF file (llama.cpp's format): config, tensors and tokenizer.

A GGUF file holds the whole model: metadata (hyper-parameters, the tokenizer's vocabulary and
merges, the chat template) and tensors, many of them quantized in blocks. ``GGUFIndex`` gives the
loader in ``checkpoint.py`` the same view a safetensors checkpoint gives it — tensors by their
Hugging Face names, in Hugging Face layout — so a stage reads only its own tensors, in chunks of
rows, each chunk dequantized (with the ``gguf`` package) and its pages of the mapped file handed
back before the next is read.

The architectures it loads and llama.cpp's conventions for each (names, the Q/K row order of its
RoPE, Mixture-of-Experts weights stacked in 3-D tensors) are in ``gguf_architectures.py``; here GGUF
lists a tensor's dimensions innermost first (``[in, out]`` for an ``[out, in]`` weight), and one
expert of a 3-D experts tensor is read as a tensor of its own (a contiguous block of rows).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import mmap
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

from pipejax.runner.errors import GGUFError
from pipejax.runner.gguf_architectures import Architecture, architecture, hf_config
from pipejax.runner.quantized import BLOCK as QBLOCK
from pipejax.runner.quantized import Q4_0, Q4_1, Q8_0, Format

log = logging.getLogger(__name__)

# The types pipejax dequantizes (each row of a 2-D tensor is whole blocks, so rows read alone).
SUPPORTED_TYPES = (QType.F32, QType.F16, QType.BF16, QType.Q4_0, QType.Q4_1, QType.Q8_0)
# Those a stage can also keep as they are (``--quantization gguf``): their ``quantized`` formats.
GGUF_FORMATS = {QType.Q8_0: Q8_0, QType.Q4_0: Q4_0, QType.Q4_1: Q4_1}


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: a ``.gguf`` file, or a folder holding one and no safetensors (with or without
    a config.json: ``gguf_folder`` makes such folders for hosts that read config and tokenizer themselves)."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir() or any(path.glob("*.safetensors")):
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(f.name for f in found)
        raise ValueError(f"{str(path)!r} holds several GGUF files ({names}); pass the one to load as --model")
    return found[0] if found else None


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: innermost first ([in, out] for an [out, in] weight)
    qtype: QType | int  # an int when the gguf package does not know the type
    data_offset: int  # from the start of the file
    n_bytes: int


# GGUF metadata value types -> struct format (8: string, 9: array are read apart).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class _Header:
    """The header of a GGUF file: metadata and tensor table, parsed with ``struct`` (the gguf package's
    reader builds a numpy view per token string, seconds for a 49k-token vocabulary; this takes ~0.1 s)."""

    def __init__(self, data: bytes | mmap.mmap, file_size: int):
        self.data, self.pos = data, 0
        if self._take("<I") != gguf.GGUF_MAGIC:
            raise ValueError("no GGUF magic number")
        version, tensor_count, kv_count = self._take("<I"), self._take("<Q"), self._take("<Q")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (pipejax reads 2 and 3)")
        self.fields = {}
        for _ in range(kv_count):
            key = self._string()
            self.fields[key] = self._value(self._take("<I"))
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            dims = tuple(self._take("<Q") for _ in range(self._take("<I")))
            infos.append((name, dims, self._take("<I"), self._take("<Q")))
        alignment = int(self.fields.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
        data_start = -(-self.pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, type_id, offset in infos:
            qtype = QType(type_id) if type_id in QType._value2member_map_ else type_id
            n_bytes = 0
            if qtype in gguf.GGML_QUANT_SIZES:
                block, size = gguf.GGML_QUANT_SIZES[qtype]
                n_bytes = int(np.prod(dims, dtype=np.int64)) // block * size
            self.tensors[name] = TensorInfo(name, dims, qtype, data_start + offset, n_bytes)

    def _take(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._take("<Q")
        self.pos += n
        return bytes(self.data[self.pos - n : self.pos]).decode("utf-8", errors="replace")

    def _value(self, kind: int):
        if kind == 8:
            return self._string()
        if kind == 9:
            item, n = self._take("<I"), self._take("<Q")
            if item in _SCALARS:  # a numeric array in one read
                fmt = f"<{n}{_SCALARS[item]}"
                values = list(struct.unpack_from(fmt, self.data, self.pos))
                self.pos += struct.calcsize(fmt)
                return values
            return [self._value(item) for _ in range(n)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata value type {kind}")
        return self._take("<" + _SCALARS[kind])


@functools.lru_cache(maxsize=4)
def _read_header(path: Path, mtime_ns: int, size: int) -> _Header:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        try:
            header = _Header(mapped, size)
        except (ValueError, struct.error, UnicodeDecodeError) as exc:  # a cut-off or foreign file
            raise GGUFError(
                f"{str(path)!r} ({size} bytes) is not a readable GGUF file ({exc}); is it truncated? download it again"
            ) from exc
        header.data = None  # parsed: drop the reference to the map
    for t in header.tensors.values():
        if t.data_offset + t.n_bytes > size:
            raise GGUFError(
                f"{str(path)!r} is truncated: tensor {t.name!r} ends at byte {t.data_offset + t.n_bytes} "
                f"but the file has {size} bytes; download it again"
            )
    return header


def open_reader(path: str | Path) -> _Header:
    """The file's metadata and tensor table (parsed once per process; the tensor data stays on disk)."""
    path = Path(path).resolve()
    stat = path.stat()
    return _read_header(path, stat.st_mtime_ns, stat.st_size)


class GGUFTensor:
    """A tensor of the file in Hugging Face layout, read and dequantized by rows: ``tensor[r0:r1]``."""

    def __init__(self, raw: np.ndarray, qtype: QType, shape: tuple[int, ...], rope_heads: int | None):
        self.raw = raw  # [rows, bytes per row] (a 1-D tensor is one row of raw bytes)
        self.qtype = qtype
        self.shape = shape
        self.rope_heads = rope_heads  # Q/K: the head count whose rows llama.cpp interleaved
        self.nbytes = int(np.prod(shape)) * 4  # dequantized (float32) size, which sets the chunk size

    @property
    def format(self) -> Format | None:
        """The quantized format its blocks are in (``quantized.Format``), or None for a float tensor."""
        return GGUF_FORMATS.get(self.qtype)

    def __getitem__(self, rows: slice) -> np.ndarray:
        r0, r1, _ = rows.indices(self.shape[0])
        if len(self.shape) == 1:
            return gguf.quants.dequantize(self.raw, self.qtype).reshape(-1)[r0:r1]
        values = gguf.quants.dequantize(self.raw[r0:r1], self.qtype).reshape(r1 - r0, *self.shape[1:])
        return self._unpermuted(values, r0, r1)

    def blocks(self, rows: slice) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Rows of a quantized 2-D tensor as they are stored, repacked with no float round trip: (q [r, n] (4-bit:
        [r, n / 2], nibbles as the file packs them), scale [r, n / 32], offset or None), as ``quantized`` holds
        a weight."""
        r0, r1, _ = rows.indices(self.shape[0])
        fmt, n = self.format, self.shape[-1]
        assert fmt is not None and len(self.shape) == 2, (self.qtype, self.shape)
        blocks = self.raw[r0:r1].reshape(r1 - r0, n // QBLOCK, -1)  # [r, blocks, bytes of a block]

        def halves(at: int) -> np.ndarray:  # the float16 at byte ``at`` of every block, as float32 [r, blocks]
            return np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32)

        data_at = 4 if fmt.offset else 2  # Q4_1: scale, minimum, nibbles; Q8_0 and Q4_0: scale, values
        q = np.ascontiguousarray(blocks[..., data_at:]).view(fmt.dtype).reshape(r1 - r0, -1)
        parts = (q, halves(0), halves(2) if fmt.offset else None)
        return tuple(None if p is None else self._unpermuted(p, r0, r1) for p in parts)

    def _unpermuted(self, values: np.ndarray, r0: int, r1: int) -> np.ndarray:
        """Rows [r0, r1) of ``values`` (rows first) in Hugging Face order."""
        if self.rope_heads is None:
            return values
        head_dim = self.shape[0] // self.rope_heads
        assert r0 % head_dim == 0 and r1 % head_dim == 0, (r0, r1, head_dim)  # whole heads only
        # llama.cpp stores head rows as pairs (i, D/2 + i); put the two halves back one after the other.
        heads = values.reshape((r1 - r0) // head_dim, head_dim // 2, 2, *values.shape[1:])
        return heads.swapaxes(1, 2).reshape(values.shape)


@dataclasses.dataclass(frozen=True)
class _Span:
    """The bytes of a Hugging Face tensor in the file: a whole GGUF tensor, or one expert's block of rows of a 3-D
    experts tensor (expert outermost, so the block is contiguous and a read of its rows copies nothing else)."""

    offset: int  # from the start of the file
    n_bytes: int
    shape: tuple[int, ...]  # Hugging Face layout


class GGUFIndex:
    """Hugging Face name -> ``GGUFTensor`` over a memory-mapped GGUF file (the loader's checkpoint view)."""

    def __init__(self, path: str | Path):
        self.path = find_gguf(path) or Path(path)
        reader = open_reader(self.path)
        config = hf_config(reader, self.path)
        self.architecture: Architecture = architecture(reader.fields, self.path)
        self.num_heads, self.num_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.num_experts = config.get("num_experts", 0)
        self.tensors = reader.tensors
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def __enter__(self) -> GGUFIndex:
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._map.close()
        except BufferError:  # a caller still holds a view; the map closes when that view is freed
            pass

    def _span(self, hf_name: str) -> _Span:
        place = self.architecture.place(hf_name)
        t = self.tensors[place.name]
        shape = tuple(reversed(t.dims))  # GGUF lists dimensions innermost first
        if place.expert is None:
            return _Span(t.data_offset, t.n_bytes, shape)
        per_expert = t.n_bytes // shape[0]
        return _Span(t.data_offset + place.expert * per_expert, per_expert, shape[1:])

    def read(self, hf_name: str, expected_shape: tuple[int, ...]) -> GGUFTensor:
        place = self.architecture.place(hf_name)
        expected, of = tuple(expected_shape), hf_name
        if place.expert is not None:  # the layer's experts, stacked on the first axis
            expected, of = (self.num_experts, *expected), f"{hf_name}: expert {place.expert} of the stacked experts"
        if place.name not in self.tensors:
            raise GGUFError(
                f"tensor {place.name!r} ({of}, expected shape {list(expected)}) is missing from GGUF file "
                f"{str(self.path)!r}; is the file complete and a llama.cpp {self.architecture.gguf_name!r} model?"
            )
        t = self.tensors[place.name]
        shape = tuple(reversed(t.dims))
        if shape != expected:
            raise GGUFError(
                f"tensor {place.name!r} ({of}) in {self.path.name} has shape {list(shape)} but the metadata implies "
                f"{list(expected)}; the file is inconsistent"
            )
        if t.qtype not in SUPPORTED_TYPES:
            type_name = t.qtype.name if isinstance(t.qtype, QType) else f"{t.qtype} (unknown to the gguf package)"
            raise GGUFError(
                f"tensor {place.name!r} in {self.path.name} has type {type_name}; pipejax dequantizes "
                f"{', '.join(q.name for q in SUPPORTED_TYPES)}; use a file quantized to one of those "
                f"(llama.cpp's llama-quantize) or the Hugging Face checkpoint"
            )
        span = self._span(hf_name)
        rows = span.shape[0] if len(span.shape) > 1 else 1
        raw = np.frombuffer(self._map, np.uint8, span.n_bytes, span.offset).reshape(rows, -1)
        rope_heads = None
        if self.architecture.rope_rows_interleaved:
            heads = {"attn_q.weight": self.num_heads, "attn_k.weight": self.num_kv_heads}
            rope_heads = heads.get(place.name.split(".", 2)[-1])
        return GGUFTensor(raw, t.qtype, span.shape, rope_heads)

    def read_all(self, hf_name: str, expected_shape: tuple[int, ...]) -> np.ndarray:
        """The whole tensor, dequantized to float32, in Hugging Face layout."""
        return self.read(hf_name, expected_shape)[:]

    def release(self, hf_name: str, rows: tuple[int, int] | None = None) -> None:
        """Drop the pages of ``hf_name`` (or of its rows ``[r0, r1)``) from this process."""
        span = self._span(hf_name)
        first, nbytes = span.offset, span.n_bytes
        if rows is not None and len(span.shape) > 1:
            row_bytes = nbytes // span.shape[0]
            first, nbytes = first + rows[0] * row_bytes, (rows[1] - rows[0]) * row_bytes
        start = first // mmap.PAGESIZE * mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, start, max(0, first + nbytes - start))


def check_quantization(reader: _Header, path: Path, quantization: str | None) -> None:
    """Refuse ``--quantization int8/int4`` on a file whose weights are already quantized (naming the first such
    tensor): quantizing dequantized blocks again would only lose more."""
    if quantization in (None, "gguf"):
        return
    stored = next((t for t in reader.tensors.values() if t.qtype not in (QType.F32, QType.F16, QType.BF16)), None)
    if stored is not None:
        kind = stored.qtype.name if isinstance(stored.qtype, QType) else stored.qtype
        raise GGUFError(f"--quantization {quantization} quantizes float weights, but {path.name} is already quantized "
                        f"(tensor {stored.name!r} is {kind}); use --quantization gguf to keep the file's own "
                        f"quantization, or a float (F32/F16/BF16) file")


def _field(reader: _Header, key: str, default=None):
    return reader.fields.get(key, default)


# tokenizer.ggml.pre -> how text is split before byte-level BPE (llama.cpp's pre-tokenizer types).
# "smollm" and its kin split every digit alone, then apply GPT-2's split.
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva")
_GPT2 = ("default", "gpt2", "gpt-2", None)


@dataclasses.dataclass(frozen=True)
class TokenizerParts:
    """What a GGUF file says about its tokenizer; ``tokenizer.Tokenizer.from_pretrained`` assembles it."""

    backend: Any  # a tokenizers.Tokenizer (byte-level BPE), special and added tokens registered
    special_tokens: dict[str, str]  # bos_token, eos_token, unk_token, pad_token: those the file names
    add_special: dict[str, bool]  # add_bos_token, add_eos_token
    eos_token_ids: set[int]  # end of text and end of turn
    bos_token_id: int | None
    chat_template: str | None


def tokenizer_parts(path: str | Path) -> TokenizerParts:
    """The file's tokenizer: byte-level BPE from ``tokenizer.ggml.*``, special tokens, chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    path = find_gguf(path) or Path(path)
    reader = open_reader(path)
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(
            f"GGUF file {str(path)!r} has a {kind!r} tokenizer; pipejax builds byte-level BPE ('gpt2') tokenizers "
            f"from GGUF metadata; give the Hugging Face checkpoint folder (with tokenizer.json) instead"
        )
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    pre = _field(reader, "tokenizer.ggml.pre")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        if pre not in _GPT2:
            log.warning("GGUF pre-tokenizer %r is not known to pipejax; splitting text as GPT-2 does", pre)
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    # 3 = control (e.g. <|im_end|>): matched whole, skipped when decoding; 4 = user-defined: matched whole.
    kinds = list(zip(tokens, types, strict=True))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in kinds if k == 3])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in kinds if k == 4])

    def token(key: str) -> str | None:
        index = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    special = {f"{k}_token": token(k) for k in ("bos", "eos", "unknown", "padding")}
    special = {name.replace("unknown", "unk").replace("padding", "pad"): t for name, t in special.items() if t}
    flags = {f"add_{k}_token": bool(_field(reader, f"tokenizer.ggml.add_{k}_token", False)) for k in ("bos", "eos")}
    eos_ids = {i for i in (_field(reader, "tokenizer.ggml.eos_token_id"), _field(reader, "tokenizer.ggml.eot_token_id"))
               if i is not None}
    bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
    return TokenizerParts(backend, special, flags, eos_ids, bos_id, _field(reader, "tokenizer.chat_template"))
