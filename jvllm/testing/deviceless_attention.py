"""The deviceless checks of the Triton attention kernel alone, built for an H200.

Owns the kernel compiled at a model's head shapes with its per-layer options (soft cap,
sliding window, sinks) and launch knobs, reported through ptxas as the step programs'
kernels are, and the launch overrides known to be bad. Not owned: the step programs
(jvllm.testing.deviceless), the CLI and the assertions.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp

from jvllm.runner.aot import CompiledProgram
from jvllm.testing.deviceless import Target, kernel_rows

# Launch overrides known to be bad for an 8B-shaped decode on an H200 (tests of the test):
# 128 query rows keep a 128 x 128 fp32 accumulator per 128 threads (spills); 512-key tiles
# need more shared memory than a block may have.
BAD_LAUNCHES = {"spills": dict(block_m=128, num_splits=1), "smem": dict(tile_n=512, num_splits=1)}


def check_attention(
    model: str,
    heads: tuple[int, int, int],  # query heads, KV heads, head dim
    num_tokens: int,
    num_seqs: int,
    options: dict[str, Any],
    target: Target,
) -> list[dict[str, Any]]:
    """The Triton attention alone, bf16, block size 16, 128 blocks a row, with `options`
    (launch knobs, soft_cap, sliding_window; sinks=True passes a sinks operand)."""
    from jvllm.kernels import jax_triton_attention

    num_heads, num_kv_heads, head_dim = heads
    device = jax.sharding.SingleDeviceSharding(target.devices()[0])
    arg = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=device)
    cache = arg((1024, 16, num_kv_heads, head_dim))
    meta = [arg((num_seqs, 128), jnp.int32), arg((num_seqs,), jnp.int32)]
    meta.append(arg((num_seqs + 1,), jnp.int32))
    knobs = {k: v for k, v in options.items() if k != "sinks"}
    if options.get("sinks"):
        meta.append(arg((num_heads,), jnp.float32))
    scale = head_dim**-0.5

    def attend(q, k, v, tables, lens, qsl, *sinks):
        return jax_triton_attention.paged_attention(
            q, k, v, tables, lens, qsl, scale, sinks=sinks[0] if sinks else None, **knobs
        )

    start = time.perf_counter()
    lowered = jax.jit(attend).lower(arg((num_tokens, num_heads, head_dim)), cache, cache, *meta)
    label = f"T={num_tokens} S={num_seqs} {options}"
    p = CompiledProgram("attention", label, lowered, lowered.compile(), 0.0)
    p = p._replace(seconds=time.perf_counter() - start)
    return kernel_rows(model, p, target)


def check_bad_launch(knobs: dict[str, int], target: Target) -> list[dict[str, Any]]:
    """The Triton attention alone, 64 tokens, 32/8 heads of 128, with `knobs`."""
    return check_attention("bad launch", (32, 8, 128), 64, 64, knobs, target)
