"""Speculative decoding changes nothing but speed.

With n-gram prompt lookup on, `LLM.generate` gives the tokens of decoding without it:
greedy (and so Transformers' greedy continuation), seeded sampling with every
processor (top-p/top-k, penalties, min_tokens, logprobs), n > 1, stop tokens and stop
strings that fall inside a run of accepted drafts, under chunked prefill (budget 16),
forced preemption and prefix caching. The proposer is checked against a brute-force
search, and the configuration errors name their field.
"""

from __future__ import annotations

import numpy as np
import pytest

from jvllm import LLM, SamplingParams
from jvllm.config import SpeculativeConfig
from jvllm.engine.ngram_proposer import NgramProposer
from jvllm.engine.spec_decode import verify
from jvllm.engine_args import EngineArgs
from tests.test_async_scheduling import _logprobs, mixed_params
from tests.test_llm import hf_greedy, prompts, token_prompts

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}
# Budget 16 chunks every prompt; 26 blocks of 16 force preemptions.
SMALL = dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=128)
ENGINE = dict(
    max_model_len=384, max_num_seqs=16, max_num_batched_tokens=16, num_gpu_blocks_override=26
)


def brute_force(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The longest suffix of lo..hi tokens seen before; what followed its latest sighting."""
    n = len(tokens)
    for size in range(min(hi, n - 1), lo - 1, -1):
        suffix = tokens[n - size :]
        ends = [e for e in range(size - 1, n - 1) if tokens[e - size + 1 : e + 1] == suffix]
        if ends:
            return tokens[ends[-1] + 1 : ends[-1] + 1 + k]
    return []


def test_ngram_proposer_matches_a_brute_force_search():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 3))
        k = int(rng.integers(1, 6))
        tokens = [int(t) for t in rng.integers(0, int(rng.choice([2, 3, 8])), rng.integers(1, 30))]
        limit = int(rng.integers(1, 7))
        got = NgramProposer(k, lo, hi).propose(np.array(tokens), limit)
        assert got == brute_force(tokens, min(k, limit), lo, hi), (tokens, k, lo, hi, limit)


def test_verify_keeps_drafts_while_they_match():
    assert verify([5, 6, 7], np.array([5, 6, 7, 8])) == [5, 6, 7, 8]  # all kept, and one more
    assert verify([5, 6, 7], np.array([5, 9, 7, 8])) == [5, 9]  # the first mismatch ends it
    assert verify([5], np.array([4, 1])) == [4]


def _outputs(llm: LLM, ps: list, params: list[SamplingParams]) -> list:
    outs = llm.generate(token_prompts(ps), params, use_tqdm=False)
    return [
        [
            (c.token_ids, c.text, c.finish_reason, c.stop_reason, _logprobs(c.logprobs))
            for c in o.outputs
        ]
        for o in outs
    ]


def _stopping_params(reference: list) -> list[SamplingParams]:
    """Greedy requests that stop on a token, or a string, their greedy output reaches: in
    looping outputs that is often inside a run the n-gram drafts got right."""
    params = []
    for i, out in enumerate(reference):
        ids, text = out[0][0], out[0][1]
        if i % 2 and len(text) > 12:
            params.append(SamplingParams(temperature=0.0, max_tokens=40, stop=[text[8:12]]))
        else:
            params.append(
                SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[ids[len(ids) // 2]])
            )
    return params


def test_ngram_speculation_gives_the_tokens_of_plain_decoding(arch, checkpoints, tokenizer_dir):
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tokenizer_dir).eos_token_id
    ps = prompts(seed=3)
    params = mixed_params(eos)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = LLM(str(checkpoints[arch]), **ENGINE)
    want = _outputs(plain, ps, params)
    want_greedy = _outputs(plain, ps, [greedy] * len(ps))
    stopping = _stopping_params(want_greedy)
    want_stops = _outputs(plain, ps, stopping)
    del plain
    spec = LLM(str(checkpoints[arch]), speculative_config=NGRAM, **ENGINE)
    assert _outputs(spec, ps, params) == want
    assert _outputs(spec, ps, [greedy] * len(ps)) == want_greedy
    assert _outputs(spec, ps, stopping) == want_stops
    m = spec.get_metrics()
    assert m["num_preemptions"] > 0 and m["prefix_cache_hits"] > 0
    assert m["spec_decode_num_accepted_tokens"] > 50  # the drafts did save steps
    assert m["spec_decode_num_accepted_tokens"] == sum(m["spec_decode_num_accepted_tokens_per_pos"])
    assert m["spec_decode_num_draft_tokens"] >= m["spec_decode_num_drafts"] > 0
    assert m["num_free_blocks"] == m["num_total_blocks"]  # nothing leaked


def test_ngram_speculation_matches_hf_greedy(checkpoints, hf_models, tokenizer_dir):
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tokenizer_dir).eos_token_id
    ps = prompts(seed=5)
    llm = LLM(str(checkpoints["qwen2"]), speculative_config=NGRAM, **SMALL)
    outs = llm.generate(
        token_prompts(ps), SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outs] == [
        hf_greedy(hf_models["qwen2"], p, 32, eos) for p in ps
    ]
    assert llm.get_metrics()["spec_decode_num_accepted_tokens"] > 0


def test_seeded_requests_are_batch_invariant_under_speculation(checkpoints):
    llm = LLM(str(checkpoints["llama"]), speculative_config=NGRAM, **SMALL)
    ps = prompts(seed=7)
    seeded = SamplingParams(
        temperature=0.8, top_k=20, seed=42, max_tokens=30, frequency_penalty=0.3
    )
    alone = llm.generate(token_prompts(ps[:1]), seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=int(n)) for n in range(5, 5 + len(ps) - 1)]
    mixed = llm.generate(token_prompts(ps), [seeded, *others], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone


def test_no_compilations_after_warm_up_with_speculation(checkpoints):
    llm = LLM(
        str(checkpoints["mistral"]),
        speculative_config=NGRAM,
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=64,
    )
    before = llm.get_metrics()["num_compilations"]
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 200, size=60)
    params = [
        SamplingParams(
            temperature=float(rng.choice([0.0, 0.8])),
            top_p=float(rng.choice([1.0, 0.9])),
            seed=int(rng.integers(0, 1000)),
            max_tokens=int(rng.integers(3, 30)),
            n=int(rng.choice([1, 2])),
            logprobs=int(rng.choice([0, 3])) if rng.random() < 0.3 else None,
            min_tokens=int(rng.choice([0, 3])),
        )
        for _ in lengths
    ]
    llm.generate(token_prompts(prompts(1, list(lengths))), params, use_tqdm=False)
    assert llm.get_metrics()["spec_decode_num_drafts"] > 0
    assert llm.get_metrics()["num_compilations"] == before


@pytest.mark.parametrize(
    "value, message",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens must be"),
        ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min=4 exceeds",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
            "prompt_lookup_min must be",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown key"),
        ({"num_speculative_tokens": 2}, "needs a 'method' or a draft 'model'"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ],
)
def test_bad_speculative_configs_name_the_field(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(value)


def test_both_spellings_of_the_config():
    old = EngineArgs(
        model="m", speculative_model="[ngram]", num_speculative_tokens=3, ngram_prompt_lookup_max=2
    )
    assert old.speculative() == SpeculativeConfig(
        "ngram", 3, prompt_lookup_max=2, prompt_lookup_min=2
    )
    new = EngineArgs(model="m", speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    assert new.speculative() == SpeculativeConfig(
        "ngram", 5, prompt_lookup_max=5, prompt_lookup_min=5
    )
    with pytest.raises(ValueError, match="not both"):
        EngineArgs(
            model="m", speculative_config={"method": "ngram"}, num_speculative_tokens=2
        ).speculative()
    with pytest.raises(ValueError, match="need speculative_model"):
        EngineArgs(model="m", num_speculative_tokens=2).speculative()
