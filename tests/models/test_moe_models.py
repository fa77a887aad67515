"""Mixture-of-experts models (Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE) against Transformers.

Tiny random checkpoints from Transformers' own classes, every constant-initialised
parameter perturbed (`jvllm.testing.moe_checkpoints`). Logits within the float32
tolerance of `test_forward.py` for prefill, chunked prefill with decode, and a mixed
step; greedy tokens equal to Transformers' `generate` alone and under chunked prefill
with forced preemption; loading per-expert and fused expert tensors alike.
"""

from __future__ import annotations

import numpy as np
import pytest

from jvllm import LLM, SamplingParams
from jvllm.models.loader import load_model
from jvllm.testing.moe_checkpoints import MOE_ARCHITECTURES, make_moe_checkpoint
from tests.helpers import hf_greedy, token_prompts
from tests.models.test_forward import Row, assert_close, hf_logits, make_runner, random_ids

PROMPT_LENGTHS = [1, 2, 7, 15, 16, 17, 33, 40, 64, 80, 100, 120]
NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
ENGINE = dict(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64)


@pytest.fixture(scope="session")
def moe_hf_models(moe_checkpoints):
    from transformers import AutoModelForCausalLM

    return {a: AutoModelForCausalLM.from_pretrained(p).eval() for a, p in moe_checkpoints.items()}


@pytest.fixture(scope="module")
def moe_runners(moe_checkpoints):
    return {a: make_runner(p) for a, p in moe_checkpoints.items()}


@pytest.fixture(params=MOE_ARCHITECTURES)
def moe_arch(request) -> str:
    return request.param


def prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(6, 512, size=n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="session")
def moe_hf_greedy(moe_hf_models, tokenizer_dir):
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tokenizer_dir).eos_token_id
    return {
        a: [hf_greedy(m, p, NEW_TOKENS, eos) for p in prompts()] for a, m in moe_hf_models.items()
    }


