"""ModelSpec: the shapes and options of a decoder-only checkpoint, read from config.json.

Owns the translation of Hugging Face config fields (old `rope_scaling` and new
`rope_parameters` spellings alike) into one frozen record, and rejects options the
model code does not implement, and the Flax parameter path -> Hugging Face tensor
name mapping (`hf_name`). It does not read weights (see `loader.py`) and imports
nothing from jvllm. DeepSeek's latent-attention configs are read by `deepseek_spec.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Rope types `rope_from_config` reads and `jvllm.layers.rotary` computes.
ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")
# Rope types every model class applies; Phi-3 also applies longrope (its factors chosen
# by `ModelSpec.rope_seq_len`) and DeepSeek yarn. Dynamic NTK needs per-row lengths.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic")
MOE_ARCHITECTURES = (
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)
# Architectures with multi-head latent attention, read by `models.deepseek_spec`.
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


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
    """Rotary embedding parameters, with Transformers' defaults already applied."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn, longrope
    max_position_embeddings: int = 2048  # dynamic scales past it
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float = 0.0  # yarn; 0: unset
    mscale_all_dim: float = 0.0  # yarn; 0: unset
    truncate: bool = True  # yarn
    attention_factor: float | None = None  # yarn, longrope; None: derived from factor
    short_factor: tuple[float, ...] = ()  # longrope, one per frequency
    long_factor: tuple[float, ...] = ()  # longrope, one per frequency
    partial_rotary_factor: float = 1.0  # the share of each head's dims rotated (Phi-4-mini)

    def __post_init__(self) -> None:
        _check_rope(self)


def _check_rope(r: RopeSpec) -> None:
    bad = lambda what: ValueError(f"config.json: rope {r.rope_type!r}: {what}")
    if r.rope_type not in ROPE_TYPES:
        raise ValueError(
            f"config.json: rope scaling type {r.rope_type!r} is not supported; "
            f"supported types are {ROPE_TYPES}"
        )
    if r.theta <= 0:
        raise bad(f"rope_theta must be > 0, got {r.theta}")
    # longrope only derives its attention factor from `factor` (1 when <= 1).
    if r.rope_type not in ("default", "longrope") and r.factor < 1.0:
        raise bad(f"factor must be >= 1, got {r.factor}")
    if r.rope_type in ("llama3", "yarn", "longrope") and r.original_max_position_embeddings < 1:
        raise bad("original_max_position_embeddings must be >= 1")
    if r.rope_type == "llama3" and r.high_freq_factor <= r.low_freq_factor:
        raise bad(
            f"high_freq_factor ({r.high_freq_factor}) must be greater than "
            f"low_freq_factor ({r.low_freq_factor})"
        )
    if r.rope_type == "yarn" and r.beta_fast < r.beta_slow:
        raise bad(f"beta_fast ({r.beta_fast}) must be >= beta_slow ({r.beta_slow})")
    if r.attention_factor is not None and r.attention_factor <= 0:
        raise bad(f"attention_factor must be > 0, got {r.attention_factor}")
    if not 0.0 < r.partial_rotary_factor <= 1.0:
        raise bad(f"partial_rotary_factor must be in (0, 1], got {r.partial_rotary_factor}")
    if r.rope_type == "longrope":
        for name in ("short_factor", "long_factor"):
            values = getattr(r, name)
            if not values or any(not v > 0 for v in values):
                raise bad(f"{name} must be a non-empty list of positive numbers, got {values}")


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
    # Multi-head latent attention (a `models.deepseek_spec.MLASpec`; DeepSeek-V2/V3).
    mla: Any = None
    # The longest sequence the engine serves (its max_model_len; None: the model's
    # max_position_embeddings). LongRoPE picks its long factors when it exceeds
    # original_max_position_embeddings, as vLLM does; set at load, never by a checkpoint.
    max_model_len: int | None = None
    # A *ForSequenceClassification checkpoint: its `score` head's rows (0: a causal LM).
    num_labels: int = 0
    # Options of an architecture with a model class of its own (models/gemma.py's
    # GemmaOptions, models/gpt_oss.py's GptOssOptions); None for the Llama family.
    variant: Any = None

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

    @property
    def kv_cache_dims(self) -> tuple[int, int, int]:
        """(heads, K width, V width) of one token in one layer's cache. Latent attention
        caches one shared head: the compressed latent in K, the rope key in V."""
        if self.mla is not None:
            return 1, self.mla.kv_lora_rank, self.mla.qk_rope_head_dim
        return self.num_kv_heads, self.head_dim, self.head_dim

    @property
    def kv_cache_split(self) -> bool:
        """Whether the cache splits over `tp` on its head axis (a latent cache, one
        head that every device's query heads read, is replicated instead)."""
        return self.mla is None

    @property
    def rope_seq_len(self) -> int:
        """The sequence length the rope's frequencies are chosen for (LongRoPE)."""
        return self.max_model_len or self.max_position_embeddings

    def is_sparse_layer(self, index: int) -> bool:
        return self.moe is not None and index in self.moe.sparse_layers


