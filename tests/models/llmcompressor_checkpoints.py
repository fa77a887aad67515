"""Quantized checkpoints made by llm-compressor itself, for the tests.

Each recipe runs llm-compressor's `oneshot` on a float checkpoint with a few calibration
samples (random token ids, never the tests' prompts) and saves what it saves for users:
a compressed-tensors checkpoint. Run in a subprocess (`python -m
tests.models.llmcompressor_checkpoints SRC OUT NAME...`): llm-compressor patches
Transformers and configures logging as it imports, which the test process must not see.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

# The in-features of the tests' tiny models are 64 and 128: groups of 32.
_W4_GROUPS = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}

# name -> (modifier, its arguments). Every recipe leaves lm_head in float, as vLLM's
# examples do.
RECIPES: dict[str, tuple[str, dict[str, Any]]] = {
    # GPTQ, 4-bit symmetric by groups of 32, columns quantized in activation order.
    "gptq-w4a16-g32": (
        "GPTQModifier",
        {"config_groups": {"g": {"targets": ["Linear"],
                                 "weights": {**_W4_GROUPS, "symmetric": True,
                                             "actorder": "weight"}}}},
    ),
    # GPTQ, 8-bit symmetric per output channel.
    "gptq-w8a16-channel": (
        "GPTQModifier",
        {"config_groups": {"g": {"targets": ["Linear"],
                                 "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                             "strategy": "channel"}}}},
    ),
    # AWQ, 4-bit with zero points by groups of 32.
    "awq-w4a16-asym-g32": (
        "AWQModifier",
        {"config_groups": {"g": {"targets": ["Linear"],
                                 "weights": {**_W4_GROUPS, "symmetric": False}}}},
    ),
    # FP8 W8A8: float8 weights per channel, dynamic per-token float8 inputs.
    "fp8-dynamic": ("QuantizationModifier", {"scheme": "FP8_DYNAMIC"}),
    # FP8 W8A8: float8 weights per tensor, static float8 inputs at calibrated scales.
    "fp8-static": ("QuantizationModifier", {"scheme": "FP8"}),
}  # fmt: skip


def _weights_only(weights: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Round-to-nearest weight quantization, activations left in float."""
    return (
        "QuantizationModifier",
        {"config_groups": {"g": {"targets": ["Linear"], "weights": weights}}},
    )


# Mixture-of-experts recipes (llm-compressor linearises the experts and leaves the routers
# in float by itself).
MOE_RECIPES: dict[str, tuple[str, dict[str, Any]]] = {
    # int8 symmetric per output channel (W8A16), pack-quantized.
    "w8a16-channel": _weights_only({"num_bits": 8, "type": "int", "symmetric": True,
                                    "strategy": "channel"}),
    # int4 symmetric by groups of 16 (W4A16), pack-quantized; 16 divides the tiny
    # Qwen3-MoE's dense down_proj inputs on each of two devices (96 / 2).
    "w4a16-g16": _weights_only({"num_bits": 4, "type": "int", "symmetric": True,
                                "strategy": "group", "group_size": 16}),
    # float8 weights per output channel, float inputs.
    "fp8-weights-channel": _weights_only({"num_bits": 8, "type": "float", "symmetric": True,
                                          "strategy": "channel"}),
    # float8 weights, one scale per tensor (per expert), float inputs.
    "fp8-weights-tensor": _weights_only({"num_bits": 8, "type": "float", "symmetric": True,
                                         "strategy": "tensor"}),
}  # fmt: skip

NUM_CALIBRATION_SAMPLES = 16
CALIBRATION_LEN = 48


def _modifier(name: str) -> Any:
    from llmcompressor.modifiers.awq import AWQModifier
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    kind, kwargs = {**RECIPES, **MOE_RECIPES}[name]
    cls = {"GPTQModifier": GPTQModifier, "AWQModifier": AWQModifier}.get(kind, QuantizationModifier)
    return cls(targets=["Linear"], ignore=["lm_head"], **kwargs)


def produce(src: Path, out: Path, names: list[str], vocab_size: int) -> None:
    """One llm-compressor checkpoint of `src` per recipe name, in `out / name`."""
    import numpy as np
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.pipelines.cache import IntermediatesCache

    if not torch.accelerator.is_available():
        # AWQ pins its cached activations for faster copies to an accelerator, which a
        # CPU-only torch refuses ("Cannot access accelerator device"); unpinned, the
        # same values go to the same computation.
        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    rng = np.random.default_rng(11)
    ids = rng.integers(6, vocab_size, size=(NUM_CALIBRATION_SAMPLES, CALIBRATION_LEN)).tolist()
    calibration = Dataset.from_dict(
        {"input_ids": ids, "attention_mask": [[1] * len(r) for r in ids]}
    )
    for name in names:
        oneshot(
            model=str(src),
            processor=str(src),
            dataset=calibration,
            recipe=_modifier(name),
            num_calibration_samples=NUM_CALIBRATION_SAMPLES,
            max_seq_length=CALIBRATION_LEN,
            output_dir=str(out / name),
        )


if __name__ == "__main__":
    source, target, vocab, *recipe_names = sys.argv[1:]
    produce(Path(source), Path(target), recipe_names, int(vocab))
