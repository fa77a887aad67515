"""The float checkpoint Transformers runs as the reference for a quantized MoE one.

compressed-tensors' own unpacker and `dequantize` turn every quantized linear weight of
an llm-compressor checkpoint (int8 packed in int32 words, or float8, with its scales)
back into the float weight it stands for; the float tensors are kept as stored. Mixtral's
experts, which llm-compressor writes under its linearised module names
(`block_sparse_moe.experts.N.gate_proj`), get the Hub's names (`w1`, `w3`, `w2`) that
Transformers reads. For float8 *inputs* (FP8_DYNAMIC), which the float weights alone
do not compute, `write_compressed_tensors_outputs` runs the quantized checkpoint itself
on llm-compressor's linearised experts. Nothing here uses jvllm's model code.
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


def write_compressed_tensors_outputs(
    src: Path, prompts: list[list[int]], new_tokens: int, eos: int, dst: Path
) -> None:
    """Transformers running `src` as compressed-tensors runs it, on llm-compressor's
    linearised experts (each expert's projections `nn.Linear`s that compressed-tensors
    quantizes, float8 per-token inputs included): the first prompt's logits and every
    prompt's greedy tokens, as JSON in `dst`. Run it in a process of its own:
    `load_quantizable_moe` leaves its conversion mappings registered in Transformers."""
    from llmcompressor.modeling.moe.linearize import load_quantizable_moe
    from transformers import AutoModelForCausalLM

    from jvllm.testing.hf_runner import hf_greedy

    with load_quantizable_moe():
        hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    assert hf.model.layers[0].mlp.experts[0].down_proj.quantization_scheme is not None
    # The linearised experts see `[tokens, in]` inputs, on which compressed-tensors'
    # per-token quantizer (it keeps dims 0 and 1) takes one scale for them all; seen as
    # `[1, tokens, in]`, as a dense layer's `[batch, seq, in]`, each token gets its own.
    for name, module in hf.named_modules():
        if ".experts." in name and isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda m, args: (args[0][None],))
            module.register_forward_hook(lambda m, args, out: out[0])
    with torch.no_grad():
        logits = hf(torch.tensor([prompts[0]])).logits[0].float()
    greedy = [hf_greedy(hf, ids, new_tokens, eos) for ids in prompts]
    dst.write_text(json.dumps({"logits": logits.tolist(), "greedy": greedy}))
