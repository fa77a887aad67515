"""XLA's GPU allocator, set from `gpu_memory_utilization` before JAX's backend starts.

Owns the environment variables that XLA's Python client reads once, when JAX's backend
starts (`XLA_PYTHON_CLIENT_MEM_FRACTION`, `_PREALLOCATE`, `_ALLOCATOR`); the check
whether that has happened, made without starting it; what an allocator's limit says of
the device's total memory; and the build option that tells XLA:GPU's scheduler how much
memory a program may use where no allocator exists (a compile-only target).

Why the fraction matters twice on a GPU. XLA's client takes `XLA_PYTHON_CLIENT_MEM_FRACTION`
of the device (0.75 unless set), and passes that limit to every compile as the
executable's `device_memory_size`; XLA:GPU's scheduler and rematerialization take it as
the memory a program may use, less its arguments and outputs (`GetSchedulerMemoryLimit`,
which falls back to 80% of the device without it). Setting the fraction to the
utilization makes the allocator, the compiler and the KV-cache sizing use one budget.

Preallocation is left on (XLA's default). The engine fills its share at start-up anyway
(weights, then a KV cache sized to the rest), so claiming it up front costs nothing; it
gives one arena (no growth while warming up, no fragmentation between regions), keeps
other processes from taking memory between the weights loading and the cache being
allocated, and its pool (`memory_stats()["pool_bytes"]`) shows what the driver granted:
XLA takes less, without failing, from a partly used device, and the sizing takes that.
Where another framework shares the device (torch in bench/gpu_check.sh), set
`XLA_PYTHON_CLIENT_PREALLOCATE=false` yourself; jvllm then leaves the allocator alone.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import pkgutil
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax

logger = logging.getLogger(__name__)

FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
PREALLOCATE_ENV = "XLA_PYTHON_CLIENT_PREALLOCATE"
ALLOCATOR_ENV = "XLA_PYTHON_CLIENT_ALLOCATOR"
USER_SETTINGS = (FRACTION_ENV, PREALLOCATE_ENV, ALLOCATOR_ENV)
XLA_DEFAULT_FRACTION = 0.75
_GPU_PLATFORMS = ("cuda", "gpu", "rocm")
# ExecutableBuildOptionsProto.device_memory_size, inside CompileOptionsProto field 3
# (xla/pjrt/proto/compile_options.proto).
_BUILD_OPTIONS_FIELD = 3
_DEVICE_MEMORY_SIZE_FIELD = 15


class AllocatorSetting(NamedTuple):
    how: str  # one of SET, USER, STARTED, NOT_GPU
    message: str


SET, USER, STARTED, NOT_GPU = "set", "user", "started", "not-gpu"
_decided: AllocatorSetting | None = None  # the first decision of this process


def backend_started() -> bool:
    """Whether JAX's backends exist already (asked without starting them)."""
    from jax._src import xla_bridge

    started = getattr(xla_bridge, "backends_are_initialized", None)
    return True if started is None else bool(started())  # unknown: too late to set


def gpu_intended() -> bool:
    """Whether JAX will start a GPU backend: JAX_PLATFORMS names one, or, unset, a CUDA
    or ROCm PJRT plugin is installed."""
    platforms = jax.config.jax_platforms or ""
    if platforms:
        return any(p.strip() in _GPU_PLATFORMS for p in platforms.split(","))
    names = [e.name for e in importlib.metadata.entry_points(group="jax_plugins")]
    try:
        import jax_plugins

        names += [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
    except ImportError:
        pass
    return any(gpu in name for name in names for gpu in ("cuda", "rocm"))


def configure_allocator(utilization: float) -> AllocatorSetting:
    """Sets XLA_PYTHON_CLIENT_MEM_FRACTION to `utilization` where that still counts: a
    GPU backend is intended, it has not started, and none of the allocator's settings
    were given by the user. Changes nothing otherwise (on CPU, nothing at all), and
    never fails: an out-of-range value is left to `CacheConfig` to reject. The first
    decision of a process stands (LLM, `jvllm serve` and the engine all call this)."""
    global _decided
    if _decided is not None:
        return _decided
    if not gpu_intended():
        setting = AllocatorSetting(NOT_GPU, "no GPU platform: XLA's allocator left alone")
    elif backend_started():
        setting = AllocatorSetting(
            STARTED,
            "JAX's backend started before jvllm could set XLA's allocator: the KV cache "
            "takes what that allocator leaves free (docs/gpu_memory.md)",
        )
    elif given := {k: os.environ[k] for k in USER_SETTINGS if k in os.environ}:
        setting = AllocatorSetting(USER, f"XLA's allocator left as set: {given}")
    elif not isinstance(utilization, int | float) or not 0.0 < utilization <= 1.0:
        return AllocatorSetting(NOT_GPU, f"gpu_memory_utilization={utilization!r} not applied")
    else:
        os.environ[FRACTION_ENV] = repr(float(utilization))
        setting = AllocatorSetting(SET, f"{FRACTION_ENV}={utilization} (gpu_memory_utilization)")
    if setting.how != NOT_GPU:
        log = logger.warning if setting.how == STARTED else logger.info
        log("XLA allocator: %s", setting.message)
    _decided = setting
    return setting


def allocator_fraction() -> float:
    """The fraction of device memory XLA's client allocator was given (XLA's default
    where unset or unreadable)."""
    try:
        fraction = float(os.environ.get(FRACTION_ENV, XLA_DEFAULT_FRACTION))
    except ValueError:
        return XLA_DEFAULT_FRACTION
    return fraction if fraction > 0 else XLA_DEFAULT_FRACTION


def preallocated() -> bool:
    """Whether XLA's client claims its whole share at start (its default)."""
    flag = os.environ.get(PREALLOCATE_ENV, "true").strip().lower()
    platform_allocator = os.environ.get(ALLOCATOR_ENV, "").strip().lower() == "platform"
    return flag not in ("0", "false", "no", "off") and not platform_allocator


def device_limits(stats: dict[str, int]) -> tuple[int, int]:
    """(device total, allocator cap) from a GPU's `memory_stats()`: XLA's allocator
    limit is `total x fraction`; the cap is that limit, or the preallocated pool where
    the driver granted less."""
    limit = int(stats["bytes_limit"])
    total = round(limit / allocator_fraction())
    pool = stats.get("pool_bytes")
    cap = min(limit, int(pool)) if preallocated() and pool else limit
    return total, cap


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def with_device_memory_size(options: Any, num_bytes: int) -> Any:
    """`options` (a jaxlib CompileOptions) with its executable's `device_memory_size`
    set, which JAX has no argument for: the serialized options plus one more
    executable-build-options message holding that field, which protobuf merges in."""
    inner = _varint(_DEVICE_MEMORY_SIZE_FIELD << 3) + _varint(num_bytes)
    extra = _varint(_BUILD_OPTIONS_FIELD << 3 | 2) + _varint(len(inner)) + inner
    return type(options).ParseFromString(options.SerializeAsString() + extra)


@contextlib.contextmanager
def compile_memory_size(num_bytes: int) -> Iterator[None]:
    """Compiles in this block tell XLA the device has `num_bytes` for them, as XLA's
    client does from its allocator on a GPU. For compile-only targets, which have no
    allocator; it wraps JAX's internal compile-options builder, so keep compiles on
    other threads out of the block."""
    from jax._src import compiler

    original = compiler.get_compile_options

    def sized(*args: Any, **kwargs: Any) -> Any:
        return with_device_memory_size(original(*args, **kwargs), num_bytes)

    compiler.get_compile_options = sized
    try:
        yield
    finally:
        compiler.get_compile_options = original
