"""GLM-4.5 (Glm4MoeForCausalLM) against Transformers, and its MTP layer as a drafter.

Tiny random checkpoints from Transformers' own classes with every constant-initialised
parameter and the routers' correction biases perturbed (`jvllm.testing.glm_checkpoints`):
a dense first layer then MoE layers (sigmoid group-limited routing, routed scaling, a
shared expert), q/k/v bias, partial rotary (0.5). With per-head q/k norm: greedy tokens
equal Transformers' generate under chunked prefill, and at TP=2 (slow). Without it, on a
vocabulary-8 checkpoint with an MTP layer (`model.layers.{num_hidden_layers}`, method
"glm4_moe_mtp"): the proposals equal the drafts of the same layer rebuilt from
Transformers' Glm4Moe modules (`jvllm.testing.mtp`), speculative outputs equal plain
decoding's and Transformers' greedy tokens.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from jvllm import LLM, SamplingParams
from jvllm.models.glm4_moe import glm4_moe_spec
from jvllm.testing.glm_checkpoints import make_glm_checkpoint
from tests.helpers import hf_greedy, token_prompts

PROMPT_LENGTHS = [3, 17, 40, 70]
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
SEED = 0  # of the MTP checkpoint: some drafts accepted, most not
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32)


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [[int(t) for t in rng.integers(6, 512, size=n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def glm(tmp_path_factory, tokenizer_dir):
    """A checkpoint with q/k norm and Transformers' greedy tokens of `prompts()`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tokenizer_dir).eos_token_id
    path = make_glm_checkpoint(tmp_path_factory.mktemp("glm"), tokenizer_dir, 7, qk_norm=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, [hf_greedy(hf, p, NEW_TOKENS, eos) for p in prompts()]


def test_greedy_tokens_equal_transformers(glm):
    """Chunked prefill (budget 32) of prompts up to 70 tokens, then decodes."""
    path, want = glm
    llm = LLM(str(path), **ENGINE)
    spec, params = llm.engine.runner.model.spec, llm.engine.runner.model.params["model"]
    assert spec.rope.partial_rotary_factor == 0.5 and spec.qk_norm
    assert "gate_proj" in params["layers_0"]["mlp"]  # first_k_dense_replace=1
    sparse = params["layers_1"]["mlp"]
    assert {"gate", "experts", "shared_experts"} <= set(sparse)
    assert "e_score_correction_bias" in sparse["gate"]
    outs = llm.generate(token_prompts(prompts()), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want


@pytest.mark.slow
def test_tp2_greedy_tokens_equal_transformers(glm):
    from jax.sharding import PartitionSpec as P

    path, want = glm
    llm = LLM(str(path), tensor_parallel_size=2, **ENGINE)
    attn = llm.engine.runner.model.params["model"]["layers_1"]["self_attn"]
    assert attn["q_proj"]["weight"].sharding.spec == P("tp", None)
    outs = llm.generate(token_prompts(prompts()[1:3]), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want[1:3]


def test_spec_reads_glm_fields(glm):
    cfg = json.loads((glm[0] / "config.json").read_text())
    spec = glm4_moe_spec(cfg)
    r = spec.variant.routing
    assert (r.n_group, r.topk_group, r.routed_scaling_factor) == (2, 1, 1.8)
    assert r.num_shared_experts == 1 and spec.moe.sparse_layers == (1,)
    assert spec.qkv_bias and not spec.o_bias
    bare = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "partial_rotary_factor")}
    assert glm4_moe_spec(bare).rope.partial_rotary_factor == 0.5  # Transformers' default
    with pytest.raises(ValueError, match="n_group=3 must divide n_routed_experts=8"):
        glm4_moe_spec({**cfg, "n_group": 3})
    # Keys a config.json leaves out take Transformers' Glm4MoeConfig defaults.
    from transformers import Glm4MoeConfig

    hf = Glm4MoeConfig()
    left_out = ("topk_group", "n_shared_experts", "num_key_value_heads", "n_group")
    bare = {k: v for k, v in cfg.items() if k not in left_out}
    spec = glm4_moe_spec({**bare, "num_attention_heads": 16})  # a multiple of 8 KV heads
    r = spec.variant.routing
    assert (r.n_group, r.topk_group, r.num_shared_experts, spec.num_kv_heads) == (
        hf.n_group,
        hf.topk_group,
        hf.n_shared_experts,
        hf.num_key_value_heads,
    )


def hf_greedy_no_eos(hf, ids: list[int], n: int) -> list[int]:
    """n greedy tokens of Transformers' model, each from a full forward (no cache)."""
    import torch

    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


def test_mtp_drafts_match_transformers_and_outputs_match_plain_decoding(tmp_path_factory):
    """Without q/k norm: every fourth proposal equals the reference layer's drafts, and
    the outputs (equal to plain decoding's) equal Transformers' greedy tokens."""
    from jvllm.testing.checkpoints import write_word_tokenizer
    from jvllm.testing.mtp import load_reference, reference_drafts
    from tests.e2e.test_eagle import DRAFT_PROMPTS, speculated_like_plain

    root = tmp_path_factory.mktemp("glm_mtp")
    write_word_tokenizer(root / "tok", 8)
    target = make_glm_checkpoint(
        root / "t", root / "tok", SEED, qk_norm=False, mtp=True, initializer_range=0.5
    )
    engine = dict(max_model_len=96, max_num_seqs=6, max_num_batched_tokens=16)
    engine["num_gpu_blocks_override"] = 9  # preemptions
    config = {"method": "glm4_moe_mtp", "num_speculative_tokens": 3}
    llm, seen = speculated_like_plain(str(target), engine, config)
    assert llm.llm_engine.config.speculative_config.method == "deepseek_mtp"
    assert not llm.engine.runner.model.spec.qk_norm
    hf, parts = load_reference(target)
    assert len(seen) > 60
    for sequence, drafts in seen[::4]:
        assert reference_drafts(hf, parts, sequence, len(drafts)) == drafts, sequence
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(DRAFT_PROMPTS[:3], greedy, use_tqdm=False)
    for prompt, out in zip(DRAFT_PROMPTS, outs, strict=False):
        assert out.outputs[0].token_ids == hf_greedy_no_eos(hf, prompt["prompt_token_ids"], 24)
