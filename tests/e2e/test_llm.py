"""LLM.generate end to end against Transformers' generate (float32, CPU, greedy).

Covers continuous batching with chunked prefill, preemption by recompute, prefix
caching, parallel sampling with copy-on-write, logprobs and the compile count.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jvllm import LLM, SamplingParams
from tests.helpers import hf_greedy, prompts, token_prompts

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_reference(hf_models, tokenizer_dir):
    """arch -> greedy continuations of `prompts()` by Transformers."""
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tokenizer_dir).eos_token_id
    return {
        arch: [hf_greedy(model, p, NEW_TOKENS, eos) for p in prompts()]
        for arch, model in hf_models.items()
    }


def make_llm(path, **kwargs) -> LLM:
    kwargs = {"max_model_len": 512, "max_num_seqs": 16, "max_num_batched_tokens": 128, **kwargs}
    return LLM(str(path), **kwargs)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {},
        {"max_num_batched_tokens": 16},
        {"max_num_batched_tokens": 64},
        # 40 blocks of 16 tokens cannot hold 12 sequences of up to 332 tokens.
        {"num_gpu_blocks_override": 40, "max_num_batched_tokens": 64},
        {"num_gpu_blocks_override": 40, "max_num_batched_tokens": 64, "preemption_mode": "swap"},
        # A host pool of a few blocks: swaps while it has room, recomputes after.
        {
            "num_gpu_blocks_override": 40,
            "max_num_batched_tokens": 64,
            "preemption_mode": "swap",
            "swap_space": 0.00005,
        },
    ],
    ids=["default", "chunk16", "chunk64", "preempt", "swap", "swap-tiny-pool"],
)
def test_greedy_generate_matches_hf(arch, checkpoints, hf_reference, engine_kwargs):
    llm = make_llm(checkpoints[arch], **engine_kwargs)
    outs = llm.generate(token_prompts(prompts()), GREEDY, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == hf_reference[arch]
    metrics = llm.get_metrics()
    if "num_gpu_blocks_override" in engine_kwargs:
        assert metrics["num_preemptions"] > 0
    if "swap_space" in engine_kwargs:
        assert 0 < metrics["num_host_blocks"] < 16
        assert metrics["num_recomputed_tokens"] > 0  # the pool was too small: recomputed
    elif "preemption_mode" in engine_kwargs:
        assert metrics["num_swapped_out_blocks"] == metrics["num_swapped_in_blocks"] > 0
        assert metrics["num_recomputed_tokens"] == 0
    else:
        assert metrics["num_swapped_out_blocks"] == 0
    assert metrics["num_free_blocks"] == metrics["num_total_blocks"]  # nothing leaked
    assert metrics["num_free_host_blocks"] == metrics["num_host_blocks"]


def test_prefix_caching_same_outputs_fewer_prefill_tokens(checkpoints):
    rng = np.random.default_rng(5)
    prefix = [int(t) for t in rng.integers(6, 512, size=200)]
    batch = [prefix + [int(t) for t in rng.integers(6, 512, size=5 + i)] for i in range(8)]
    results, metrics = {}, {}
    for caching in (True, False):
        llm = make_llm(checkpoints["qwen3"], enable_prefix_caching=caching)
        # The first prompt runs alone, so the rest find its prefix cached.
        first = llm.generate(token_prompts(batch[:1]), GREEDY, use_tqdm=False)
        rest = llm.generate(token_prompts(batch[1:]), GREEDY, use_tqdm=False)
        results[caching] = [o.outputs[0].token_ids for o in first + rest]
        metrics[caching] = llm.get_metrics()
        cached = [o.num_cached_tokens for o in rest]
        assert all(c >= 192 for c in cached) if caching else not any(cached)
    assert results[True] == results[False]
    assert metrics[True]["prefix_cache_hits"] > 0
    assert metrics[False]["prefix_cache_hits"] == 0


def test_parallel_sampling_reproducible_and_shares_blocks(checkpoints):
    llm = make_llm(checkpoints["llama"])
    prompt = {"prompt_token_ids": prompts(1, [100])[0]}
    params = SamplingParams(n=4, temperature=1.0, seed=123, max_tokens=24, ignore_eos=True)
    alone = llm.generate(prompt, params, use_tqdm=False)[0]
    texts = [c.token_ids for c in alone.outputs]
    assert len(texts) == 4 and len({tuple(t) for t in texts}) == 4
    others = token_prompts(prompts(2, [40, 3, 90]))
    mixed = llm.generate(others[:2] + [prompt] + others[2:], [GREEDY] * 2 + [params, GREEDY])
    assert [c.token_ids for c in mixed[2].outputs] == texts

    # Block sharing: run only the prefill and a few steps, then count blocks in use.
    engine = llm.engine
    engine.add_request("share", prompt, params.clone(max_tokens=24))
    for _ in range(4):
        engine.step()
    used = engine.get_metrics()["num_total_blocks"] - engine.get_metrics()["num_free_blocks"]
    unshared = 4 * -(-(100 + 3) // 16)
    assert used < unshared
    while engine.has_unfinished_requests():
        engine.step()


def test_swap_keeps_seeded_sampling_and_shared_prefixes(checkpoints):
    """n > 1 siblings and prefix-cache sharers swapped out and back: the same tokens."""
    rng = np.random.default_rng(9)
    prefix = [int(t) for t in rng.integers(6, 512, size=70)]
    batch = [
        {"prompt_token_ids": prefix + [int(t) for t in rng.integers(6, 512, 9 + i)]}
        for i in range(6)
    ]
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)
    want = make_llm(checkpoints["llama"]).generate(batch, params, use_tqdm=False)
    llm = make_llm(
        checkpoints["llama"],
        num_gpu_blocks_override=40,
        max_num_batched_tokens=64,
        preemption_mode="swap",
    )
    got = llm.generate(batch, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == [
        [c.token_ids for c in o.outputs] for o in want
    ]
    metrics = llm.get_metrics()
    assert metrics["num_swapped_out_blocks"] > 0 and metrics["num_recomputed_tokens"] == 0
    assert metrics["prefix_cache_hits"] > 0
    assert metrics["num_free_host_blocks"] == metrics["num_host_blocks"]


def test_host_prefix_tier_brings_evicted_prefixes_back(checkpoints):
    """16 requests sharing a 200-token prefix, evicted between them by unrelated ones:
    the host tier keeps it, so later requests hit it instead of computing it again."""
    rng = np.random.default_rng(11)
    prefix = [int(t) for t in rng.integers(6, 512, size=200)]
    batches = []
    for i in range(16):
        shared = {"prompt_token_ids": prefix + [int(t) for t in rng.integers(6, 512, 4 + i)]}
        flusher = {"prompt_token_ids": [int(t) for t in rng.integers(6, 512, 470)]}
        batches += [[shared], [flusher]]
    results, metrics = {}, {}
    for size in (0.0, 0.001):
        # 33 usable blocks of 16: each flusher's 502 tokens evict the prefix's blocks.
        llm = make_llm(checkpoints["mistral"], num_gpu_blocks_override=34, kv_offloading_size=size)
        results[size] = [
            llm.generate(b, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for b in batches
        ]
        metrics[size] = llm.get_metrics()
    assert results[0.0] == results[0.001]
    off, on = metrics[0.0], metrics[0.001]
    assert off["num_tier_blocks"] == 0 and off["prefix_cache_host_hits"] == 0
    assert on["num_tier_blocks"] > 0 and on["num_offloaded_blocks"] > 0
    # Most of the 15 later prefixes (12 full blocks each) come back from the host tier
    # (2592 tokens of 2880 when written), so that many fewer prompt tokens are computed.
    assert on["prefix_cache_host_hits"] >= 12 * 192
    computed = {size: m["prompt_tokens"] - m["prefix_cache_hits"] for size, m in metrics.items()}
    assert computed[0.001] <= computed[0.0] - 12 * 192


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"preemption_mode": "evict"}, "preemption_mode must be one of"),
        ({"swap_space": -1}, "swap_space must be a number of GiB >= 0"),
        ({"preemption_mode": "swap", "swap_space": 1e5}, "exceed the .* GiB of host memory"),
        ({"kv_offloading_size": 1e5}, "exceed the .* GiB of host memory"),
        ({"kv_offloading_size": "2"}, "kv_offloading_size must be a number"),
        ({"cpu_offload_gb": -1}, "cpu_offload_gb must be a number"),
    ],
)
def test_bad_swap_settings_name_the_flag(checkpoints, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_llm(checkpoints["llama"], **kwargs)


def test_cpu_offload_gb_keeps_the_first_layers_in_host_memory(checkpoints, caplog):
    """A budget of 1.5 layers: llama's first layer of two keeps its weights in pinned host
    memory (JAX's memory kinds, which the CPU backend has too), the step copies them in,
    and the tokens are those without offload; at TP=2 each device's half layers both fit."""
    import jax

    engine = dict(max_num_batched_tokens=32)  # two token buckets: quick to warm up
    ps = token_prompts(prompts(lengths=[8, 30]))
    plain = make_llm(checkpoints["llama"], **engine)
    want = [o.outputs[0].token_ids for o in plain.generate(ps, GREEDY, use_tqdm=False)]
    layer = plain.llm_engine.runner.model.params["model"]["layers_0"]
    budget = 1.5 * sum(x.nbytes for x in jax.tree.leaves(layer)) / 2**30
    del plain
    for tp, offloaded in ((1, 1), (2, 2)):
        with caplog.at_level("INFO", logger="jvllm"):
            llm = make_llm(
                checkpoints["llama"], cpu_offload_gb=budget, tensor_parallel_size=tp, **engine
            )
        assert f"the first {offloaded} of 2 decoder layers" in caplog.text
        params = llm.llm_engine.runner.model.params["model"]
        for i in range(2):
            kinds = {x.sharding.memory_kind for x in jax.tree.leaves(params[f"layers_{i}"])}
            assert kinds == {"pinned_host" if i < offloaded else "device"}, (tp, i)
        warm = llm.get_metrics()["num_compilations"]
        assert [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)] == want
        assert llm.get_metrics()["num_compilations"] == warm
        del llm
        caplog.clear()


