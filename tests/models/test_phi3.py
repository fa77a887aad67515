"""Phi-3 (fused qkv_proj and gate_up_proj, LongRoPE) against Transformers.

A tiny random checkpoint from Transformers' own class, every constant-initialised
parameter perturbed, with distinct short and long rope factors and a 64-token original
window (`jvllm.testing.variant_checkpoints`). Transformers switches to the long factors
for a forward whose sequence passes the window; jvllm, as vLLM, picks them once from
max_model_len. The two agree when max_model_len stays within the window (short) and on
prompts past it (long), which is what is compared: logits (prefill, chunked prefill then
decode), greedy tokens alone and chunked with forced preemption, and at TP=2.
"""

from __future__ import annotations

import numpy as np
import pytest

from jvllm import LLM, SamplingParams
from jvllm.config import CacheConfig, SchedulerConfig
from jvllm.models.loader import load_model
from jvllm.parallel.mesh import make_mesh
from jvllm.runner.model_runner import ModelRunner
from jvllm.testing.mla_checkpoints import PHI3_ORIGINAL_WINDOW, make_variant_checkpoint
from tests.helpers import hf_greedy, token_prompts
from tests.models.test_forward import Row, assert_close, hf_logits, random_ids

WINDOW = PHI3_ORIGINAL_WINDOW
# Every prompt past the original window: Transformers runs them with the long factors.
LONG_PROMPTS = [65, 66, 70, 79, 80, 81, 96, 100, 128, 129, 150, 170]
NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory, tokenizer_dir):
    return make_variant_checkpoint("phi3", tmp_path_factory.mktemp("phi3") / "p", tokenizer_dir)


@pytest.fixture(scope="module")
def phi3_hf(phi3):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(phi3).eval()


def runner(path, max_model_len: int, mesh=None) -> ModelRunner:
    scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256)
    loaded = load_model(path, mesh=mesh, max_model_len=max_model_len)
    return ModelRunner(loaded, 32, CacheConfig(block_size=16), scheduler, mesh)


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(6, 512, size=n)] for n in LONG_PROMPTS]


def test_fused_projections_load_split(phi3):
    from safetensors.numpy import load_file

    tensors = load_file(phi3 / "model.safetensors")
    attn = load_model(phi3).params["model"]["layers_1"]["self_attn"]
    qkv = tensors["model.layers.1.self_attn.qkv_proj.weight"]  # [(4 + 2 + 2) * 16, 64]
    np.testing.assert_array_equal(np.asarray(attn["k_proj"]["weight"]), qkv[64:96])
    np.testing.assert_array_equal(np.asarray(attn["v_proj"]["weight"]), qkv[96:])


@pytest.mark.parametrize("max_model_len", [WINDOW, 256], ids=["short-factors", "long-factors"])
def test_logits_match_hf(phi3, phi3_hf, max_model_len):
    """Within the window (max_model_len 64): a 40-token prompt chunked by 16, then
    decodes up to the window's end. Past it: a 100-token prompt chunked by 48, then
    decodes."""
    prompt_len, total, chunk = (40, 64, 16) if max_model_len == WINDOW else (100, 110, 48)
    ours = runner(phi3, max_model_len)
    ids, blocks, got = random_ids(total, seed=5), [7, 3, 12, 1, 20, 9, 15], []
    for start in range(0, prompt_len, chunk):
        piece = ids[start : min(start + chunk, prompt_len)]
        got += list(ours.forward_logits([Row(piece, start, blocks)], every_token=True)[0])
    for pos in range(prompt_len, total):
        got.append(ours.forward_logits([Row([ids[pos]], pos, blocks)])[0])
    ref = hf_logits(phi3_hf, ids[:prompt_len])  # the prompt's own forward picks the factors
    assert_close(np.stack(got[:prompt_len]), ref)
    decode_ref = [hf_logits(phi3_hf, ids[: pos + 1])[-1] for pos in range(prompt_len, total)]
    assert_close(np.stack(got[prompt_len:]), np.stack(decode_ref))


@pytest.fixture(scope="module")
def phi3_hf_greedy(phi3_hf, tokenizer_dir):
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tokenizer_dir).eos_token_id
    return [hf_greedy(phi3_hf, p, NEW_TOKENS, eos) for p in prompts()]


def test_greedy_tokens_equal_hf_past_the_window(phi3, phi3_hf_greedy):
    """One engine: two prompts alone (each in one step), then all 12 chunked and
    preempted."""
    engine = dict(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=80)
    llm = LLM(str(phi3), **engine, num_gpu_blocks_override=20)
    for i in (0, 3):  # 65 and 79 tokens
        out = llm.generate(token_prompts(prompts()[i : i + 1]), GREEDY, use_tqdm=False)
        assert out[0].outputs[0].token_ids == phi3_hf_greedy[i]
    assert llm.get_metrics()["num_preemptions"] == 0
    outs = llm.generate(token_prompts(prompts()), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == phi3_hf_greedy
    assert llm.get_metrics()["num_preemptions"] > 0


def test_tp2_logits_match_hf(phi3, phi3_hf):
    """The fused tensors split per head and per intermediate row on two devices."""
    ids = random_ids(90, seed=9)
    ours = runner(phi3, 256, make_mesh(2))
    got = ours.forward_logits([Row(ids, 0, [1, 2, 3, 4, 5, 6])], every_token=True)[0]
    assert_close(got, hf_logits(phi3_hf, ids))


def test_partial_rotary_logits_match_hf(tmp_path, tokenizer_dir):
    """Phi-4-mini's layout: `partial_rotary_factor` 0.5 rotates the first 8 of each
    head's 16 dims (LongRoPE's factors one per rotated pair) and passes the rest through:
    a 40-token prompt chunked by 16, then decodes, against Transformers."""
    from transformers import AutoModelForCausalLM

    from jvllm.testing.mla_checkpoints import _factors

    rope = dict(
        rope_type="longrope",
        rope_theta=10000.0,
        short_factor=_factors(3, 4, 1.0, 1.5),
        long_factor=_factors(4, 4, 1.0, 8.0),
        partial_rotary_factor=0.5,
    )
    path = make_variant_checkpoint("phi3", tmp_path / "p", tokenizer_dir, rope_parameters=rope)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    assert load_model(path).spec.rope.partial_rotary_factor == 0.5
    ours = runner(path, WINDOW)
    ids, blocks, got = random_ids(48, seed=6), [7, 3, 12, 1], []
    for start in range(0, 40, 16):
        got += list(
            ours.forward_logits(
                [Row(ids[start : min(start + 16, 40)], start, blocks)], every_token=True
            )[0]
        )
    for pos in range(40, 48):
        got.append(ours.forward_logits([Row([ids[pos]], pos, blocks)])[0])
    assert_close(np.stack(got[:40]), hf_logits(hf, ids[:40]))
    decode_ref = [hf_logits(hf, ids[: pos + 1])[-1] for pos in range(40, 48)]
    assert_close(np.stack(got[40:]), np.stack(decode_ref))
