"""Which cores XLA:CPU computes on, and which the Python threads run on (vLLM's
`VLLM_CPU_OMP_THREADS_BIND` and `VLLM_CPU_NUM_OF_RESERVED_CPU`).

XLA:CPU sizes its compute thread pool from the process's CPU affinity when its client
starts, and splits each matrix product over that pool. On a small machine every other
busy thread (the server's event loop, the engine's scheduling, a client on the same host)
preempts one of those threads and stalls the whole product until it runs again. vLLM's
CPU build reserves cores for its API server and scheduler and binds its OpenMP compute
threads to the rest; with a binding set, jvllm does the same for XLA: the client starts
with the compute cores as the affinity (its pool and runtime threads keep them), then the
calling thread - and every Python thread it starts later - moves to the reserved cores.

Settings (jvllm's name first, then vLLM's): `JVLLM_CPU_THREADS_BIND` /
`VLLM_CPU_OMP_THREADS_BIND` = `all` (the default: no binding), `auto` (compute on the
usable cores but the last `JVLLM_CPU_NUM_OF_RESERVED_CPU` / `VLLM_CPU_NUM_OF_RESERVED_CPU`,
default 1; Python on those), or a core list such as `0-2,5` (compute there, Python on the
other usable cores, or on the same ones when none is left). Only a CPU backend not yet
started is bound; on a GPU, or once JAX's backend runs, the setting is logged and ignored.
Not owned: XLA's allocator (`xla_allocator.py`), which is decided at the same moment.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

logger = logging.getLogger("jvllm.cpu_binding")

BIND_ENV = ("JVLLM_CPU_THREADS_BIND", "VLLM_CPU_OMP_THREADS_BIND")
RESERVED_ENV = ("JVLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_NUM_OF_RESERVED_CPU")


@dataclasses.dataclass(frozen=True)
class CpuBinding:
    compute: tuple[int, ...]  # XLA's compute pool and runtime threads
    python: tuple[int, ...]  # the calling thread and the threads it starts later


def _env(names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        value = os.environ.get(name)
        if value is not None and value.strip():
            return name, value.strip()
    return None


def parse_cpu_list(text: str, name: str = BIND_ENV[0]) -> tuple[int, ...]:
    """`0-2,5` -> (0, 1, 2, 5); a clear error naming `name` otherwise."""
    cores: set[int] = set()
    for part in text.split(","):
        first, sep, last = part.strip().partition("-")
        try:
            lo, hi = int(first), int(last) if sep else int(first)
        except ValueError:
            raise ValueError(
                f"{name}={text!r}: expected 'all', 'auto' or a core list such as '0-3,6'"
            ) from None
        if lo < 0 or hi < lo:
            raise ValueError(f"{name}={text!r}: {part.strip()!r} is not a range of core ids")
        cores.update(range(lo, hi + 1))
    return tuple(sorted(cores))


def plan_binding(
    setting: str, usable: tuple[int, ...], reserved: int | None, name: str = BIND_ENV[0]
) -> CpuBinding | None:
    """The binding `setting` (of variable `name`) asks for on the `usable` cores (None:
    leave the threads alone)."""
    if setting == "all":
        return None
    if setting == "auto":
        num = 1 if reserved is None else reserved
        if num < 1:
            raise ValueError(f"{RESERVED_ENV[0]}={num}: reserve at least one core with 'auto'")
        if len(usable) <= num:
            logger.warning(
                "%s=auto: %d usable core(s) cannot spare %d for Python threads; not bound",
                name,
                len(usable),
                num,
            )
            return None
        return CpuBinding(usable[:-num], usable[-num:])
    compute = parse_cpu_list(setting, name)
    outside = sorted(set(compute) - set(usable))
    if outside:
        raise ValueError(
            f"{name}={setting!r}: cores {outside} are not usable by this process "
            f"(its affinity is {list(usable)})"
        )
    rest = tuple(c for c in usable if c not in compute)
    return CpuBinding(compute, rest or compute)


@functools.cache
def bind_cpu_threads() -> CpuBinding | None:
    """Applies the environment's binding before JAX's CPU backend starts; once a process
    (LLM, `jvllm serve` and an engine-core process call it before building anything)."""
    given = _env(BIND_ENV)
    if given is None or given[1] == "all" or not hasattr(os, "sched_setaffinity"):
        return None
    from jvllm.runner.xla_allocator import backend_started, gpu_intended

    name, setting = given
    if gpu_intended():
        logger.info("%s=%s ignored: a GPU backend is intended", name, setting)
        return None
    if backend_started():
        logger.warning("%s=%s ignored: JAX's backend started before jvllm", name, setting)
        return None
    reserved = _env(RESERVED_ENV)
    try:
        num = None if reserved is None else int(reserved[1])
    except ValueError:
        raise ValueError(f"{reserved[0]}={reserved[1]!r}: expected a core count") from None
    binding = plan_binding(setting, tuple(sorted(os.sched_getaffinity(0))), num, name)
    if binding is not None:
        _start_backend_on(binding)
        logger.info("XLA:CPU computes on %s, Python on %s", binding.compute, binding.python)
    return binding


def _start_backend_on(binding: CpuBinding) -> None:
    import jax

    os.sched_setaffinity(0, binding.compute)
    try:
        jax.devices()  # the client, its compute pool and runtime threads start here
    finally:
        os.sched_setaffinity(0, binding.python)
