"""Start-up resolution of engine settings that depend on the machine or the model.

Owns the attention backend 'auto' resolves to, the compiled-program cache directory
(JAX's persistent cache, configured once per process), the max_model_len a model
allows, and the cpu_offload_gb check. `EngineArgs` (engine_args.py) calls these while it
builds an engine; nothing here builds anything.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax

from jvllm.models.spec import ModelSpec

logger = logging.getLogger("jvllm.engine_args")


def compilation_cache(cache_dir: str | None) -> Path | None:
    """Where compiled programs are kept between starts (see EngineArgs); None: nowhere.

    JAX's persistent compilation cache is there, keeping every program however small or
    quick (a small model's are both): it skips XLA's compile of any program compiled
    before, under any engine configuration. One process also keeps the runner's
    executables there (`ExecutableStore`, EXECUTABLES_DIR), which skips tracing and
    lowering too on a start with the same configuration (not across processes of one
    multi-host program; on CPU devices not the model forwards, which served slower loaded
    from there). A directory the process already configured (a benchmark's) is the one
    used."""
    if cache_dir == "":
        return None
    if cache_dir is None:
        if jax.config.jax_compilation_cache_dir:
            return Path(jax.config.jax_compilation_cache_dir)
        root = os.environ.get("JVLLM_CACHE") or Path.home() / ".cache" / "jvllm"
        cache_dir = str(Path(root) / "xla")
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return Path(cache_dir)


def check_cpu_offload(gib: float) -> None:
    """vLLM's cpu_offload_gb: GiB of weights per device kept in pinned host memory."""
    if not isinstance(gib, int | float) or isinstance(gib, bool) or not 0 <= gib < 1e6:
        raise ValueError(f"cpu_offload_gb must be a number of GiB >= 0, got {gib!r}")


def resolve_backend(backend: str) -> str:
    """'auto' is the Triton kernel on a CUDA GPU (when jax-triton is installed), the C++
    decode kernel on a CPU (when a C++ compiler is on PATH), else the jax.numpy
    reference; 'triton' anywhere but a CUDA GPU, or 'cpu' anywhere but a CPU, is a user
    error."""
    import importlib.util

    from jvllm.kernels import cpu_attention

    platform = jax.devices()[0].platform
    on_cuda = platform in ("gpu", "cuda")
    if backend == "cpu" and platform != "cpu":
        raise ValueError(
            f"attention_backend='cpu' needs JAX on a CPU, but it runs on {platform!r}; use 'auto'"
        )
    if backend == "auto":
        if platform == "cpu":
            return "cpu" if cpu_attention.available() else "reference"
        if not on_cuda:
            return "reference"
        if importlib.util.find_spec("jax_triton") is None:
            logger.warning("jax-triton is not installed: attention_backend='auto' uses 'reference'")
            return "reference"
        return "triton"
    if backend == "triton" and not on_cuda:
        raise ValueError(
            f"attention_backend='triton' needs an NVIDIA GPU, but JAX runs on {platform!r}; "
            "use 'reference' or 'auto'"
        )
    return backend


def resolve_prefix_caching(requested: bool, spec: ModelSpec) -> bool:
    """Prefix caching unless the model's cached keys depend on the request: dynamic NTK
    rope rotates each token by its sequence's length, so a block another request wrote
    holds keys of another rotation."""
    if requested and spec.rope.rope_type == "dynamic":
        logger.info("dynamic rope: cached keys depend on their request's length; no prefix caching")
        return False
    return requested


def resolve_max_model_len(requested: int | None, spec: ModelSpec) -> int:
    # Dynamic NTK stretches the window by its factor (vLLM derives the same limit).
    factor = spec.rope.factor if spec.rope.rope_type == "dynamic" else 1.0
    limit = int(spec.max_position_embeddings * factor)
    if requested is None:
        return limit
    if requested > limit:
        scaled = f" x dynamic rope factor {factor}" if factor != 1.0 else ""
        raise ValueError(
            f"max_model_len={requested} exceeds the model's max_position_embeddings="
            f"{spec.max_position_embeddings}{scaled}"
        )
    return requested
