"""ModelSpec: the shapes and options of a decoder-only checkpoint, read from config.json.

Owns the translation of Hugging Face config fields (old `rope_scaling` and new
`rope_parameters` spellings alike) into one frozen record, and rejects options the
model code does not implement, and the Flax parameter path -> Hugging Face tensor
name mapping (`hf_name`). It does not read weights (see `loader.py`) and imports
nothing from jvllm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    # Linear weights quantized at load ("int8", "fp8"), or a compressed-tensors
    # checkpoint's packed weights (a models.quantization.PackedWeights).
    quantization: Any = None
    # Float linear and lm_head weights held `[in, out]`, the layout XLA:CPU's matmuls
    # read fastest; set after loading by `models.weight_layout`, never by a checkpoint.
    transposed_weights: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def num_params(self) -> int:
        """Parameter count, for FLOP and bandwidth figures."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        mlp = 3 * h * self.intermediate_size
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp + 2 * h) + embed + h


def _get(cfg: dict[str, Any], key: str, default: Any = None) -> Any:
    value = cfg.get(key, default)
    return default if value is None else value


def _rope_from_config(cfg: dict[str, Any]) -> RopeSpec:
    params = dict(cfg.get("rope_parameters") or {})
    # transformers < 5 keeps the scaling dict and the base apart.
    legacy = cfg.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = float(params.get("rope_theta", _get(cfg, "rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json: rope scaling type {rope_type!r} is not supported; "
            f"supported types are {SUPPORTED_ROPE_TYPES}"
        )
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("config.json: partial_rotary_factor != 1.0 is not supported")
    return RopeSpec(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _check_full_attention(cfg: dict[str, Any], arch: str) -> None:
    if cfg.get("use_sliding_window"):
        raise ValueError(f"config.json: {arch} with use_sliding_window=true is not supported")
    layer_types = cfg.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(
            f"config.json: layer_types other than 'full_attention' are not supported, "
            f"got {sorted(set(layer_types))}"
        )


def spec_from_hf_config(cfg: dict[str, Any]) -> ModelSpec:
    """Builds a ModelSpec from a parsed config.json of a supported architecture."""
    archs = cfg.get("architectures") or []
    if not archs:
        raise ValueError("config.json has no 'architectures' entry")
    arch = archs[0]
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {cfg['hidden_act']!r} is not supported (silu)")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    sliding_window = None
    if arch == "MistralForCausalLM":
        sliding_window = cfg.get("sliding_window")
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        _check_full_attention(cfg, arch)
    attention_bias = bool(cfg.get("attention_bias", False))
    return ModelSpec(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(_get(cfg, "num_key_value_heads", heads)),
        head_dim=int(_get(cfg, "head_dim", hidden // heads)),
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6)),
        rope=_rope_from_config(cfg),
        max_position_embeddings=int(_get(cfg, "max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias or arch == "Qwen2ForCausalLM",
        o_bias=attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_window=int(sliding_window) if sliding_window else None,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
    )


def hf_name(path: tuple[str, ...]) -> str:
    """('model', 'layers_3', 'mlp', 'up_proj', 'weight') -> 'model.layers.3.mlp.up_proj.weight'."""
    parts = []
    for p in path:
        if p.startswith("layers_"):
            parts += ["layers", p.removeprefix("layers_")]
        else:
            parts.append("weight" if p == "embedding" else p)
    return ".".join(parts)
