"""The CLIP and SigLIP vision transformers as pure JAX functions over their checkpoint
tensors.

Owns the tower's forward (patch embedding, CLIP's class token and pre-norm, position
embeddings, the encoder layers) up to a requested layer, with Transformers'
`hidden_states` numbering: 0 is the embeddings (after CLIP's pre-norm), i the output of
encoder layer i. SigLIP's layers are CLIP's; it has no class token and no pre-norm.
Parameters are a flat dict keyed by the tensor's name inside the tower
(`embeddings.patch_embedding.weight`, `encoder.layers.0.mlp.fc1.bias`, ...). Not owned:
loading them, the projector, or choosing the layer (`models/llava.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

Params = dict[str, jax.Array]


@dataclass(frozen=True)
class CLIPVisionSpec:
    hidden_size: int
    num_heads: int
    num_layers: int
    patch_size: int
    image_size: int
    layer_norm_eps: float
    hidden_act: str
    model_type: str = "clip_vision_model"

    @property
    def has_class_token(self) -> bool:
        return self.model_type == "clip_vision_model"

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> CLIPVisionSpec:
        model_type = cfg.get("model_type", "clip_vision_model")
        if model_type not in _DEFAULT_ACT:
            raise ValueError(
                f"vision_config model_type {model_type!r} is not supported "
                f"({', '.join(_DEFAULT_ACT)})"
            )
        return cls(
            hidden_size=int(cfg.get("hidden_size", 768)),
            num_heads=int(cfg.get("num_attention_heads", 12)),
            num_layers=int(cfg.get("num_hidden_layers", 12)),
            patch_size=int(cfg.get("patch_size", 32)),
            image_size=int(cfg.get("image_size", 224)),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-5)),
            hidden_act=str(cfg.get("hidden_act", _DEFAULT_ACT[model_type])),
            model_type=model_type,
        )


# The vision towers read here, with the activation their configs default to.
_DEFAULT_ACT = {"clip_vision_model": "quick_gelu", "siglip_vision_model": "gelu_pytorch_tanh"}


def activation(name: str, x: jax.Array) -> jax.Array:
    if name == "quick_gelu":
        return x * jax.nn.sigmoid(1.702 * x)
    if name == "gelu":
        return jax.nn.gelu(x, approximate=False)
    if name in ("gelu_pytorch_tanh", "gelu_new"):
        return jax.nn.gelu(x, approximate=True)
    raise ValueError(f"activation {name!r} is not supported (quick_gelu, gelu, gelu_pytorch_tanh)")


def layer_norm(p: Params, name: str, x: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * p[f"{name}.weight"] + p[f"{name}.bias"]).astype(x.dtype)


def linear(p: Params, name: str, x: jax.Array) -> jax.Array:
    """x @ W^T + b with the checkpoint's `[out, in]` weight."""
    y = x @ p[f"{name}.weight"].T
    bias = p.get(f"{name}.bias")
    return y if bias is None else y + bias


def embeddings(p: Params, spec: CLIPVisionSpec, pixels: jax.Array) -> jax.Array:
    """`[N, 3, H, W]` pixels -> `[N, (H/p)*(W/p), D]`, CLIP's class token first."""
    w = p["embeddings.patch_embedding.weight"]  # [D, 3, p, p]
    patches = jax.lax.conv_general_dilated(
        pixels.astype(w.dtype),
        w,
        (spec.patch_size,) * 2,
        "VALID",
        dimension_numbers=("NCHW", "OIHW", "NCHW"),
    )  # [N, D, H/p, W/p]
    n, d = patches.shape[:2]
    x = patches.reshape(n, d, -1).transpose(0, 2, 1)  # [N, P, D]
    if "embeddings.patch_embedding.bias" in p:  # SigLIP's
        x = x + p["embeddings.patch_embedding.bias"]
    if spec.has_class_token:
        cls = jnp.broadcast_to(p["embeddings.class_embedding"], (n, 1, d))
        x = jnp.concatenate([cls.astype(x.dtype), x], axis=1)
    return x + p["embeddings.position_embedding.weight"][None, : x.shape[1]]


def encoder_layer(p: Params, spec: CLIPVisionSpec, i: int, x: jax.Array) -> jax.Array:
    """One pre-norm block: x + attention(ln1(x)), then + mlp(ln2(...))."""
    pre = f"encoder.layers.{i}"
    n, t, d = x.shape
    heads, hd = spec.num_heads, d // spec.num_heads
    h = layer_norm(p, f"{pre}.layer_norm1", x, spec.layer_norm_eps)
    q, k, v = (linear(p, f"{pre}.self_attn.{m}_proj", h).reshape(n, t, heads, hd) for m in "qkv")
    scores = jnp.einsum("nqhd,nkhd->nhqk", q, k).astype(jnp.float32) * hd**-0.5
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    attn = jnp.einsum("nhqk,nkhd->nqhd", probs, v).reshape(n, t, d)
    x = x + linear(p, f"{pre}.self_attn.out_proj", attn)
    h = layer_norm(p, f"{pre}.layer_norm2", x, spec.layer_norm_eps)
    h = linear(p, f"{pre}.mlp.fc2", activation(spec.hidden_act, linear(p, f"{pre}.mlp.fc1", h)))
    return x + h


def hidden_states(p: Params, spec: CLIPVisionSpec, pixels: jax.Array, upto: int) -> list[jax.Array]:
    """Transformers' `hidden_states[0..upto]` of the tower, each `[N, T, D]`."""
    x = embeddings(p, spec, pixels)
    if spec.has_class_token:
        x = layer_norm(p, "pre_layrnorm", x, spec.layer_norm_eps)
    out = [x]
    for i in range(upto):
        x = encoder_layer(p, spec, i, x)
        out.append(x)
    return out
