"""The Triton paged-attention kernels against the jax.numpy reference, without a GPU.

Launches `triton_attention`'s kernels through Triton's own launcher on torch tensors:
CPU tensors under Triton's interpreter (conftest sets `TRITON_INTERPRET=1`), or CUDA
tensors where torch sees a GPU. Every case draws fresh random inputs (never zeros),
fills each cache slot that no sequence owns with NaN (the kernel must never read one
unmasked), and fills the output and the split partials with NaN before the launch
(every output element must be written).

Error is |out - ref| / |ref| (Frobenius norms over the real tokens) against the
reference in float32 on the same, already rounded, inputs. Per-dtype thresholds, with
the worst measured here under the interpreter:
- float32 1e-5 (measured 5e-7): the same sums in another order.
- float16 1e-3 (measured 3e-4): P is rounded to float16 before P @ V, as on the GPU.
- bfloat16 1.5e-2 (measured 6e-3): P and the output keep 8 bits of mantissa, and the
  interpreter truncates float32 to bfloat16 where the GPU rounds to nearest.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import triton

from jvllm.kernels import reference
from jvllm.kernels import triton_attention as ta

THRESHOLDS = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 1.5e-2}
INTERPRETED = not isinstance(ta.paged_attention_kernel, triton.runtime.JITFunction)
DEVICE = "cpu" if INTERPRETED else "cuda"
REPO = Path(__file__).resolve().parents[2]
# Triton's interpreter runs each kernel a Python loop per program: a minute in all on CPU.
pytestmark = pytest.mark.slow


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    q_lens: tuple[int, ...]  # new tokens per sequence
    seq_lens: tuple[int, ...]  # tokens in the cache per sequence, new ones included
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    dtype: str = "float32"
    num_splits: int | None = 1  # None: the launch heuristic
    block_m: int | None = None
    tile_n: int | None = None
    sliding_window: int | None = None
    pad_tokens: int = 0  # tokens past query_start_loc[-1]
    pad_seqs: int = 0  # rows with no tokens and seq_len 0
    contiguous: bool = False  # blocks in order instead of shuffled
    kv_dtype: str | None = None  # the cache's dtype when not the query's (fp8)


MIXED = dict(q_lens=(37, 1, 9, 1), seq_lens=(37, 101, 39, 1))
CASES = [
    # Lengths around the block size (16 unless named), decode.
    Case("decode-len1", (1,), (1,)),
    Case("decode-len15", (1,), (15,)),
    Case("decode-len16", (1,), (16,)),
    Case("decode-len17", (1,), (17,)),
    Case("decode-bs8-len7-8-9", (1, 1, 1), (7, 8, 9), block_size=8, dtype="bfloat16"),
    Case("decode-bs32-len31-32-33", (1, 1, 1), (31, 32, 33), block_size=32, dtype="float16"),
    Case("decode-len1100-auto-split", (1,), (1100,), 8, 2, 128, dtype="bfloat16", num_splits=None),
    Case("decode-len1030-gqa8", (1,), (1030,), 8, 1, 64, tile_n=64),
    # Every GQA ratio with both model head dims.
    Case("gqa1-d64", (1, 1, 1), (5, 40, 77), 2, 2, 64),
    Case("gqa1-d128", (1, 1, 1), (5, 40, 77), 2, 2, 128, dtype="bfloat16"),
    Case("gqa2-d64", (1, 1, 1), (5, 40, 77), 4, 2, 64, dtype="float16"),
    Case("gqa2-d128", (1, 1, 1), (5, 40, 77), 4, 2, 128, dtype="float16"),
    Case("gqa4-d64", (1, 1, 1), (5, 40, 77), 4, 1, 64, dtype="bfloat16"),
    Case("gqa4-d128", (1, 1, 1), (5, 40, 77), 8, 2, 128),
    Case("gqa8-d64", (1, 1, 1), (5, 40, 77), 8, 1, 64, dtype="float16"),
    Case("gqa8-d128", (1, 1, 1), (5, 40, 77), 16, 2, 128, dtype="bfloat16"),
    # The tiny test checkpoints' head dims, and a group that is not a power of two.
    Case("d16-tiny-model", MIXED["q_lens"], MIXED["seq_lens"], 4, 2, 16),
    Case("d32-tiny-model", MIXED["q_lens"], MIXED["seq_lens"], 4, 2, 32, block_m=64),
    Case("gqa7", (3, 1), (3, 50), 14, 2, 64, dtype="bfloat16"),
    # Prefill of a whole prompt, lengths around the block size.
    Case("prefill-len1", (1,), (1,), block_m=64),
    Case("prefill-len15", (15,), (15,), block_m=64),
    Case("prefill-len16", (16,), (16,), block_m=64, dtype="bfloat16"),
    Case("prefill-len17", (17,), (17,), block_m=16),
    Case("prefill-len40-bs8", (40,), (40,), 8, 2, 64, 8, "float16", block_m=64),
    # Prefill chunks attending to a cached prefix.
    Case("chunk-20-after-50", (20,), (70,), block_m=64),
    Case("chunk-33-after-1000", (33,), (1033,), 4, 2, 128, 32, "bfloat16", block_m=64),
    # Mixed prefill / chunk / decode batches.
    Case("mixed", **MIXED),
    Case("mixed-bf16-split4", **MIXED, dtype="bfloat16", num_splits=4),
    Case("mixed-fp16-bs8-gqa4", **MIXED, num_heads=8, block_size=8, dtype="float16"),
    Case("mixed-contiguous", **MIXED, contiguous=True),
    Case("mixed-auto", **MIXED, num_splits=None, block_m=64),
    # Splitting the key range.
    Case("decode-split2", (1, 1), (300, 45), num_splits=2),
    Case("decode-split16-short", (1, 1), (3, 20), num_splits=16, tile_n=16),
    # Sliding window (Mistral).
    Case("window32-decode", (1, 1), (200, 20), sliding_window=32, tile_n=16),
    Case("window16-prefill", (50,), (50,), sliding_window=16, block_m=16, tile_n=16),
    Case("window-chunk-split4", (12,), (140,), sliding_window=40, num_splits=4),
    # Padding: tokens past query_start_loc[-1] and sequences with no tokens.
    Case("padding", **MIXED, pad_tokens=5, pad_seqs=3),
    Case("padding-split4", (1, 1), (30, 9), pad_tokens=6, pad_seqs=2, num_splits=4),
    Case("padding-only", (), (), pad_tokens=4, pad_seqs=2),
    # An fp8 KV cache (kv_cache_dtype="fp8"), cast up to the query's dtype on load.
    Case("mixed-fp8-cache-bf16", **MIXED, dtype="bfloat16", kv_dtype="float8_e4m3fn"),
    Case("decode-fp8-cache-f32", (1, 1), (40, 77), kv_dtype="float8_e4m3fn"),
]


@dataclasses.dataclass
class Inputs:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [N, BS, Hkv, D], NaN in every slot no sequence owns
    v_cache: torch.Tensor
    k_ref: np.ndarray  # float32, the same values with 0 for NaN
    v_ref: np.ndarray
    block_tables: torch.Tensor  # [S, W] int32
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32


def make_inputs(case: Case, gen: torch.Generator) -> Inputs:
    bs, dtype = case.block_size, getattr(torch, case.dtype)
    per_seq = [math.ceil(n / bs) for n in case.seq_lens]
    num_blocks = 1 + sum(per_seq) + 2  # the null block, the sequences' and two spare
    physical = torch.arange(1, num_blocks)
    if not case.contiguous:
        physical = physical[torch.randperm(num_blocks - 1, generator=gen)]
    num_seqs = len(case.seq_lens) + case.pad_seqs
    tables = torch.zeros(num_seqs, max(per_seq, default=0) + 1, dtype=torch.int32)
    owned = torch.zeros(num_blocks * bs, dtype=torch.bool)
    first = 0
    for s, (n, length) in enumerate(zip(per_seq, case.seq_lens, strict=True)):
        tables[s, :n] = physical[first : first + n]
        first += n
        pos = torch.arange(length)
        owned[tables[s, pos // bs].long() * bs + pos % bs] = True
    shape = (num_blocks, bs, case.num_kv_heads, case.head_dim)
    caches, refs = [], []
    for _ in range(2):
        kv_dtype = getattr(torch, case.kv_dtype or case.dtype)
        cache = torch.randn(shape, generator=gen).to(kv_dtype).float()  # rounded to kv_dtype
        ref = cache.clone().reshape(num_blocks * bs, -1)
        ref[~owned] = 0.0
        cache.view(num_blocks * bs, -1)[~owned] = float("nan")
        caches.append(cache.to(kv_dtype).to(DEVICE))
        refs.append(ref.reshape(shape).numpy())
    q_lens = list(case.q_lens) + [0] * case.pad_seqs
    num_tokens = sum(q_lens) + case.pad_tokens
    q = torch.randn(num_tokens, case.num_heads, case.head_dim, generator=gen).to(dtype)
    starts = np.concatenate([[0], np.cumsum(q_lens)])
    ints = lambda x: torch.tensor(np.asarray(x), dtype=torch.int32, device=DEVICE)
    return Inputs(
        q.to(DEVICE),
        caches[0],
        caches[1],
        refs[0],
        refs[1],
        tables.to(DEVICE),
        ints(list(case.seq_lens) + [0] * case.pad_seqs),
        ints(starts),
    )


def run_kernel(case: Case, x: Inputs) -> torch.Tensor:
    num_tokens, num_heads, head_dim = x.q.shape
    cfg = ta.launch_config(
        num_tokens,
        x.block_tables.shape[0],
        num_heads,
        case.num_kv_heads,
        head_dim,
        x.q.element_size(),
        num_splits=case.num_splits,
        block_m=case.block_m,
        tile_n=case.tile_n,
    )
    out = torch.full_like(x.q, float("nan"))
    part_shape, lse_shape = ta.partial_shapes(cfg, tuple(x.q.shape))
    if cfg.num_splits == 1:
        part_shape, lse_shape = (1,), (1,)
    nans = lambda shape: torch.full(shape, float("nan"), device=DEVICE)
    part_out, part_lse = nans(part_shape), nans(lse_shape)
    scale = head_dim**-0.5
    args = (x.q, x.k_cache, x.v_cache, x.block_tables, x.seq_lens, x.query_start_loc)
    ta.launch(*args, out, part_out, part_lse, cfg, scale, case.sliding_window)
    return out


_reference = jax.jit(reference.paged_attention, static_argnames=("scale", "sliding_window"))


def run_reference(case: Case, x: Inputs) -> np.ndarray:
    ints = lambda t: jnp.asarray(t.cpu().numpy())
    out = _reference(
        jnp.asarray(x.q.float().cpu().numpy()),
        jnp.asarray(x.k_ref),
        jnp.asarray(x.v_ref),
        ints(x.block_tables),
        ints(x.seq_lens),
        ints(x.query_start_loc),
        scale=case.head_dim**-0.5,
        sliding_window=case.sliding_window,
    )
    return np.asarray(out)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_kernel_matches_reference(case: Case) -> None:
    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    x = make_inputs(case, gen)
    got = run_kernel(case, x).float().cpu().numpy()
    unwritten = np.argwhere(~np.isfinite(got))
    assert unwritten.size == 0, f"unwritten or NaN outputs at [token, head, dim] {unwritten[:5]}"
    real = sum(case.q_lens)
    if real == 0:
        return
    want = run_reference(case, x)[:real]
    err = float(np.linalg.norm(got[:real] - want) / np.linalg.norm(want))
    assert err <= THRESHOLDS[case.dtype], f"relative error {err:.3g} > {THRESHOLDS[case.dtype]}"


def test_heuristic_splits_long_decode_and_not_prefill() -> None:
    decode = ta.launch_config(64, 64, 32, 8, 128, 2)
    prefill = ta.launch_config(2048, 64, 32, 8, 128, 2)
    assert decode.num_splits > 1 and decode.block_m == 16
    assert prefill.num_splits == 1 and prefill.block_m == 64


@pytest.mark.parametrize("head_dim", [8, 80, 512])
def test_unsupported_head_dim_is_refused(head_dim: int) -> None:
    with pytest.raises(ValueError, match="head_dim"):
        ta.launch_config(4, 2, 4, 2, head_dim, 2)


# Launch configurations whose GPU build is checked without a GPU: (T, S, Hq, Hkv, D, BS,
# dtype, splits, variant options). tl.dot's 16-row minimum and the shared memory per stage
# only show there.
HOPPER_BUILDS = [
    (256, 256, 32, 8, 128, 16, "bfloat16", None, {}),  # decode, the goal shape
    (64, 64, 32, 8, 128, 16, "bfloat16", 4, {}),  # split decode and the merge kernel
    (2048, 64, 32, 8, 128, 16, "bfloat16", None, {}),  # prefill tiles
    (128, 8, 4, 2, 16, 16, "float32", None, {}),  # the tiny test model in float32
    (2048, 16, 16, 8, 256, 16, "bfloat16", None, dict(soft_cap=50.0)),  # Gemma 2 prefill
    (64, 64, 64, 8, 64, 16, "bfloat16", 4, dict(has_sinks=True)),  # gpt-oss decode, merge
]


def compile_for_hopper() -> None:
    """Builds each of HOPPER_BUILDS for sm_90 with Triton's compiler (no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    types = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}

    def build(fn, pointers: list[str], params: dict, num_warps: int, num_stages: int) -> None:
        signature = dict(zip(fn.arg_names, pointers, strict=False))
        signature.update({name: "constexpr" for name in params})
        constants = {(fn.arg_names.index(k),): v for k, v in params.items()}
        aligned = {(i,): [["tt.divisibility", 16]] for i in range(len(pointers))}
        source = ASTSource(fn, signature, constants, aligned)
        options = {"num_warps": num_warps, "num_stages": num_stages}
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        assert kernel.metadata.shared <= 227 * 1024, kernel.metadata.shared

    for t, s, hq, hkv, d, bs, dtype, splits, options in HOPPER_BUILDS:
        cfg = ta.launch_config(t, s, hq, hkv, d, 4 if dtype == "float32" else 2, splits)
        shapes = (cfg, (t, hq, d), (64, bs, hkv, d), (s, 32), d**-0.5, None, dtype)
        params = ta.kernel_params(*shapes, **options)
        ty = types[dtype]
        out = "*fp32" if cfg.num_splits > 1 else f"*{ty}"
        pointers = [f"*{ty}"] * 3 + ["*i32"] * 3 + ["*fp32", out, "*fp32"]
        build(ta.paged_attention_kernel, pointers, params, cfg.num_warps, cfg.num_stages)
        if cfg.num_splits > 1:
            merge = ta.merge_params(cfg, (t, hq, d), options.get("has_sinks", False))
            build(ta.merge_splits_kernel, ["*fp32", "*fp32", "*fp32", f"*{ty}"], merge, 4, 1)


