"""Attention variants (logit soft-capping, sinks, a custom softmax scale, sliding windows)
in every backend.

A dense softmax written here (float64 numpy, one query at a time over its sequence's
gathered keys) is checked against Transformers' own eager attention of Gemma 2 (soft
cap, scale, window) and gpt-oss (sinks, window); the jax.numpy reference is checked
against that dense softmax; the C++ CPU kernel and the Triton kernel (under Triton's
interpreter on a CPU, compiled inside jax.jit where a GPU is lent) against the
reference. Every batch is ragged: decode rows, a prefill chunk after a cached prefix, a
whole prompt, padding tokens and a padding row; GQA (8 query heads over 2 KV heads),
block size 16, shuffled blocks. The kernels read a cache whose unowned slots hold NaN
(a read past a table or a position shows up).
Errors are relative Frobenius norms over real tokens: float32 within 1e-5 (sums in
another order; a tanh written with exp in the Triton kernel), bfloat16 within 1.5e-2.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import triton

from jvllm.kernels import cpu_attention, reference
from jvllm.kernels import triton_attention as ta
from jvllm.layers import attention

HEADS, KV_HEADS, DIM, BS = 8, 2, 64, 16
Q_LENS = (1, 9, 1, 20)  # decode, chunk of 9 after 36 cached, decode, whole prompt
SEQ_LENS = (40, 45, 77, 20)
PAD_TOKENS, PAD_SEQS = 3, 1
LIMITS = {"float32": 1e-5, "bfloat16": 1.5e-2}


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    scale: float = DIM**-0.5
    soft_cap: float | None = None
    sinks: bool = False
    sliding_window: int | None = None


VARIANTS = [
    Variant("plain"),
    Variant("query-pre-attn-scalar", scale=256**-0.5),  # Gemma: scale from the config
    Variant("soft-cap", soft_cap=2.0, scale=0.4),  # logits past the cap: tanh bends them
    Variant("sinks", sinks=True),
    Variant("window", sliding_window=24),
    Variant("gemma2-local", scale=0.3, soft_cap=3.0, sliding_window=16),
    Variant("gpt-oss-local", sinks=True, sliding_window=12),
    Variant("all", scale=0.3, soft_cap=2.5, sinks=True, sliding_window=30),
]


@dataclasses.dataclass
class Batch:
    q: np.ndarray  # [T, Hq, D] float32
    k: np.ndarray  # [N, BS, Hkv, D], NaN in every slot no sequence owns
    v: np.ndarray
    tables: np.ndarray  # [S, W] int32
    seq_lens: np.ndarray  # [S] int32
    qsl: np.ndarray  # [S + 1] int32
    sinks: np.ndarray  # [Hq] float32

    @property
    def real(self) -> int:
        return int(self.qsl[-1])

    def clean(self) -> tuple[np.ndarray, np.ndarray]:
        return np.nan_to_num(self.k), np.nan_to_num(self.v)


def make_batch(seed: int, dtype: str = "float32") -> Batch:
    """Random inputs, already rounded to dtype (so every backend sees the same values)."""
    rng = np.random.default_rng(seed)
    rounded = lambda x: np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))
    per_seq = [-(-n // BS) for n in SEQ_LENS]
    num_blocks = sum(per_seq) + 3
    physical = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(SEQ_LENS) + PAD_SEQS, max(per_seq) + 1), np.int32)
    k = np.full((num_blocks, BS, KV_HEADS, DIM), np.nan, np.float32)
    v = k.copy()
    first = 0
    for s, (n, length) in enumerate(zip(per_seq, SEQ_LENS, strict=True)):
        tables[s, :n] = physical[first : first + n]
        first += n
        for p in range(length):
            k[tables[s, p // BS], p % BS] = rounded(rng.standard_normal((KV_HEADS, DIM)))
            v[tables[s, p // BS], p % BS] = rounded(rng.standard_normal((KV_HEADS, DIM)))
    q_lens = list(Q_LENS) + [0] * PAD_SEQS
    q = rounded(2 * rng.standard_normal((sum(q_lens) + PAD_TOKENS, HEADS, DIM)))
    sinks = (2 * rng.standard_normal(HEADS)).astype(np.float32)
    return Batch(
        q,
        k,
        v,
        tables,
        np.array(list(SEQ_LENS) + [0] * PAD_SEQS, np.int32),
        np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
        sinks,
    )


def dense_attention(
    q: np.ndarray,  # [n, Hq, D]
    k: np.ndarray,  # [L, Hkv, D], the sequence's keys by position
    v: np.ndarray,
    positions: np.ndarray,  # [n]
    variant: Variant,
    sinks: np.ndarray,  # [Hq]
) -> np.ndarray:  # [n, Hq, D]
    """Softmax attention written out, in float64: one query at a time."""
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k.astype(np.float64), group, axis=1)  # [L, Hq, D]
    v = np.repeat(v.astype(np.float64), group, axis=1)
    key_pos = np.arange(k.shape[0])
    out = np.zeros(q.shape, np.float64)
    for i, pos in enumerate(positions):
        logits = variant.scale * np.einsum("hd,lhd->hl", q[i].astype(np.float64), k)
        if variant.soft_cap:
            logits = variant.soft_cap * np.tanh(logits / variant.soft_cap)
        visible = key_pos <= pos
        if variant.sliding_window:
            visible &= key_pos > pos - variant.sliding_window
        logits = np.where(visible[None, :], logits, -np.inf)
        if variant.sinks:
            logits = np.concatenate([logits, sinks[:, None].astype(np.float64)], axis=1)
        weights = np.exp(logits - logits.max(axis=1, keepdims=True))
        weights /= weights.sum(axis=1, keepdims=True)
        out[i] = np.einsum("hl,lhd->hd", weights[:, : k.shape[0]], v)
    return out


def dense_batch(b: Batch, variant: Variant) -> np.ndarray:  # [real, Hq, D]
    k, v = b.clean()
    k, v = k.reshape(-1, KV_HEADS, DIM), v.reshape(-1, KV_HEADS, DIM)
    out = []
    for s, length in enumerate(SEQ_LENS):
        lo, hi = b.qsl[s], b.qsl[s + 1]
        pos = np.arange(length)
        slots = b.tables[s, pos // BS] * BS + pos % BS
        positions = np.arange(length - (hi - lo), length)
        out.append(dense_attention(b.q[lo:hi], k[slots], v[slots], positions, variant, b.sinks))
    return np.concatenate(out)


def rel_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def run_jax(fn, b: Batch, variant: Variant, dtype: str = "float32", clean: bool = False):
    k, v = b.clean() if clean else (b.k, b.v)
    arrays = [jnp.asarray(x, dtype) for x in (b.q, k, v)]
    arrays += [jnp.asarray(x) for x in (b.tables, b.seq_lens, b.qsl)]
    sinks = jnp.asarray(b.sinks) if variant.sinks else None
    options = dict(soft_cap=variant.soft_cap)

    @jax.jit
    def call(*a):
        return fn(*a, variant.scale, variant.sliding_window, sinks=sinks, **options)

    return np.asarray(call(*arrays).astype(jnp.float32))


def test_dense_softmax_is_transformers_eager_attention():
    """The dense softmax above against Gemma 2's and gpt-oss's eager attention."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss

    rng = np.random.default_rng(0)
    length = 40
    q = 2 * rng.standard_normal((length, HEADS, DIM)).astype(np.float32)
    k, v = rng.standard_normal((2, length, KV_HEADS, DIM)).astype(np.float32)
    sinks = (2 * rng.standard_normal(HEADS)).astype(np.float32)
    pos = np.arange(length)
    to_hf = lambda x: torch.from_numpy(x).transpose(0, 1)[None]  # [1, H, L, D]
    module = types.SimpleNamespace(
        num_key_value_groups=HEADS // KV_HEADS,
        training=False,
        head_dim=DIM,
        sinks=torch.from_numpy(sinks),
    )
    for variant, eager in [
        (Variant("gemma2", scale=0.3, soft_cap=3.0, sliding_window=16), gemma2),
        (Variant("gpt-oss", sinks=True, sliding_window=12), gpt_oss),
    ]:
        window = variant.sliding_window
        visible = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
        mask = torch.from_numpy(np.where(visible, 0.0, -np.inf).astype(np.float32))[None, None]
        extra = dict(softcap=variant.soft_cap) if variant.soft_cap else {}
        want, _ = eager(
            module, to_hf(q), to_hf(k), to_hf(v), mask, scaling=variant.scale, dropout=0.0, **extra
        )
        got = dense_attention(q, k, v, pos, variant, sinks)
        assert rel_error(got, want[0].double().numpy()) < 1e-6, variant.name


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_reference_matches_dense_softmax(variant: Variant):
    b = make_batch(zlib.crc32(variant.name.encode()))
    got = run_jax(reference.paged_attention, b, variant, clean=True)
    assert np.isfinite(got).all()
    assert rel_error(got[: b.real], dense_batch(b, variant)) <= 1e-5


