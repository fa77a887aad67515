"""LoRA adapters end to end: a batch mixing the base model and three PEFT adapters
(random A and B) through `LLM.generate`, token for token against PEFT's
`merge_and_unload()` models in Transformers (float32, greedy); with more adapters than
device slots and host cache entries, chunked prefill and preemption, prefix caching on
(the same prompts under every adapter), no compilation after start-up, and TP=2.
"""

from __future__ import annotations

import pytest
from jax.sharding import PartitionSpec as P

from jvllm import LLM, LoRARequest, SamplingParams
from jvllm.testing.lora_adapters import make_peft_adapter, merged_reference
from tests.helpers import hf_greedy, prompts, token_prompts

NEW_TOKENS = 10
PROMPTS = prompts(seed=3, lengths=[7, 20, 40])
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def adapters(checkpoints, tmp_path_factory) -> list[LoRARequest]:
    """Ranks 4, 8 and 8 over every target, the last rsLoRA on q/v/down only."""
    base, root = checkpoints["llama"], tmp_path_factory.mktemp("adapters")
    paths = [
        make_peft_adapter(base, root / "a1", rank=4, seed=1),
        make_peft_adapter(base, root / "a2", rank=8, seed=2),
        make_peft_adapter(
            base, root / "a3", 8, 3, ("q_proj", "v_proj", "down_proj"), use_rslora=True
        ),
    ]
    return [LoRARequest(f"a{i}", i, str(p)) for i, p in enumerate(paths, 1)]


@pytest.fixture(scope="module")
def batch(adapters) -> tuple[list[dict], list[LoRARequest | None]]:
    """Every prompt under the base model and each adapter, interleaved."""
    loras = [None, *adapters]
    return token_prompts(PROMPTS) * len(loras), [r for r in loras for _ in PROMPTS]


@pytest.fixture(scope="module")
def expected(checkpoints, hf_models, tokenizer_dir, batch) -> list[list[int]]:
    """Each request's greedy tokens by Transformers: the base model, or PEFT's merge."""
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tokenizer_dir).eos_token_id
    models = {None: hf_models["llama"]}
    for lora in batch[1]:
        if lora is not None and lora.lora_int_id not in models:
            models[lora.lora_int_id] = merged_reference(checkpoints["llama"], lora.lora_path)
    return [
        hf_greedy(models[lora and lora.lora_int_id], p["prompt_token_ids"], NEW_TOKENS, eos)
        for p, lora in zip(*batch, strict=True)
    ]


def make_llm(path, **kwargs) -> LLM:
    kwargs = {
        "max_model_len": 128,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "enable_lora": True,
        "max_loras": 2,
        "max_lora_rank": 8,
        **kwargs,
    }
    return LLM(str(path), **kwargs)


@pytest.fixture(scope="module")
def llm(checkpoints) -> LLM:
    # Two device slots and two host entries for three adapters.
    return make_llm(checkpoints["llama"], max_cpu_loras=2)


def test_mixed_adapters_match_peft_merged_models(llm, batch, expected, hf_models):
    compiled = llm.get_metrics()["num_compilations"]
    outs = llm.generate(batch[0], GREEDY, use_tqdm=False, lora_request=batch[1])
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert [o.lora_request for o in outs] == batch[1]
    # The adapters change the output (B is not zero), and none of it compiled anything.
    base = expected[: len(PROMPTS)]
    assert all(expected[i * len(PROMPTS) : (i + 1) * len(PROMPTS)] != base for i in (1, 2, 3))
    assert llm.get_metrics()["num_compilations"] == compiled
    # The slots evicted; the host cache kept every adapter in use (no step read one).
    slots = llm.engine.lora_slots
    assert slots.num_device_loads >= 3 and slots.num_reads == 3


def test_one_adapter_for_all_prompts_and_prefix_reuse(llm, adapters, batch, expected):
    hits = llm.get_metrics()["prefix_cache_hits"]
    outs = llm.generate(batch[0][:3], GREEDY, use_tqdm=False, lora_request=adapters[1])
    assert [o.outputs[0].token_ids for o in outs] == expected[6:9]
    # The same prompts under the same adapter: their full blocks are reused.
    assert llm.get_metrics()["prefix_cache_hits"] > hits


def test_bad_adapter_requests_are_refused_and_the_engine_goes_on(llm, batch, expected, tmp_path):
    missing = LoRARequest("missing", 9, str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="does not exist"):
        llm.generate(batch[0][:1], GREEDY, use_tqdm=False, lora_request=missing)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(batch[0][:2], GREEDY, use_tqdm=False, lora_request=[None])
    outs = llm.generate(batch[0][:1], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == expected[0]


def test_chunked_prefill_and_preemption(checkpoints, batch, expected):
    llm = make_llm(
        checkpoints["llama"],
        max_num_batched_tokens=16,
        num_gpu_blocks_override=10,
        max_loras=3,
        enable_prefix_caching=False,
    )
    outs = llm.generate(batch[0], GREEDY, use_tqdm=False, lora_request=batch[1])
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.get_metrics()["num_preemptions"] > 0


# 4 devices: the model's 2 KV heads repeated twice, and so each adapter's k/v B.
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_equals_one_device(checkpoints, batch, expected, tp):
    llm = make_llm(checkpoints["llama"], tensor_parallel_size=tp)
    outs = llm.generate(batch[0], GREEDY, use_tqdm=False, lora_request=batch[1])
    assert [o.outputs[0].token_ids for o in outs] == expected
    # Split as the base layers: column-parallel B on its outputs, row-parallel A on inputs.
    weights = llm.engine.runner.lora.weights
    assert weights["0.q_proj"][1].sharding.spec == P(None, None, "tp")
    assert weights["1.down_proj"][0].sharding.spec == P(None, "tp", None)
    assert weights["0.q_proj"][0].sharding.is_fully_replicated


def test_lora_request_without_enable_lora_is_refused(checkpoints, adapters):
    llm = LLM(
        str(checkpoints["llama"]), max_model_len=64, max_num_seqs=1, max_num_batched_tokens=16
    )
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate(token_prompts(PROMPTS[:1]), GREEDY, use_tqdm=False, lora_request=adapters[0])
