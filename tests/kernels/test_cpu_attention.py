"""The C++ paged-attention kernel for XLA:CPU against the jax.numpy reference.

Every case mixes decode rows (one new token; every head of a row in one pass over its
keys) with prefill rows (several, attending to a cached prefix and causally among
themselves) and padding, and draws random inputs.
Every cache slot no sequence owns holds NaN, so a read outside a block table or past
a query's position shows up in the kernel's output; the comparison with the reference
runs on the same cache with those slots zeroed (the engine's cache is zeroed, and the
reference's masked products would turn 0 * NaN into NaN). Error is the largest
|out - ref| over real tokens, relative to max |ref|: float32 within 1e-5 (the same sums
in another order, and a polynomial exp), bfloat16 within 1e-2 (both sides round the
output to 8 bits of mantissa after float32 accumulation).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.kernels import cpu_attention, reference

pytestmark = pytest.mark.skipif(
    not cpu_attention.available(), reason="no C++ compiler on PATH to build the CPU kernel"
)


@dataclasses.dataclass(frozen=True)
class Case:
    q_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    num_heads: int = 6
    num_kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    dtype: str = "float32"
    sliding_window: int | None = None
    pad_seqs: int = 2


CASES = [
    Case((1, 1, 1), (1, 17, 300)),
    Case((1, 5, 1, 12), (40, 5, 129, 64)),  # decode and prefill rows interleaved
    Case((1,) * 9, (3, 16, 33, 64, 65, 100, 257, 511, 2)),
    Case((1, 1, 3), (50, 200, 70), num_heads=8, num_kv_heads=1, head_dim=128),  # MQA
    Case((1, 1, 1), (9, 31, 80), num_heads=4, num_kv_heads=4, head_dim=32, block_size=8),
    Case((1, 1, 4), (100, 61, 90), block_size=32, sliding_window=24),
    Case((40, 1, 17), (40, 61, 90), sliding_window=16),  # windowed prefill from position 0
    Case((33, 100), (150, 100), num_heads=16, num_kv_heads=1),  # wide group: short tiles
    Case((1, 1, 2, 1), (77, 300, 20, 5), dtype="bfloat16"),
    Case((1,) * 64, tuple(range(20, 660, 10)), pad_seqs=0),  # enough keys for two threads
    # More query heads than one decode item holds (32): decode by per-KV-head tiles.
    Case((1, 1, 2), (70, 200, 33), num_heads=40, num_kv_heads=8, head_dim=32),
]


def _inputs(case: Case, seed: int):
    rng = np.random.default_rng(seed)
    bs, hkv, d = case.block_size, case.num_kv_heads, case.head_dim
    needed = [-(-n // bs) for n in case.seq_lens]
    num_blocks = sum(needed) + 8
    ids = rng.permutation(np.arange(1, num_blocks))
    width = max(needed) + 2
    num_seqs = len(case.seq_lens) + case.pad_seqs
    tables = np.zeros((num_seqs, width), np.int32)
    k = np.full((num_blocks, bs, hkv, d), np.nan, np.float32)
    v = np.full((num_blocks, bs, hkv, d), np.nan, np.float32)
    used = 0
    for s, n in enumerate(case.seq_lens):
        blocks = ids[used : used + needed[s]]
        used += needed[s]
        tables[s, : needed[s]] = blocks
        for p in range(n):  # only owned slots hold numbers
            k[blocks[p // bs], p % bs] = rng.standard_normal((hkv, d))
            v[blocks[p // bs], p % bs] = rng.standard_normal((hkv, d))
    num_tokens = sum(case.q_lens) + 3  # padding tokens past the last row
    qsl = np.full(num_seqs + 1, sum(case.q_lens), np.int32)
    qsl[: len(case.q_lens) + 1] = np.concatenate([[0], np.cumsum(case.q_lens)])
    seq_lens = np.zeros(num_seqs, np.int32)
    seq_lens[: len(case.seq_lens)] = case.seq_lens
    q = rng.standard_normal((num_tokens, case.num_heads, d)).astype(np.float32)
    dtype = jnp.dtype(case.dtype)
    return (
        jnp.asarray(q, dtype),
        jnp.asarray(k, dtype),
        jnp.asarray(v, dtype),
        jnp.asarray(tables),
        jnp.asarray(seq_lens),
        jnp.asarray(qsl),
    )


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"q{len(c.q_lens)}-{c.dtype}-d{c.head_dim}")
def test_matches_the_reference(case):
    args = _inputs(case, seed=len(case.seq_lens))
    scale = case.head_dim**-0.5
    clean = [jnp.nan_to_num(a) if i in (1, 2) else a for i, a in enumerate(args)]
    run = lambda fn, inputs: np.asarray(
        jax.jit(lambda *a: fn(*a, scale, case.sliding_window))(*inputs), np.float32
    )
    got = run(cpu_attention.paged_attention, clean)
    want = run(reference.paged_attention, clean)
    real = int(args[5][-1])
    limit = 1e-5 if case.dtype == "float32" else 1e-2
    error = np.abs(got[:real] - want[:real]).max() / np.abs(want[:real]).max()
    assert error <= limit, error
    poisoned = run(cpu_attention.paged_attention, args)
    assert np.isfinite(poisoned).all()  # padding rows included
    np.testing.assert_array_equal(poisoned, got)


def test_unsupported_dtypes_fall_back_to_the_reference():
    case = Case((1, 3), (10, 20), dtype="float16", pad_seqs=0)
    args = [jnp.nan_to_num(a) for a in _inputs(case, seed=0)]
    got = jax.jit(lambda *a: cpu_attention.paged_attention(*a, 0.125))(*args)
    want = jax.jit(lambda *a: reference.paged_attention(*a, 0.125))(*args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