@pytest.mark.skipif(not cpu_attention.available(), reason="no C++ compiler to build the kernel")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_cpu_kernel_matches_reference(variant: Variant, dtype: str):
    b = make_batch(zlib.crc32(variant.name.encode()) + 1, dtype)
    want = run_jax(reference.paged_attention, b, variant, clean=True)[: b.real]
    got = run_jax(cpu_attention.paged_attention, b, variant, dtype)
    assert np.isfinite(got).all()  # NaN slots never read, padding rows written
    assert rel_error(got[: b.real], want) <= LIMITS[dtype]


# Under the interpreter each launch takes seconds: the variants that change the kernel.
TRITON_CASES = [
    (VARIANTS[2], "float32", 1),  # soft cap
    (VARIANTS[3], "float32", 1),  # sinks in the attention kernel
    (VARIANTS[3], "float32", 4),  # sinks in the merge of split partials
    (VARIANTS[7], "bfloat16", 1),  # everything at once
    (VARIANTS[7], "float32", 2),
]


def _triton(b: Batch, variant: Variant, dtype: str, splits: int) -> np.ndarray:
    device = "cuda" if isinstance(ta.paged_attention_kernel, triton.runtime.JITFunction) else "cpu"
    tensor = lambda x, dt=torch.float32: torch.from_numpy(np.array(x)).to(dt).to(device)
    q = tensor(b.q, getattr(torch, dtype))
    k, v = (tensor(x, getattr(torch, dtype)) for x in (b.k, b.v))
    cfg = ta.launch_config(
        q.shape[0], len(b.seq_lens), HEADS, KV_HEADS, DIM, q.element_size(), splits
    )
    part_shape, lse_shape = ta.partial_shapes(cfg, tuple(q.shape))
    if splits == 1:
        part_shape, lse_shape = (1,), (1,)
    nans = lambda shape: torch.full(shape, float("nan"), device=device)
    out, part_out, part_lse = torch.full_like(q, float("nan")), nans(part_shape), nans(lse_shape)
    ints = [tensor(x, torch.int32) for x in (b.tables, b.seq_lens, b.qsl)]
    sinks = tensor(b.sinks) if variant.sinks else None
    ta.launch(
        q,
        k,
        v,
        *ints,
        out,
        part_out,
        part_lse,
        cfg,
        variant.scale,
        variant.sliding_window,
        soft_cap=variant.soft_cap,
        sinks=sinks,
    )
    return out.float().cpu().numpy()