def test_kernels_compile_for_hopper() -> None:
    """The interpreter accepts what the GPU compiler rejects: build for sm_90 too."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "from tests.kernels.test_triton_interpreter import compile_for_hopper as c; c()"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]


def _interpreted_triton_call(*args, kernel, out_shape, grid, num_warps, num_stages=None, **meta):
    """Stands in for `jax_triton.triton_call` on the CPU: the same kernel, argument order
    and constexprs, launched by Triton's interpreter on torch copies of the arrays."""
    to_torch = lambda a: torch.from_numpy(np.array(a.astype(jnp.float32))).to(
        getattr(torch, jnp.dtype(a.dtype).name)
    )
    single = not isinstance(out_shape, tuple)
    shapes = (out_shape,) if single else out_shape
    nans = lambda s: torch.full(
        s.shape, float("nan"), dtype=getattr(torch, jnp.dtype(s.dtype).name)
    )
    outs = [nans(s) for s in shapes]
    kernel[grid](*map(to_torch, args), *outs, num_warps=num_warps, **meta)
    results = [
        jnp.asarray(o.float().numpy()).astype(s.dtype) for o, s in zip(outs, shapes, strict=True)
    ]
    return results[0] if single else tuple(results)


@pytest.mark.skipif(not INTERPRETED, reason="stands in for jax-triton with the interpreter")
@pytest.mark.parametrize("num_splits", [1, 4])
def test_jax_wrapper_arguments(num_splits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The jax-triton wrapper's launches (argument order, outputs, grid, constexprs)."""
    from jvllm.kernels import jax_triton_attention

    fake = type(sys)("jax_triton")
    fake.triton_call = _interpreted_triton_call
    monkeypatch.setitem(sys.modules, "jax_triton", fake)
    case = Case("wrapper", **MIXED, dtype="float16", pad_tokens=3, pad_seqs=1)
    x = make_inputs(case, torch.Generator().manual_seed(num_splits))
    jax_args = [jnp.asarray(t.float().cpu().numpy()) for t in (x.q, x.k_cache, x.v_cache)]
    jax_args = [a.astype(jnp.float16) for a in jax_args]
    jax_args += [jnp.asarray(t.cpu().numpy()) for t in (x.block_tables, x.seq_lens)]
    jax_args.append(jnp.asarray(x.query_start_loc.cpu().numpy()))
    got = jax_triton_attention.paged_attention(
        *jax_args, case.head_dim**-0.5, None, num_splits=num_splits
    )
    got = np.asarray(got.astype(jnp.float32))
    assert got.dtype == np.float32 and np.isfinite(got).all()
    real = sum(case.q_lens)
    want = run_reference(case, x)[:real]
    err = float(np.linalg.norm(got[:real] - want) / np.linalg.norm(want))
    assert err <= THRESHOLDS[case.dtype]