def test_prefill_logits_match_hf(moe_arch, moe_runners, moe_hf_models):
    runner = moe_runners[moe_arch]
    for length in (1, 70):
        ids = random_ids(length, seed=length)
        blocks = list(range(1, 1 + -(-length // 16)))
        (ours,) = runner.forward_logits([Row(ids, 0, blocks)], every_token=True)
        assert_close(ours, hf_logits(moe_hf_models[moe_arch], ids))


def test_chunked_prefill_then_decode_match_hf(moe_arch, moe_runners, moe_hf_models):
    runner = moe_runners[moe_arch]
    prompt_len, decode_steps, chunk = 30, 8, 7
    ids = random_ids(prompt_len + decode_steps, seed=11)
    blocks = [9, 4, 17]
    got = []
    for start in range(0, prompt_len, chunk):
        piece = ids[start : min(start + chunk, prompt_len)]
        got += list(runner.forward_logits([Row(piece, start, blocks)], every_token=True)[0])
    for pos in range(prompt_len, prompt_len + decode_steps):
        got.append(runner.forward_logits([Row([ids[pos]], pos, blocks)])[0])
    assert_close(np.stack(got), hf_logits(moe_hf_models[moe_arch], ids))


def test_mixed_decode_and_prefill_step_matches_hf(moe_arch, moe_runners, moe_hf_models):
    """One step of 2 decodes and 2 prefill chunks (one attending to a cached prefix)."""
    runner = moe_runners[moe_arch]
    lengths, before = [9, 40, 21, 5], [8, 39, 12, 0]
    tables = [[30], [31, 32, 33], [34, 35], [36]]
    seqs = [random_ids(n, seed=50 + i) for i, n in enumerate(lengths)]
    triples = list(zip(seqs, before, tables, strict=True))
    runner.forward_logits([Row(s[:b], 0, t) for s, b, t in triples if b])
    rows = [Row(s[b:], b, t) for s, b, t in triples]
    mixed = runner.forward_logits(rows, every_token=True)
    for ids, b, ours in zip(seqs, before, mixed, strict=True):
        assert_close(ours, hf_logits(moe_hf_models[moe_arch], ids)[b:])


@pytest.mark.parametrize(
    "engine_kwargs",
    [{}, {"num_gpu_blocks_override": 20, "max_num_batched_tokens": 32}],
    ids=["alone", "chunked-preempted"],
)
def test_greedy_tokens_equal_hf(moe_arch, moe_checkpoints, moe_hf_greedy, engine_kwargs):
    llm = LLM(str(moe_checkpoints[moe_arch]), **{**ENGINE, **engine_kwargs})
    warm = llm.get_metrics()["num_compilations"]
    outs = llm.generate(token_prompts(prompts()), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == moe_hf_greedy[moe_arch]
    metrics = llm.get_metrics()
    assert metrics["num_compilations"] == warm  # no routing compiles a new program
    if engine_kwargs:
        assert metrics["num_preemptions"] > 0
    assert metrics["num_free_blocks"] == metrics["num_total_blocks"]


def test_fused_expert_tensors_load_as_per_expert_ones(tmp_path, tokenizer_dir, moe_checkpoints):
    """Transformers 5's in-memory `experts.gate_up_proj`/`down_proj` (and Mixtral's
    `mlp.` prefix) give the same parameters as the Hub's per-expert tensors."""
    for arch in MOE_ARCHITECTURES:
        fused = make_moe_checkpoint(arch, tmp_path / arch, tokenizer_dir, fused=True)
        a = load_model(fused).params
        b = load_model(moe_checkpoints[arch]).params
        assert_trees_equal(a, b)


def assert_trees_equal(a, b) -> None:
    import jax

    flat_a, tree_a = jax.tree.flatten(a)
    flat_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b
    for x, y in zip(flat_a, flat_b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_missing_expert_tensor_is_named(tmp_path, tokenizer_dir):
    from safetensors.numpy import load_file, save_file

    path = make_moe_checkpoint("mixtral", tmp_path / "m", tokenizer_dir)
    tensors = load_file(path / "model.safetensors")
    gone = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    del tensors[gone]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=gone.replace(".", r"\.")):
        load_model(path)


@pytest.mark.parametrize(
    "field,value",
    [("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("n_group", 4)],
)
def test_unsupported_router_is_named(tmp_path, tokenizer_dir, field, value):
    import json

    path = make_moe_checkpoint("qwen3_moe", tmp_path / "q", tokenizer_dir)
    config = json.loads((path / "config.json").read_text())
    config[field] = value
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"router field {field}="):
        load_model(path)


def test_quantized_experts_refused_unless_supported(moe_checkpoints):
    """Experts take int8/fp8 at load (tests/models/test_moe_quantized.py); a checkpoint
    scheme they cannot take is named."""
    from jvllm.models.expert_quantization import expert_scheme
    from jvllm.models.quantization import PackedWeights

    assert expert_scheme("int8", "OlmoeForCausalLM").storage == "int8"
    assert expert_scheme(PackedWeights(4, 32), "OlmoeForCausalLM").dequantized
    for refused in (PackedWeights(4, 32, zero_points=True), PackedWeights(4, 32, False, True)):
        with pytest.raises(ValueError, match="quantized experts in the scheme"):
            expert_scheme(refused, "OlmoeForCausalLM")


def test_expert_parallel_needs_experts(tmp_path, tokenizer_dir):
    from jvllm.testing import make_checkpoint

    path = make_checkpoint("llama", tmp_path / "l", tokenizer_dir)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        load_model(path, expert_parallel=True)


def test_ngram_speculation_swap_prefix_cache_and_n2_keep_greedy_tokens(
    moe_checkpoints, moe_hf_greedy
):
    """The engine features are model-agnostic; on an MoE model (a shared expert and a
    dense layer among the sparse ones) they still give Transformers' greedy tokens."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    engine = dict(ENGINE, max_num_batched_tokens=32, num_gpu_blocks_override=20)
    engine |= dict(speculative_config=ngram, preemption_mode="swap")
    llm = LLM(str(moe_checkpoints["qwen2_moe"]), **engine)
    want = moe_hf_greedy["qwen2_moe"]
    outs = llm.generate(token_prompts(prompts()), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.get_metrics()["num_preemptions"] > 0
    for _ in range(2):  # the second time, the long prompt's blocks are cached
        outs = llm.generate(token_prompts(prompts()[-1:]), GREEDY, use_tqdm=False)
        assert outs[0].outputs[0].token_ids == want[-1]
    pairs = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, n=2)
    outs = llm.generate(token_prompts(prompts()[:3]), pairs, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[w, w] for w in want[:3]]
    m = llm.get_metrics()
    assert m["prefix_cache_hits"] > 0 and m["spec_decode_num_draft_tokens"] > 0
