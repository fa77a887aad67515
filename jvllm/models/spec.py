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
MOE_ARCHITECTURES = (
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)


@dataclass(frozen=True)
class MoESpec:
    """The sparse MLP of a mixture-of-experts checkpoint."""

    num_experts: int
    top_k: int  # experts each token is routed to
    intermediate_size: int  # of one expert
    norm_topk_prob: bool  # renormalise the top-k routing weights to sum to 1
    # Decoder layers with a sparse MLP (the others keep a dense one of intermediate_size).
    sparse_layers: tuple[int, ...]
    # A dense MLP every token runs, scaled by sigmoid(x @ shared_expert_gate) (Qwen2-MoE).
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(
                f"config.json: num_experts_per_tok={self.top_k} must be in 1..num_experts "
                f"({self.num_experts})"
            )


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
    # q/k RMSNorm over the whole projection (OLMoE) rather than per head (Qwen3).
    qk_norm_over_projection: bool = False
    moe: MoESpec | None = None
    # Experts split over the `tp` mesh axis instead of their intermediate axis (vLLM's
    # enable_expert_parallel); set by the loader, never by a checkpoint.
    expert_parallel: bool = False
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
        mlp = 3 * h * self.intermediate_size * self.num_layers
        if self.moe is not None:
            m = self.moe
            sparse = len(m.sparse_layers)
            per_sparse = 3 * h * (m.intermediate_size * m.num_experts)
            per_sparse += 3 * h * m.shared_expert_intermediate_size + h * m.num_experts
            mlp += sparse * (per_sparse - 3 * h * self.intermediate_size)
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + 2 * h) + mlp + embed + h

    def is_sparse_layer(self, index: int) -> bool:
        return self.moe is not None and index in self.moe.sparse_layers


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
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        sliding_window = cfg.get("sliding_window")
    elif arch.startswith(("Qwen2", "Qwen3")):
        _check_full_attention(cfg, arch)
    if arch == "OlmoeForCausalLM" and cfg.get("clip_qkv") is not None:
        raise ValueError(f"config.json: clip_qkv={cfg['clip_qkv']} is not supported (null)")
    attention_bias = bool(cfg.get("attention_bias", False))
    qkv_bias = attention_bias or arch == "Qwen2ForCausalLM"
    if arch == "Qwen2MoeForCausalLM":
        qkv_bias = bool(cfg.get("qkv_bias", True))
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
        qkv_bias=qkv_bias,
        o_bias=attention_bias and arch != "Qwen2MoeForCausalLM",
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"),
        qk_norm_over_projection=arch == "OlmoeForCausalLM",
        moe=moe_from_hf_config(cfg, arch) if arch in MOE_ARCHITECTURES else None,
        sliding_window=int(sliding_window) if sliding_window else None,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
    )


# Router fields whose other values select a routing jvllm does not implement.
_ROUTER_DEFAULTS = {
    "scoring_func": "softmax",
    "topk_method": "greedy",
    "n_group": None,
    "topk_group": None,
    "routed_scaling_factor": 1.0,
}


def moe_from_hf_config(cfg: dict[str, Any], arch: str) -> MoESpec:
    """The sparse MLP of a Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE config.json.

    All four route by a softmax over the experts in float32 then top-k; Mixtral always
    renormalises the k weights, the others as `norm_topk_prob` says.
    """
    for key, default in _ROUTER_DEFAULTS.items():
        if cfg.get(key) is not None and cfg[key] != default:
            raise ValueError(
                f"config.json: router field {key}={cfg[key]!r} is not supported "
                f"({default!r}: softmax top-k routing)"
            )
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if not experts:
        raise ValueError(f"config.json: {arch} needs num_experts (or num_local_experts)")
    layers = int(cfg["num_hidden_layers"])
    if arch in ("MixtralForCausalLM", "OlmoeForCausalLM"):
        sparse = tuple(range(layers))
        inter = int(cfg["intermediate_size"])  # their experts' own size
    else:
        step = int(_get(cfg, "decoder_sparse_step", 1))
        if step < 1:
            raise ValueError(f"config.json: decoder_sparse_step={step} must be >= 1")
        dense = set(cfg.get("mlp_only_layers") or [])
        sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        inter = int(cfg["moe_intermediate_size"])
    shared = int(_get(cfg, "shared_expert_intermediate_size", 0))
    return MoESpec(
        num_experts=int(experts),
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=inter,
        norm_topk_prob=True if arch == "MixtralForCausalLM" else bool(cfg.get("norm_topk_prob")),
        sparse_layers=sparse,
        shared_expert_intermediate_size=shared if arch == "Qwen2MoeForCausalLM" else 0,
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
