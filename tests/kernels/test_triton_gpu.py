"""The Triton attention backend on a GPU, and its refusal elsewhere.

`gpu` tests (run with `pytest -m gpu`; skipped where JAX has no GPU): the jax-triton
launch inside `jax.jit` against the reference, and the full model with
`attention_backend="triton"` against `"reference"`. Unowned cache slots hold NaN,
as in the interpreter tests. Error thresholds, |out - ref| / |ref| against the
reference in float32 on the same inputs: float32 1e-5 (the kernel's fp32 dots are
IEEE, not tf32), float16 1e-3, bfloat16 1e-2 (P and the output rounded to bf16).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm import LLM, SamplingParams
from jvllm.engine_resolution import resolve_backend
from jvllm.kernels import reference

ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU and a CUDA jaxlib")
THRESHOLDS = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 1e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    q_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    num_splits: int | None = None
    sliding_window: int | None = None
    pad_tokens: int = 0
    pad_seqs: int = 0


CASES = [
    Case("decode-lengths", (1,) * 6, (1, 15, 16, 17, 1100, 4000), 32, 8, 128, 16, "bfloat16"),
    Case("decode-split8", (1, 1), (3000, 70), 32, 8, 128, 16, "bfloat16", num_splits=8),
    Case("mixed-fp16-bs8", (300, 1, 17, 1), (300, 900, 50, 8), 16, 8, 64, 8, "float16"),
    Case("mixed-fp32-bs32-gqa1", (40, 1, 1), (1040, 33, 32), 8, 8, 128, 32, "float32"),
    Case("window-bf16", (64, 1), (200, 500), 16, 4, 128, 16, "bfloat16", sliding_window=96),
    Case("tiny-model-d16", (5, 1, 1), (5, 17, 16), 4, 2, 16, 16, "float32", pad_tokens=3),
    Case("padding-gqa2", (7, 1), (7, 64), 8, 4, 64, 16, "bfloat16", pad_tokens=9, pad_seqs=5),
]


def make_inputs(case: Case, rng: np.random.Generator) -> tuple[tuple, tuple]:
    """(kernel arguments with NaN in unowned slots, the same with 0 there, in float32)."""
    bs = case.block_size
    per_seq = [math.ceil(n / bs) for n in case.seq_lens]
    num_blocks = 1 + sum(per_seq) + 2
    physical = rng.permutation(np.arange(1, num_blocks))
    num_seqs = len(case.seq_lens) + case.pad_seqs
    tables = np.zeros((num_seqs, max(per_seq) + 1), np.int32)
    owned = np.zeros(num_blocks * bs, bool)
    for s, (n, length) in enumerate(zip(per_seq, case.seq_lens, strict=True)):
        tables[s, :n] = physical[sum(per_seq[:s]) : sum(per_seq[:s]) + n]
        pos = np.arange(length)
        owned[tables[s, pos // bs] * bs + pos % bs] = True
    shape = (num_blocks, bs, case.num_kv_heads, case.head_dim)
    dtype = jnp.dtype(case.dtype)
    caches, refs = [], []
    for _ in range(2):
        cache = rng.standard_normal(shape, np.float32).astype(dtype).astype(np.float32)
        flat = cache.reshape(num_blocks * bs, -1)
        refs.append(np.where(owned[:, None], flat, 0.0).reshape(shape))
        caches.append(jnp.asarray(np.where(owned[:, None], flat, np.nan).reshape(shape), dtype))
    q_lens = list(case.q_lens) + [0] * case.pad_seqs
    num_tokens = sum(q_lens) + case.pad_tokens
    q = rng.standard_normal((num_tokens, case.num_heads, case.head_dim), np.float32)
    q = q.astype(dtype).astype(np.float32)
    meta = (
        jnp.asarray(tables),
        jnp.asarray(list(case.seq_lens) + [0] * case.pad_seqs, jnp.int32),
        jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
    )
    kernel_args = (jnp.asarray(q, dtype), *caches, *meta)
    reference_args = (jnp.asarray(q), *(jnp.asarray(r) for r in refs), *meta)
    return kernel_args, reference_args


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_jax_triton_matches_reference(case: Case) -> None:
    from jvllm.kernels import jax_triton_attention

    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    kernel_args, reference_args = make_inputs(case, rng)
    static = dict(scale=case.head_dim**-0.5, sliding_window=case.sliding_window)
    attend = functools.partial(
        jax_triton_attention.paged_attention, **static, num_splits=case.num_splits
    )
    got = np.asarray(jax.jit(attend)(*kernel_args).astype(jnp.float32))
    assert np.isfinite(got).all(), f"NaN outputs at {np.argwhere(~np.isfinite(got))[:5]}"
    real = sum(case.q_lens)
    want = np.asarray(reference.paged_attention(*reference_args, **static))[:real]
    err = float(np.linalg.norm(got[:real] - want) / np.linalg.norm(want))
    assert err <= THRESHOLDS[case.dtype], f"relative error {err:.3g} > {THRESHOLDS[case.dtype]}"


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_llm_triton_matches_reference(arch: str, checkpoints) -> None:
    """Greedy float32 generation: identical tokens, logprobs within 1e-3."""
    rng = np.random.default_rng(1)
    prompts = [
        {"prompt_token_ids": [int(t) for t in rng.integers(6, 512, size=n)]}
        for n in (1, 7, 16, 17, 100, 300)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1)
    runs = {}
    for backend in ("reference", "triton"):
        llm = LLM(
            str(checkpoints[arch]),
            dtype="float32",
            attention_backend=backend,
            max_model_len=512,
            max_num_seqs=8,
            max_num_batched_tokens=128,
            num_gpu_blocks_override=256,
        )
        runs[backend] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    for ref, got in zip(runs["reference"], runs["triton"], strict=True):
        assert got.token_ids == ref.token_ids
        ref_lp = [lp[t].logprob for lp, t in zip(ref.logprobs, ref.token_ids, strict=True)]
        got_lp = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids, strict=True)]
        np.testing.assert_allclose(got_lp, ref_lp, atol=1e-3)


@pytest.mark.skipif(ON_GPU, reason="checks the refusal without a GPU")
def test_triton_backend_needs_a_gpu() -> None:
    from jvllm.kernels import cpu_attention

    # On a CPU, auto is the C++ kernel where it can be built.
    assert resolve_backend("auto") == ("cpu" if cpu_attention.available() else "reference")
    assert resolve_backend("reference") == "reference"
    with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
        resolve_backend("triton")