def _get(cfg: dict[str, Any], key: str, default: Any = None) -> Any:
    value = cfg.get(key, default)
    return default if value is None else value


def _factors(params: dict[str, Any], name: str) -> tuple[float, ...]:
    values = params.get(name) or ()
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"config.json: rope {name} must be a list of numbers, got {values!r}")
    return tuple(float(v) for v in values)


def _rope_parameters(cfg: dict[str, Any], layer_type: str | None) -> dict[str, Any]:
    """The flat rope dict of `layer_type`'s layers. Configs with per-layer-type rope
    (Gemma 3) nest one dict per type under `rope_parameters`."""
    params = dict(cfg.get("rope_parameters") or {})
    nested = sorted(k for k, v in params.items() if isinstance(v, dict))
    if not nested:
        # transformers < 5 keeps the scaling dict and the base apart.
        return {**(cfg.get("rope_scaling") or {}), **params}
    if layer_type not in nested:
        raise ValueError(
            f"config.json: rope_parameters are given per layer type {nested}; "
            f"got layer_type={layer_type!r}"
        )
    return dict(params[layer_type])


def rope_from_config(cfg: dict[str, Any], layer_type: str | None = None) -> RopeSpec:
    """The rope parameters of a parsed config.json (any of ROPE_TYPES), filled in and
    checked the way Transformers' `standardize_rope_params` and its rope functions do;
    layer_type ("full_attention", "sliding_attention") picks a per-layer-type entry."""
    params = _rope_parameters(cfg, layer_type)
    theta = float(params.get("rope_theta", _get(cfg, "rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = float(params.get("partial_rotary_factor", _get(cfg, "partial_rotary_factor", 1.0)))
    max_pos = int(_get(cfg, "max_position_embeddings", 2048))
    # Phi-3 keeps the pretraining length beside the rope parameters; it then wins.
    original = int(_get(cfg, "original_max_position_embeddings", 0)) or int(
        params.get("original_max_position_embeddings") or max_pos
    )
    factor = params.get("factor")
    if factor is None:
        # yarn and longrope read the extension ratio from the two lengths.
        factor = max_pos / original if rope_type in ("yarn", "longrope") else 1.0
    attention_factor = params.get("attention_factor")
    return RopeSpec(
        theta=theta,
        rope_type=rope_type,
        factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        max_position_embeddings=max_pos,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=None if attention_factor is None else float(attention_factor),
        short_factor=_factors(params, "short_factor"),
        long_factor=_factors(params, "long_factor"),
        partial_rotary_factor=partial,
    )


def _rope_from_config(cfg: dict[str, Any], also: tuple[str, ...] = ()) -> RopeSpec:
    """The rope of a config, refused unless the model classes apply its type (the
    SUPPORTED_ROPE_TYPES, and `also` for this architecture)."""
    rope = rope_from_config(cfg)
    if rope.rope_type not in SUPPORTED_ROPE_TYPES + also:
        raise ValueError(
            f"config.json: rope scaling type {rope.rope_type!r} is not supported by the "
            f"model classes yet; supported types are {SUPPORTED_ROPE_TYPES}"
        )
    return rope


def _check_full_attention(cfg: dict[str, Any], arch: str) -> None:
    if cfg.get("use_sliding_window"):
        raise ValueError(f"config.json: {arch} with use_sliding_window=true is not supported")
    layer_types = cfg.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(
            f"config.json: layer_types other than 'full_attention' are not supported, "
            f"got {sorted(set(layer_types))}"
        )


SEQUENCE_CLASSIFICATION = "ForSequenceClassification"


def spec_from_hf_config(cfg: dict[str, Any]) -> ModelSpec:
    """Builds a ModelSpec from a parsed config.json of a supported architecture."""
    archs = cfg.get("architectures") or []
    if not archs:
        raise ValueError("config.json has no 'architectures' entry")
    arch, num_labels = archs[0], 0
    if arch.endswith(SEQUENCE_CLASSIFICATION):  # the causal LM's body under a score head
        arch = arch.removesuffix(SEQUENCE_CLASSIFICATION) + "ForCausalLM"
        num_labels = int(cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 2)
    if arch in MLA_ARCHITECTURES:
        raise ValueError(f"{arch} configs are read by models.deepseek_spec.deepseek_spec")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {cfg['hidden_act']!r} is not supported (silu)")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    sliding_window = None
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
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
        rope=_rope_from_config(cfg, ("longrope",) if arch == "Phi3ForCausalLM" else ()),
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
        num_labels=num_labels,
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
