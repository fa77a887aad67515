"""The deviceless H200 check of Gemma-2-9B- and gpt-oss-20b-shaped stacks of 4 layers.

Owns one fact set per model built for XLA:GPU without a GPU, at one small token bucket
(a decode-sized step: compile time grows little with the bucket, and every layer of a
kind compiles to the same kernels): that its forward compiles with the Triton attention
kernel at its per-layer options (Gemma 2's soft cap and window 4096; gpt-oss's sinks,
window 128, YaRN and its 32 experts in the Triton grouped matmul), in the hybrid KV
layout (full and sliding layers sharing cache arrays, `models/kv_groups.py`) as served
with prefix caching off; its temporaries; and ptxas's registers, spills and shared
memory per kernel. Not owned: the DeepSeek-V3 stack (`deviceless_mla.py`), the CLI.
"""

from __future__ import annotations

import time
from typing import Any

import jax.numpy as jnp

from jvllm.config import CacheConfig
from jvllm.models.registry import read_spec
from jvllm.runner.aot import CompileOnlyRunner
from jvllm.testing import triton_ptx
from jvllm.testing.deviceless import _COMPILED, EIGHT_B, Target, configs, kernel_rows, model_on

# The released config.json fields the specs read, with 4 of the models' layers (two of
# each kind, alternating as released).
GEMMA2_9B: dict[str, Any] = dict(
    architectures=["Gemma2ForCausalLM"],
    vocab_size=256000,
    hidden_size=3584,
    intermediate_size=14336,
    num_hidden_layers=42,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=256,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0,
    max_position_embeddings=8192,
    rope_theta=10000.0,
)
GPT_OSS_20B: dict[str, Any] = dict(
    architectures=["GptOssForCausalLM"],
    vocab_size=201088,
    hidden_size=2880,
    intermediate_size=2880,
    num_hidden_layers=24,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    sliding_window=128,
    num_local_experts=32,
    num_experts_per_tok=4,
    max_position_embeddings=131072,
    rope_scaling=dict(
        rope_type="yarn",
        factor=32.0,
        beta_fast=32.0,
        beta_slow=1.0,
        original_max_position_embeddings=4096,
        truncate=False,
    ),
    rope_theta=150000.0,
    swiglu_limit=7.0,
    attention_bias=True,
)
STACKS = {"gemma-2-9b": GEMMA2_9B, "gpt-oss-20b": GPT_OSS_20B}
STACK_LAYERS = 4
STACK_BUCKET = 16
NUM_BLOCKS = 4096  # the cache's size changes no program (it is an argument)


def check_variant_stack(name: str, target: Target, num_tokens: int = STACK_BUCKET) -> dict:
    """The 4-layer stack's forward at `num_tokens` on one H200 ("triton" backend), in
    the hybrid KV layout."""
    spec = read_spec({**STACKS[name], "num_hidden_layers": STACK_LAYERS})
    loaded = model_on(spec, jnp.bfloat16, target.devices())
    cache, scheduler = configs(EIGHT_B)
    cache = CacheConfig(block_size=cache.block_size, enable_prefix_caching=False)
    runner = CompileOnlyRunner(
        loaded, target.devices()[0], NUM_BLOCKS, cache, scheduler, None, _COMPILED
    )
    start = time.perf_counter()
    p = runner.compile_forward(num_tokens)
    seconds = time.perf_counter() - start
    calls = triton_ptx.triton_calls(p.compiled.as_text())
    return dict(
        model=name,
        num_layers=spec.num_layers,
        num_tokens=num_tokens,
        kv_sliding_window=runner.kv_sliding_window,
        cache_arrays=len(runner.caches),
        table_width=runner.width,
        seconds=round(seconds, 1),
        temp_bytes=p.compiled.memory_analysis().temp_size_in_bytes,
        triton_kernels=sorted({c.kernel_name for c in calls}),
        kernels=kernel_rows(name, p, target),
    )
