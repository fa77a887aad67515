"""Gemma 2, Gemma 3 (text) and gpt-oss against Transformers.

Tiny random checkpoints from Transformers' own classes, every constant-initialised
parameter perturbed (`jvllm.testing.variant_checkpoints`): a sliding window of 16 on
alternate layers, Gemma 2's soft caps, Gemma 3's q/k norms and two ropes, gpt-oss's sinks,
biased router and experts, clamped SwiGLU and YaRN past its original window of 64.
Logits within float32 tolerance of Transformers' eager forward for prompts past the
window, chunked prefill with decode; greedy tokens equal to Transformers' `generate` on
12 prompts alone, and at TP=2 under chunked prefill with forced preemption; gpt-oss's
MXFP4 experts loaded from blocks and scales equal to the float ones.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from jvllm import LLM, SamplingParams
from jvllm.engine.kv.hybrid_kv_cache_manager import HybridKVCacheManager
from jvllm.models.loader import load_model
from jvllm.testing.variant_checkpoints import (
    VARIANT_ARCHITECTURES,
    WINDOW,
    make_variant_checkpoint,
)
from tests.helpers import hf_greedy, token_prompts
from tests.models.test_forward import Row, assert_close, hf_logits, make_runner, random_ids
from tests.models.test_moe_models import assert_trees_equal

PROMPT_LENGTHS = [1, 2, 7, 15, 16, 17, 33, 40, 64, 80, 100, 120]
NEW_TOKENS = 10
LONG_DECODE = SamplingParams(temperature=0.0, max_tokens=40)
SLIDING_BLOCK_BOUND = -(-WINDOW // 16) + 1  # blocks of 16 tokens (the default)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
ENGINE = dict(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def variant_checkpoints(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("variants")
    return {
        a: make_variant_checkpoint(a, root / a, tokenizer_dir, mxfp4=a == "gpt_oss")
        for a in VARIANT_ARCHITECTURES
    }


@pytest.fixture(scope="module")
def variant_hf_models(variant_checkpoints):
    from transformers import AutoModelForCausalLM

    return {
        a: AutoModelForCausalLM.from_pretrained(p, attn_implementation="eager").eval()
        for a, p in variant_checkpoints.items()
    }


@pytest.fixture(scope="module")
def variant_runners(variant_checkpoints):
    return {a: make_runner(p) for a, p in variant_checkpoints.items()}


@pytest.fixture(params=VARIANT_ARCHITECTURES)
def variant(request) -> str:
    return request.param


def prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(6, 512, size=n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def variant_hf_greedy(variant_hf_models, tokenizer_dir):
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tokenizer_dir).eos_token_id
    return {
        a: [hf_greedy(m, p, NEW_TOKENS, eos) for p in prompts()]
        for a, m in variant_hf_models.items()
    }


def test_prefill_logits_match_hf_past_the_window(variant, variant_runners, variant_hf_models):
    """70 tokens: past the window (16) and past gpt-oss's original rope window (64)."""
    ids = random_ids(70, seed=70)
    blocks = list(range(1, 6))
    (ours,) = variant_runners[variant].forward_logits([Row(ids, 0, blocks)], every_token=True)
    assert_close(ours, hf_logits(variant_hf_models[variant], ids))


def test_chunked_prefill_then_decode_match_hf(variant, variant_runners, variant_hf_models):
    runner = variant_runners[variant]
    prompt_len, decode_steps, chunk = 30, 8, 7
    ids = random_ids(prompt_len + decode_steps, seed=11)
    blocks = [9, 4, 17]
    got = []
    for start in range(0, prompt_len, chunk):
        piece = ids[start : min(start + chunk, prompt_len)]
        got += list(runner.forward_logits([Row(piece, start, blocks)], every_token=True)[0])
    for pos in range(prompt_len, prompt_len + decode_steps):
        got.append(runner.forward_logits([Row([ids[pos]], pos, blocks)])[0])
    assert_close(np.stack(got), hf_logits(variant_hf_models[variant], ids))


HYBRID_TP2 = dict(
    num_gpu_blocks_override=20,
    max_num_batched_tokens=32,
    tensor_parallel_size=2,
    enable_prefix_caching=False,  # the hybrid KV layout: sliding blocks freed
)


