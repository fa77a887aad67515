"""DeepSeek-V3 and V2-Lite-shaped models (multi-head latent attention) against Transformers.

Tiny random checkpoints from Transformers' own classes, every constant-initialised
parameter and the routers' correction biases perturbed
(`jvllm.testing.variant_checkpoints`): V3 with q_lora, sigmoid group-limited routing,
routed scaling and yarn; V2 without q_lora, softmax greedy routing. Logits within the
float32 tolerance of `test_forward.py` (prefill, chunked prefill then decode, a mixed step
of absorbed decodes and expanded prefills); greedy tokens equal to Transformers' on 12
prompts, alone and under chunked prefill with forced preemption, and at TP=2; the router
against Transformers' router modules; the latent cache's size against a per-head one.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from jvllm import LLM, SamplingParams
from jvllm.models.deepseek import deepseek_route
from jvllm.models.deepseek_spec import deepseek_spec
from jvllm.models.loader import load_model
from jvllm.parallel.mesh import make_mesh
from jvllm.runner import memory
from jvllm.testing.mla_checkpoints import make_variant_checkpoint
from tests.helpers import hf_greedy, token_prompts
from tests.models.test_forward import Row, assert_close, hf_logits, make_runner, random_ids

ARCHS = ("deepseek_v3", "deepseek_v2")
PROMPT_LENGTHS = [1, 2, 7, 15, 16, 17, 33, 40, 64, 80, 100, 120]
NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
ENGINE = dict(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def mla_checkpoints(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("mla")
    return {a: make_variant_checkpoint(a, root / a, tokenizer_dir) for a in ARCHS}


@pytest.fixture(scope="module")
def mla_hf(mla_checkpoints):
    from transformers import AutoModelForCausalLM

    return {a: AutoModelForCausalLM.from_pretrained(p).eval() for a, p in mla_checkpoints.items()}


@pytest.fixture(scope="module")
def mla_runners(mla_checkpoints):
    return {a: make_runner(p) for a, p in mla_checkpoints.items()}


def prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(6, 512, size=n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def mla_hf_greedy(mla_hf, tokenizer_dir):
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tokenizer_dir).eos_token_id
    return {a: [hf_greedy(m, p, NEW_TOKENS, eos) for p in prompts()] for a, m in mla_hf.items()}


def test_logits_match_hf(mla_runners, mla_hf):
    """V3: a 70-token prefill, and a prompt chunked by 7 then 8 decodes. Both: one step
    of two decodes (absorbed) and two prefill chunks (expanded), one after a cached
    prefix."""
    runner, hf = mla_runners["deepseek_v3"], mla_hf["deepseek_v3"]
    ids = random_ids(70, seed=70)
    (ours,) = runner.forward_logits([Row(ids, 0, [1, 2, 3, 4, 5])], every_token=True)
    assert_close(ours, hf_logits(hf, ids))
    ids, blocks, got = random_ids(38, seed=11), [9, 6, 17], []
    for start in range(0, 30, 7):
        piece = ids[start : min(start + 7, 30)]
        got += list(runner.forward_logits([Row(piece, start, blocks)], every_token=True)[0])
    for pos in range(30, 38):
        got.append(runner.forward_logits([Row([ids[pos]], pos, blocks)])[0])
    assert_close(np.stack(got), hf_logits(hf, ids))
    lengths, before = [9, 40, 21, 5], [8, 39, 12, 0]
    tables = [[30], [31, 32, 33], [34, 35], [36]]
    seqs = [random_ids(n, seed=50 + i) for i, n in enumerate(lengths)]
    triples = list(zip(seqs, before, tables, strict=True))
    for arch in ARCHS:
        runner, hf = mla_runners[arch], mla_hf[arch]
        runner.forward_logits([Row(s[:b], 0, t) for s, b, t in triples if b])
        mixed = runner.forward_logits([Row(s[b:], b, t) for s, b, t in triples], True)
        for seq, b, out in zip(seqs, before, mixed, strict=True):
            assert_close(out, hf_logits(hf, seq)[b:])


def test_cache_holds_only_the_latent(mla_runners):
    runner = mla_runners["deepseek_v3"]
    latent, rope = runner.caches[0]
    assert latent.shape[2:] == (1, 32) and rope.shape[2:] == (1, 8)  # kv_lora_rank, rope


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_hf(arch, mla_checkpoints, mla_hf_greedy):
    """One engine (two token buckets, 20 blocks): the prompts that fit one step run
    alone, unchunked; then all 12 together, chunked and preempted."""
    engine = dict(ENGINE, num_gpu_blocks_override=20, max_num_batched_tokens=32)
    llm = LLM(str(mla_checkpoints[arch]), **engine)
    warm = llm.get_metrics()["num_compilations"]
    want = mla_hf_greedy[arch]
    for i in [i for i, n in enumerate(PROMPT_LENGTHS) if n <= 32]:
        out = llm.generate(token_prompts(prompts()[i : i + 1]), GREEDY, use_tqdm=False)
        assert out[0].outputs[0].token_ids == want[i]
    assert llm.get_metrics()["num_preemptions"] == 0
    outs = llm.generate(token_prompts(prompts()), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    metrics = llm.get_metrics()
    assert metrics["num_compilations"] == warm
    assert metrics["num_preemptions"] > 0


def test_tp2_splits_heads_keeps_the_latent_whole(mla_checkpoints, mla_hf_greedy):
    """TP=2: query heads split (q_b_proj, kv_b_proj by rows), the latent projection and
    the cache whole on both devices; Transformers' greedy tokens."""
    from jax.sharding import PartitionSpec as P

    engine = dict(ENGINE, max_num_batched_tokens=16, max_num_seqs=4)
    llm = LLM(str(mla_checkpoints["deepseek_v3"]), tensor_parallel_size=2, **engine)
    runner = llm.engine.runner
    attn = runner.model.params["model"]["layers_1"]["self_attn"]
    assert attn["kv_b_proj"]["weight"].sharding.spec == P("tp", None)
    assert attn["q_b_proj"]["weight"].sharding.spec == P("tp", None)
    assert attn["kv_a_proj_with_mqa"]["weight"].sharding.spec == P()
    assert runner.caches[0][0].sharding.spec == P()  # every device holds the latent
    picked = [2, 6, 9, 11]  # 7, 33, 80 and 120 tokens
    outs = llm.generate(token_prompts([prompts()[i] for i in picked]), GREEDY, use_tqdm=False)
    want = mla_hf_greedy["deepseek_v3"]
    assert [o.outputs[0].token_ids for o in outs] == [want[i] for i in picked]


