"""The float checkpoint Transformers runs as the reference for a quantized MoE one.

compressed-tensors' own unpacker and `dequantize` turn every quantized linear weight of
an llm-compressor checkpoint (int8 packed in int32 words, or float8, with its scales)
back into the float weight it stands for; the float tensors are kept as stored. Mixtral's
experts, which llm-compressor writes under its linearised module names
(`block_sparse_moe.experts.N.gate_proj`), get the Hub's names (`w1`, `w3`, `w2`) that
Transformers reads. Nothing here uses jvllm.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

_MIXTRAL = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_DROPPED = (".weight_shape", ".input_scale")


def _weights_args(config: dict) -> object:
    from compressed_tensors.quantization import QuantizationArgs

    (group,) = config["quantization_config"]["config_groups"].values()
    return QuantizationArgs(**group["weights"])


def _hub_name(name: str) -> str:
    if ".block_sparse_moe.experts." not in name:
        return name
    head, proj, leaf = name.rsplit(".", 2)
    return f"{head}.{_MIXTRAL.get(proj, proj)}.{leaf}"


def write_dequantized(src: Path, dst: Path) -> Path:
    """`src`'s weights as compressed-tensors dequantizes them, in a float checkpoint."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from safetensors.torch import load_file, save_file

    config = json.loads((src / "config.json").read_text())
    args = _weights_args(config)
    tensors = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(_DROPPED) or name.endswith(".weight_scale"):
            continue
        prefix, _, leaf = name.rpartition(".")
        scale = tensors.get(f"{prefix}.weight_scale")
        if scale is None:
            out[_hub_name(name)] = t
            continue
        if leaf == "weight_packed":
            shape = torch.Size(tensors[f"{prefix}.weight_shape"].tolist())
            t = unpack_from_int32(t, args.num_bits, shape).to(torch.int8)
        weight = dequantize(t, scale, None, args).to(torch.float32)
        out[_hub_name(f"{prefix}.weight")] = weight.contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "generation_config", "chat_template")):
            shutil.copy(f, dst / f.name)
    return dst
