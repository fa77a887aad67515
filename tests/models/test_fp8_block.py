"""`quant_method: "fp8"` checkpoints (float8 e4m3 weights, one float32 scale per weight
block, as DeepSeek-V3 and Qwen3-FP8 publish them): logits, greedy tokens on 12 prompts,
TP=2 equal to TP=1, weight bytes, and the errors of bad configs.

The weights and block scales are what compressed-tensors' block quantizer and its
float-quantized compressor produce, renamed into the fp8 layout (`weight_scale` ->
`weight_scale_inv`, DeepSeek's quantization_config). The reference is Transformers
running the weights that compressed-tensors' own fp8-block dequantizer reads from
that checkpoint (Transformers itself needs accelerate, not installed, to load fp8).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from jvllm import LLM
from jvllm.models.loader import load_model
from jvllm.parallel.mesh import make_mesh
from tests.models.test_compressed_tensors import (
    ENGINE,
    check_greedy,
    check_logits,
    check_tensor_parallel,
)
from tests.models.test_quantization import linear_bytes

ct = pytest.importorskip("compressed_tensors")
from safetensors.torch import load_file, save_file  # noqa: E402

BLOCK = [16, 32]  # rows (outputs), columns (inputs) of a weight block
FP8_CONFIG = dict(
    quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=BLOCK
)


def block_quantized(src):
    """The float model of `src` with compressed-tensors' block fp8 weights and scales
    (its qparams from each block's min/max, then its float-quantized compressor)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    args = QuantizationArgs(
        num_bits=8, type="float", strategy="block", block_structure=BLOCK, symmetric=True
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    )
    rows, cols = BLOCK
    for module in model.modules():
        if hasattr(module, "quantization_scheme") and hasattr(module, "weight_scale"):
            w = module.weight.data
            blocks = w.reshape(w.shape[0] // rows, rows, w.shape[1] // cols, cols)
            scale, _ = calculate_qparams(blocks.amin((1, 3)), blocks.amax((1, 3)), args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    return model


def write_fp8(src, dst):
    block_quantized(src).save_pretrained(dst)
    tensors = load_file(str(dst / "model.safetensors"))
    renamed = {name.replace(".weight_scale", ".weight_scale_inv"): t for name, t in tensors.items()}
    save_file(renamed, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = FP8_CONFIG
    (dst / "config.json").write_text(json.dumps(config))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and not (dst / f.name).exists():
            shutil.copy(f, dst / f.name)
    return dst


@pytest.fixture(scope="module")
def fp8_dir(checkpoints, tmp_path_factory):
    return write_fp8(checkpoints["llama"], tmp_path_factory.mktemp("fp8") / "llama-fp8")


@pytest.fixture(scope="module")
def reference(fp8_dir, checkpoints):
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import (
        FP8BlockDequantizer,
    )
    from transformers import AutoModelForCausalLM

    dequantizer = FP8BlockDequantizer(
        targets=["re:.*_proj$"], weight_block_size=tuple(BLOCK), dtype=torch.float32
    )
    weights = dequantizer.process(load_file(str(fp8_dir / "model.safetensors")))
    hf = AutoModelForCausalLM.from_pretrained(checkpoints["llama"], dtype=torch.float32).eval()
    for name, module in hf.named_modules():
        if name.endswith("_proj"):
            module.weight.data.copy_(weights[f"{name}.weight"])
    return LLM(str(fp8_dir), **ENGINE), hf


def test_checkpoint_is_block_fp8(fp8_dir) -> None:
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (64 // 16, 128 // 32)


def test_logits_match_transformers(reference) -> None:
    check_logits(*reference)


def test_greedy_generate_matches_transformers(reference) -> None:
    check_greedy(*reference)


def test_tensor_parallel_equals_one_device(reference, fp8_dir) -> None:
    check_tensor_parallel(reference[0], fp8_dir)


def test_fp8_weights_take_about_half_the_bytes_of_bfloat16(fp8_dir, checkpoints) -> None:
    bf16 = linear_bytes(load_model(checkpoints["llama"], "bfloat16"))
    ratio = linear_bytes(load_model(fp8_dir, "bfloat16")) / bf16
    assert ratio <= 0.55, ratio  # a byte per weight and a float32 scale per 512


def test_bad_fp8_configs_are_refused(fp8_dir, tmp_path) -> None:
    for i, (change, words) in enumerate([
        ({"weight_block_size": None}, "weight_block_size=None"),
        ({"activation_scheme": "static"}, "activation_scheme='static'"),
        ({"weight_block_size": [64, 32]}, "into 32, not a multiple of the weight block's 64"),
    ]):  # fmt: skip
        dst = tmp_path / str(i)
        shutil.copytree(fp8_dir, dst)
        config = json.loads((dst / "config.json").read_text())
        config["quantization_config"] |= change
        (dst / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=words):
            load_model(dst, mesh=make_mesh(2))
