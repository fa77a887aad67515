"""EAGLE-1 heads in torch, built from Transformers' own Llama layers: test checkpoints
and the reference drafts jvllm's head must reproduce.

`make_eagle_head` writes a random head for a target checkpoint in the public EAGLE-1
layout (config.json, `fc.weight`, `layers.0.*` without layer 0's input norm).
`reference_drafts` recomputes, from scratch for one sequence, the k greedy drafts an
EAGLE head proposes after it: the target's final hidden states over the sequence, the
head over every position (token i + 1 with feature i), then k steps feeding its own
output features forward, each scored by the target's lm_head.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _head_config(target_config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    keep = (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "rope_parameters",
        "rope_scaling",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    )
    config = {k: target_config[k] for k in keep if k in target_config}
    return {
        **config,
        "architectures": ["EagleLlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": num_layers,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def build_head(config: dict[str, Any], fc_bias: bool = False) -> Any:
    """A torch EAGLE-1 head (`fc` and Transformers' LlamaDecoderLayer, the first with
    no input norm) for a head config.json."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})
    cfg._attn_implementation = "eager"

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            h = cfg.hidden_size
            self.fc = torch.nn.Linear(2 * h, h, bias=fc_bias)
            self.layers = torch.nn.ModuleList(
                LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)
            )
            self.layers[0].input_layernorm = torch.nn.Identity()
            self.rotary = LlamaRotaryEmbedding(cfg)

        def forward(self, embeds: Any, features: Any) -> Any:  # [1, n, H] each
            n = embeds.shape[1]
            x = self.fc(torch.cat([embeds, features], dim=-1))
            positions = torch.arange(n)[None]
            cos_sin = self.rotary(x, positions)
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            for layer in self.layers:
                x = layer(
                    x, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin
                )
            return x

    return Head()


def make_eagle_head(
    target_dir: str | Path,
    out_dir: str | Path,
    seed: int = 0,
    num_layers: int = 1,
    fc_bias: bool = False,
    init_std: float | None = None,
) -> Path:
    """A random EAGLE-1 head for the checkpoint in `target_dir` (float32 safetensors)."""
    import torch
    from safetensors.torch import save_file

    target_config = json.loads((Path(target_dir) / "config.json").read_text())
    config = _head_config(target_config, num_layers)
    torch.manual_seed(seed)
    head = build_head(config, fc_bias)
    if init_std is not None:
        for name, p in head.named_parameters():
            if not name.endswith("norm.weight"):
                torch.nn.init.normal_(p, std=init_std)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in head.state_dict().items() if "rotary" not in k}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def load_head(head_dir: str | Path) -> Any:
    import torch
    from safetensors.torch import load_file

    path = Path(head_dir)
    config = json.loads((path / "config.json").read_text())
    state = load_file(str(path / "model.safetensors"))
    head = build_head(config, fc_bias="fc.bias" in state)
    head.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=False)
    return head.eval()


def reference_drafts(target: Any, head: Any, tokens: list[int], k: int) -> list[int]:
    """The k greedy drafts `head` proposes after `tokens` (the last one newly sampled)
    for the Transformers model `target`, recomputed without any cache."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([tokens])
        features = target.model(ids).last_hidden_state  # after the final norm
        embed = target.get_input_embeddings()
        # Entry i pairs token i + 1 with feature i; each draft adds an entry pairing it
        # with the head's own output feature before it.
        inputs, feats = ids[:, 1:], features[:, :-1]
        drafts = []
        for _ in range(k):
            predicted = head(embed(inputs), feats)[:, -1:]
            draft = int(target.lm_head(predicted)[0, -1].argmax())
            drafts.append(draft)
            inputs = torch.cat([inputs, torch.tensor([[draft]])], dim=1)
            feats = torch.cat([feats, predicted], dim=1)
        return drafts
