"""Tiny random Gemma 2, Gemma 3 (text) and gpt-oss checkpoints built with Transformers'
own classes, and gpt-oss's experts written in MXFP4 as the released checkpoints are.

Owns the test configs (a sliding window of 16, shorter than the longer test prompts;
Gemma 2's soft caps small enough to bend the logits; gpt-oss's YaRN rope with an original
window of 64) and `make_variant_checkpoint`, which perturbs every parameter Transformers
initialises to a constant (norm weights, biases, sinks, the router). With `mxfp4=True`,
gpt-oss's expert weights are first rounded to MXFP4 values (so the float checkpoint and
the packed one hold the same numbers), then written as `*_blocks` (`uint8 [E, out,
in / 32, 16]`, two 4-bit E2M1 codes a byte, low nibble first) and `*_scales` (`uint8
[E, out, in / 32]`, a power-of-two exponent biased by 127) with `quantization_config`
`{"quant_method": "mxfp4"}`. The float values come from Transformers' own MXFP4 decoder
(`convert_moe_packed_tensors`). Imports nothing of jvllm.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from jvllm.testing.checkpoints import copy_tokenizer, tokenizer_special_ids
from jvllm.testing.moe_checkpoints import perturb_constants

VARIANT_ARCHITECTURES = ("gemma2", "gemma3", "gpt_oss")
WINDOW = 16

_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "full_attention"],
)
_PER_ARCH: dict[str, dict[str, Any]] = {
    # Soft caps that bend the logits; query_pre_attn_scalar unlike head_dim.
    "gemma2": dict(
        query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=5.0,
        rope_theta=10000.0,
    ),
    # q/k norms; a global rope (linear, 1e6) unlike the local one (default, 1e4).
    "gemma3": dict(
        query_pre_attn_scalar=32,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    ),
    # Sinks, biased attention and experts, YaRN past an original window of 64.
    "gpt_oss": dict(
        intermediate_size=32,
        max_position_embeddings=256,  # 4 x the original window: YaRN's factor
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
            "rope_theta": 150000.0,
        },
    ),
}


def _config(arch: str, vocab_size: int, special_ids: dict[str, int], overrides: dict[str, Any]):
    from transformers import Gemma2Config, Gemma3TextConfig, GptOssConfig

    cls = {"gemma2": Gemma2Config, "gemma3": Gemma3TextConfig, "gpt_oss": GptOssConfig}[arch]
    kwargs = {**_COMMON, **_PER_ARCH[arch], **special_ids, "vocab_size": vocab_size, **overrides}
    config = cls(**kwargs)
    if arch == "gemma3":
        config.architectures = ["Gemma3ForCausalLM"]
    return config


def make_variant_checkpoint(
    arch: str,
    out_dir: str | Path,
    tokenizer_dir: str | Path,
    seed: int = 0,
    mxfp4: bool = False,
    **overrides: Any,
) -> Path:
    """A random float32 checkpoint of `arch` with the tokenizer beside it; for gpt-oss
    with `mxfp4`, experts rounded to MXFP4 and a second checkpoint, `out_dir/mxfp4`,
    holding them packed."""
    import torch
    from transformers import AutoModelForCausalLM

    if arch not in VARIANT_ARCHITECTURES:
        raise ValueError(f"arch must be one of {VARIANT_ARCHITECTURES}, got {arch!r}")
    out = Path(out_dir)
    vocab_size, special = tokenizer_special_ids(tokenizer_dir)
    config = _config(arch, vocab_size, special, overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    perturb_constants(model)
    packed = _round_experts_to_mxfp4(model) if mxfp4 else None
    model.save_pretrained(out, safe_serialization=True)
    copy_tokenizer(tokenizer_dir, out)
    if packed is not None:
        _write_mxfp4(model, packed, out / "mxfp4", tokenizer_dir)
    return out


_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`w [..., N]` (N a multiple of 32) -> blocks `uint8 [..., N/32, 16]` and scales
    `uint8 [..., N/32]`: each 32-value group gets the power of two that brings its largest
    magnitude to at most 6, and each value the nearest E2M1 code."""
    groups = w.reshape(*w.shape[:-1], -1, 32).astype(np.float32)  # [..., G, 32]
    amax = np.abs(groups).max(axis=-1, keepdims=True)
    exp = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).astype(np.int32)  # [..., G, 1]
    scaled = groups / np.exp2(exp.astype(np.float32))
    codes = np.abs(scaled[..., None] - _E2M1).argmin(axis=-1).astype(np.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # low nibble first
    # Contiguous: safetensors writes a numpy array's buffer as it lies in memory.
    scales = np.ascontiguousarray(exp[..., 0] + 127, dtype=np.uint8)
    return np.ascontiguousarray(blocks, dtype=np.uint8), scales


def _round_experts_to_mxfp4(model: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Replaces every expert weight by its MXFP4 rounding (decoded by Transformers);
    returns checkpoint name -> (blocks, scales), laid out `[E, out, in]` as released."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    packed = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                continue
            out_in = p.detach().transpose(1, 2).numpy()  # [E, H, 2I] -> [E, 2I, H]
            blocks, scales = quantize_mxfp4(out_in)
            decoded = convert_moe_packed_tensors(
                torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
            )  # [E, in, out], the parameter's own layout
            p.copy_(decoded)
            packed[name] = (blocks, scales)
    return packed


def _write_mxfp4(
    model: Any, packed: dict[str, tuple[np.ndarray, np.ndarray]], out: Path, tokenizer_dir
) -> None:
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name in packed:
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = packed[name]
        elif not (name == "lm_head.weight" and model.config.tie_word_embeddings):
            tensors[name] = tensor.contiguous().numpy()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer(tokenizer_dir, out)