def _hf_router(version: int, **fields):
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    common = dict(hidden_size=16, num_attention_heads=2, n_routed_experts=16, num_experts_per_tok=4)
    common.update(fields)
    if version == 3:
        return DeepseekV3TopkRouter(DeepseekV3Config(**common))
    return DeepseekV2TopkRouter(DeepseekV2Config(**common))


@pytest.mark.parametrize(
    "version,fields",
    [
        (3, dict(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)),
        (3, dict(n_group=8, topk_group=3, norm_topk_prob=False, routed_scaling_factor=1.5)),
        (2, dict(topk_method="greedy", routed_scaling_factor=1.0)),
        (2, dict(topk_method="group_limited_greedy", n_group=4, topk_group=2)),
    ],
)
def test_router_matches_transformers(version, fields):
    torch.manual_seed(version)
    router = _hf_router(version, **fields)
    with torch.no_grad():
        router.weight.normal_()
        if version == 3:
            router.e_score_correction_bias.normal_(std=0.3)
        x = torch.randn(64, 16)
        _, want_w, want_e = router(x)
    cfg = router_config(version, fields)
    spec = deepseek_spec(cfg)
    bias = router.e_score_correction_bias.numpy() if version == 3 else None
    logits = (x @ router.weight.T).detach().numpy()
    got = deepseek_route(logits, bias, spec.mla.routing, 4, spec.moe.norm_topk_prob)
    order_w, order_e = np.argsort(want_e.numpy(), -1), np.argsort(np.asarray(got.experts), -1)
    np.testing.assert_array_equal(
        np.take_along_axis(want_e.numpy(), order_w, -1),
        np.take_along_axis(np.asarray(got.experts), order_e, -1),
    )
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(got.weights), order_e, -1),
        np.take_along_axis(want_w.numpy(), order_w, -1),
        rtol=1e-5,
    )


