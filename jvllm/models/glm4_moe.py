"""GLM-4.5/4.6 (`Glm4MoeForCausalLM`): its config.json read into a Llama-family spec.

GLM-4.5 is DeepSeek-V3's mixture of experts (sigmoid scores, `e_score_correction_bias`,
`n_group`/`topk_group` group-limited top-k, `routed_scaling_factor`, `norm_topk_prob`,
`n_shared_experts` shared experts, the first `first_k_dense_replace` layers dense) on
standard grouped-query attention with q/k/v bias (`attention_bias`), optional per-head
q/k RMSNorm (`use_qk_norm`) and a partial rotary embedding (`partial_rotary_factor`,
0.5: the first half of each head's dims rotate, NeoX-style). So it runs on
`models.llama.CausalLM` (attention, dense MLP, decoder stack) with the sparse MLP of
`models.deepseek.DeepseekMoE`, which `Glm4MoeOptions.sparse_block` names for the
decoder layer. Owns `glm4_moe_spec`; not the modules. Its multi-token prediction layer
(`model.layers.{num_hidden_layers}`) is read by `models.deepseek_mtp`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jvllm.models.deepseek import DeepseekMoE
from jvllm.models.deepseek_spec import DeepseekRouting
from jvllm.models.spec import ModelSpec, MoESpec, _rope_from_config


@dataclass(frozen=True)
class Glm4MoeOptions:
    """`spec.variant` of GLM-4.5: its router, the decoder layers' sparse MLP module, and
    that the checkpoint's layers past num_hidden_layers are MTP layers the target skips."""

    routing: DeepseekRouting
    sparse_block: type = DeepseekMoE
    has_mtp_layers: bool = True


def _int(cfg: dict[str, Any], key: str, default: int) -> int:
    value = cfg.get(key)
    return default if value is None else int(value)


# Defaults are Transformers' Glm4MoeConfig's, for config.json files that leave a key out.


def _routing(cfg: dict[str, Any]) -> DeepseekRouting:
    experts, n_group = int(cfg["n_routed_experts"]), _int(cfg, "n_group", 1)
    topk_group = _int(cfg, "topk_group", 1)
    if n_group < 1 or experts % n_group or not 0 < topk_group <= n_group:
        raise ValueError(
            f"config.json: n_group={n_group} must divide n_routed_experts={experts} and "
            f"topk_group={topk_group} must be in 1..n_group"
        )
    return DeepseekRouting(
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        correction_bias=True,
        num_shared_experts=_int(cfg, "n_shared_experts", 1),
    )


def glm4_moe_spec(cfg: dict[str, Any]) -> ModelSpec:
    """The ModelSpec of a Glm4MoeForCausalLM config.json."""
    arch = cfg["architectures"][0]
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {cfg['hidden_act']!r} is not supported (silu)")
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    layers = int(cfg["num_hidden_layers"])
    first_dense = _int(cfg, "first_k_dense_replace", 1)
    moe = MoESpec(
        num_experts=int(cfg["n_routed_experts"]),
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        sparse_layers=tuple(range(first_dense, layers)),
    )
    eos = cfg.get("eos_token_id")
    return ModelSpec(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=_int(cfg, "num_key_value_heads", 8),
        head_dim=_int(cfg, "head_dim", hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-5),
        # Transformers' default for GLM-4.5 configs that leave it out.
        rope=_rope_from_config({"partial_rotary_factor": 0.5, **cfg}),
        max_position_embeddings=_int(cfg, "max_position_embeddings", 131072),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=bool(cfg.get("use_qk_norm", False)),
        moe=moe,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        variant=Glm4MoeOptions(_routing(cfg)),
    )