@pytest.mark.parametrize(
    "engine_kwargs",
    [{}, HYBRID_TP2],
    ids=["alone", "tp2-chunked-preempted-hybrid"],  # one engine for all of these: CI time
)
def test_greedy_tokens_equal_hf(variant, variant_checkpoints, variant_hf_greedy, engine_kwargs):
    llm = LLM(str(variant_checkpoints[variant]), **{**ENGINE, **engine_kwargs})
    held = watch_sliding_blocks(llm)
    outs = llm.generate(token_prompts(prompts()), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == variant_hf_greedy[variant]
    metrics = llm.get_metrics()
    if "num_gpu_blocks_override" in engine_kwargs:
        assert metrics["num_preemptions"] > 0
        assert held and max(held) <= SLIDING_BLOCK_BOUND, max(held)
    assert metrics["num_free_blocks"] == metrics["num_total_blocks"]


def test_mxfp4_experts_load_as_the_float_ones(variant_checkpoints):
    """The released layout (`*_blocks`, `*_scales`, quant_method mxfp4) gives the same
    parameters as the float checkpoint whose experts Transformers decoded from it."""
    path = variant_checkpoints["gpt_oss"]
    assert json.loads((path / "mxfp4" / "config.json").read_text())["quantization_config"]
    assert_trees_equal(load_model(path / "mxfp4").params, load_model(path).params)


def test_dequantize_mxfp4_equals_transformers():
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from jvllm.models.mxfp4 import dequantize_mxfp4

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(3, 8, 2, 16), dtype=np.uint8)  # every code
    scales = rng.integers(120, 135, size=(3, 8, 2), dtype=np.uint8)
    ref = convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
    )  # [E, in, out]
    ours = dequantize_mxfp4(blocks, scales)  # [E, out, in]
    np.testing.assert_array_equal(ours, ref.transpose(1, 2).numpy())


@pytest.mark.parametrize(
    "arch,change,match",
    [
        ("gemma2", {"hidden_activation": "relu"}, "hidden_activation"),
        ("gemma2", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
        ("gpt_oss", {"swiglu_limit": 5.0}, "swiglu_limit"),
    ],
)
def test_unsupported_options_are_named(variant_checkpoints, arch, change, match):
    from jvllm.models.registry import read_spec

    cfg = json.loads((variant_checkpoints[arch] / "config.json").read_text())
    if "rope_parameters" in change:
        change["rope_parameters"]["rope_theta"] = 10000.0
    with pytest.raises(ValueError, match=match):
        read_spec({**cfg, **change})


def watch_sliding_blocks(llm: LLM) -> list[int]:
    """After every `schedule()`, the sliding-group blocks each decoding request holds
    (none recorded with the one-table layout)."""
    scheduler = llm.llm_engine.scheduler
    kv, schedule, held = scheduler.kv_cache_manager, scheduler.schedule, []
    if not isinstance(kv, HybridKVCacheManager):
        return held

    def schedule_and_count():
        out = schedule()
        for request in scheduler.running:
            if request.num_computed_tokens > request.num_prompt_tokens:
                held.append(kv.num_sliding_blocks(request.request_id))
        return out

    scheduler.schedule = schedule_and_count
    return held


# gpt-oss's engine here compiles programs no other test shares (20 s): slow.
@pytest.mark.parametrize("arch", ["gemma2", pytest.param("gpt_oss", marks=pytest.mark.slow)])
def test_sliding_window_blocks_are_freed_in_long_decodes(
    arch, variant_checkpoints, variant_hf_models, tokenizer_dir
):
    """Prompts far past the window, then 40 tokens each, under a pool too small for
    both (preemption): tokens equal Transformers', full and sliding layers share their
    cache array, a decoding request's sliding group never holds more than
    ceil(window / block) + 1 blocks, and every block comes back."""
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tokenizer_dir).eos_token_id
    rng = np.random.default_rng(5)
    ps = [[int(t) for t in rng.integers(6, 512, size=n)] for n in (100, 120)]
    expected = [hf_greedy(variant_hf_models[arch], p, LONG_DECODE.max_tokens, eos) for p in ps]
    llm = LLM(str(variant_checkpoints[arch]), **{**ENGINE, **HYBRID_TP2, "tensor_parallel_size": 1})
    engine = llm.llm_engine
    assert isinstance(engine.scheduler.kv_cache_manager, HybridKVCacheManager)
    assert len(engine.runner.caches) == 1  # 2 layers: one full, one sliding
    held = watch_sliding_blocks(llm)
    outs = llm.generate(token_prompts(ps), LONG_DECODE, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert held and max(held) <= SLIDING_BLOCK_BOUND, max(held)
    metrics = llm.get_metrics()
    assert metrics["num_preemptions"] > 0
    assert metrics["num_free_blocks"] == metrics["num_total_blocks"]
