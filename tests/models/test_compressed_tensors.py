"""compressed-tensors checkpoints (pack-quantized W4A16 by groups and W8A16 per channel;
float-quantized FP8 W8A8 with dynamic per-token or calibrated static per-tensor inputs),
written by the compressed-tensors library itself, against Transformers loading the same
checkpoint: logits, greedy tokens on 12 prompts, weight bytes. TP=2 equal to TP=1 for
the same four schemes is checked on llm-compressor's own checkpoints
(test_llmcompressor_checkpoints.py), whose engine is built there anyway."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest
import torch

from jvllm import LLM, SamplingParams
from jvllm.models.loader import load_model
from tests.helpers import hf_greedy
from tests.models.test_forward import assert_close, hf_logits
from tests.models.test_quantization import linear_bytes, prompt_row

ct = pytest.importorskip("compressed_tensors")

NEW_TOKENS = 16
ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)
# name -> (bits, strategy, group size[, symmetric]) of int weights, or a compressed-tensors
# preset.
SCHEMES = {
    "w4a16-g32": (4, "group", 32),
    "w8a16-channel": (8, "channel", None),
    "fp8-dynamic": "FP8_DYNAMIC",  # float8 weights per channel, float8 tokens
    "fp8-static": "FP8",  # float8 weights per tensor, float8 inputs at calibrated scales
}


def input_peaks(model) -> dict[str, torch.Tensor]:
    """Each decoder Linear's max|input| over a few calibration prompts (not the test's)."""
    peaks: dict[str, torch.Tensor] = {}

    def record(name):
        def hook(module, args):
            peak = args[0].detach().abs().amax()
            peaks[name] = torch.maximum(peaks.get(name, peak), peak)

        return hook

    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    hooks = [m.register_forward_pre_hook(record(n)) for n, m in linears if n != "lm_head"]
    rng = np.random.default_rng(7)
    with torch.no_grad():
        for n in (17, 40, 96):
            model(torch.from_numpy(rng.integers(6, 512, size=(1, n))))
    for h in hooks:
        h.remove()
    return peaks


def compress(src, dst, scheme_spec):
    """Quantizes a float checkpoint with compressed-tensors: its own qparams from each
    weight's min/max (what a min-max observer gives) and, for static inputs, from each
    layer's calibrated max|input|; then its compressor (pack-quantized for int weights,
    float-quantized for float8)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    if isinstance(scheme_spec, str):
        scheme = preset_name_to_scheme(scheme_spec, ["Linear"])
        args, group_size, fmt = scheme.weights, None, None
    else:
        bits, strategy, group_size, symmetric = (*scheme_spec, True)[:4]
        args = QuantizationArgs(
            num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group_size
        )
        scheme = QuantizationScheme(targets=["Linear"], weights=args)
        fmt = "pack-quantized"
    inputs = scheme.input_activations
    # Static input scales need calibration (llm-compressor's job): on the float model.
    peaks = input_peaks(model) if inputs is not None and not inputs.dynamic else {}
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    )
    for name, module in model.named_modules():
        if name in peaks:
            scale, _ = calculate_qparams(-peaks[name], peaks[name], inputs)
            module.input_scale.data.copy_(scale.reshape(module.input_scale.shape))
        if hasattr(module, "quantization_scheme") and hasattr(module, "weight_scale"):
            w = module.weight.data
            if args.strategy == "tensor":
                w = w.reshape(1, -1)
            groups = w.reshape(w.shape[0], -1, group_size or w.shape[1])
            scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(dst)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and not (dst / f.name).exists():
            shutil.copy(f, dst / f.name)
    return dst


@pytest.fixture(scope="module", params=sorted(SCHEMES))
def packed(request, checkpoints, tmp_path_factory):
    dst = tmp_path_factory.mktemp("ct") / request.param
    return compress(checkpoints["llama"], dst, SCHEMES[request.param])


@pytest.fixture(scope="module")
def reference(packed):
    from transformers import AutoModelForCausalLM

    # Transformers' compressed-tensors integration as loaded by default: it runs the
    # checkpoint's scheme, float8 tokens included (run_compressed=False would drop them).
    hf = AutoModelForCausalLM.from_pretrained(packed, dtype=torch.float32).eval()
    return LLM(str(packed), **ENGINE), hf


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(4)
    return [[int(t) for t in rng.integers(6, 512, size=n)] for n in range(3, 123, 10)]


def test_checkpoint_is_packed_by_the_library(packed) -> None:
    config = json.loads((packed / "config.json").read_text())["quantization_config"]
    want = "float-quantized" if packed.name.startswith("fp8") else "pack-quantized"
    assert config["quant_method"] == "compressed-tensors" and config["format"] == want


