"""Weights turned `[in, out]` after loading on a CPU: the same logits as Transformers, the
checkpoint's weights transposed, and only where the layout applies."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jvllm import LLM, SamplingParams
from jvllm.config import CacheConfig, SchedulerConfig
from jvllm.models.loader import load_model
from jvllm.models.weight_layout import process_weights_after_loading, transposes_weights
from jvllm.parallel.mesh import make_mesh
from jvllm.runner.model_runner import ModelRunner
from tests.helpers import hf_greedy
from tests.models.test_forward import BLOCK, Row, assert_close, hf_logits, random_ids

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _leaves(params) -> dict[tuple[str, ...], np.ndarray]:
    """Parameter path -> host copy."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    return {tuple(k.key for k in path): np.asarray(leaf) for path, leaf in leaves}


def test_linear_weights_and_lm_head_are_the_checkpoints_transposed(arch, checkpoints):
    loaded = load_model(checkpoints[arch])
    turned = process_weights_after_loading(load_model(checkpoints[arch]))
    assert turned.spec.transposed_weights and not loaded.spec.transposed_weights
    flat, turned_flat = _leaves(loaded.params), _leaves(turned.params)
    assert flat.keys() == turned_flat.keys()
    transposed = [p for p in flat if p[-1] == "weight" and (p[-2] in LINEAR or p[0] == "lm_head")]
    # 7 per layer, plus lm_head unless tied (qwen2's test checkpoint ties it).
    untied = not loaded.spec.tie_word_embeddings
    assert len(transposed) == 7 * loaded.spec.num_layers + untied
    for path, ours in turned_flat.items():
        theirs = flat[path].T if path in transposed else flat[path]
        np.testing.assert_array_equal(ours, theirs, err_msg=".".join(path))


@pytest.mark.parametrize("length", [1, 17])
def test_transposed_forward_matches_hf(arch, checkpoints, hf_models, length):
    runner = ModelRunner(
        process_weights_after_loading(load_model(checkpoints[arch])),
        num_blocks=32,
        cache_config=CacheConfig(block_size=BLOCK),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=128, max_model_len=512
        ),
    )
    ids = random_ids(length, seed=length)
    blocks = list(range(1, 1 + -(-length // BLOCK)))
    (ours,) = runner.forward_logits([Row(ids, 0, blocks)], every_token=True)
    assert_close(ours, hf_logits(hf_models[arch], ids))


def test_layout_applies_to_one_cpu_device_and_float_weights_only(checkpoints):
    spec = load_model(checkpoints["llama"]).spec
    assert transposes_weights(spec, None)
    assert not transposes_weights(spec, make_mesh(2))
    assert not transposes_weights(dataclasses.replace(spec, quantization="int8"), None)
    assert not transposes_weights(spec, None, num_offloaded_layers=1)


def test_engine_serves_the_turned_model_and_matches_hf(checkpoints, hf_models, tokenizer_dir):
    from transformers import AutoTokenizer

    llm = LLM(str(checkpoints["llama"]), max_model_len=128, num_gpu_blocks_override=32)
    assert llm.llm_engine.runner.spec.transposed_weights
    eos = AutoTokenizer.from_pretrained(tokenizer_dir).eos_token_id
    prompts = [random_ids(n, seed=n) for n in (3, 40)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf_models["llama"], prompt, 12, eos)
