"""DeepSeek's multi-head latent attention (MLA) as a Flax module over the paged cache.

Owns the projections (`q_proj`, or `q_a_proj` -> `q_a_layernorm` -> `q_b_proj` with
q_lora; `kv_a_proj_with_mqa` -> `kv_a_layernorm`; `kv_b_proj`; `o_proj`, named as the
checkpoint names them), the rope of the shared key (interleaved pairs turned into
Hugging Face's half-split layout, the same permutation on q and k, so every dot product
is unchanged), the softmax scale (yarn's mscale^2 included) and the cache write: per
token, one layer's cache keeps only the latent `[kv_lora_rank]` (as K) and the rotated
rope key `[qk_rope_head_dim]` (as V), one head shared by every query head. The
attention itself is `kernels/mla_reference.py`.

Under tensor parallelism the query heads are split (`q_proj`/`q_b_proj` and `kv_b_proj`
by rows, `o_proj` by columns, as `parallel/mesh.py` splits them), while the latent
projection, its norm and the cache stay whole on every device: each device writes the
same latents and attends with its own heads, and o_proj's partial sums are all-reduced.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jvllm.kernels.mla_reference import mla_paged_attention, write_latent
from jvllm.layers.attention import AttentionMetadata, KVCache
from jvllm.layers.rotary import apply_rotary, yarn_softmax_scale
from jvllm.models.llama import Linear, RMSNorm
from jvllm.models.quantization import QUANTIZED_LAYERS, param
from jvllm.models.spec import ModelSpec
from jvllm.parallel.mesh import AXIS, HEADS

# DeepSeek's q_a_layernorm and kv_a_layernorm keep the RMSNorm default, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def deinterleave(x: jax.Array) -> jax.Array:
    """`[..., D]` pairs `(x0, x1), (x2, x3), ...` -> `[x0, x2, ..., x1, x3, ...]`."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


class MLAttention(nn.Module):
    spec: ModelSpec
    dtype: jnp.dtype
    backend: str
    mesh: Mesh | None = None

    def _linear(self, features: int, bias: bool, name: str) -> Linear:
        # Only the layers `models.weight_layout` turns are held `[in, out]`.
        transposed = self.spec.transposed_weights and name in QUANTIZED_LAYERS
        return Linear(features, bias, self.dtype, None, transposed, name=name)

    @nn.compact
    def __call__(
        self,
        x: jax.Array,  # [T, H]
        cos_sin: tuple[jax.Array, jax.Array],  # [T, Dr] each
        cache: KVCache,  # latent [N, BS, 1, R], rope key [N, BS, 1, Dr]
        meta: AttentionMetadata,
    ) -> tuple[jax.Array, KVCache]:
        s, m, t = self.spec, self.spec.mla, x.shape[0]
        heads, dn, dr, rank = s.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
        if m.q_lora_rank is None:
            q = self._linear(heads * m.qk_head_dim, False, "q_proj")(x)
        else:
            q = self._linear(m.q_lora_rank, m.attention_bias, "q_a_proj")(x)
            q = RMSNorm(LATENT_NORM_EPS, self.dtype, name="q_a_layernorm")(q)
            q = self._linear(heads * m.qk_head_dim, False, "q_b_proj")(q)
        q = q.reshape(t, heads, m.qk_head_dim)
        q_nope, q_pe = q[..., :dn], q[..., dn:]  # [T, Hq, Dn], [T, Hq, Dr]
        kv = self._linear(rank + dr, m.attention_bias, "kv_a_proj_with_mqa")(x)
        latent = RMSNorm(LATENT_NORM_EPS, self.dtype, name="kv_a_layernorm")(kv[:, :rank])
        k_pe = kv[:, None, rank:]  # [T, 1, Dr]
        if m.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = apply_rotary(q_pe, *cos_sin), apply_rotary(k_pe, *cos_sin)
        cache = write_latent(cache[0], cache[1], latent, k_pe[:, 0], meta.slot_mapping)
        w_kv_b = UpProjection(heads * (dn + m.v_head_dim), rank, self.dtype, name="kv_b_proj")()
        w_kv_b = w_kv_b.reshape(heads, dn + m.v_head_dim, rank)
        w_kb, w_vb = w_kv_b[:, :dn], w_kv_b[:, dn:]  # [Hq, Dn, R], [Hq, Dv, R]
        scale = yarn_softmax_scale(s.rope, m.qk_head_dim**-0.5)
        attend = functools.partial(mla_attention, self.backend, scale=scale)
        if self.mesh is not None:
            # Each device attends with its own heads over the whole latent cache.
            split = P(AXIS, None, None)
            attend = jax.shard_map(
                attend,
                mesh=self.mesh,
                in_specs=(HEADS, HEADS, (P(), P()), split, split, P()),
                out_specs=HEADS,
                check_vma=False,
            )
        out = attend(q_nope, q_pe, cache, w_kb, w_vb, meta)  # [T, Hq, Dv]
        out = self._linear(s.hidden_size, m.attention_bias, "o_proj")(out.reshape(t, -1))
        return out, cache


class UpProjection(nn.Module):
    """`kv_b_proj.weight` `[Hq * (Dn + Dv), R]` as stored: the attention splits it per
    head into the key and value up-projections rather than multiplying by it whole."""

    features: int
    rank: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self) -> jax.Array:
        init = nn.initializers.normal(0.02)
        return param(self, "weight", init, (self.features, self.rank), self.dtype)


def mla_attention(
    backend: str,
    q_nope: jax.Array,  # [T, Hq, Dn]
    q_pe: jax.Array,  # [T, Hq, Dr]
    cache: KVCache,
    w_kb: jax.Array,  # [Hq, Dn, R]
    w_vb: jax.Array,  # [Hq, Dv, R]
    meta: AttentionMetadata,
    scale: float,
) -> jax.Array:  # [T, Hq, Dv]
    """The latent attention of one layer: the jax.numpy reference
    (`kernels/mla_reference.py`) on every backend, whose decode rows the Triton kernel
    (`kernels/jax_triton_mla.py`) computes on the "triton" backend."""
    decode = None
    if backend == "triton":
        from jvllm.kernels.jax_triton_mla import mla_decode as decode
    return mla_paged_attention(
        q_nope,
        q_pe,
        *cache,
        w_kb,
        w_vb,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        scale,
        decode,
    )
