"""Reading PEFT adapters (`jvllm.lora.peft_adapter`) against PEFT itself, each bad
adapter's error, and the masked shrink/expand product against a per-token loop."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jvllm.lora.peft_adapter import LoRAAdapterError, load_peft_adapter, module_shapes
from jvllm.lora.punica import lora_delta
from jvllm.models.spec import spec_from_hf_config
from jvllm.testing.lora_adapters import make_peft_adapter


@pytest.fixture(scope="module")
def llama_shapes(checkpoints):
    config = json.loads((checkpoints["llama"] / "config.json").read_text())
    return module_shapes(spec_from_hf_config(config))


@pytest.fixture(scope="module")
def patterned(checkpoints, tmp_path_factory):
    """rsLoRA with per-module ranks and alphas, on a subset of the targets."""
    return make_peft_adapter(
        checkpoints["llama"],
        tmp_path_factory.mktemp("patterned"),
        rank=4,
        seed=7,
        target_modules=("q_proj", "v_proj", "down_proj"),
        use_rslora=True,
        rank_pattern={"v_proj": 2},
        alpha_pattern={"down_proj": 3.0},
    )


def test_weights_equal_peft_delta_weights(checkpoints, patterned, llama_shapes):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(checkpoints["llama"], dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(patterned))
    model = load_peft_adapter(str(patterned), 5, 8, llama_shapes)
    assert model.rank == 4 and len(model.weights) == 2 * 3  # 2 layers, 3 targets
    assert model.weights[(0, "v_proj")][0].shape == (64, 2)
    for (layer, name), (a, b) in model.weights.items():
        part = "self_attn" if name.endswith(("q_proj", "v_proj")) else "mlp"
        module = peft.base_model.model.model.layers[layer].get_submodule(f"{part}.{name}")
        expected = module.get_delta_weight("default").detach().numpy()  # [out, in]
        np.testing.assert_allclose((a @ b).T, expected, rtol=1e-5, atol=1e-6)


def test_rank_over_max_lora_rank_is_refused(patterned, llama_shapes):
    with pytest.raises(LoRAAdapterError, match="LoRA rank 4 .* greater than max_lora_rank 2"):
        load_peft_adapter(str(patterned), 1, 2, llama_shapes)


def test_unknown_target_modules_are_named(checkpoints, tmp_path, llama_shapes):
    path = make_peft_adapter(checkpoints["llama"], tmp_path, 2, 0, ("q_proj", "lm_head"))
    with pytest.raises(LoRAAdapterError, match=r"expected target modules in .* \['lm_head'\]"):
        load_peft_adapter(str(path), 1, 8, llama_shapes)


def test_missing_and_corrupt_adapters_are_refused(patterned, tmp_path, llama_shapes):
    with pytest.raises(LoRAAdapterError, match="does not exist"):
        load_peft_adapter(str(tmp_path / "nowhere"), 1, 8, llama_shapes)
    with pytest.raises(LoRAAdapterError, match="no adapter_config.json"):
        load_peft_adapter(str(tmp_path), 1, 8, llama_shapes)
    (tmp_path / "adapter_config.json").write_text((patterned / "adapter_config.json").read_text())
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(LoRAAdapterError, match="cannot be read as safetensors"):
        load_peft_adapter(str(tmp_path), 1, 8, llama_shapes)
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAAdapterError, match="not valid JSON"):
        load_peft_adapter(str(tmp_path), 1, 8, llama_shapes)


def test_adapter_of_another_model_is_refused(checkpoints, tmp_path, llama_shapes):
    path = make_peft_adapter(checkpoints["qwen3"], tmp_path, 2, 0, ("q_proj",))
    with pytest.raises(LoRAAdapterError, match=r"layers.0.q_proj .* do not fit"):
        load_peft_adapter(str(path), 1, 8, llama_shapes)


def test_lora_delta_is_each_tokens_own_adapter():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 5)).astype(np.float32)  # [T, in]
    a = rng.normal(size=(3, 5, 4)).astype(np.float32)  # [N, in, R]
    b = rng.normal(size=(3, 4, 7)).astype(np.float32)  # [N, R, out]
    slots = np.array([0, 1, 2, 3, 1, 0], np.int32)
    got = np.asarray(lora_delta(jnp.asarray(x), jnp.asarray(a), jnp.asarray(b), slots))
    for t, s in enumerate(slots):
        want = np.zeros(7, np.float32) if s == 0 else x[t] @ a[s - 1] @ b[s - 1]
        np.testing.assert_allclose(got[t], want, rtol=1e-5, atol=1e-5)
