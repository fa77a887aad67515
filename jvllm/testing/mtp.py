"""DeepSeek-V3 (and GLM-4.5) MTP layers in torch, built from Transformers' own modules: a test
checkpoint and the reference drafts jvllm's MTP layer must reproduce.

`make_mtp_checkpoint` saves a tiny random DeepseekV3ForCausalLM of num_hidden_layers + 1
layers with Transformers, then declares one layer fewer (`num_nextn_predict_layers` 1):
the last layer's tensors become the MTP layer's decoder block, and the MTP layer's own
tensors (`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, `shared_head.head`) are added
to the safetensors, perturbed away from any constant. Transformers loads the target and
ignores them. `load_reference` rebuilds the layer from Transformers' modules (the block
as Transformers loads layer N of the larger model, its DeepseekV3RMSNorm and rotary
embedding); `reference_drafts` recomputes, from scratch for one sequence, the k greedy
drafts: position i pairs the embedding of token i + 1 (zero at position 0) with the
target's final hidden state at i, and each draft feeds the layer's output back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jvllm.testing.mla_checkpoints import make_variant_checkpoint


def make_mtp_checkpoint(
    out_dir: str | Path, tokenizer_dir: str | Path, seed: int = 0, **overrides: Any
) -> Path:
    """A DeepSeek-V3 checkpoint of 2 decoder layers and one MTP layer (`model.layers.2`)."""
    out = Path(out_dir)
    make_variant_checkpoint(
        "deepseek_v3", out, tokenizer_dir, seed, num_hidden_layers=3, **overrides
    )
    return add_mtp_layer(out, seed)


def add_mtp_layer(out: Path, seed: int) -> Path:
    """Declares the last decoder layer of the checkpoint at `out` its MTP layer's block
    and adds the MTP layer's own tensors, perturbed away from any constant."""
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((out / "config.json").read_text())
    n = config["num_hidden_layers"] - 1
    config.update(num_hidden_layers=n, num_nextn_predict_layers=1)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    h, v = config["hidden_size"], config["vocab_size"]
    files = sorted(out.glob("*.safetensors"))
    assert len(files) == 1, files  # tiny: one file
    state = load_file(str(files[0]))
    gen = torch.Generator().manual_seed(seed + 1)
    noise = lambda *shape, scale: torch.randn(*shape, generator=gen) * scale
    prefix = f"model.layers.{n}."
    state[prefix + "enorm.weight"] = 1 + noise(h, scale=0.2)
    state[prefix + "hnorm.weight"] = 1 + noise(h, scale=0.2)
    state[prefix + "eh_proj.weight"] = noise(h, 2 * h, scale=0.15)
    state[prefix + "shared_head.norm.weight"] = 1 + noise(h, scale=0.2)
    state[prefix + "shared_head.head.weight"] = noise(v, h, scale=0.3)
    save_file(state, str(files[0]), metadata={"format": "pt"})
    return out


def load_reference(checkpoint: str | Path) -> tuple[Any, dict[str, Any]]:
    """(the target as Transformers loads it, the MTP layer's torch modules)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRMSNorm

    checkpoint = Path(checkpoint)
    target = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    config = AutoConfig.from_pretrained(checkpoint)
    n, h, eps = config.num_hidden_layers, config.hidden_size, config.rms_norm_eps
    config.num_hidden_layers = n + 1
    config._attn_implementation = "eager"
    larger = AutoModelForCausalLM.from_pretrained(checkpoint, config=config, dtype=torch.float32)
    state = {}
    for f in checkpoint.glob("*.safetensors"):
        state.update(load_file(str(f)))
    prefix = f"model.layers.{n}."
    parts: dict[str, Any] = {
        "block": larger.model.layers[n].eval(),
        "rotary": larger.model.rotary_emb,
    }
    for name in ("enorm", "hnorm", "shared_head.norm"):
        norm = (Glm4MoeRMSNorm if config.model_type == "glm4_moe" else DeepseekV3RMSNorm)(h, eps)
        norm.weight.data = state[f"{prefix}{name}.weight"].float()
        parts[name] = norm
    for name, shape in (("eh_proj", (2 * h, h)), ("shared_head.head", (h, config.vocab_size))):
        linear = torch.nn.Linear(*shape, bias=False)
        linear.weight.data = state[f"{prefix}{name}.weight"].float()
        parts[name] = linear
    return target, parts


def reference_drafts(target: Any, parts: dict[str, Any], tokens: list[int], k: int) -> list[int]:
    """The k greedy drafts the MTP layer proposes after `tokens` (the last newly
    sampled), recomputed without any cache."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([tokens])
        features = target.model(ids).last_hidden_state  # after the final norm
        embed = target.get_input_embeddings()
        inputs, feats = ids[:, 1:], features[:, :-1]
        drafts = []
        for _ in range(k):
            n = inputs.shape[1]
            e = embed(inputs).clone()
            e[:, 0] = 0.0  # position 0's embedding is masked
            x = parts["eh_proj"](torch.cat([parts["enorm"](e), parts["hnorm"](feats)], -1))
            positions = torch.arange(n)[None]
            cos_sin = parts["rotary"](x, positions)
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            out = parts["block"](
                x, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin
            )
            out = (out[0] if isinstance(out, tuple) else out)[:, -1:]
            logits = parts["shared_head.head"](parts["shared_head.norm"](out))[0, -1]
            draft = int(logits.argmax())
            drafts.append(draft)
            inputs = torch.cat([inputs, torch.tensor([[draft]])], dim=1)
            feats = torch.cat([feats, out], dim=1)
        return drafts
