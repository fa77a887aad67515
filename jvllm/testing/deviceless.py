"""The deviceless checks: the engine's step programs built for NVIDIA H200s without a GPU.

Owns XLA:GPU compile-only devices from a GPU target description
(`jax.experimental.topologies`) and one check per question, each returning plain facts
(JSON-ready dicts): every program the runner's warm-up compiles for one model on one
device (via `jvllm.runner.aot`), with ptxas on its Triton kernels and the KV-cache sizing
rule against the compiled programs' memory (the step reserve measured as the engine
measures it, XLA told the same budget as a GPU's allocator tells it, and what XLA's
scheduler logs while compiling); one tensor-parallel forward over a topology's
devices; and the operand types of an FP8 model's dots. Not owned: the attention kernel
alone (jvllm.testing.deviceless_attention), MoE (jvllm.testing.deviceless_moe), which
models and sizes to check, the report and the command line
(jvllm.testing.deviceless_cli), the assertions (tests/gpu_compile).
Needs the CUDA PJRT plugin and jax-triton importable.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies

from jvllm.config import CacheConfig, SchedulerConfig
from jvllm.layers.attention import AttentionMetadata
from jvllm.models.loader import LoadedModel
from jvllm.models.spec import ModelSpec
from jvllm.parallel.mesh import make_mesh
from jvllm.runner import memory
from jvllm.runner.aot import (
    CompiledProgram,
    CompileOnlyRunner,
    abstract_model,
    measure_step_reserve,
)
from jvllm.testing import triton_ptx

GPU_ARCH = "sm_90a"
UTILIZATION = 0.9
# Collective ops of compiled XLA:GPU HLO (the async forms end in -start).
# What XLA:GPU logs when a program's arguments exceed the memory it was told of, and
# when rematerialization cannot bring a program under its limit.
SCHEDULER_WARNING = re.compile(r"exceeds the base limit|Can't reduce memory use below")
_COLLECTIVE = re.compile(
    r"= (.*?) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)


class EngineSizes(NamedTuple):
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int = 16


# Llama-3-8B served with the engine's defaults at max_model_len 8192.
EIGHT_B = EngineSizes(8192, 256, 2048)
# Two buckets: T=16 takes the decode launch configuration, T=32 the prefill one.
TINY = EngineSizes(256, 8, 32)
# bench/throughput.py --preset 8b (what bench/gpu_check.sh runs): sizing only.
THROUGHPUT_8B = EngineSizes(2048, 256, 8192)


class Target(NamedTuple):
    text: str  # GpuTargetConfigProto, text format
    memory_bytes: int  # device_memory_size
    shared_limit: int  # shared_memory_per_block_optin

    @classmethod
    def read(cls, path: Path) -> Target:
        text = path.read_text()
        field = lambda name: int(re.search(rf"{name}: (\d+)", text).group(1))
        return cls(text, field("device_memory_size"), field("shared_memory_per_block_optin"))

    def devices(self, topology: str = "1x1x1") -> list[jax.Device]:
        return list(_topology_devices(self.text, topology))


@functools.cache
def _topology_devices(text: str, topology: str) -> tuple[jax.Device, ...]:
    """Compile-only devices; one set per topology, since each call makes new devices."""
    desc = topologies.get_topology_desc(platform="cuda", topology=topology, target_config=text)
    return tuple(desc.devices)


def _bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of placed ShapeDtypeStructs."""
    leaves = jax.tree.leaves(tree)
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves)


def _dims(shape: str) -> str:
    """'bf16[4096,128]{1,0}' -> '4096,128'."""
    return shape.split("[")[1].split("]")[0]


def model_on(spec: ModelSpec, dtype: Any, devices: list[jax.Device]) -> LoadedModel:
    mesh = make_mesh(len(devices), devices) if len(devices) > 1 else None
    return abstract_model(spec, dtype, "triton", mesh, devices[0])


class Sizing(NamedTuple):
    size: memory.KVCacheSize
    weights: int  # bytes of parameters on one device
    budget: memory.DeviceBudget


