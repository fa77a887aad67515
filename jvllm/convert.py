"""`jvllm convert`: load a Hugging Face checkpoint once, save it as an orbax checkpoint.

A converted directory restores with each device reading only its own slices
(`LLM(model=OUT)`), skipping the safetensors parsing and dtype conversion.
"""

from __future__ import annotations

import time
from pathlib import Path

from jvllm.models import orbax_checkpoint
from jvllm.models.loader import _flatten, load_model
from jvllm.models.registry import read_spec
from jvllm.parallel.mesh import make_mesh


def convert(model: str, out: str, tensor_parallel_size: int = 1, dtype: str = "auto") -> float:
    """Converts `model` into `out`; returns the seconds it took."""
    start = time.perf_counter()
    mesh = make_mesh(tensor_parallel_size) if tensor_parallel_size > 1 else None
    loaded = load_model(model, dtype, mesh=mesh)
    flat = dict(_flatten(loaded.params))
    spec = read_spec(loaded.hf_config)
    orbax_checkpoint.save(flat, spec, tensor_parallel_size, loaded.dtype, Path(model), Path(out))
    return time.perf_counter() - start
