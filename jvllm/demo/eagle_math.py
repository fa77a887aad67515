"""The demo target's and its EAGLE-1 head's forward, in plain JAX, for training.

Owns the math the trainer differentiates: RoPE, RMS norm, a Llama decoder layer, the
frozen target's post-norm features, and the head (fc over [embedding of t_{i+1},
target feature h_i], one decoder layer without its input norm, no final norm). Shares
no code with the serving model, so the engine's head is checked against an
independent one. Not the loss or the training loop (`train_eagle.py`).
"""

from __future__ import annotations

import math
from typing import Any

from jvllm.demo.train import _LAYER_KEYS, MODEL_SHAPE, RMS_EPS, ROPE_THETA


def rope_tables(t: int) -> tuple[Any, Any]:
    """cos, sin [T, 1, D/2] for positions 0..t-1."""
    import jax.numpy as jnp

    d = MODEL_SHAPE["head_dim"]
    inv_freq = 1.0 / ROPE_THETA ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    freqs = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq
    return jnp.cos(freqs)[:, None, :], jnp.sin(freqs)[:, None, :]


def rms(x: Any, w: Any) -> Any:
    import jax
    import jax.numpy as jnp

    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + RMS_EPS) * w


def rope(x: Any, cos: Any, sin: Any) -> Any:
    """x [B, T, N, D] rotated in HF's rotate-half layout."""
    import jax.numpy as jnp

    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def qkv(p: dict, y: Any, cos: Any, sin: Any) -> tuple[Any, Any, Any]:
    """Rotated q [B, T, Nq, D] and k, v repeated to the Nq query heads."""
    import jax.numpy as jnp

    nq, nk, d = (MODEL_SHAPE[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    b, t = y.shape[:2]
    q = rope((y @ p["wq"]).reshape(b, t, nq, d), cos, sin)
    k = jnp.repeat(rope((y @ p["wk"]).reshape(b, t, nk, d), cos, sin), nq // nk, 2)
    v = jnp.repeat((y @ p["wv"]).reshape(b, t, nk, d), nq // nk, 2)
    return q, k, v


def causal_attention(q: Any, k: Any, v: Any) -> Any:
    """[B, T, N, D] each -> [B, T, N*D]; position i attends to 0..i."""
    import jax
    import jax.numpy as jnp

    b, t, n, d = q.shape
    s = jnp.einsum("btnd,bsnd->bnts", q, k) / math.sqrt(d)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e30)
    return jnp.einsum("bnts,bsnd->btnd", jax.nn.softmax(s, -1), v).reshape(b, t, n * d)


def mlp(p: dict, a: Any) -> Any:
    import jax

    y = rms(a, p["ln2"])
    return (jax.nn.silu(y @ p["w_gate"]) * (y @ p["w_up"])) @ p["w_down"]


def decoder_layer(p: dict, x: Any, cos: Any, sin: Any) -> Any:
    """One Llama layer; without "ln1" in p it skips the input norm (EAGLE's layer 0)."""
    y = rms(x, p["ln1"]) if "ln1" in p else x
    a = x + causal_attention(*qkv(p, y, cos, sin)) @ p["wo"]
    return a + mlp(p, a)


def target_features(target: dict, tokens: Any) -> Any:
    """The target's post-norm hidden states [B, T, H] (what its lm_head scores)."""
    cos, sin = rope_tables(tokens.shape[1])
    x = target["embed"][tokens]
    for n in range(target["wq"].shape[0]):
        x = decoder_layer({k: target[k][n] for k in _LAYER_KEYS}, x, cos, sin)
    return rms(x, target["norm"])


def head_input(head: dict, embed: Any, next_tokens: Any, feats: Any) -> Any:
    import jax.numpy as jnp

    return jnp.concatenate([embed[next_tokens], feats], -1) @ head["fc"]


def head_forward(head: dict, embed: Any, next_tokens: Any, feats: Any) -> Any:
    """g [B, T, H]: the predicted feature h_{i+1} from t_{i+1} and h_i at each position i."""
    cos, sin = rope_tables(next_tokens.shape[1])
    return decoder_layer(head["layer"], head_input(head, embed, next_tokens, feats), cos, sin)


def head_second_step(head: dict, embed: Any, next_tokens: Any, feats: Any, g: Any) -> Any:
    """The head's second draft at every position j >= 1: its input feature is its own g_{j-1}
    instead of h_j, and it attends to positions 0..j-1 as computed from the real features
    plus itself (EAGLE's tree drafting). Row 0 is meaningless."""
    import jax
    import jax.numpy as jnp

    p = head["layer"]
    b, t, nq = next_tokens.shape[0], next_tokens.shape[1], MODEL_SHAPE["num_attention_heads"]
    cos, sin = rope_tables(t)
    x = head_input(head, embed, next_tokens, feats)
    _, k, v = qkv(p, x, cos, sin)
    prev = jnp.concatenate([jnp.zeros_like(g[:, :1]), g[:, :-1]], 1)
    x2 = head_input(head, embed, next_tokens, prev)
    q2, k2, v2 = qkv(p, x2, cos, sin)
    d = q2.shape[-1]
    before = jnp.einsum("btnd,bsnd->bnts", q2, k) / math.sqrt(d)
    before = jnp.where(jnp.tril(jnp.ones((t, t), bool), -1), before, -1e30)
    own = jnp.einsum("btnd,btnd->bnt", q2, k2)[..., None] / math.sqrt(d)
    w = jax.nn.softmax(jnp.concatenate([before, own], -1), -1)
    attn = jnp.einsum("bnts,bsnd->btnd", w[..., :t], v) + w[..., t:].transpose(0, 2, 1, 3) * v2
    a = x2 + attn.reshape(b, t, nq * d) @ p["wo"]
    return a + mlp(p, a)
