"""The Triton MLA decode kernel against the jax.numpy latent attention, without a GPU.

Launches `triton_mla`'s kernel (and, split, the merge kernel) through Triton's own
launcher on torch CPU tensors under Triton's interpreter (conftest sets
`TRITON_INTERPRET=1`), or CUDA tensors where torch sees a GPU, and compares the decode
rows with `mla_reference.mla_paged_attention` on the same, already rounded, inputs:
random latents and rope keys, NaN in every cache slot no sequence owns (never read
unmasked), NaN-filled outputs (every element written), shuffled blocks, a padding row,
a head count that leaves the last head block partial. Error is |out - ref| / |ref|.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import triton

from jvllm.kernels import mla_reference
from jvllm.kernels import triton_mla as tm

INTERPRETED = not isinstance(tm.mla_decode_kernel, triton.runtime.JITFunction)
DEVICE = "cpu" if INTERPRETED else "cuda"
THRESHOLDS = {"float32": 1e-5, "bfloat16": 1.5e-2}
HEADS, NOPE, RANK, ROPE, V_DIM, BS = 20, 32, 64, 16, 32, 16
# Every case has 5 rows, 8 table columns and 24 blocks: one compile of the reference.
NUM_BLOCKS, WIDTH = 24, 8


def _inputs(seq_lens: tuple[int, ...], dtype: str, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    per_seq = [math.ceil(n / BS) for n in seq_lens]
    num_blocks = NUM_BLOCKS
    physical = 1 + torch.randperm(num_blocks - 1, generator=gen)
    tables = torch.zeros(len(seq_lens), WIDTH, dtype=torch.int32)
    owned = torch.zeros(num_blocks * BS, dtype=torch.bool)
    first = 0
    for s, (n, length) in enumerate(zip(per_seq, seq_lens, strict=True)):
        tables[s, :n] = physical[first : first + n]
        first += n
        pos = torch.arange(length)
        owned[tables[s, pos // BS].long() * BS + pos % BS] = True
    t_dtype = getattr(torch, dtype)
    rounded = lambda *shape: torch.randn(*shape, generator=gen).to(t_dtype).float()
    caches = {}
    for name, dim in (("latent", RANK), ("rope", ROPE)):
        cache = rounded(num_blocks * BS, dim)
        caches[name + "_ref"] = torch.where(owned[:, None], cache, 0.0).reshape(
            num_blocks, BS, 1, dim
        )
        cache[~owned] = float("nan")
        caches[name] = cache.reshape(num_blocks, BS, 1, dim).to(t_dtype).to(DEVICE)
    num_seqs = len(seq_lens)
    return dict(
        q_nope=rounded(num_seqs, HEADS, NOPE),
        q_pe=rounded(num_seqs, HEADS, ROPE),
        w_kb=rounded(HEADS, NOPE, RANK) / 4,
        w_vb=rounded(HEADS, V_DIM, RANK) / 4,
        tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        **caches,
    )


def _reference(x: dict, scale: float) -> np.ndarray:  # [S, H, Dv]
    j = lambda t: jnp.asarray(t.numpy())
    num_seqs = len(x["seq_lens"])
    qsl = jnp.arange(num_seqs + 1, dtype=jnp.int32)  # every row one query
    return np.asarray(
        _jitted_reference(
            j(x["q_nope"]),
            j(x["q_pe"]),
            j(x["latent_ref"]),
            j(x["rope_ref"]),
            j(x["w_kb"]),
            j(x["w_vb"]),
            j(x["tables"]),
            j(x["seq_lens"]),
            qsl,
            scale,
        )
    )


_jitted_reference = jax.jit(mla_reference.mla_paged_attention, static_argnums=(9,))


@pytest.mark.parametrize(
    "seq_lens,dtype,num_splits",
    [
        ((1, 16, 17, 100, 0), "float32", 1),
        ((1, 16, 17, 100, 0), "bfloat16", 1),
        ((3, 100, 40, 0, 9), "float32", 3),  # the merge kernel, splits with no keys
    ],
    ids=["f32", "bf16", "f32-split3"],
)
def test_mla_decode_kernel_matches_the_reference(seq_lens, dtype, num_splits):
    x = _inputs(seq_lens, dtype)
    scale = (NOPE + ROPE) ** -0.5
    t_dtype = getattr(torch, dtype)
    # The absorbed query, as `jax_triton_mla.mla_decode` folds it before the kernel.
    q_lat = torch.einsum("shd,hdr->shr", x["q_nope"], x["w_kb"]).to(t_dtype).contiguous()
    q_lat = q_lat.to(DEVICE)
    q_pe = x["q_pe"].to(t_dtype).to(DEVICE)
    num_seqs = len(seq_lens)
    cfg = tm.mla_launch_config(num_seqs, HEADS, RANK, ROPE, q_lat.element_size(), num_splits)
    out = torch.full_like(q_lat, float("nan"))
    part_shape, lse_shape = tm.mla_partial_shapes(cfg, num_seqs, HEADS, RANK)
    if num_splits == 1:
        part_shape, lse_shape = (1,), (1,)
    nans = lambda shape: torch.full(shape, float("nan"), device=DEVICE)
    tables, lens = x["tables"].to(DEVICE), x["seq_lens"].to(DEVICE)
    tm.launch(
        q_lat, q_pe, x["latent"], x["rope"], tables, lens, out, nans(part_shape),
        nans(lse_shape), cfg, scale,
    )  # fmt: skip
    got = torch.einsum("shr,hvr->shv", out.float().cpu(), x["w_vb"]).numpy()
    ref = _reference(x, scale)
    real = np.asarray(seq_lens) > 0
    assert np.isfinite(got).all()
    assert not got[~real].any(), "a padding row's output is zeros"
    err = np.linalg.norm(got[real] - ref[real]) / np.linalg.norm(ref[real])
    assert err < THRESHOLDS[dtype], err


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU and jax-triton")
@pytest.mark.parametrize("num_splits", [None, 1])
def test_mla_decode_in_jit_matches_the_reference_at_v3_shapes(num_splits):
    """`jax_triton_mla.mla_decode` inside jax.jit on the GPU, DeepSeek-V3's heads (128,
    nope 128, rope 64, latent 512, v 128), bf16, against the reference in float32."""
    from jvllm.kernels import jax_triton_mla

    rng = np.random.default_rng(0)
    heads, nope, rope, rank, v_dim, bs = 128, 128, 64, 512, 128, 16
    seq_lens = np.array([1, 17, 300, 2000, 4096, 0], np.int32)
    width = 4096 // bs + 1
    num_blocks = 1 + sum(-(-n // bs) for n in seq_lens)
    tables = np.zeros((len(seq_lens), width), np.int32)
    perm, first = 1 + rng.permutation(num_blocks - 1), 0
    for s, n in enumerate(seq_lens):
        tables[s, : -(-n // bs)] = perm[first : first + -(-n // bs)]
        first += -(-n // bs)
    bf16 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    q_nope, q_pe = bf16(len(seq_lens), heads, nope), bf16(len(seq_lens), heads, rope)
    latent, rope_cache = bf16(num_blocks, bs, 1, rank), bf16(num_blocks, bs, 1, rope)
    w_kb, w_vb = bf16(heads, nope, rank) / 16, bf16(heads, v_dim, rank) / 16
    scale = (nope + rope) ** -0.5
    args = (q_nope, q_pe, latent, rope_cache, w_kb, w_vb, jnp.asarray(tables), seq_lens)
    decode = jax.jit(lambda *a: jax_triton_mla.mla_decode(*a, scale, num_splits=num_splits))
    got = np.asarray(decode(*args), np.float32)
    f32 = [a.astype(jnp.float32) for a in args[:6]]
    qsl = jnp.arange(len(seq_lens) + 1, dtype=jnp.int32)
    ref = np.asarray(_jitted_reference(*f32, args[6], jnp.asarray(seq_lens), qsl, scale))
    real = seq_lens > 0
    assert not got[~real].any()
    err = np.linalg.norm(got[real] - ref[real]) / np.linalg.norm(ref[real])
    assert err < 2e-2, err


def _mixed_batch(dtype: jnp.dtype) -> tuple[tuple, jax.Array]:
    """Three decodes, a 5-token prefill chunk and a padding sequence over shuffled blocks
    (the runner's row order: decodes first), and its query_start_loc."""
    rng = np.random.default_rng(3)
    seq_lens = np.array([1, 17, 40, 12, 0], np.int32)
    q_lens = np.array([1, 1, 1, 5, 0], np.int32)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    num_tokens = int(q_lens.sum()) + 3  # bucket padding past the last row
    tables = np.zeros((len(seq_lens), WIDTH), np.int32)
    perm, first = 1 + rng.permutation(NUM_BLOCKS - 1), 0
    for s, n in enumerate(seq_lens):
        tables[s, : -(-n // BS)] = perm[first : first + -(-n // BS)]
        first += -(-n // BS)
    val = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    args = (
        val(num_tokens, HEADS, NOPE),
        val(num_tokens, HEADS, ROPE),
        val(NUM_BLOCKS, BS, 1, RANK),
        val(NUM_BLOCKS, BS, 1, ROPE),
        val(HEADS, NOPE, RANK) / 4,
        val(HEADS, V_DIM, RANK) / 4,
        jnp.asarray(tables),
        jnp.asarray(seq_lens),
    )
    return args, qsl


def _reference_decode(q_nope, q_pe, latent, rope, w_kb, w_vb, tables, seq_lens, scale):
    """`mla_decode`'s contract computed by the reference: one query per sequence."""
    qsl = jnp.arange(q_nope.shape[0] + 1, dtype=jnp.int32)
    out = mla_reference.mla_paged_attention(
        q_nope, q_pe, latent, rope, w_kb, w_vb, tables, seq_lens, qsl, scale
    )
    return jnp.where((seq_lens > 0)[:, None, None], out, 0.0)


@pytest.mark.parametrize("gpu", [False, pytest.param(True, marks=pytest.mark.gpu)])
def test_a_decode_kernel_takes_the_decode_rows_of_a_mixed_batch(gpu):
    """`mla_paged_attention(decode=...)` hands the kernel the leading decode rows and
    keeps the prefill rows expanded: equal to the reference alone. On a GPU the kernel is
    `jax_triton_mla.mla_decode`; on a CPU the same contract computed by the reference."""
    if gpu and jax.default_backend() != "gpu":
        pytest.skip("needs an NVIDIA GPU and jax-triton")
    if gpu:
        from jvllm.kernels.jax_triton_mla import mla_decode as decode
    else:
        decode = _reference_decode
    traced = []  # the kernel is traced into the program (once)
    kernel = decode
    decode = lambda *a: traced.append(a[0].shape) or kernel(*a)
    dtype = jnp.bfloat16 if gpu else jnp.float32
    args, qsl = _mixed_batch(dtype)
    scale = (NOPE + ROPE) ** -0.5
    attend = lambda *a, decode=None: mla_reference.mla_paged_attention(
        *a, qsl, scale, decode=decode
    )
    want = np.asarray(jax.jit(attend)(*args), np.float32)
    got = np.asarray(jax.jit(functools.partial(attend, decode=decode))(*args), np.float32)
    assert traced == [(5, HEADS, NOPE)]  # one query per sequence slot
    rows = int(qsl[-1])
    err = np.linalg.norm(got[:rows] - want[:rows]) / np.linalg.norm(want[:rows])
    assert err < (2e-2 if gpu else 1e-6), err
