"""DeepSeek-V2/V3 config.json fields: multi-head latent attention and the router.

Owns `MLASpec` (the latent attention's ranks and head widths), `DeepseekRouting` (how a
token picks its experts) and `deepseek_spec`, which reads both into a `ModelSpec` whose
`moe` holds the routed experts (every layer from `first_k_dense_replace` on) and whose
`mla` holds the rest. Options the model does not implement are refused with the field
named. Not owned: the modules (`models/deepseek.py`, `models/mla.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jvllm.models.spec import (
    ModelSpec,
    MoESpec,
    RopeSpec,
    _rope_from_config,
)

SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class DeepseekRouting:
    """A DeepSeek router: scores, then (with groups) the best `topk_group` of `n_group`
    expert groups, then the top-k experts of those."""

    scoring_func: str  # "softmax" (V2) or "sigmoid" (V3)
    topk_method: str  # "greedy", "group_limited_greedy" (V2), "noaux_tc" (V3)
    n_group: int  # expert groups (1: no grouping)
    topk_group: int  # groups a token may use
    routed_scaling_factor: float  # multiplies the routed experts' weights
    correction_bias: bool  # V3's e_score_correction_bias, added for choosing only
    num_shared_experts: int  # a dense MLP of that many experts' width on every token


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention: K and V come from a per-token latent of
    `kv_lora_rank` values plus one rope key of `qk_rope_head_dim` shared by every head."""

    q_lora_rank: int | None  # None: q_proj straight from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rope dims stored as interleaved pairs (V2 always)
    attention_bias: bool
    routing: DeepseekRouting

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def _int(cfg: dict[str, Any], key: str, default: int) -> int:
    value = cfg.get(key)
    return default if value is None else int(value)


def _routing(cfg: dict[str, Any], arch: str) -> DeepseekRouting:
    v3 = arch == "DeepseekV3ForCausalLM"
    scoring = cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    if scoring not in SCORING_FUNCS:
        raise ValueError(f"config.json: scoring_func={scoring!r} is not one of {SCORING_FUNCS}")
    if method not in TOPK_METHODS:
        raise ValueError(f"config.json: topk_method={method!r} is not one of {TOPK_METHODS}")
    grouped = v3 or method == "group_limited_greedy"
    n_group = _int(cfg, "n_group", 1) if grouped else 1
    topk_group = _int(cfg, "topk_group", n_group) if grouped else 1
    experts = int(cfg["n_routed_experts"])
    if experts % n_group or not 0 < topk_group <= n_group:
        raise ValueError(
            f"config.json: n_group={n_group} must divide n_routed_experts={experts} and "
            f"topk_group={topk_group} must be in 1..n_group"
        )
    return DeepseekRouting(
        scoring_func=scoring,
        topk_method=method,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        correction_bias=v3,
        num_shared_experts=_int(cfg, "n_shared_experts", 0),
    )


def _rope(cfg: dict[str, Any]) -> RopeSpec:
    if float((cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("config.json: partial_rotary_factor != 1.0 is not supported")
    return _rope_from_config(cfg, ("yarn",))


def deepseek_spec(cfg: dict[str, Any]) -> ModelSpec:
    """The ModelSpec of a DeepseekV2ForCausalLM or DeepseekV3ForCausalLM config.json."""
    arch = cfg["architectures"][0]
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {cfg['hidden_act']!r} is not supported (silu)")
    if _int(cfg, "moe_layer_freq", 1) != 1:
        raise ValueError(
            f"config.json: moe_layer_freq={cfg['moe_layer_freq']} is not supported (1)"
        )
    heads, layers = int(cfg["num_attention_heads"]), int(cfg["num_hidden_layers"])
    routing = _routing(cfg, arch)
    q_lora = cfg.get("q_lora_rank")
    mla = MLASpec(
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
        rope_interleave=bool(cfg.get("rope_interleave", True)) or arch == "DeepseekV2ForCausalLM",
        attention_bias=bool(cfg.get("attention_bias", False)),
        routing=routing,
    )
    first_dense = _int(cfg, "first_k_dense_replace", 0)
    moe = MoESpec(
        num_experts=int(cfg["n_routed_experts"]),
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        sparse_layers=tuple(range(first_dense, layers)),
    )
    eos = cfg.get("eos_token_id")
    return ModelSpec(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=1,  # one latent "head" shared by every query head
        head_dim=mla.qk_head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
        rope=_rope(cfg),
        max_position_embeddings=_int(cfg, "max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        moe=moe,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        mla=mla,
    )