def configs(
    sizes: EngineSizes, kv_cache_dtype: str = "auto"
) -> tuple[CacheConfig, SchedulerConfig]:
    scheduler = SchedulerConfig(
        max_num_seqs=sizes.max_num_seqs,
        max_num_batched_tokens=sizes.max_num_batched_tokens,
        max_model_len=sizes.max_model_len,
    )
    return CacheConfig(block_size=sizes.block_size, kv_cache_dtype=kv_cache_dtype), scheduler


def limit_bytes(target: Target, utilization: float) -> int:
    return int(target.memory_bytes * utilization)


def measured_reserve(
    loaded: LoadedModel, sizes: EngineSizes, target: Target, utilization: float
) -> int:
    """The engine's step reserve (`aot.measure_step_reserve`) on the target."""
    cache, scheduler = configs(sizes)
    reserve, _ = measure_step_reserve(
        loaded,
        target.devices()[0],
        cache,
        scheduler,
        loaded.module.mesh,
        device_memory_bytes=limit_bytes(target, utilization),
        shared_compiles=_COMPILED,
    )
    return reserve


def kv_cache_for(
    loaded: LoadedModel,
    sizes: EngineSizes,
    target: Target,
    kv_cache_dtype: str = "auto",
    utilization: float = UTILIZATION,
    reserve: int | None = None,
) -> Sizing:
    """The engine's sizing rule on one device; weights from the abstract params (all a
    fresh device holds); `reserve` None: the estimate (`memory.activation_reserve`)."""
    tp = 1 if loaded.module.mesh is None else loaded.module.mesh.devices.size
    weights = _bytes(loaded.params)
    itemsize = np.dtype(CacheConfig(kv_cache_dtype=kv_cache_dtype).kv_dtype(loaded.dtype)).itemsize
    block = memory.kv_block_bytes(loaded.spec, sizes.block_size, itemsize, tp)
    if reserve is None:
        reserve = memory.activation_reserve(sizes.max_num_batched_tokens, loaded.spec.vocab_size)
    budget = memory.gpu_budget(target.memory_bytes, weights, utilization, reserve)
    size = memory.kv_cache_size(
        budget.kv_bytes, block, sizes.block_size, sizes.max_num_seqs, sizes.max_model_len
    )
    return Sizing(size, weights, budget)


# Programs compiled so far in this process (tiny models share their sampler programs;
# XLA's memory limit aside, which changes no program whose arguments fit it anyway).
_COMPILED: dict[str, jax.stages.Compiled] = {}


def build_runner(
    loaded: LoadedModel,
    sizes: EngineSizes,
    num_blocks: int,
    device: jax.Device,
    kv_cache_dtype: str = "auto",
    device_memory_bytes: int | None = None,
    shared: bool = True,
) -> CompileOnlyRunner:
    """A compile-only runner; `shared=False` compiles every program afresh."""
    cache, scheduler = configs(sizes, kv_cache_dtype)
    return CompileOnlyRunner(
        loaded,
        device,
        num_blocks,
        cache,
        scheduler,
        loaded.module.mesh,
        _COMPILED if shared else {},
        device_memory_bytes=device_memory_bytes,
    )


@contextlib.contextmanager
def captured_stderr() -> Iterator[list[str]]:
    """What the process writes to file descriptor 2 in the block (XLA's C++ log), in the
    list yielded once the block ends; copied on to the real stderr as well."""
    sys.stderr.flush()
    saved = os.dup(2)
    text: list[str] = []
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 2)
        try:
            yield text
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            captured = f.read()
            os.write(2, captured)
            text.append(captured.decode(errors="replace"))


def scheduler_warnings(log: str) -> list[str]:
    return [line[-200:] for line in log.splitlines() if SCHEDULER_WARNING.search(line)]


def program_row(model: str, p: CompiledProgram) -> dict[str, Any]:
    m = p.compiled.memory_analysis()
    return dict(
        model=model,
        program=p.name,
        label=p.label,
        seconds=round(p.seconds, 2),
        temp_bytes=m.temp_size_in_bytes,
        argument_bytes=m.argument_size_in_bytes,
        output_bytes=m.output_size_in_bytes,
        alias_bytes=m.alias_size_in_bytes,
    )


