"""Random PEFT LoRA adapters for a checkpoint, for tests and benchmarks.

Owns `make_peft_adapter`: PEFT's own `get_peft_model` on the Transformers model of a
checkpoint, every lora_A and lora_B filled with random values (PEFT starts B at zero,
which would make the adapter a no-op), saved with `save_pretrained`; and
`merged_reference`: PEFT's `merge_and_unload()` model of an adapter, the reference its
greedy tokens are compared against.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(
    base_dir: str | Path,
    out_dir: str | Path,
    rank: int,
    seed: int,
    target_modules: Sequence[str] = ALL_TARGETS,
    lora_alpha: float | None = None,
    scale: float = 0.3,
    **config: Any,
) -> Path:
    """A rank-`rank` adapter of the checkpoint at `base_dir`, written to `out_dir`;
    A and B normal with standard deviation `scale` (from `seed`); `config`: more
    `LoraConfig` fields (use_rslora, rank_pattern, ...)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora = LoraConfig(
        r=rank,
        lora_alpha=lora_alpha if lora_alpha is not None else 2 * rank,
        target_modules=list(target_modules),
        lora_dropout=0.0,
        **config,
    )
    model = get_peft_model(base, lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    out = Path(out_dir)
    model.save_pretrained(out)
    return out


def merged_reference(base_dir: str | Path, adapter_dir: str | Path) -> Any:
    """The checkpoint with the adapter merged into its weights by PEFT (torch, eval)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload().eval()
