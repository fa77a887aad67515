"""Tiny random mixture-of-experts checkpoints built with Transformers' own classes.

Owns the four MoE test architectures' configs and `make_moe_checkpoint`, which perturbs
every parameter Transformers initialises to a constant (norm scales at 1, biases at 0,
a router or gate at 0) so a forward that skipped one would not match, and writes
either the Hub's per-expert tensors (what `save_pretrained` writes) or Transformers 5's
fused `experts.gate_up_proj` / `experts.down_proj` (what its modules hold). Imports
nothing of jvllm.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jvllm.testing.checkpoints import copy_tokenizer, tokenizer_special_ids

MOE_ARCHITECTURES = ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe")

_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    initializer_range=0.1,  # spread logits, so greedy choices are clear-cut
    num_experts_per_tok=2,
)
_PER_ARCH: dict[str, dict[str, Any]] = {
    # A dense layer between sparse ones (mlp_only_layers), renormalised top-k.
    "qwen3_moe": dict(
        num_hidden_layers=3,
        head_dim=32,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        rope_theta=1000000.0,
    ),
    # Sliding window shorter than the longest test prompt.
    "mixtral": dict(intermediate_size=32, num_local_experts=4, sliding_window=48),
    # Shared expert with a sigmoid gate, q/k/v bias, top-k weights not renormalised,
    # every second layer sparse (decoder_sparse_step=2).
    "qwen2_moe": dict(
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=4,
        norm_topk_prob=False,
        decoder_sparse_step=2,
    ),
    # q/k RMSNorm over the whole projections.
    "olmoe": dict(intermediate_size=32, num_experts=8, norm_topk_prob=False),
}


def _config(arch: str, vocab_size: int, special_ids: dict[str, int], overrides: dict[str, Any]):
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    cls = {
        "qwen3_moe": Qwen3MoeConfig,
        "mixtral": MixtralConfig,
        "qwen2_moe": Qwen2MoeConfig,
        "olmoe": OlmoeConfig,
    }[arch]
    kwargs = {**_COMMON, **_PER_ARCH[arch], **special_ids, "vocab_size": vocab_size, **overrides}
    return cls(**kwargs)


def perturb_constants(model: Any, scale: float = 0.2) -> list[str]:
    """Adds noise to every parameter whose entries are all equal; their names."""
    import torch

    changed = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.numel() and bool((p == p.flatten()[0]).all()):
                p.add_(torch.randn_like(p) * scale)
                changed.append(name)
    return changed


def make_moe_checkpoint(
    arch: str,
    out_dir: str | Path,
    tokenizer_dir: str | Path,
    seed: int = 0,
    fused: bool = False,
    **overrides: Any,
) -> Path:
    """A random float32 checkpoint of `arch` with the tokenizer copied beside it."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    if arch not in MOE_ARCHITECTURES:
        raise ValueError(f"arch must be one of {MOE_ARCHITECTURES}, got {arch!r}")
    out = Path(out_dir)
    vocab_size, special = tokenizer_special_ids(tokenizer_dir)
    config = _config(arch, vocab_size, special, overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    perturb_constants(model)
    model.save_pretrained(out, safe_serialization=True)
    if fused:  # the in-memory names in place of the per-expert ones save_pretrained wrote
        for f in out.glob("model*.safetensors*"):
            f.unlink()
        tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
        if config.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    copy_tokenizer(tokenizer_dir, out)
    return out


def config_of(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / "config.json").read_text())