def kernel_rows(model: str, p: CompiledProgram, target: Target) -> list[dict[str, Any]]:
    """ptxas on each distinct kernel of a program (every layer launches the same ones)."""
    rows: dict[bytes, dict[str, Any]] = {}
    for call in triton_ptx.triton_calls(p.compiled.as_text()):
        if call.ptx in rows:
            rows[call.ptx]["launches"] += 1
            continue
        report = triton_ptx.assemble(call, GPU_ARCH, target.shared_limit)
        row = dict(report._asdict(), model=model, label=p.label, problems=report.problems)
        rows[call.ptx] = row | {"launches": 1}
    return list(rows.values())


def memory_fit(programs: list[dict[str, Any]], sizing: Sizing) -> dict[str, Any]:
    """Peak use of one step: what stays resident (weights, cache) plus, as if at once,
    the worst temporaries and fresh outputs of each program; beside the sizing rule's
    figures."""
    resident = max(p["argument_bytes"] for p in programs if p["program"] == "forward")
    worst: dict[str, int] = {}
    for p in programs:
        fresh = p["temp_bytes"] + p["output_bytes"] - p["alias_bytes"]
        worst[p["program"]] = max(worst.get(p["program"], 0), fresh)
    transient = sum(worst.values())
    size, budget = sizing.size, sizing.budget
    return dict(
        num_blocks=size.num_blocks,
        kv_tokens=size.num_tokens,
        block_bytes=size.block_bytes,
        weight_bytes=sizing.weights,
        total_bytes=budget.total,
        utilization=budget.utilization,
        limit_bytes=budget.limit,
        reserve_bytes=budget.reserve,
        budget_bytes=budget.kv_bytes,
        resident_bytes=resident,
        transient_bytes=transient,
        peak_bytes=resident + transient,
    )


def check_model(
    name: str,
    spec: ModelSpec,
    dtype: Any,
    sizes: EngineSizes,
    target: Target,
    buckets: Sequence[int] | None = None,
    kv_cache_dtype: str = "auto",
    utilization: float = UTILIZATION,
    measure: bool = False,
) -> dict[str, Any]:
    """Warm-up's programs for one device, their kernels, the memory they need, and what
    XLA's scheduler logged compiling them. `measure`: the step reserve measured as the
    engine measures it on a GPU, else the estimate (faster)."""
    loaded = model_on(spec, dtype, target.devices())
    reserve = measured_reserve(loaded, sizes, target, utilization) if measure else None
    sizing = kv_cache_for(loaded, sizes, target, kv_cache_dtype, utilization, reserve)
    limit = limit_bytes(target, utilization)
    device = target.devices()[0]
    runner = build_runner(loaded, sizes, sizing.size.num_blocks, device, kv_cache_dtype, limit)
    if buckets is not None:
        runner.token_buckets = tuple(buckets)  # a representative subset
    with captured_stderr() as log:
        runner.warm_up()
    programs = [program_row(name, p) for p in runner.programs]
    forwards = [p for p in runner.programs if p.name == "forward"]
    return dict(
        model=name,
        buckets=list(runner.token_buckets),
        programs=programs,
        kernels=[k for p in forwards for k in kernel_rows(name, p, target)],
        memory=memory_fit(programs, sizing) | dict(reserve_measured=measure),
        scheduler_warnings=scheduler_warnings(log[0]),
    )


def check_unlimited_forward(
    spec: ModelSpec, sizes: EngineSizes, target: Target, num_tokens: int = 16
) -> dict[str, Any]:
    """A test of the test: one forward with the 0.9-sized cache compiled as before XLA
    was told the budget (80% of the device, XLA's default), and what XLA logged."""
    loaded = model_on(spec, jnp.bfloat16, target.devices())
    sizing = kv_cache_for(loaded, sizes, target)
    runner = build_runner(loaded, sizes, sizing.size.num_blocks, target.devices()[0], shared=False)
    with captured_stderr() as log:
        p = runner.compile_forward(num_tokens)
    return dict(label=p.label, scheduler_warnings=scheduler_warnings(log[0]))