def router_config(version: int, fields: dict) -> dict:
    arch = f"DeepseekV{version}ForCausalLM"
    cfg = dict(
        architectures=[arch],
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        kv_lora_rank=8,
        qk_nope_head_dim=4,
        qk_rope_head_dim=4,
        v_head_dim=4,
        n_routed_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=8,
    )
    return {**cfg, **fields}


def v3_config() -> dict:
    """DeepSeek-V3's attention shapes (config.json of the release)."""
    cfg = router_config(3, dict(n_group=8, topk_group=4, n_routed_experts=256))
    cfg.update(
        hidden_size=7168,
        num_hidden_layers=61,
        num_attention_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    )
    return cfg


@pytest.mark.parametrize("tp", [1, 8])
def test_kv_blocks_grow_by_the_latent_ratio(tp):
    """For one memory budget, the latent cache (576 values a token and layer, whole on
    every device) holds 2 x 128 x 192 / 576 = 85.3 times the blocks of a per-head cache
    of V3's heads (split over tp devices, so tp times fewer)."""
    import dataclasses

    latent = deepseek_spec(v3_config())
    per_head = dataclasses.replace(latent, mla=None, num_kv_heads=128, head_dim=192)
    budget, block = 40 * memory.GIB, 16
    bytes_latent = memory.kv_block_bytes(latent, block, 2, tp)
    bytes_heads = memory.kv_block_bytes(per_head, block, 2, tp)
    assert bytes_latent == 61 * block * 576 * 2
    ratio = 2 * 128 * 192 / 576 / tp
    assert bytes_heads == bytes_latent * ratio
    size = lambda b: memory.kv_cache_size(budget, b, block, 10**6, 10**6).num_blocks
    assert size(bytes_latent) == int(budget // bytes_latent)
    # The same budget in whole blocks: ratio times as many, up to the rounding down.
    assert ratio * size(bytes_heads) <= size(bytes_latent) < ratio * (size(bytes_heads) + 1)


def test_pipeline_stages_and_unknown_router_are_refused(tmp_path, mla_checkpoints):
    cfg = json.loads((mla_checkpoints["deepseek_v2"] / "config.json").read_text())
    with pytest.raises(ValueError, match="scoring_func='tanh'"):
        deepseek_spec({**cfg, "scoring_func": "tanh"})
    with pytest.raises(ValueError, match="n_group=4 must divide n_routed_experts=6"):
        deepseek_spec({**cfg, "topk_method": "group_limited_greedy", "n_group": 4})
    mesh = make_mesh(1, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 does not support Deepseek"):
        load_model(mla_checkpoints["deepseek_v2"], mesh=mesh)


def test_multi_token_prediction_layers_are_skipped(tmp_path, mla_checkpoints):
    """V3 checkpoints carry a layer past num_hidden_layers (`model.layers.61.*`, multi-
    token prediction), which Transformers skips too; any other extra tensor is named."""
    import shutil

    from safetensors.numpy import load_file, save_file

    path = tmp_path / "mtp"
    shutil.copytree(mla_checkpoints["deepseek_v2"], path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.2.self_attn.kv_b_proj.weight"] = np.zeros((4, 4), np.float32)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    load_model(path)
    tensors["model.layers.1.mlp.extra.weight"] = np.zeros((4, 4), np.float32)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="mlp.extra.weight"):
        load_model(path)
