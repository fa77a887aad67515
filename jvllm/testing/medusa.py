"""Medusa heads in torch: test checkpoints and the reference drafts jvllm must reproduce.

`make_medusa_heads` writes random heads for a target checkpoint in vLLM's Medusa layout
(`blocks.{h}.layers.{l}.weight`/`.bias`, `lm_heads.{h}.weight`) or FasterDecoding's
older one (`{h}.{l}.linear.weight`, `{h}.{L}.weight`). `reference_drafts` recomputes,
from scratch for one sequence, the drafts Medusa proposes after it: Transformers' model
over the sequence but its newest token, the final (post-norm) hidden state at the last
position, each head's residual blocks `x + SiLU(W x + b)` in torch, each head's argmax.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def make_medusa_heads(
    target: str | Path,
    out: str | Path,
    num_heads: int = 3,
    num_layers: int = 1,
    seed: int = 0,
    init_std: float = 0.5,
    layout: str = "vllm",
) -> Path:
    """Random Medusa heads (biases and projections all non-zero) for `target`."""
    import torch
    from safetensors.torch import save_file

    target_config = json.loads((Path(target) / "config.json").read_text())
    h, v = target_config["hidden_size"], target_config["vocab_size"]
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen) * init_std
    tensors: dict[str, Any] = {}
    for i in range(num_heads):
        for j in range(num_layers):
            prefix = f"{i}.{j}.linear" if layout == "faster" else f"blocks.{i}.layers.{j}"
            tensors[f"{prefix}.weight"] = randn(h, h) / h**0.5
            tensors[f"{prefix}.bias"] = randn(h)
        name = f"{i}.{num_layers}.weight" if layout == "faster" else f"lm_heads.{i}.weight"
        tensors[name] = randn(v, h)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(out / "model.safetensors"))
    config = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": h,
        "vocab_size": v,
        "medusa_fc_bias": True,
    }
    if layout == "faster":
        config |= {"medusa_num_heads": num_heads, "medusa_num_layers": num_layers}
    else:
        config |= {"num_heads": num_heads, "num_hidden_layers": num_layers}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def load_heads(path: str | Path) -> dict[str, Any]:
    """A written checkpoint's tensors (torch, float32) and its config."""
    from safetensors.torch import load_file

    path = Path(path)
    return {
        "config": json.loads((path / "config.json").read_text()),
        "tensors": {k: t.float() for k, t in load_file(str(path / "model.safetensors")).items()},
    }


def reference_drafts(hf: Any, heads: dict[str, Any], sequence: list[int], n: int) -> list[int]:
    """The first `n` heads' argmax from the feature that sampled `sequence`'s last token."""
    import torch

    config, tensors = heads["config"], heads["tensors"]
    num_layers = config.get("num_hidden_layers", config.get("medusa_num_layers"))
    faster = "0.0.linear.weight" in tensors
    with torch.no_grad():
        ids = torch.tensor([sequence[:-1]])
        feature = hf.model(input_ids=ids).last_hidden_state[0, -1].float()
        drafts = []
        for i in range(n):
            x = feature
            for j in range(num_layers):
                prefix = f"{i}.{j}.linear" if faster else f"blocks.{i}.layers.{j}"
                y = x @ tensors[f"{prefix}.weight"].T + tensors[f"{prefix}.bias"]
                x = x + torch.nn.functional.silu(y)
            lm = tensors[f"{i}.{num_layers}.weight" if faster else f"lm_heads.{i}.weight"]
            drafts.append(int(torch.argmax(x @ lm.T)))
    return drafts
