"""The deviceless H200 check of a DeepSeek-V3-shaped stack (multi-head latent attention).

Owns one fact set about a 4-layer stack at DeepSeek-V3's shapes (hidden 7168, 128 heads,
q_lora 1536, latent 512 + rope 64, 256 experts top-8 in 8 groups, one dense layer then
three sparse ones) built for XLA:GPU without a GPU: that the forward of each token
bucket compiles (the latent attention in jax.numpy, the experts in the Triton
grouped-matmul kernel, as served), its temporaries, and the KV cache the engine's sizing
rule gives it next to what a per-head cache of the same heads would get. Not owned: the
dense and MoE checks (`deviceless.py`, `deviceless_moe.py`), the CLI.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax.numpy as jnp

from jvllm.models.deepseek_spec import deepseek_spec
from jvllm.models.spec import ModelSpec
from jvllm.runner import memory
from jvllm.testing import triton_ptx
from jvllm.testing.deviceless import EIGHT_B, Target, build_runner, kv_cache_for, model_on

MLA_BUCKETS = (16, 256, 2048)
# deepseek-ai/DeepSeek-V3's config.json, with 4 of its 61 layers (the first dense).
DEEPSEEK_V3 = dict(
    architectures=["DeepseekV3ForCausalLM"],
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=4,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    rms_norm_eps=1e-6,
    max_position_embeddings=163840,
    rope_interleave=True,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
)


def mla_spec() -> ModelSpec:
    return deepseek_spec(DEEPSEEK_V3)


def check_mla_stack(target: Target, buckets: tuple[int, ...] = MLA_BUCKETS) -> dict[str, Any]:
    """The stack's forward at each bucket on one H200 ("triton" backend), and the KV
    cache sizing of its latent cache against a per-head one."""
    spec = mla_spec()
    loaded = model_on(spec, jnp.bfloat16, target.devices())
    sizing = kv_cache_for(loaded, EIGHT_B, target)
    per_head = dataclasses.replace(spec, mla=None, num_kv_heads=128, head_dim=192)
    head_block = memory.kv_block_bytes(per_head, EIGHT_B.block_size, 2, 1)
    runner = build_runner(loaded, EIGHT_B, sizing.size.num_blocks, target.devices()[0])
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
                triton_kernels=sorted({c.kernel_name for c in calls}),
            )
        )
    return dict(
        num_layers=spec.num_layers,
        weight_bytes=sizing.weights,
        kv_block_bytes=sizing.size.block_bytes,
        kv_tokens=sizing.size.num_tokens,  # capped at what 256 sequences of 8192 can use
        kv_tokens_uncapped=sizing.budget.kv_bytes // sizing.size.block_bytes * EIGHT_B.block_size,
        per_head_block_bytes=head_block,
        per_head_kv_tokens=max(0, sizing.budget.kv_bytes // head_block) * EIGHT_B.block_size,
        cache_shapes=[str(a.shape) for a in runner.caches[0]],
        forwards=forwards,
    )


# (sequences, splits): a small decode batch (the key range split, the merge kernel) and
# a full one (one split).
MLA_DECODE_LAUNCHES = ((16, None), (256, 1))


def check_mla_decode_kernel(target: Target) -> list[dict[str, Any]]:
    """The Triton MLA decode kernel alone at V3's shapes (128 heads, latent 512, rope 64,
    nope 128, v 128; bf16, block size 16, 256 blocks a row), through `mla_decode` as
    jitted, with ptxas's registers, spills and shared memory per kernel."""
    import jax

    from jvllm.kernels import jax_triton_mla
    from jvllm.runner.aot import CompiledProgram
    from jvllm.testing.deviceless import kernel_rows

    s = mla_spec()
    heads, rank, rope = s.num_heads, s.mla.kv_lora_rank, s.mla.qk_rope_head_dim
    nope, v_dim = s.mla.qk_nope_head_dim, s.mla.v_head_dim
    device = jax.sharding.SingleDeviceSharding(target.devices()[0])
    arg = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=device)
    rows = []
    for num_seqs, splits in MLA_DECODE_LAUNCHES:

        def decode(qn, qp, lat, rp, wkb, wvb, tables, lens, splits=splits):
            return jax_triton_mla.mla_decode(
                qn, qp, lat, rp, wkb, wvb, tables, lens, (nope + rope) ** -0.5, num_splits=splits
            )

        start = time.perf_counter()
        lowered = jax.jit(decode).lower(
            arg((num_seqs, heads, nope)),
            arg((num_seqs, heads, rope)),
            arg((4096, 16, 1, rank)),
            arg((4096, 16, 1, rope)),
            arg((heads, nope, rank)),
            arg((heads, v_dim, rank)),
            arg((num_seqs, 256), jnp.int32),
            arg((num_seqs,), jnp.int32),
        )
        label = f"decode S={num_seqs} splits={splits or 'auto'}"
        p = CompiledProgram("mla_decode", label, lowered, lowered.compile(), 0.0)
        rows += kernel_rows("deepseek-v3", p._replace(seconds=time.perf_counter() - start), target)
    return rows