def test_logprobs_match_hf_log_softmax(checkpoints, hf_models):
    llm = make_llm(checkpoints["qwen2"], max_num_batched_tokens=16)
    ids = prompts(3, [40])[0]
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=5, prompt_logprobs=3)
    # The same prompt twice: the second run must not skip its cached prefix.
    llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    completion = out.outputs[0]
    full = ids + completion.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_models["qwen2"](torch.tensor([full])).logits[0], -1).numpy()
    for i, (tok, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        row = ref[len(ids) - 1 + i]
        assert list(entry)[0] == tok and entry[tok].rank == 1
        assert len(entry) == 5
        for t, lp in entry.items():
            assert abs(lp.logprob - row[t]) < 1e-4
    expected = sum(ref[len(ids) - 1 + i][t] for i, t in enumerate(completion.token_ids))
    assert abs(completion.cumulative_logprob - expected) < 1e-3
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for p in range(1, len(ids)):
        entry = out.prompt_logprobs[p]
        assert abs(entry[ids[p]].logprob - ref[p - 1][ids[p]]) < 1e-4
        assert entry[ids[p]].rank == int((ref[p - 1] > ref[p - 1][ids[p]]).sum()) + 1
        assert len(entry) in (3, 4)


def test_prompt_logprobs_of_one_long_step_match_hf(checkpoints, hf_models):
    """A 150-token prompt scored in one step: on CPU devices its positions go in three
    groups of 64 (`SCORE_GROUP_TOKENS_CPU`), each position as HF scores it."""
    llm = make_llm(checkpoints["qwen2"], max_num_batched_tokens=256)
    ids = prompts(5, [150])[0]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf_models["qwen2"](torch.tensor([ids])).logits[0], -1).numpy()
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for p in range(1, len(ids)):
        entry, row = out.prompt_logprobs[p], ref[p - 1]
        assert abs(entry[ids[p]].logprob - row[ids[p]]) < 1e-4
        assert entry[ids[p]].rank == int((row > row[ids[p]]).sum()) + 1
        best = [t for t in entry if entry[t].rank <= 2]
        assert sorted(best) == sorted(np.argsort(-row)[:2].tolist())


