"""The deviceless H200 checks of a mixture-of-experts model (Qwen3-30B-A3B-shaped).

Owns three facts about a Qwen3-30B-A3B-shaped stack (hidden 2048, 128 experts, top-8,
expert intermediate 768, 4 layers) built for XLA:GPU without a GPU: that the forward of
each token bucket compiles (with the Triton grouped-matmul kernel, as served on a GPU);
which implementation XLA picks for `ragged_dot` instead (read from the optimized HLO: the
shapes of the dots it became); and how many bytes one sparse layer accesses per bucket
with either (XLA's cost analysis of the compiled layer) against the bytes of the experts
a step can activate, with ptxas's report on the kernel. Also one expert-parallel
forward over a compile-only four-GPU topology. Not owned: the dense checks
(`jvllm.testing.deviceless`), the CLI.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax._src.lib import xla_client

from jvllm.models.llama import SparseMoeBlock
from jvllm.models.spec import ModelSpec, spec_from_hf_config
from jvllm.runner.aot import CompiledProgram
from jvllm.testing import triton_ptx
from jvllm.testing.deviceless import (
    _COLLECTIVE,
    EIGHT_B,
    Target,
    build_runner,
    kernel_rows,
    kv_cache_for,
    model_on,
)

MOE_BUCKETS = (16, 256, 2048)
# Qwen/Qwen3-30B-A3B's config.json, with 4 of its 48 layers.
QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"],
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)
# A dot XLA made of the experts' ragged_dot_general: its result type and shape.
_EXPERT_DOT = re.compile(r"= (\w+\[[\d,]*\])\S* dot\([^\n]*ragged_dot_general")


def moe_spec() -> ModelSpec:
    return spec_from_hf_config(QWEN3_30B_A3B)


def _bytes_accessed(compiled: jax.stages.Compiled) -> float:
    """XLA's HloCostAnalysis of the optimized module. `Compiled.cost_analysis()` gives
    None for compile-only devices, so the CPU client analyses the GPU module."""
    module = compiled.runtime_executable().hlo_modules()[0]
    cpu = jax.devices("cpu")[0].client
    return float(xla_client._xla.hlo_module_cost_analysis(cpu, module)["bytes accessed"])


def sparse_layer_bytes(
    spec: ModelSpec, target: Target, num_tokens: int, backend: str
) -> dict[str, Any]:
    """One sparse MLP (router and experts) on `num_tokens` bf16 tokens, compiled alone
    with `backend`'s grouped matmul ("reference": XLA's ragged_dot; "triton": the kernel)."""
    loaded = model_on(spec, jnp.bfloat16, target.devices())
    params = loaded.params["model"]["layers_0"]["mlp"]
    block = SparseMoeBlock(loaded.spec, jnp.bfloat16, backend=backend)
    on = jax.sharding.SingleDeviceSharding(target.devices()[0])
    x = jax.ShapeDtypeStruct((num_tokens, spec.hidden_size), jnp.bfloat16, sharding=on)
    apply = lambda p, x: block.apply({"params": p}, x)
    start = time.perf_counter()
    lowered = jax.jit(apply).lower(params, x)
    compiled = lowered.compile()
    program = CompiledProgram("moe", f"{backend} T={num_tokens}", lowered, compiled, 0.0)
    program = program._replace(seconds=time.perf_counter() - start)
    m = spec.moe
    per_expert = 3 * m.intermediate_size * spec.hidden_size * 2  # bf16 gate, up, down
    activated = min(m.num_experts, num_tokens * m.top_k)  # at most, whatever the routing
    return dict(
        backend=backend,
        num_tokens=num_tokens,
        # XLA's cost analysis does not see inside a Triton custom call: for "triton" this
        # is the bytes around the kernel (routing, sorting, the padded buffers); the
        # kernel's tiles read at most the activated experts' weights, by construction.
        bytes_accessed=_bytes_accessed(compiled),
        expert_bytes=per_expert * m.num_experts,
        activated_expert_bytes_max=per_expert * activated,
        expert_dots=sorted(set(_EXPERT_DOT.findall(compiled.as_text()))),
        kernels=kernel_rows(f"moe {backend}", program, target),
    )


def check_moe_stack(target: Target, buckets: tuple[int, ...] = MOE_BUCKETS) -> dict[str, Any]:
    """The 4-layer stack's forward at each bucket on one H200 (the "triton" backend, as
    served), and one sparse layer's bytes accessed at each bucket with either backend."""
    spec = moe_spec()
    loaded = model_on(spec, jnp.bfloat16, target.devices())
    size, weights, _ = kv_cache_for(loaded, EIGHT_B, target)
    runner = build_runner(loaded, EIGHT_B, size.num_blocks, target.devices()[0])
    forwards = []
    for t in buckets:
        start = time.perf_counter()
        p = runner.compile_forward(t)
        calls = triton_ptx.triton_calls(p.compiled.as_text())
        forwards.append(
            dict(
                num_tokens=t,
                seconds=round(time.perf_counter() - start, 1),
                temp_bytes=p.compiled.memory_analysis().temp_size_in_bytes,
                expert_dots=sorted(set(_EXPERT_DOT.findall(p.compiled.as_text()))),
                triton_kernels=sorted({c.kernel_name for c in calls}),
            )
        )
    return dict(
        num_layers=spec.num_layers,
        weight_bytes=weights,
        forwards=forwards,
        sparse_layer=[
            sparse_layer_bytes(spec, target, t, backend)
            for backend in ("reference", "triton")
            for t in buckets
        ],
    )


def check_moe_expert_parallel(
    target: Target, topology: str = "1x1x4", num_tokens: int = 64
) -> dict[str, Any]:
    """The stack at TP = EP = 4 over compile-only GPUs: per-device expert bytes and
    every collective of the compiled forward (none may carry an expert's weights)."""
    devices = target.devices(topology)
    spec = dataclasses.replace(moe_spec(), expert_parallel=True)
    loaded = model_on(spec, jnp.bfloat16, devices)
    size, _, _ = kv_cache_for(loaded, EIGHT_B, target)
    runner = build_runner(loaded, EIGHT_B, size.num_blocks, devices[0])
    p = runner.compile_forward(num_tokens)
    experts = [
        w
        for name, layer in loaded.params["model"].items()
        if name.startswith("layers_")
        for w in layer["mlp"]["experts"].values()
    ]
    m = spec.moe
    i, h = m.intermediate_size, spec.hidden_size
    expert_dims = {f"{i},{h}", f"{h},{i}"}
    collectives = [(op, lhs) for lhs, op in _COLLECTIVE.findall(p.compiled.as_text())]
    return dict(
        tp=len(devices),
        expert_shard_shapes=sorted({str(w.sharding.shard_shape(w.shape)) for w in experts}),
        expert_bytes_per_device=sum(
            2 * math.prod(w.sharding.shard_shape(w.shape)) for w in experts
        ),
        expert_bytes=sum(2 * math.prod(w.shape) for w in experts),
        collectives=sorted(set(collectives)),
        expert_moved=[c for c in collectives if any(d in c[1] for d in expert_dims)],
    )
