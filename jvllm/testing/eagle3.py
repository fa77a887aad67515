"""EAGLE-3 heads in torch, built from Transformers' own Llama layers: test checkpoints
and the reference drafts jvllm's head must reproduce.

`make_eagle3_head` writes a random head for a target checkpoint in the public EAGLE-3
layout (config.json with `draft_vocab_size` and `eagle_aux_hidden_state_layer_ids`;
`fc.weight`, `midlayer.*` with `hidden_norm` and q/k/v over 2H, `norm.weight`,
`lm_head.weight` over the draft vocabulary, `d2t` and `t2d`). `reference_drafts`
recomputes, from scratch for one sequence, the k greedy drafts the head proposes after
it: the inputs of the target's aux layers (read by hooks on Transformers' decoder
layers) fused by `fc`, the head over every position (token i + 1 with fused feature i),
then k steps feeding its own pre-norm output forward, each scored by its lm_head and
mapped to target ids.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jvllm.testing.eagle import _head_config


def build_head(config: dict[str, Any]) -> Any:
    """A torch EAGLE-3 head for a head config.json: `fc`, a Transformers
    LlamaDecoderLayer (`midlayer`) with q/k/v widened to 2H and a `hidden_norm`, the
    final norm and the draft-vocabulary lm_head."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaDecoderLayer,
        LlamaRMSNorm,
        LlamaRotaryEmbedding,
    )

    keep = {k: v for k, v in config.items() if k not in ("architectures", "eagle_config")}
    cfg = LlamaConfig(**keep)
    cfg._attn_implementation = "eager"
    h, eps = cfg.hidden_size, cfg.rms_norm_eps

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(3 * h, h, bias=False)
            layer = LlamaDecoderLayer(cfg, 0)
            attn = layer.self_attn
            for name in ("q_proj", "k_proj", "v_proj"):
                out = getattr(attn, name).out_features
                setattr(attn, name, torch.nn.Linear(2 * h, out, bias=cfg.attention_bias))
            layer.hidden_norm = LlamaRMSNorm(h, eps)
            self.midlayer = layer
            self.norm = LlamaRMSNorm(h, eps)
            self.lm_head = torch.nn.Linear(h, config["draft_vocab_size"], bias=False)
            self.rotary = LlamaRotaryEmbedding(cfg)

        def forward(self, embeds: Any, hidden: Any) -> Any:  # [1, n, H] each -> [1, n, H]
            n, layer = embeds.shape[1], self.midlayer
            positions = torch.arange(n)[None]
            cos_sin = self.rotary(hidden, positions)
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            both = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], -1)
            attended, _ = layer.self_attn(
                hidden_states=both, position_embeddings=cos_sin, attention_mask=mask
            )
            x = hidden + attended
            return x + layer.mlp(layer.post_attention_layernorm(x))

    return Head()


def make_eagle3_head(
    target_dir: str | Path,
    out_dir: str | Path,
    draft_token_ids: Sequence[int],
    aux_layers: Sequence[int] | None,
    seed: int = 0,
    init_std: float = 0.5,
) -> Path:
    """A random EAGLE-3 head for the checkpoint in `target_dir` (float32 safetensors)
    whose draft vocabulary is `draft_token_ids` (ascending target ids), fusing the
    inputs of target layers `aux_layers` (None: vLLM's default layers)."""
    import torch
    from safetensors.torch import save_file

    target_config = json.loads((Path(target_dir) / "config.json").read_text())
    config = {
        **_head_config(target_config, 1),
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": len(draft_token_ids),
    }
    if aux_layers is not None:
        config["eagle_aux_hidden_state_layer_ids"] = list(aux_layers)
    torch.manual_seed(seed)
    head = build_head(config)
    for name, p in head.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.normal_(p, mean=1.0, std=0.2)
        else:
            torch.nn.init.normal_(p, std=init_std)
    state = {k: v.contiguous() for k, v in head.state_dict().items() if "rotary" not in k}
    ids = torch.tensor(list(draft_token_ids), dtype=torch.int64)
    state["d2t"] = ids - torch.arange(len(ids))
    t2d = torch.zeros(config["vocab_size"], dtype=torch.bool)
    t2d[ids] = True
    state["t2d"] = t2d
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def load_head(head_dir: str | Path) -> tuple[Any, list[int]]:
    """The torch head and its draft vocabulary's target ids (from `d2t`)."""
    import torch
    from safetensors.torch import load_file

    path = Path(head_dir)
    config = json.loads((path / "config.json").read_text())
    state = load_file(str(path / "model.safetensors"))
    d2t, _ = state.pop("d2t"), state.pop("t2d")
    head = build_head(config)
    head.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=False)
    target_ids = (torch.arange(len(d2t)) + d2t).tolist()
    return head.eval(), target_ids


def aux_hidden_states(target: Any, ids: Any, layers: Sequence[int]) -> Any:
    """The inputs of `target`'s decoder layers `layers` (layer N: the last layer's
    output, before the final norm), concatenated `[1, n, 3H]`."""
    import torch

    decoder = target.model.layers
    seen: dict[int, Any] = {}

    def before(i: int) -> Any:
        def hook(module: Any, args: Any, kwargs: Any) -> None:
            seen[i] = args[0] if args else kwargs["hidden_states"]

        return hook

    def after(module: Any, args: Any, output: Any) -> None:
        seen[len(decoder)] = output[0] if isinstance(output, tuple) else output

    handles = [
        layer.register_forward_pre_hook(before(i), with_kwargs=True)
        for i, layer in enumerate(decoder)
    ]
    handles.append(decoder[-1].register_forward_hook(after))
    try:
        with torch.no_grad():
            target.model(ids)
    finally:
        for handle in handles:
            handle.remove()
    return torch.cat([seen[i] for i in sorted(set(layers))], dim=-1)


def reference_drafts(
    target: Any,
    head: Any,
    target_ids: list[int],
    layers: Sequence[int],
    tokens: list[int],
    k: int,
    embed: Any = None,
) -> list[int]:
    """The k greedy drafts `head` proposes after `tokens` (the last one newly sampled)
    for the Transformers model `target`, recomputed without any cache; tokens embedded
    by `embed` (the head's own embedding), else by the target's."""
    import torch

    vocab = target.config.vocab_size
    with torch.no_grad():
        ids = torch.tensor([tokens])
        fused = head.fc(aux_hidden_states(target, ids, layers))  # [1, n, H]
        embed = embed or target.get_input_embeddings()
        # Entry i pairs token i + 1 with feature i; each draft adds an entry pairing it
        # with the head's own output before it.
        inputs, feats = ids[:, 1:], fused[:, :-1]
        drafts = []
        for _ in range(k):
            out = head(embed(inputs), feats)[:, -1:]
            logits = torch.full((vocab,), float("-inf"))
            logits[target_ids] = head.lm_head(head.norm(out))[0, -1]
            draft = int(logits.argmax())
            drafts.append(draft)
            inputs = torch.cat([inputs, torch.tensor([[draft]])], dim=1)
            feats = torch.cat([feats, out], dim=1)
        return drafts
