"""Whether the engine runs in an engine-core process: `JVLLM_ENABLE_V1_MULTIPROCESSING`
(or vLLM's `VLLM_ENABLE_V1_MULTIPROCESSING`), 1 or 0. Imports nothing: `LLM` and the
server ask before anything of the split (msgspec, zmq) is imported."""

from __future__ import annotations

import os

MULTIPROCESSING_ENV = ("JVLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_ENABLE_V1_MULTIPROCESSING")


def multiprocessing_enabled(default: bool) -> bool:
    """The environment's choice (1 or 0; jvllm's name first), else `default`."""
    for name in MULTIPROCESSING_ENV:
        value = os.environ.get(name)
        if value is not None:
            if value not in ("0", "1"):
                raise ValueError(f"{name} must be 0 or 1, got {value!r}")
            return value == "1"
    return default
