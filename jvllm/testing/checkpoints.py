"""Tiny random-weight Hugging Face checkpoints of every supported architecture."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")

_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    # Larger than the usual 0.02 so logits are spread and greedy choices are clear-cut.
    initializer_range=0.1,
)
_PER_ARCH: dict[str, dict[str, Any]] = {
    # GQA with llama3 rope scaling.
    "llama": dict(
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
        rope_theta=10000.0,
    ),
    # Sliding window shorter than the longest test prompt.
    "mistral": dict(sliding_window=64, rope_theta=10000.0),
    # q/k/v bias, tied embeddings.
    "qwen2": dict(tie_word_embeddings=True, rope_theta=1000000.0),
    # Per-head q/k RMSNorm, head_dim not hidden/heads.
    "qwen3": dict(head_dim=32, rope_theta=1000000.0),
}


def _config(arch: str, vocab_size: int, special_ids: dict[str, int], overrides: dict[str, Any]):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    cls = {
        "llama": LlamaConfig,
        "mistral": MistralConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
    }[arch]
    kwargs = {**_COMMON, **_PER_ARCH[arch], **special_ids, "vocab_size": vocab_size, **overrides}
    return cls(**kwargs)


def make_checkpoint(
    arch: str,
    out_dir: str | Path,
    tokenizer_dir: str | Path,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """Builds a random-weight checkpoint of `arch` with the tokenizer copied beside it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {ARCHITECTURES}, got {arch!r}")
    out = Path(out_dir)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    special = dict(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    config = _config(arch, len(tok), special, overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to(getattr(torch, dtype)).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    for f in Path(tokenizer_dir).iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    return out
