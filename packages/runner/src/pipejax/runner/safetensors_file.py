"""A Hugging Face safetensors checkpoint, read by tensor name as zero-copy views into memory-mapped files
(``SafetensorsIndex``); ``checkpoint.py`` loads a stage's parameters from it (or from a ``gguf_file.GGUFIndex``,
which reads the same way)."""

from __future__ import annotations

import json
import mmap
from pathlib import Path

import ml_dtypes
import numpy as np

from pipejax.runner.errors import CheckpointError

SAFETENSORS_DTYPES = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype(np.float64),
}


class SafetensorsIndex:
    """Name -> tensor for a single-file or sharded (``model.safetensors.index.json``) checkpoint.

    Tensors are zero-copy views into memory-mapped files (the safetensors layout: an 8-byte
    header length, a JSON header with dtype/shape/offsets, then the raw data). ``release`` hands a
    tensor's pages (or some of its rows' pages) back to the OS once they have been copied, so a
    loading process never holds more of the checkpoint than the chunk it is working on.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index_file = self.path / "model.safetensors.index.json"
        if index_file.is_file():
            files = sorted({self.path / f for f in json.loads(index_file.read_text())["weight_map"].values()})
        else:
            files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"no *.safetensors files in {str(self.path)!r}; pipejax loads Hugging Face safetensors "
                f"checkpoints (convert .bin weights with transformers' save_pretrained)"
            )
        self._maps: list[mmap.mmap] = []
        self.entries: dict[str, tuple[mmap.mmap, str, dict]] = {}
        for file in files:
            with open(file, "rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(header_len))
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps.append(mapped)
            header.pop("__metadata__", None)
            for name, meta in header.items():
                meta["data_start"] = 8 + header_len + meta["data_offsets"][0]
                self.entries[name] = (mapped, file.name, meta)

    def __enter__(self) -> SafetensorsIndex:
        return self

    def __exit__(self, *exc) -> None:
        for mapped in self._maps:
            try:
                mapped.close()
            except BufferError:  # a caller still holds a view; the map closes when that view is freed
                pass
        self._maps.clear()

    def read(self, name: str, expected_shape: tuple[int, ...]) -> np.ndarray:
        """A read-only view of ``name``, checked against ``expected_shape``."""
        if name not in self.entries:
            raise CheckpointError(
                f"tensor {name!r} (expected shape {list(expected_shape)}) is missing from the checkpoint in "
                f"{str(self.path)!r}; is config.json from the same model as the weights?"
            )
        mapped, file_name, meta = self.entries[name]
        shape = tuple(meta["shape"])
        if shape != tuple(expected_shape):
            raise CheckpointError(
                f"tensor {name!r} in {file_name} has shape {list(shape)} but the config implies "
                f"{list(expected_shape)}; is config.json from the same model as the weights?"
            )
        if meta["dtype"] not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"tensor {name!r} has dtype {meta['dtype']}; supported: {sorted(SAFETENSORS_DTYPES)}")
        dtype = SAFETENSORS_DTYPES[meta["dtype"]]
        count = int(np.prod(shape)) if shape else 1
        return np.frombuffer(mapped, dtype, count, meta["data_start"]).reshape(shape)

    def read_all(self, name: str, expected_shape: tuple[int, ...]) -> np.ndarray:
        """The whole tensor (a read-only view)."""
        return self.read(name, expected_shape)

    def release(self, name: str, rows: tuple[int, int] | None = None) -> None:
        """Drop the pages of ``name`` (or of its rows ``[r0, r1)`` along the first axis) from this
        process; they stay in the OS page cache."""
        mapped, _, meta = self.entries[name]
        first = meta["data_start"]
        nbytes = meta["data_offsets"][1] - meta["data_offsets"][0]
        if rows is not None and meta["shape"]:
            row_bytes = nbytes // max(1, meta["shape"][0])
            first, nbytes = first + rows[0] * row_bytes, (rows[1] - rows[0]) * row_bytes
        start = first // mmap.PAGESIZE * mmap.PAGESIZE
        mapped.madvise(mmap.MADV_DONTNEED, start, max(0, first + nbytes - start))
