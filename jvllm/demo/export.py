"""Writes trained demo parameters as a Hugging Face Llama checkpoint directory.

Imports nothing of jvllm: `train` calls it. Owns the mapping from the training layout
(layers stacked on [L], linear weights [in, out]) to Transformers' names and [out, in]
layout, in bfloat16.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

# training name -> HF name under model.layers.{n}.
_LAYER_NAMES = {
    "ln1": "input_layernorm.weight",
    "ln2": "post_attention_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}


def hf_tensors(params: dict[str, Any]) -> dict[str, np.ndarray]:
    """HF-named bfloat16 tensors; tied embeddings, so no lm_head.weight."""
    import ml_dtypes

    def bf16(x: Any) -> np.ndarray:
        return np.ascontiguousarray(np.asarray(x, np.float32).astype(ml_dtypes.bfloat16))

    tensors = {
        "model.embed_tokens.weight": bf16(params["embed"]),
        "model.norm.weight": bf16(params["norm"]),
    }
    for name, hf in _LAYER_NAMES.items():
        stacked = np.asarray(params[name])
        for n in range(stacked.shape[0]):
            w = stacked[n].T if stacked.ndim == 3 else stacked[n]
            tensors[f"model.layers.{n}.{hf}"] = bf16(w)
    return tensors


def write_checkpoint(
    out: Path, params: dict[str, Any], config: dict[str, Any], report: dict, words: set[str]
) -> None:
    """config.json, model.safetensors, training.json and words.txt into out (the
    tokenizer is already there)."""
    from safetensors.numpy import save_file

    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(hf_tensors(params), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "words.txt").write_text("\n".join(sorted(words)) + "\n")
