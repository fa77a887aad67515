"""Weights quantized at load (int8, fp8) against Transformers running the dequantized
float weights: logits, greedy tokens on 12 prompts, TP=2 equal to TP=1, and the device
bytes the linear weights take."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from jvllm import LLM, SamplingParams
from jvllm.models.loader import _flatten, load_model
from jvllm.models.quantization import QUANTIZED_LAYERS, dequantize, quantize
from jvllm.models.safetensors_index import SafetensorsIndex
from tests.helpers import hf_greedy
from tests.models.test_forward import Row, assert_close, hf_logits

NEW_TOKENS = 16
ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [[int(t) for t in rng.integers(6, 512, size=n)] for n in range(3, 123, 10)]


def dequantized_copy(src, dst, quantization: str):
    """The checkpoint with every quantized layer's weight replaced by what its
    quantized form stands for: the float model a quantized engine must equal."""
    index = SafetensorsIndex(src)
    tensors = {}
    for name in index.names():
        array = np.asarray(index.array(name), np.float32)
        if name.endswith(".weight") and name.split(".")[-2] in QUANTIZED_LAYERS:
            array = dequantize(*quantize(array, quantization))
        tensors[name] = array
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module", params=["int8", "fp8"])
def quantization(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def reference(checkpoints, tmp_path_factory, quantization):
    """(quantized jvllm engine, HF model on the dequantized weights, its directory)."""
    from transformers import AutoModelForCausalLM

    src = checkpoints["qwen2"]  # q/k/v biases too
    dst = dequantized_copy(src, tmp_path_factory.mktemp("deq") / quantization, quantization)
    hf = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    llm = LLM(str(src), quantization=quantization, **ENGINE)
    return llm, hf, dst


def test_logits_match_the_dequantized_model(reference) -> None:
    llm, hf, _ = reference
    ids = prompts()[5]
    runner = llm.engine.runner
    row = prompt_row(ids)
    (got,) = runner.forward_logits([row], every_token=True)
    assert_close(got, hf_logits(hf, ids))  # within 1e-4 * max(1, max|logits|)


def test_greedy_generate_matches_transformers_on_the_dequantized_weights(reference) -> None:
    llm, hf, _ = reference
    eos = llm.get_tokenizer().eos_token_id
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    for ids, out in zip(prompts(), outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, NEW_TOKENS, eos)


def test_tensor_parallel_equals_one_device(checkpoints, quantization) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts()[:4]]
    outs = {}
    for tp in (1, 2):
        llm = LLM(
            str(checkpoints["llama"]), quantization=quantization, tensor_parallel_size=tp, **ENGINE
        )
        outs[tp] = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    assert outs[1] == outs[2]


def linear_bytes(loaded) -> int:
    """Device bytes of the quantizable projections (weights, scales, packed words)."""
    return sum(
        int(leaf.nbytes)
        for path, leaf in _flatten(loaded.params)
        if any(layer in path for layer in QUANTIZED_LAYERS)
    )


def prompt_row(ids: list[int]) -> Row:
    """A whole prompt as one scheduled row over fresh blocks 1, 2, ..."""
    return Row(ids, 0, list(range(1, 1 + -(-len(ids) // 16))))


def test_linear_weights_take_about_half_the_bytes_of_bfloat16(checkpoints, quantization) -> None:
    path = checkpoints["llama"]
    bf16 = load_model(path, "bfloat16")
    quantized = load_model(path, "bfloat16", quantization=quantization)
    ratio = linear_bytes(quantized) / linear_bytes(bf16)
    assert ratio <= 0.55, ratio  # one byte per weight, plus a float32 scale per row
    assert quantized.weight_bytes < bf16.weight_bytes


def test_bad_quantization_is_refused(checkpoints, tmp_path) -> None:
    with pytest.raises(ValueError, match="int8, fp8"):
        load_model(checkpoints["llama"], quantization="int4")
    src = checkpoints["llama"]
    dst = tmp_path / "bnb"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes' is not supported"):
        load_model(dst)