@pytest.mark.parametrize(
    "variant,dtype,splits", TRITON_CASES, ids=lambda x: getattr(x, "name", str(x))
)
def test_triton_kernel_matches_reference(variant: Variant, dtype: str, splits: int):
    b = make_batch(zlib.crc32(variant.name.encode()) + 2, dtype)
    want = run_jax(reference.paged_attention, b, variant, clean=True)[: b.real]
    got = _triton(b, variant, dtype, splits)
    assert np.isfinite(got).all(), np.argwhere(~np.isfinite(got))[:5]
    assert rel_error(got[: b.real], want) <= LIMITS[dtype]


@pytest.mark.parametrize("splits", [1, 2])
def test_jax_triton_wrapper_passes_the_options(splits: int, monkeypatch: pytest.MonkeyPatch):
    """jax_triton_attention's launches (sinks operand, constexprs) under the interpreter,
    with jax-triton's `triton_call` stood in for by the interpreter launch."""
    from jvllm.kernels import jax_triton_attention
    from tests.kernels.test_triton_interpreter import INTERPRETED, _interpreted_triton_call

    if not INTERPRETED:
        pytest.skip("stands in for jax-triton with the interpreter")
    fake = types.ModuleType("jax_triton")
    fake.triton_call = _interpreted_triton_call
    monkeypatch.setitem(sys.modules, "jax_triton", fake)
    variant = VARIANTS[7]
    b = make_batch(11)
    want = run_jax(reference.paged_attention, b, variant, clean=True)[: b.real]
    fn = functools.partial(jax_triton_attention.paged_attention, num_splits=splits)
    arrays = [jnp.asarray(x) for x in (b.q, b.k, b.v, b.tables, b.seq_lens, b.qsl)]
    got = fn(
        *arrays,
        variant.scale,
        variant.sliding_window,
        soft_cap=variant.soft_cap,
        sinks=jnp.asarray(b.sinks),
    )
    assert rel_error(np.asarray(got)[: b.real], want) <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU and a CUDA jaxlib")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_jax_triton_on_a_gpu_matches_reference(variant: Variant, dtype: str):
    """The compiled kernels inside jax.jit (bench/gpu_check.sh runs `-m gpu`)."""
    from jvllm.kernels import jax_triton_attention

    b = make_batch(zlib.crc32(variant.name.encode()) + 3, dtype)
    want = run_jax(reference.paged_attention, b, variant, clean=True)[: b.real]
    got = run_jax(jax_triton_attention.paged_attention, b, variant, dtype)
    assert np.isfinite(got).all()
    assert rel_error(got[: b.real], want) <= LIMITS[dtype]


