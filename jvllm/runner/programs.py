"""The runner's device programs, and the store that keeps their executables across runs.

Owns `Program`: one jitted step function (the forward, the sampler, a block copy ...)
and the executables compiled for it, one per signature (static arguments and the shapes
of the arguments that vary between calls). Owns `ExecutableStore`: a directory of
serialized XLA executables, so that a later start with the same code, model, engine
configuration and JAX loads each program instead of tracing, lowering and compiling it
again. JAX's persistent compilation cache skips only XLA's compile on such a start: it
still traces and lowers every program to find its key (the `cpu` bench preset's 49
programs: about 7 s of a 15 s warm start, `bench/startup.py`).

A stored executable is found by a digest of everything its program depends on: the
store's scope (the jvllm source, JAX's version and configuration, the devices, the
runner's configuration; see `scope_digest`) and the call's full signature (the tree,
shapes, dtypes and shardings of every argument, and the static ones). The directory is
trusted as the C++ kernel's build directory is: loading an executable runs its code.
Not owned: which programs exist and what they compute (`ModelRunner`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import jax
from jax.experimental import serialize_executable

logger = logging.getLogger(__name__)

_SUFFIX = ".jex"
_JAX_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_jax_cache_hits = threading.local()  # .count: JAX persistent-cache hits on this thread


def _count_jax_cache_hits(event: str, **_: Any) -> None:
    if event == _JAX_CACHE_HIT:
        _jax_cache_hits.count = getattr(_jax_cache_hits, "count", 0) + 1


@functools.cache
def _listen_for_jax_cache_hits() -> None:
    jax.monitoring.register_event_listener(_count_jax_cache_hits)


@functools.cache
def source_digest() -> str:
    """SHA-256 of every .py and .cc file of jvllm (its kernels included), read once a
    process."""
    digest = hashlib.sha256()
    root = Path(sys.modules["jvllm"].__file__ or "").parent
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cc")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def scope_digest(configuration: Iterable[Any]) -> str:
    """What every stored executable of a runner depends on besides its arguments: the
    jvllm source, JAX's and jaxlib's versions and configuration, XLA_FLAGS, the devices
    (platform, kinds, count, processes), and `configuration` (the runner's reprs)."""
    import jaxlib

    devices = jax.devices()
    parts = [
        source_digest(),
        jax.__version__,
        jaxlib.__version__,
        repr(sorted(jax.config.values.items())),
        os.environ.get("XLA_FLAGS", ""),
        devices[0].client.platform,
        devices[0].client.platform_version,
        repr(sorted({d.device_kind for d in devices})),
        f"{len(devices)} devices, {jax.process_count()} processes",
        *map(repr, configuration),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _leaf_signature(x: Any) -> Any:
    if hasattr(x, "shape"):
        aval = jax.typeof(x) if isinstance(x, jax.Array) else (x.shape, x.dtype)
        return (str(aval), repr(getattr(x, "sharding", None)))
    return repr(x)


class ExecutableStore:
    """Serialized executables under `directory/<scope>/`, one file per program signature.
    Files are written whole then renamed, so concurrent processes never read half of one;
    one that cannot be read is compiled again and replaced. Only fresh compiles are
    written: an executable that JAX's persistent cache deserialized loses code when
    XLA:CPU serializes it again ("Function ... not found" on its first run after
    loading). Such a program is traced again at every start until XLA compiles it anew
    (after a change to its lowered program, or with JAX's cache emptied)."""

    def __init__(self, directory: Path, scope: str) -> None:
        _listen_for_jax_cache_hits()
        self.directory = Path(directory) / scope[:32]
        self.loaded = 0  # executables read from disk by this store
        self.written = 0
        self._count_lock = threading.Lock()  # warm-up gets executables from several threads

    def get(self, name: str, jitted: Any, args: tuple, kwargs: dict) -> jax.stages.Compiled:
        """The executable of `jitted` for this call: read from disk, else compiled and
        written."""
        signature = repr(jax.tree.map(_leaf_signature, (args, kwargs)))
        key = hashlib.sha256(signature.encode()).hexdigest()[:32]
        path = self.directory / f"{name}-{key}{_SUFFIX}"
        if path.exists():
            try:
                payload, in_tree, out_tree, device_ids = pickle.loads(path.read_bytes())
                by_id = {d.id: d for d in jax.devices()}
                compiled = serialize_executable.deserialize_and_load(
                    payload, in_tree, out_tree, execution_devices=[by_id[i] for i in device_ids]
                )
                with self._count_lock:
                    self.loaded += 1
                return compiled
            except Exception as e:  # noqa: BLE001 - a bad file is rebuilt, never fatal
                logger.warning("Stored executable %s unreadable (%s); compiling again", path, e)
        hits = getattr(_jax_cache_hits, "count", 0)
        compiled = jitted.lower(*args, **kwargs).compile()
        if getattr(_jax_cache_hits, "count", 0) == hits:
            self._write(path, compiled)
        return compiled

    def _write(self, path: Path, compiled: jax.stages.Compiled) -> None:
        try:
            # The devices it runs on, in its device assignment's order: loading binds
            # them again (every device of the backend otherwise). JAX names no public
            # accessor for them.
            devices = compiled._executable.xla_executable.local_devices()
            serialized = serialize_executable.serialize(compiled)
            payload = pickle.dumps((*serialized, [d.id for d in devices]))
        except (AttributeError, ValueError, NotImplementedError) as e:  # e.g. a constant
            logger.debug("Executable %s not stored: %s", path.name, e)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".partial", delete=False) as f:
            f.write(payload)
        os.replace(f.name, path)
        with self._count_lock:
            self.written += 1


class Program:
    """A jitted function and its executables, one per signature. Calls look an executable
    up by the static arguments and the shapes of the arguments not in `fixed` (argument
    positions whose shapes never change over the runner's life: the weights, the KV
    cache), so a step pays for flattening only its small inputs; the executable itself
    checks every argument against what it was compiled for; `fixed_kwargs` names keyword
    arguments of that kind (the LoRA slots). `lower` is jax.jit's."""

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str,
        store: ExecutableStore | None,
        static_argnames: Sequence[str] = (),
        donate_argnames: Sequence[str] = (),
        fixed: Sequence[int] = (),
        fixed_kwargs: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.jitted = jax.jit(fn, static_argnames=static_argnames, donate_argnames=donate_argnames)
        self.store = store
        self.static_argnames = frozenset(static_argnames)
        self.fixed = frozenset(fixed)
        self.fixed_kwargs = frozenset(fixed_kwargs)
        self.executables: dict[Any, jax.stages.Compiled] = {}

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        return self.jitted.lower(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        statics = tuple(sorted((k, v) for k, v in kwargs.items() if k in self.static_argnames))
        dynamic = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        varying = [a for i, a in enumerate(args) if i not in self.fixed]
        varying_kwargs = {k: v for k, v in dynamic.items() if k not in self.fixed_kwargs}
        leaves, tree = jax.tree.flatten((varying, varying_kwargs))
        key = (statics, tree, *((getattr(x, "shape", x), getattr(x, "dtype", 0)) for x in leaves))
        executable = self.executables.get(key)
        if executable is None:
            executable = self._build(args, kwargs)
            self.executables[key] = executable
        return executable(*args, **dynamic)

    def _build(self, args: tuple, kwargs: dict) -> jax.stages.Compiled:
        if self.store is None:
            return self.jitted.lower(*args, **kwargs).compile()
        return self.store.get(self.name, self.jitted, args, kwargs)
