"""Reading a PEFT LoRA adapter directory into host arrays, with every check a user's
adapter can fail.

Owns `load_peft_adapter`: `adapter_config.json` plus `adapter_model.safetensors` (the
files `PeftModel.save_pretrained` writes) -> `LoRAModel`, each target layer's A `[in, r]`
and B `[r, out]` in float32 with the adapter's scaling (`lora_alpha / r`, or
`/ sqrt(r)` with rsLoRA, per module with `rank_pattern`/`alpha_pattern`) folded into B.
Also `module_shapes`: which layers of a model an adapter may target. Placing adapters
on the devices is the runner's (`runner/lora_weights.py`); this module imports no jax.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# The linear layers an adapter may target, by their Hugging Face names.
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_TARGETS = ATTENTION_TARGETS + MLP_TARGETS

# (layer index, module name), e.g. (0, "q_proj").
TargetKey = tuple[int, str]

_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])"
    r"(?:\.[\w-]+)?\.weight$"
)


class LoRAAdapterError(ValueError):
    """A LoRA adapter that cannot be used (the server answers it with a 400)."""


@dataclass(frozen=True)
class LoRAModel:
    """One adapter read into host memory."""

    lora_int_id: int
    rank: int  # the largest of its modules' ranks
    # (layer, module) -> (A [in, r] float32, B [r, out] float32, scaling folded in)
    weights: dict[TargetKey, tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def module_shapes(spec: Any) -> dict[TargetKey, tuple[int, int]]:
    """Every (layer, module) an adapter may target in a model of `spec` (a `ModelSpec`),
    with its (in, out) features; a mixture-of-experts layer's MLP is not a target."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    h, inter = spec.hidden_size, spec.intermediate_size
    attention = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    mlp = {"gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    shapes: dict[TargetKey, tuple[int, int]] = {}
    for layer in range(spec.num_layers):
        sparse = spec.moe is not None and spec.is_sparse_layer(layer)
        for name, shape in (attention | ({} if sparse else mlp)).items():
            shapes[(layer, name)] = shape
    return shapes


def load_peft_adapter(
    path: str,
    lora_int_id: int,
    max_lora_rank: int,
    shapes: dict[TargetKey, tuple[int, int]],
) -> LoRAModel:
    """The adapter at `path`, checked against `max_lora_rank` and the model's `shapes`;
    `LoRAAdapterError` names whatever is wrong with it."""
    root = Path(path)
    config = _read_config(root)
    tensors = _read_tensors(root)
    pairs: dict[TargetKey, dict[str, np.ndarray]] = {}
    unknown = set()
    for name, value in tensors.items():
        match = _TENSOR.match(name)
        if match is None or match.group(3) not in SUPPORTED_TARGETS:
            # The module's own name: "lm_head" of "base_model.model.lm_head.lora_A.weight"
            # (or of "...lm_head.weight", a whole layer PEFT saved).
            stem = name.split(".lora_")[0].removesuffix(".weight").removesuffix(".base_layer")
            unknown.add(match.group(3) if match else stem.split(".")[-1])
            continue
        key = (int(match.group(1)), match.group(3))
        pairs.setdefault(key, {})[match.group(4)] = value
    if unknown:
        raise LoRAAdapterError(
            f"While loading {path}, expected target modules in {list(SUPPORTED_TARGETS)} but "
            f"received {sorted(unknown)}"
        )
    if not pairs:
        raise LoRAAdapterError(f"LoRA adapter {path} holds no lora_A/lora_B weights")
    weights = {
        key: _module_weights(path, key, pair, config, max_lora_rank, shapes)
        for key, pair in sorted(pairs.items())
    }
    rank = max(a.shape[1] for a, _ in weights.values())
    return LoRAModel(lora_int_id, rank, weights)


def _read_config(root: Path) -> dict[str, Any]:
    file = root / "adapter_config.json"
    if not root.is_dir():
        raise LoRAAdapterError(f"LoRA adapter directory {str(root)!r} does not exist")
    if not file.is_file():
        raise LoRAAdapterError(f"{str(root)!r} has no adapter_config.json (not a PEFT adapter)")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"{file}: peft_type must be 'LORA'")
    for field, accepted in (("bias", ("none", None)), ("use_dora", (False, None))):
        if config.get(field) not in accepted:
            raise LoRAAdapterError(f"{file}: {field}={config[field]!r} is not supported")
    if config.get("modules_to_save"):
        raise LoRAAdapterError(
            f"{file}: modules_to_save={config['modules_to_save']!r} is not supported "
            "(only low-rank weights of the attention and MLP projections)"
        )
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        raise LoRAAdapterError(f"{file}: r must be an integer >= 1, got {config.get('r')!r}")
    return config


def _read_tensors(root: Path) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    file = root / "adapter_model.safetensors"
    if not file.is_file():
        raise LoRAAdapterError(f"{str(root)!r} has no adapter_model.safetensors")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as e:
        raise LoRAAdapterError(f"{file} cannot be read as safetensors: {e}") from None


def _module_weights(
    path: str,
    key: TargetKey,
    pair: dict[str, np.ndarray],
    config: dict[str, Any],
    max_lora_rank: int,
    shapes: dict[TargetKey, tuple[int, int]],
) -> tuple[np.ndarray, np.ndarray]:
    """One module's A `[in, r]` and B `[r, out]` (scaled), checked."""
    where = f"layers.{key[0]}.{key[1]} of {path}"
    if set(pair) != {"A", "B"}:
        raise LoRAAdapterError(f"{where} has lora_{''.join(pair)} without its pair")
    if key not in shapes:
        raise LoRAAdapterError(f"{where}: the model has no such layer to adapt")
    a, b = pair["A"], pair["B"]  # PEFT: A [r, in], B [out, r]
    rank = a.shape[0]
    if rank > max_lora_rank:
        raise LoRAAdapterError(
            f"LoRA rank {rank} of {path} is greater than max_lora_rank {max_lora_rank}"
        )
    expected_in, expected_out = shapes[key]
    if a.shape != (rank, expected_in) or b.shape != (expected_out, rank):
        raise LoRAAdapterError(
            f"{where}: lora_A {a.shape} and lora_B {b.shape} do not fit the model's "
            f"({rank}, {expected_in}) and ({expected_out}, {rank})"
        )
    alpha = _pattern_value(config.get("alpha_pattern") or {}, key, config.get("lora_alpha", 8))
    root = math.sqrt(rank) if config.get("use_rslora") else rank
    scaling = float(alpha) / root
    return a.T.astype(np.float32), (b.T.astype(np.float32) * np.float32(scaling))


def _pattern_value(pattern: dict[str, Any], key: TargetKey, default: Any) -> Any:
    """PEFT's per-module override: the first pattern that matches the module's name."""
    name = f"model.layers.{key[0]}.{'self_attn' if key[1] in ATTENTION_TARGETS else 'mlp'}"
    name = f"{name}.{key[1]}"
    for pattern_key, value in pattern.items():
        if re.match(rf"(.*\.)?{pattern_key}$", name):
            return value
    return default