def test_layer_threads_the_options_to_each_backend():
    """layers.attention: defaults give today's attention; options reach the backend."""
    b = make_batch(7)
    k, v = b.clean()
    q = jnp.asarray(b.q)
    new_k, new_v = jnp.zeros((q.shape[0], KV_HEADS, DIM)), jnp.zeros((q.shape[0], KV_HEADS, DIM))
    meta = attention.AttentionMetadata(
        slot_mapping=jnp.zeros(q.shape[0], jnp.int32),  # every token writes the null block
        query_start_loc=jnp.asarray(b.qsl),
        seq_lens=jnp.asarray(b.seq_lens),
        block_tables=jnp.asarray(b.tables),
    )
    cache = (jnp.asarray(k), jnp.asarray(v))
    variant = VARIANTS[7]
    backends = ["reference"] + (["cpu"] if cpu_attention.available() else [])
    for backend in backends:
        run = lambda backend, **kw: np.asarray(
            attention.paged_attention(backend, q, new_k, new_v, cache, meta, variant.scale, **kw)[0]
        )
        plain = run(backend, sliding_window=None)
        want_plain = run_jax(
            reference.paged_attention, b, Variant("p", scale=variant.scale), clean=True
        )
        assert rel_error(plain[: b.real], want_plain[: b.real]) <= 1e-5
        got = run(
            backend,
            sliding_window=variant.sliding_window,
            soft_cap=variant.soft_cap,
            sinks=jnp.asarray(b.sinks),
        )
        assert rel_error(got[: b.real], dense_batch(b, variant)) <= 1e-5, backend
    bad = dict(soft_cap=0.0), dict(sliding_window=0), dict(sinks=jnp.zeros(3))
    for kwargs in bad:
        options = {"sliding_window": None, **kwargs}
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            attention.paged_attention("reference", q, new_k, new_v, cache, meta, 0.1, **options)
