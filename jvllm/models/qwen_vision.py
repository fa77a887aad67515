"""Qwen2.5-VL's vision transformer as pure JAX functions over its checkpoint tensors.

Owns the tower's forward for one image of a given patch grid: the patch embedding
(Transformers' Conv3d over temporal_patch_size x patch x patch, as one matmul over the
processor's flattened patches), the 2-D rotary embedding of each patch's (row, column),
window attention (windows of `window_size` pixels over the merged grid) with full
attention at `fullatt_block_indexes`, RMSNorm + SwiGLU blocks, and the patch merger
(spatial_merge_size^2 patches -> one language-model embedding). The window order, the
rotary angles and each patch's window depend on the grid only, so they are numpy
constants of each grid's program. Parameters are a flat dict keyed by the tensor's name
inside `visual.` (`blocks.0.attn.qkv.weight`, `merger.mlp.0.bias`, ...). Not owned:
loading them (`models/qwen2_5_vl.py`), or the processor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.models.clip_vision import activation, linear

Params = dict[str, jax.Array]
Grid = tuple[int, int, int]  # (t, h, w) in patches, as the processor's image_grid_thw
RMS_EPS = 1e-6  # Transformers' Qwen2_5_VLRMSNorm of the tower and merger


@dataclass(frozen=True)
class QwenVisionSpec:
    hidden_size: int
    num_heads: int
    depth: int
    intermediate_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    out_hidden_size: int
    hidden_act: str = "silu"
    in_channels: int = 3
    rope_theta: float = 10000.0

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> QwenVisionSpec:
        rope = cfg.get("rope_parameters") or {}
        return cls(
            hidden_size=int(cfg.get("hidden_size", 1280)),
            num_heads=int(cfg.get("num_heads", 16)),
            depth=int(cfg.get("depth", 32)),
            intermediate_size=int(cfg.get("intermediate_size", 3420)),
            patch_size=int(cfg.get("patch_size", 14)),
            temporal_patch_size=int(cfg.get("temporal_patch_size", 2)),
            spatial_merge_size=int(cfg.get("spatial_merge_size", 2)),
            window_size=int(cfg.get("window_size", 112)),
            fullatt_block_indexes=tuple(cfg.get("fullatt_block_indexes", (7, 15, 23, 31))),
            out_hidden_size=int(cfg.get("out_hidden_size", 3584)),
            hidden_act=str(cfg.get("hidden_act", "silu")),
            in_channels=int(cfg.get("in_channels", 3)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2


def patch_positions(grid: Grid, merge: int) -> np.ndarray:
    """`[P, 2]` (row, column) of each patch in the processor's order: merge x merge
    blocks, row-major over blocks, repeated for each of the t frames."""
    t, h, w = grid
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    block = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(block).transpose(0, 2, 1, 3).ravel()
    cols = cols.reshape(block).transpose(0, 2, 1, 3).ravel()
    return np.tile(np.stack([rows, cols], axis=-1), (t, 1))


def window_order(spec: QwenVisionSpec, grid: Grid) -> tuple[np.ndarray, np.ndarray]:
    """The merged tokens' order window by window `[P / merge_unit]`, and each patch's
    window in that order `[P]` (Transformers' get_vision_window_index)."""
    t, h, w = grid
    m = spec.spatial_merge_size
    gh, gw = h // m, w // m
    side = spec.window_size // m // spec.patch_size  # merged tokens per window side
    nh, nw = -(-gh // side), -(-gw // side)
    index = np.full((t, nh * side, nw * side), -1, np.int64)
    index[:, :gh, :gw] = np.arange(t * gh * gw).reshape(t, gh, gw)
    windows = index.reshape(t, nh, side, nw, side).transpose(0, 1, 3, 2, 4).reshape(-1, side * side)
    order = windows[windows >= 0]
    window_of_token = np.repeat(np.arange(len(windows)), (windows >= 0).sum(axis=1))
    return order, np.repeat(window_of_token, spec.merge_unit)


def rotary(spec: QwenVisionSpec, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin `[P, head_dim]` float32 of each patch's (row, column): half the
    rotary frequencies turn with the row, half with the column."""
    half = spec.head_dim // 2
    inv = np.float32(1.0) / np.float32(spec.rope_theta) ** (
        np.arange(0, half, 2).astype(np.float32) / np.float32(half)
    )  # [head_dim / 4]
    freqs = positions[:, :, None].astype(np.float32) * inv  # [P, 2, head_dim / 4]
    freqs = freqs.reshape(len(positions), half)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb), np.sin(emb)


def rms_norm(p: Params, name: str, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt((x32 * x32).mean(-1, keepdims=True) + RMS_EPS)
    return p[f"{name}.weight"] * y.astype(x.dtype)


def _rotate(x: jax.Array, cos: np.ndarray, sin: np.ndarray) -> jax.Array:
    """`[P, heads, D]` rotated in float32 (Hugging Face's half-split layout)."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos[:, None] + rotated * sin[:, None]).astype(x.dtype)


Attend = Any  # (q, k, v) `[P, heads, hd]` each -> `[P, heads, hd]`
FULL_CHUNK = 1024  # queries a step in full-attention blocks: scores [heads, 1024, P]


def _attention(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array) -> jax.Array:
    """Softmax attention of `[B, Q, heads, hd]` queries over `[B, K, heads, hd]` keys
    where `allowed` `[B, Q or 1, K]`; float32 scores."""
    scale = q.shape[-1] ** -0.5
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * scale
    scores = jnp.where(allowed[:, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def windowed_attention(window_of_patch: np.ndarray) -> Attend:
    """Attention within each window, the patches being in window order: windows padded
    to the longest `W` and batched, so memory is `[windows, heads, W, W]`, linear in P."""
    n = len(window_of_patch)
    lengths = np.bincount(window_of_patch)
    width = int(lengths.max())
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    slot = np.arange(width)
    index = np.where(slot < lengths[:, None], starts[:, None] + slot, n)  # [nw, W]; pad -> n
    valid = index < n
    rows = np.flatnonzero(valid.ravel())  # [P]: where each patch lands in [nw * W]

    def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        def windows(x: jax.Array) -> jax.Array:  # [P, h, d] -> [nw, W, h, d]
            return jnp.concatenate([x, jnp.zeros_like(x[:1])])[index]

        out = _attention(windows(q), windows(k), windows(v), jnp.asarray(valid)[:, None, :])
        return out.reshape(-1, *q.shape[1:])[rows]

    return attend


def full_attention(frame_of_patch: np.ndarray) -> Attend:
    """Attention within each frame (the whole image for images), queries taken
    FULL_CHUNK at a time so the scores are `[heads, FULL_CHUNK, P]`."""
    n = len(frame_of_patch)
    chunk = min(n, FULL_CHUNK)
    padded = -(-n // chunk) * chunk
    frames = np.concatenate([frame_of_patch, np.full(padded - n, -1)]).astype(np.int32)

    def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        key_frames = jnp.asarray(frame_of_patch, jnp.int32)
        qs = jnp.concatenate([q, jnp.zeros((padded - n, *q.shape[1:]), q.dtype)])
        qs = qs.reshape(-1, chunk, *q.shape[1:])  # [chunks, C, h, d]
        q_frames = jnp.asarray(frames).reshape(-1, chunk)

        def one(args: tuple[jax.Array, jax.Array]) -> jax.Array:
            qc, fc = args
            allowed = (fc[:, None] == key_frames[None, :])[None]  # [1, C, P]
            return _attention(qc[None], k[None], v[None], allowed)[0]

        return jax.lax.map(one, (qs, q_frames)).reshape(padded, *q.shape[1:])[:n]

    return attend


def block(p: Params, spec: QwenVisionSpec, i: int, x: jax.Array, rope: tuple, attend: Attend):
    """One block: x + attention(norm1(x)) (`attend`: windowed or full), then
    + SwiGLU(norm2(x)). `x` `[P, hidden]`."""
    pre = f"blocks.{i}"
    n, heads, hd = x.shape[0], spec.num_heads, spec.head_dim
    qkv = linear(p, f"{pre}.attn.qkv", rms_norm(p, f"{pre}.norm1", x)).reshape(n, 3, heads, hd)
    q, k, v = _rotate(qkv[:, 0], *rope), _rotate(qkv[:, 1], *rope), qkv[:, 2]
    attn = attend(q, k, v).reshape(n, heads * hd)
    x = x + linear(p, f"{pre}.attn.proj", attn)
    h = rms_norm(p, f"{pre}.norm2", x)
    gate = activation_fn(spec.hidden_act, linear(p, f"{pre}.mlp.gate_proj", h))
    return x + linear(p, f"{pre}.mlp.down_proj", gate * linear(p, f"{pre}.mlp.up_proj", h))


def activation_fn(name: str, x: jax.Array) -> jax.Array:
    return jax.nn.silu(x) if name == "silu" else activation(name, x)


def encode(p: Params, spec: QwenVisionSpec, pixels: jax.Array, grid: Grid) -> jax.Array:
    """The processor's `[P, C * tps * patch * patch]` patches of one image of `grid`
    -> `[P / merge_unit, out_hidden_size]` embeddings, in the image's token order."""
    n = int(np.prod(grid))
    assert pixels.shape[0] == n, (pixels.shape, grid)
    w = p["patch_embed.proj.weight"]  # [D, C, tps, patch, patch]
    x = pixels.astype(w.dtype) @ w.reshape(w.shape[0], -1).T  # [P, D]
    order, window_of_patch = window_order(spec, grid)
    u = spec.merge_unit
    patch_order = (order[:, None] * u + np.arange(u)).ravel()  # [P]: patches window by window
    x = x[patch_order]
    cos, sin = rotary(spec, patch_positions(grid, spec.spatial_merge_size)[patch_order])
    windowed = windowed_attention(window_of_patch)
    full = full_attention(patch_order // (grid[1] * grid[2]))
    for i in range(spec.depth):
        attend = full if i in spec.fullatt_block_indexes else windowed
        x = block(p, spec, i, x, (cos, sin), attend)
    h = rms_norm(p, "merger.ln_q", x).reshape(n // u, -1)  # [P / u, D * u]
    h = activation("gelu", linear(p, "merger.mlp.0", h))
    out = linear(p, "merger.mlp.2", h)
    return out[np.argsort(order)]  # back to the image's token order
