"""Zero-copy access to the tensors of a Hugging Face safetensors checkpoint.

Owns finding the shard files (one file, several files, or an index json), parsing
their headers, and checking each tensor's bytes are really in the file. Tensors
are memory-mapped views in their stored dtype (bfloat16 through ml_dtypes), so
a caller converts each straight to its target dtype without a float32 detour.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype(np.float64),
    # Quantized checkpoints: packed words, zero points, shapes, float8 weights.
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "BOOL": np.dtype(np.bool_),  # an EAGLE-3 head's t2d mask
}


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


class SafetensorsIndex:
    """Name -> tensor entry across all shards of one checkpoint directory."""

    def __init__(self, model_dir: Path) -> None:
        self.entries: dict[str, TensorEntry] = {}
        self._maps: dict[Path, np.memmap] = {}
        for file in _shard_files(model_dir):
            self.entries.update(_read_header(file))

    def names(self) -> set[str]:
        return set(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def file(self, name: str) -> Path:
        return self.entries[name].file

    def describe(self, name: str, shape: tuple[int, ...]) -> str:
        """How an error names a tensor the model needs in `shape`."""
        return f"{name!r} (shape {shape})"

    def array(self, name: str) -> np.ndarray:
        """A read-only memory-mapped view of one tensor in its stored dtype."""
        e = self.entries[name]
        if e.file not in self._maps:
            self._maps[e.file] = np.memmap(e.file, dtype=np.uint8, mode="r")
        return self._maps[e.file][e.start : e.end].view(e.dtype).reshape(e.shape)


def _shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' object")
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"{index} names shard files that are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files found")
    return files


def _read_header(file: Path) -> dict[str, TensorEntry]:
    size = file.stat().st_size
    with file.open("rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise ValueError(f"{file}: truncated safetensors file (no header)")
        (header_len,) = struct.unpack("<Q", raw)
        if 8 + header_len > size:
            raise ValueError(f"{file}: truncated safetensors file (header runs past the end)")
        try:
            header = json.loads(fh.read(header_len))
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}: corrupt safetensors header ({e.msg})") from None
    base = 8 + header_len
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(
                f"{file}: tensor {name!r} has dtype {info['dtype']}; supported: {sorted(_DTYPES)}"
            )
        dtype = _DTYPES[info["dtype"]]
        start, end = (base + o for o in info["data_offsets"])
        shape = tuple(info["shape"])
        if end > size:
            raise ValueError(
                f"{file}: truncated: tensor {name!r} needs bytes up to {end}, file has {size}"
            )
        if end - start != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise ValueError(f"{file}: tensor {name!r} byte size does not match shape {shape}")
        entries[name] = TensorEntry(file, dtype, shape, start, end)
    return entries
