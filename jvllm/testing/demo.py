"""The demo model that `jvllm serve` runs when given no MODEL.

Owns building, once, a tiny random-weight Llama checkpoint with the local test
tokenizer into a cache directory (`$JVLLM_CACHE/demo-llama-v1`, else
`~/.cache/jvllm/demo-llama-v1`). Only numpy, safetensors, tokenizers and
transformers' tokenizer classes are used, never torch, so it works with just the
`serve` extra installed. Its output is noise: it exists to try the server.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

DEMO_NAME = "jvllm-demo"
_DIR_NAME = "demo-llama-v1"  # bump when the config or weights change
_SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)
# Engine defaults for the demo, applied unless the command line sets them.
DEMO_ENGINE_DEFAULTS = dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=128)


def demo_cache_dir() -> Path:
    root = os.environ.get("JVLLM_CACHE") or Path.home() / ".cache" / "jvllm"
    return Path(root) / _DIR_NAME


def ensure_demo_model(directory: str | Path | None = None, seed: int = 0) -> Path:
    """Returns the demo checkpoint directory, building it first if it is missing."""
    target = Path(directory) if directory is not None else demo_cache_dir()
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: a concurrent or interrupted build never
    # leaves a half-written checkpoint where the server would load it.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _build(staging, seed)
        os.rename(staging, target)
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _build(out: Path, seed: int) -> None:
    from safetensors.numpy import save_file
    from transformers import AutoTokenizer

    from jvllm.testing.tokenizer import make_tokenizer

    make_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(out)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **_SHAPE,
        "vocab_size": len(tok),
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "jvllm_demo": True,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(_weights(config, seed), str(out / "model.safetensors"), metadata={"format": "pt"})


def _weights(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    """Llama tensors under Hugging Face names; linear weights are [out, in]."""
    rng = np.random.default_rng(seed)
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv, v = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, cfg["vocab_size"]

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    tensors = {
        "model.embed_tokens.weight": normal(v, h),
        "model.norm.weight": np.ones(h, np.float32),
        "lm_head.weight": normal(v, h),
    }
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        tensors |= {
            p + "self_attn.q_proj.weight": normal(q, h),
            p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h),
            p + "self_attn.o_proj.weight": normal(h, q),
            p + "mlp.gate_proj.weight": normal(i, h),
            p + "mlp.up_proj.weight": normal(i, h),
            p + "mlp.down_proj.weight": normal(h, i),
            p + "input_layernorm.weight": np.ones(h, np.float32),
            p + "post_attention_layernorm.weight": np.ones(h, np.float32),
        }
    return tensors