def first_float8_tie(hf: Any, ids: list[int], rel: float = 1e-6) -> int:
    """The first position where some layer's input over its static `input_scale` lies
    within `rel` (a few float32 ulps) of a float8 rounding midpoint, so float32 noise may
    round it either way (causal attention carries a flip to every later position);
    len(ids) if none."""
    values = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    values = np.unique(values[np.isfinite(values) & (values >= 0)])
    mids = (values[1:] + values[:-1]) / 2
    near = np.zeros(len(ids), bool)

    def hook(module, args):
        a = (args[0][0] / module.input_scale).abs().double().numpy()  # [T, in]
        j = np.clip(np.searchsorted(mids, a), 1, len(mids) - 1)
        gap = np.minimum(np.abs(a - mids[j]), np.abs(a - mids[j - 1]))
        near[:] |= (gap < rel * np.maximum(a, 1e-30)).any(axis=-1)

    hooks = [m.register_forward_pre_hook(hook) for m in hf.modules() if hasattr(m, "input_scale")]
    with torch.no_grad():
        hf(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return int(np.argmax(near)) if near.any() else len(ids)


def check_logits(llm: LLM, hf: Any) -> None:
    """Every position's logits on one prompt within 1e-4 * max(1, max|logits|) of hf's, up
    to the first float8 rounding tie of a static input scale (static FP8 only)."""
    ids = prompts()[6]
    (got,) = llm.engine.runner.forward_logits([prompt_row(ids)], every_token=True)
    n = first_float8_tie(hf, ids)
    assert n >= len(ids) // 3, f"a float8 rounding tie at position {n} of {len(ids)}"
    assert_close(got[:n], hf_logits(hf, ids)[:n])


def check_greedy(llm: LLM, hf: Any) -> None:
    """Greedy outputs on the 12 prompts equal hf's, token for token."""
    eos = llm.get_tokenizer().eos_token_id
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    for ids, out in zip(prompts(), outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, NEW_TOKENS, eos)


def check_tensor_parallel(llm: LLM, checkpoint: Path) -> None:
    """The checkpoint at tensor_parallel_size=2 gives `llm`'s greedy tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts()[:4]]
    two = LLM(str(checkpoint), tensor_parallel_size=2, **ENGINE)
    outs = [[o.outputs[0].token_ids for o in e.generate(batch, params, use_tqdm=False)]
            for e in (llm, two)]  # fmt: skip
    assert outs[0] == outs[1]


def test_logits_match_transformers(reference) -> None:
    check_logits(*reference)


def test_greedy_generate_matches_transformers(reference) -> None:
    check_greedy(*reference)


def test_packed_weights_take_the_bytes_of_their_bits(packed, checkpoints) -> None:
    bits = 4 if "w4" in packed.name else 8
    bf16 = linear_bytes(load_model(checkpoints["llama"], "bfloat16"))
    ratio = linear_bytes(load_model(packed, "bfloat16")) / bf16
    # 4 bits + a bfloat16 scale per 32 weights = 4.5 bits; 8 bits + one scale per row.
    assert ratio <= (0.3 if bits == 4 else 0.55), ratio


def test_unsupported_schemes_are_refused(packed, tmp_path) -> None:
    for change, words in [
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
        ({"format": "int-quantized"}, "'int-quantized'"),
    ]:
        dst = tmp_path / words.split()[-1].strip("'")
        shutil.copytree(packed, dst)
        config = json.loads((dst / "config.json").read_text())
        config["quantization_config"] |= change
        for group in config["quantization_config"]["config_groups"].values():
            group["format"] = config["quantization_config"]["format"]
        (dst / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=words):
            load_model(dst)
    with pytest.raises(ValueError, match="cannot be quantized again"):
        load_model(packed, quantization="int8")


@pytest.mark.parametrize("packed", ["fp8-dynamic"], indirect=True)
def test_unsupported_float_activations_are_refused(packed, tmp_path) -> None:
    config = json.loads((packed / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["input_activations"] |= {"dynamic": False, "strategy": "channel"}
    dst = tmp_path / "channel-inputs"
    shutil.copytree(packed, dst)
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="static float activations of 8 bits by 'channel'") as e:
        load_model(dst)
    assert "dynamic per-token or static per-tensor" in str(e.value)


@pytest.mark.parametrize("packed", ["fp8-static"], indirect=True)
def test_scalar_per_tensor_scales_load_as_one_element(packed, tmp_path) -> None:
    """Some writers store a per-tensor scale as a scalar [] rather than [1]."""
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "scalar-scales"
    shutil.copytree(packed, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        save_file({k: v.reshape(()) if v.shape == (1,) else v for k, v in tensors.items()}, f)
    ours, theirs = load_model(dst).params, load_model(packed).params
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), ours, theirs))