def _big_shapes(arrays: list[jax.ShapeDtypeStruct]) -> set[str]:
    """Dims of every weight matrix and KV cache, whole and per device: '4096,14336'."""
    shapes = {x.shape for x in arrays} | {x.sharding.shard_shape(x.shape) for x in arrays}
    return {",".join(map(str, s)) for s in shapes if len(s) > 1}


def check_tensor_parallel(
    spec: ModelSpec, topology: str, num_tokens: int, target: Target
) -> dict[str, Any]:
    """One forward over a topology's devices ("1x1x4": 4 in this process, "1x2x1": one in
    each of 2 processes): shard_map bodies, collectives, Triton operands."""
    devices = target.devices(topology)
    tp = len(devices)
    loaded = model_on(spec, jnp.bfloat16, devices)
    size, _, _ = kv_cache_for(loaded, EIGHT_B, target)
    limit = limit_bytes(target, UTILIZATION)
    runner = build_runner(loaded, EIGHT_B, size.num_blocks, devices[0], device_memory_bytes=limit)
    p = runner.compile_forward(num_tokens)
    compiled = p.compiled.as_text()
    big = _big_shapes([*jax.tree.leaves(loaded.params), runner.caches[0][0]])
    collectives = [(op, triton_ptx.SHAPE.findall(lhs)) for lhs, op in _COLLECTIVE.findall(compiled)]
    s = loaded.spec
    return dict(
        tp=tp,
        topology=topology,
        processes=len({d.process_index for d in devices}),
        label=p.label,
        seconds=round(p.seconds, 2),
        num_layers=s.num_layers,
        manual_computations=p.lowered.as_text().count("sdy.manual_computation"),
        triton_operands=[list(c.operands) for c in triton_ptx.triton_calls(compiled)],
        expected_q=f"bf16[{num_tokens},{s.num_heads // tp},{s.head_dim}]",
        expected_cache=f"bf16[{size.num_blocks},{EIGHT_B.block_size},"
        f"{s.num_kv_heads // tp},{s.head_dim}]",
        collectives=collectives,
        weight_or_cache_moved=[c for c in collectives if any(_dims(x) in big for x in c[1])],
        kv_tokens=size.num_tokens,
        kernels=kernel_rows(f"8b {topology}", p, target),
    )


def check_fp8_matmul(spec: ModelSpec, target: Target, num_tokens: int = 64) -> dict[str, Any]:
    """`spec` (FP8 W8A8: float8 weights, float8 inputs) built for one H200 as the loader
    builds it there: the operand types of every dot in its compiled forward."""
    device = target.devices()[0]
    loaded = abstract_model(spec, jnp.bfloat16, "reference", None, device)
    s, n = loaded.spec, num_tokens
    blocks = -(-n // 16)
    cache = jax.ShapeDtypeStruct((blocks + 1, 16, s.num_kv_heads, s.head_dim), jnp.bfloat16)
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    meta = AttentionMetadata(ints(n), ints(2), ints(1), ints(1, blocks))
    inputs = ([(cache, cache)] * s.num_layers, ints(n), ints(n), meta)
    on_device = jax.sharding.SingleDeviceSharding(device)
    inputs = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_device), inputs
    )
    module = loaded.module

    def forward(params: Any, caches: Any, tokens: Any, positions: Any, meta: Any) -> Any:
        return module.apply({"params": params}, tokens, positions, caches, meta)

    hlo = jax.jit(forward).lower(loaded.params, *inputs).compile().as_text()
    return dict(
        num_layers=s.num_layers, fp8_matmul=s.quantization.fp8_matmul, dots=dot_operand_types(hlo)
    )


def dot_operand_types(hlo: str) -> list[list[str | None]]:
    """The element types of each dot's two operands, in compiled HLO text."""
    dots, types = [], {}
    for line in hlo.splitlines():
        if line.endswith("{") and not line.startswith(" "):  # a new computation
            types = {}
        defined = re.match(r"\s*(?:ROOT )?%([\w.-]+) = (\w+)\[", line)
        if defined is None:
            continue
        types[defined.group(1)] = defined.group(2)
        dot = re.search(r" dot\(%([\w.-]+), %([\w.-]+)\)", line)
        if dot is not None:
            dots.append([types.get(dot.group(1)), types.get(dot.group(2))])
    return dots
