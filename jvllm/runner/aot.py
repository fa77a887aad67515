"""Ahead-of-time compilation of the runner's step programs for devices it need not have.

Owns `CompileOnlyRunner`: a `ModelRunner` built from abstract parameters (shapes,
dtypes and shardings, no values) whose jitted programs are lowered and compiled for a
target instead of run. Its `warm_up()` is the runner's own, so it compiles exactly the
programs the engine compiles at start-up, with the runner's own packing and bucket
sizes. The target may be a compile-only device: an XLA:GPU topology built from a GPU
target description on a machine without a GPU (tests/gpu_compile builds an H200).

What it relies on in `ModelRunner`, and nothing more: every device program is an
attribute ending in `_fn` (of the runner, or of its `blocks`, the `BlockCopier`) with a
`lower` method, as `jax.jit`'s; device arrays are made only by
`_allocate_cache` (the KV cache) and `_put` (host arrays to the device). Here the cache
is ShapeDtypeStructs, `_put` keeps host arrays on the host, and each `_fn` call places
its host arguments on the target (replicated on a mesh), compiles once per distinct
signature, and returns the outputs as ShapeDtypeStructs for the next program.
Also owns the reserve the KV-cache sizing keeps for one step (`measure_step_reserve`):
what the largest bucket's compiled programs need beyond their arguments, measured by
compiling them against a two-block cache (a program's temporaries do not depend on the
cache's size: the cache is donated, so aliased, never copied).
Not owned: checking what was compiled (jvllm.testing.deviceless).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from jvllm.config import CacheConfig, SchedulerConfig
from jvllm.layers.attention import KVCache
from jvllm.models.loader import LoadedModel, abstract_params, sharded_spec
from jvllm.models.registry import model_class
from jvllm.models.spec import ModelSpec, hf_name
from jvllm.parallel.mesh import cache_sharding, partition_spec, replicated
from jvllm.runner.model_runner import ModelRunner
from jvllm.runner.xla_allocator import compile_memory_size


class CompiledProgram(NamedTuple):
    name: str  # the runner attribute without `_fn`: forward, sample, ...
    label: str  # what tells this program apart from others of its name (bucket sizes)
    lowered: jax.stages.Lowered
    compiled: jax.stages.Compiled
    seconds: float  # lowering and compiling


def abstract_model(
    spec: ModelSpec, dtype: Any, backend: str, mesh: Mesh | None, device: jax.Device
) -> LoadedModel:
    """A LoadedModel whose params are ShapeDtypeStructs placed as `load_model` places them:
    on `device`, or on a mesh split by `partition_spec`."""
    tp = 1 if mesh is None else mesh.devices.size
    built = sharded_spec(spec, tp, device)
    module = model_class(spec.architecture)(spec=built, dtype=dtype, backend=backend, mesh=mesh)

    def place(path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        if mesh is None:
            sharding = SingleDeviceSharding(device)
        else:
            name = hf_name(tuple(k.key for k in path))
            sharding = NamedSharding(mesh, partition_spec(name, leaf.shape, spec, tp))
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    params = jax.tree_util.tree_map_with_path(place, abstract_params(module, built))
    return LoadedModel(built, module, params, jnp.dtype(dtype), {})


def _describe(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """Static keyword arguments (the forward's BatchShape), else the last array's shape."""
    given = {k: v for k, v in kwargs.items() if v is not None}  # e.g. no draft model
    if given:
        return ", ".join(f"{k}={v}" for k, v in given.items())
    leaves = jax.tree.leaves(args)
    return "x".join(map(str, leaves[-1].shape)) if leaves else ""


def _devices(args: Any) -> str:
    """Where a program runs: the same StableHLO over other devices is another program."""
    shardings = [x.sharding for x in jax.tree.leaves(args) if getattr(x, "sharding", None)]
    return str(sorted({(d.id, d.process_index) for s in shardings for d in s.device_set}))


def _signature(x: Any) -> Any:
    return (x.shape, x.dtype, x.sharding) if hasattr(x, "shape") else x


class _CompileOnCall:
    """Stands in for one jitted program: a call compiles it for the target, once."""

    def __init__(self, runner: CompileOnlyRunner, name: str, jitted: Callable[..., Any]):
        self.runner, self.name, self.jitted = runner, name, jitted
        self.outputs: dict[str, Any] = {}  # signature -> output ShapeDtypeStructs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = jax.tree.map(self.runner.to_target, (args, kwargs))
        signature = str(jax.tree.map(_signature, (args, kwargs)))
        if signature not in self.outputs:
            start = time.perf_counter()
            lowered = self.jitted.lower(*args, **kwargs)
            program = hashlib.sha256(lowered.as_text().encode()).hexdigest() + _devices(args)
            shared = self.runner.shared_compiles
            if program not in shared:  # another runner may have built the very same program
                shared[program] = self.runner.compile(lowered)
            seconds = time.perf_counter() - start
            label = _describe(args, kwargs)
            self.runner.programs.append(
                CompiledProgram(self.name, label, lowered, shared[program], seconds)
            )
            self.outputs[signature] = shared[program].out_info
        return self.outputs[signature]


class CompileOnlyRunner(ModelRunner):
    """A ModelRunner that compiles its programs for the devices of `loaded.params` and
    never runs them; `programs` lists what was compiled, in order (a program another
    runner in `shared_compiles` already built is listed with its lowering time only)."""

    def __init__(
        self,
        loaded: LoadedModel,
        device: jax.Device,
        num_blocks: int,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        mesh: Mesh | None = None,
        shared_compiles: dict[str, jax.stages.Compiled] | None = None,
        device_memory_bytes: int | None = None,
        **runner_options: Any,
    ) -> None:
        """`device_memory_bytes`: what XLA is told a program may use of a device (its
        scheduler's budget, which a GPU's allocator gives it; `compile_memory_size`);
        None: XLA's own default. `runner_options`: ModelRunner's further arguments."""
        self.device = device  # the target when there is no mesh
        self.programs: list[CompiledProgram] = []
        # StableHLO digest and devices -> executable, shareable between runners.
        self.shared_compiles = {} if shared_compiles is None else shared_compiles
        self.device_memory_bytes = device_memory_bytes
        super().__init__(loaded, num_blocks, cache_config, scheduler_config, mesh, **runner_options)
        self.last_sampled = np.zeros(self.max_rows, np.int32)  # to_target places it
        for owner in (self, self.blocks):
            for attribute, value in list(vars(owner).items()):
                if attribute.endswith("_fn") and hasattr(value, "lower"):
                    name = attribute.strip("_").removesuffix("_fn")  # _forward_fn -> forward
                    setattr(owner, attribute, _CompileOnCall(self, name, value))

    @property
    def num_compilations(self) -> int:
        return len(self.programs)

    def compile(self, lowered: jax.stages.Lowered) -> jax.stages.Compiled:
        if self.device_memory_bytes is None:
            return lowered.compile()
        with compile_memory_size(self.device_memory_bytes):
            return lowered.compile()

    def _allocate_cache(self, num_blocks: int) -> list[KVCache]:
        s = self.spec
        heads, k_dim, v_dim = s.kv_cache_dims
        shape = (num_blocks, self.block_size, heads)
        sharding = cache_sharding(self.mesh, s.kv_cache_split) or SingleDeviceSharding(self.device)
        k, v = (
            jax.ShapeDtypeStruct((*shape, d), self.kv_dtype, sharding=sharding)
            for d in (k_dim, v_dim)
        )
        return [(k, v) for _ in range(self.num_target_layers)]  # pairs in the hybrid layout

    def _put(self, tree: Any) -> Any:
        return tree  # host arrays stay numpy until a program call places them (to_target)

    def to_target(self, x: Any) -> Any:
        """A host array as it would arrive on the target; anything else unchanged."""
        if not isinstance(x, np.ndarray | np.generic):
            return x
        mesh = self.mesh
        sharding = SingleDeviceSharding(self.device) if mesh is None else replicated(mesh)
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)

    def compile_forward(self, num_tokens: int) -> CompiledProgram:
        """Compiles only the forward of the bucket holding `num_tokens` (no warm-up)."""
        before = len(self.programs)
        self._run_forward([], self.batch_shape(num_tokens))
        assert len(self.programs) == before + 1, "already compiled"
        return self.programs[-1]


def step_transient_bytes(programs: list[CompiledProgram]) -> int:
    """Bytes one step needs beyond its arguments: the worst temporaries and fresh
    (not aliased) outputs of each program, summed as if all were live at once."""
    worst: dict[str, int] = {}
    for p in programs:
        m = p.compiled.memory_analysis()
        fresh = m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
        worst[p.name] = max(worst.get(p.name, 0), fresh)
    return sum(worst.values())


def _device_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of placed arrays (or ShapeDtypeStructs)."""
    leaves = jax.tree.leaves(tree)
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves)


