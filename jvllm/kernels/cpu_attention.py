"""Paged attention on XLA:CPU by a C++ kernel, called as an XLA FFI custom call.

Owns building `cpu/paged_attention.cc` into a shared library (once per machine, with the C++
compiler on PATH, into the jvllm cache directory), registering it as an XLA FFI target,
and `paged_attention`, which has `reference.paged_attention`'s signature and contract.
The kernel reads each row's keys in place through its block table; the jax.numpy
reference has to gather them into copies first (and runs tiny matrix products), which
bounds it on a CPU. Dtypes other than float32 and bfloat16 use the reference. Not the
choice of backend (`jvllm.layers.attention`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.kernels import reference

_SOURCE = Path(__file__).with_name("cpu") / "paged_attention.cc"
_TARGET = "jvllm_paged_attention"
SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16)


def cache_dir() -> Path:
    """Where built kernels live: $JVLLM_CACHE/kernels (default ~/.cache/jvllm/kernels)."""
    root = os.environ.get("JVLLM_CACHE") or Path.home() / ".cache" / "jvllm"
    return Path(root) / "kernels"


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    raise RuntimeError(
        "attention_backend='cpu' builds a C++ kernel, but no C++ compiler is on PATH "
        "(set CXX, or install g++); use attention_backend='reference'"
    )


def _cpu_signature() -> str:
    """What a -march=native build depends on: the processor's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        fields = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
        return "\n".join(sorted(set(fields)))
    except OSError:
        return platform.processor() or platform.machine()


def available() -> bool:
    """Whether the kernel can be built (or is built) here."""
    try:
        _compiler()
    except RuntimeError:
        return False
    return True


@functools.cache
def _library() -> ctypes.CDLL:
    """Builds (at most once per source, compiler and CPU) and loads the kernel library."""
    cxx = _compiler()
    flags = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread"]
    # Reassociation lets the dot products vectorise; no other fast-math licence is taken.
    flags += ["-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-fno-math-errno"]
    key = hashlib.sha256(
        "\0".join([_SOURCE.read_text(), cxx, *flags, _cpu_signature(), jax.__version__]).encode()
    ).hexdigest()[:16]
    out = cache_dir() / f"paged_attention-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        include = ["-I", jax.ffi.include_dir()]
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            partial = Path(tmp) / out.name
            cmd = [cxx, *flags, *include, str(_SOURCE), "-o", str(partial)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode:
                raise RuntimeError(f"building the CPU attention kernel failed:\n{done.stderr}")
            partial.replace(out)  # atomic: a concurrent build never sees half a file
    return ctypes.cdll.LoadLibrary(str(out))


@functools.cache
def register() -> None:
    """Registers the kernel as an XLA FFI target (once a process; builds it first)."""
    handler = jax.ffi.pycapsule(_library().JvllmPagedAttention)
    jax.ffi.register_ffi_target(_TARGET, handler, platform="cpu")


def paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_cache: jax.Array,  # [N, BS, Hkv, D]
    v_cache: jax.Array,  # [N, BS, Hkv, D]
    block_tables: jax.Array,  # [S, W] int32
    seq_lens: jax.Array,  # [S] int32
    query_start_loc: jax.Array,  # [S + 1] int32
    scale: float,
    sliding_window: int | None = None,
    *,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,  # [Hq]
) -> jax.Array:  # [T, Hq, D]
    """`reference.paged_attention`, computed by the C++ kernel."""
    if q.dtype not in SUPPORTED_DTYPES or k_cache.dtype != q.dtype:
        return reference.paged_attention(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            sliding_window,
            soft_cap=soft_cap,
            sinks=sinks,
        )
    register()
    num_heads = q.shape[1]
    # -inf is no sink: the kernel then starts each row's softmax empty.
    sinks = jnp.full((num_heads,), -jnp.inf, jnp.float32) if sinks is None else sinks
    return jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        sinks.astype(jnp.float32).reshape(num_heads),
        scale=np.float32(scale),
        soft_cap=np.float32(soft_cap or 0.0),
        sliding_window=np.int64(sliding_window or 0),
    )
