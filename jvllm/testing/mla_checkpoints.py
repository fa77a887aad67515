"""Tiny random Phi-3 and DeepSeek-V2/V3 checkpoints built with Transformers' own classes.

Owns their configs and `make_variant_checkpoint`, which perturbs every parameter and
buffer Transformers initialises to a constant (norm scales, the router's
`e_score_correction_bias`) so a forward that skipped one would not match. Phi-3 runs
LongRoPE with distinct short and long factors and a short original window; DeepSeek-V3
routes by sigmoid with group-limited top-k, q_lora and yarn; V2-Lite's shape (no
q_lora, softmax greedy top-k) is `deepseek_v2`. Imports nothing of jvllm's models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from jvllm.testing.checkpoints import copy_tokenizer, tokenizer_special_ids
from jvllm.testing.moe_checkpoints import perturb_constants

VARIANT_ARCHITECTURES = ("phi3", "deepseek_v3", "deepseek_v2")
# Phi-3's pretraining window in the tiny checkpoint: prompts past it take long factors.
PHI3_ORIGINAL_WINDOW = 64


def _factors(seed: int, n: int, low: float, high: float) -> list[float]:
    return [float(x) for x in np.random.default_rng(seed).uniform(low, high, n)]


def _mla_common() -> dict[str, Any]:
    return dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=96,
        moe_intermediate_size=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=24,
        first_k_dense_replace=1,
        n_shared_experts=1,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        tie_word_embeddings=False,
    )


def _config(arch: str, vocab_size: int, special: dict[str, int], overrides: dict[str, Any]):
    from transformers import DeepseekV2Config, DeepseekV3Config, Phi3Config

    if arch == "phi3":
        rope = dict(
            rope_type="longrope",
            rope_theta=10000.0,
            short_factor=_factors(1, 8, 1.0, 1.5),
            long_factor=_factors(2, 8, 1.0, 8.0),
        )
        kwargs = dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=96,
            max_position_embeddings=1024,
            original_max_position_embeddings=PHI3_ORIGINAL_WINDOW,
            rope_parameters=rope,
            initializer_range=0.1,
            tie_word_embeddings=False,
        )
        cls = Phi3Config
    elif arch == "deepseek_v3":
        # yarn with DeepSeek's mscale pair: the softmax scale grows by mscale^2.
        rope = dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=256,
            beta_fast=32,
            beta_slow=1,
            mscale=0.707,
            mscale_all_dim=0.707,
        )
        kwargs = dict(
            _mla_common(),
            q_lora_rank=24,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            rope_parameters=rope,
            rope_interleave=True,
        )
        cls = DeepseekV3Config
    elif arch == "deepseek_v2":
        kwargs = dict(
            _mla_common(),
            q_lora_rank=None,
            n_routed_experts=6,
            num_experts_per_tok=2,
            topk_method="greedy",
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
        )
        cls = DeepseekV2Config
    else:
        raise ValueError(f"arch must be one of {VARIANT_ARCHITECTURES}, got {arch!r}")
    return cls(**{**kwargs, **special, "vocab_size": vocab_size, **overrides})


def make_variant_checkpoint(
    arch: str, out_dir: str | Path, tokenizer_dir: str | Path, seed: int = 0, **overrides: Any
) -> Path:
    """A random float32 checkpoint of `arch` with the tokenizer copied beside it."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    vocab_size, special = tokenizer_special_ids(tokenizer_dir)
    config = _config(arch, vocab_size, special, overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    perturb_constants(model)
    with torch.no_grad():  # buffers: the routers' correction biases
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.2)
    model.save_pretrained(out, safe_serialization=True)
    copy_tokenizer(tokenizer_dir, out)
    return out