def step_input_bytes(programs: list[CompiledProgram], resident: int) -> int:
    """The forward's arguments beyond what stays resident (weights and KV cache): the
    step's packed inputs, block tables and sampling arrays."""
    forwards = [p for p in programs if p.name == "forward"]
    args = max(p.compiled.memory_analysis().argument_size_in_bytes for p in forwards)
    return max(0, args - resident)


def measure_step_reserve(
    loaded: LoadedModel,
    device: jax.Device,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    mesh: Mesh | None = None,
    device_memory_bytes: int | None = None,
    shared_compiles: dict[str, jax.stages.Compiled] | None = None,
    **runner_options: Any,
) -> tuple[int, list[CompiledProgram]]:
    """The step reserve of the KV-cache sizing: `step_transient_bytes` and
    `step_input_bytes` of the largest token bucket's programs (its forward, sampler and
    prompt logprobs, the block copy, any drafter's programs), compiled for
    `device` against a two-block cache; and those programs. The runner that compiled
    them is dropped (on a GPU it holds a few small device arrays)."""
    runner = CompileOnlyRunner(
        loaded,
        device,
        2,
        cache_config,
        scheduler_config,
        mesh,
        shared_compiles,
        device_memory_bytes=device_memory_bytes,
        **runner_options,
    )
    runner.token_buckets = runner.token_buckets[-1:]
    runner.warm_up()
    resident = _device_bytes((loaded.params, runner.caches))  # the forward takes all
    inputs = step_input_bytes(runner.programs, resident)
    return step_transient_bytes(runner.programs) + inputs, runner.programs
