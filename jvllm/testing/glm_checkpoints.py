"""Tiny random GLM-4.5 (`Glm4MoeForCausalLM`) checkpoints built with Transformers' classes.

`make_glm_checkpoint` saves a float32 model of one dense layer then MoE layers (sigmoid
group-limited routing over 8 experts in 2 groups, routed scaling, one shared expert),
q/k/v bias, a partial rotary embedding (factor 0.5) and, with `qk_norm`, per-head q/k
RMSNorm; every parameter Transformers initialises to a constant and the routers'
`e_score_correction_bias` are perturbed. With `mtp`, one more layer is saved and
declared the MTP layer (`jvllm.testing.mtp.add_mtp_layer`). Imports nothing of jvllm's
models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jvllm.testing.checkpoints import copy_tokenizer, tokenizer_special_ids
from jvllm.testing.moe_checkpoints import perturb_constants


def glm_config(vocab_size: int, special: dict[str, int], qk_norm: bool, **overrides: Any):
    from transformers import Glm4MoeConfig

    kwargs = dict(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.8,
        attention_bias=True,
        use_qk_norm=qk_norm,
        partial_rotary_factor=0.5,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    return Glm4MoeConfig(**{**kwargs, **special, "vocab_size": vocab_size, **overrides})


def make_glm_checkpoint(
    out_dir: str | Path,
    tokenizer_dir: str | Path,
    seed: int = 0,
    qk_norm: bool = True,
    mtp: bool = False,
    **overrides: Any,
) -> Path:
    """A random float32 GLM-4.5 checkpoint with the tokenizer copied beside it."""
    import torch
    from transformers import AutoModelForCausalLM

    from jvllm.testing.mtp import add_mtp_layer

    out = Path(out_dir)
    vocab_size, special = tokenizer_special_ids(tokenizer_dir)
    if mtp:
        layers = int(overrides.pop("num_hidden_layers", 2)) + 1
        overrides["num_hidden_layers"] = layers
    config = glm_config(vocab_size, special, qk_norm, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    perturb_constants(model)
    with torch.no_grad():  # buffers: the routers' correction biases
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.2)
    model.save_pretrained(out, safe_serialization=True)
    copy_tokenizer(tokenizer_dir, out)
    return add_mtp_layer(out, seed) if mtp else out