def test_token_slots_count_each_forward_and_its_padding(checkpoints):
    # Token buckets of 16 up to 64, and 1, 4 and 8 below them on a CPU device: a prompt
    # of 40 runs in 48 slots, each decode token in 1.
    llm = make_llm(checkpoints["mistral"], max_num_seqs=4, max_num_batched_tokens=64)
    runner = llm.engine.runner
    before = list(runner.token_slots)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    (out,) = llm.generate(token_prompts(prompts(3, [40])), params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
    # The prompt's 40 tokens, then the first two outputs fed back one step each.
    real, slots = (b - a for a, b in zip(before, runner.token_slots, strict=True))
    assert runner.token_buckets == (1, 4, 8, 16, 32, 48, 64)
    assert (real, slots) == (40 + 2, 48 + 1 + 1)


def test_no_compilations_after_warm_up(checkpoints):
    llm = make_llm(checkpoints["mistral"], max_num_seqs=8, max_num_batched_tokens=64)
    before = llm.get_metrics()["num_compilations"]
    # Warm-up compiled a forward per token bucket; on CPU devices one prompt-logprobs
    # program and one sampler program (token bitmask included) for every bucket; one
    # block copy.
    buckets = llm.engine.runner.token_buckets
    assert before == len(buckets) + 2 + 1
    rng = np.random.default_rng(11)
    lengths = rng.integers(1, 200, size=200)
    params = [
        SamplingParams(
            temperature=float(rng.choice([0.0, 0.7, 1.3])),
            top_p=float(rng.choice([1.0, 0.9])),
            top_k=int(rng.choice([-1, 5])),
            min_p=float(rng.choice([0.0, 0.05])),
            seed=int(rng.integers(0, 1000)) if rng.random() < 0.5 else None,
            max_tokens=int(rng.integers(3, 12)),
            n=int(rng.choice([1, 1, 2])),
            logprobs=int(rng.choice([0, 3])) if rng.random() < 0.3 else None,
            # min_tokens bans EOS and these ids until reached: up to 4 ids in all.
            min_tokens=int(rng.choice([0, 0, 3])),
            stop_token_ids=[int(t) for t in rng.integers(10, 100, int(rng.integers(0, 4)))],
            # Penalties over histories of every length (the prompts run 1-200 tokens).
            repetition_penalty=float(rng.choice([1.0, 1.0, 1.2])),
            frequency_penalty=float(rng.choice([0.0, 0.5])),
            presence_penalty=float(rng.choice([0.0, -0.3])),
            prompt_logprobs=1 if rng.random() < 0.1 else None,
        )
        for _ in lengths
    ]
    outs = llm.generate(token_prompts(prompts(12, list(lengths))), params, use_tqdm=False)
    assert len(outs) == 200 and all(o.finished for o in outs)
    assert llm.get_metrics()["num_compilations"] == before
