"""logit_bias, allowed_token_ids and bad_words against Transformers' own processors
(sequence_bias, prefix_allowed_tokens_fn, bad_words_ids), greedy, token for token."""

from __future__ import annotations

import numpy as np
import pytest

from jvllm import LLM, SamplingParams
from jvllm.engine.token_constraints import BadWords
from tests.helpers import hf_greedy

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def llm(checkpoints) -> LLM:
    return LLM(
        str(checkpoints["llama"]), max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64
    )


@pytest.fixture(scope="module")
def hf(hf_models):
    return hf_models["llama"]


def _prompts(seed: int, n: int = 6) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(6, 512, size=int(k))] for k in rng.integers(3, 60, n)]


def _hf_greedy(hf, ids: list[int], eos: int, **processors) -> list[int]:
    return hf_greedy(hf, ids, NEW_TOKENS, eos, **processors)


def _generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _eos(llm: LLM) -> int:
    return llm.get_tokenizer().eos_token_id


def test_logit_bias_matches_transformers_sequence_bias(llm, hf) -> None:
    prompts = _prompts(1)
    rng = np.random.default_rng(2)
    biases = [
        {
            int(t): float(v)
            for t, v in zip(rng.integers(6, 512, 8), rng.uniform(-5, 5, 8), strict=True)
        }
        for _ in prompts
    ]
    params = [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logit_bias=b) for b in biases]
    # Unbiased rows in the same batch keep their unbiased outputs.
    plain = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    got = _generate(llm, prompts + prompts[:2], params + [plain, plain])
    for ids, bias, out in zip(prompts, biases, got, strict=False):
        sequence_bias = {(t,): v for t, v in bias.items()}
        assert out == _hf_greedy(hf, ids, _eos(llm), sequence_bias=sequence_bias)
    assert got[-2:] == [_hf_greedy(hf, p, _eos(llm)) for p in prompts[:2]]


def test_logit_bias_of_100_forces_and_minus_100_bans(llm) -> None:
    prompts = _prompts(3, 4)
    forced = 77
    out = _generate(
        llm,
        prompts,
        [SamplingParams(temperature=0.0, max_tokens=8, logit_bias={forced: 100.0})] * 4,
    )
    assert all(o == [forced] * 8 for o in out)
    plain = _generate(llm, prompts, [SamplingParams(temperature=0.0, max_tokens=8)] * 4)
    banned = {t for o in plain for t in o}
    params = SamplingParams(
        temperature=0.8, seed=5, max_tokens=16, logit_bias=dict.fromkeys(banned, -100.0)
    )
    assert not banned & {t for o in _generate(llm, prompts, [params] * 4) for t in o}


def test_allowed_token_ids_match_transformers_prefix_allowed_tokens(llm, hf) -> None:
    prompts = _prompts(4, 4)
    allowed = sorted({int(t) for t in np.random.default_rng(5).integers(6, 512, 40)})
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, allowed_token_ids=allowed)
    got = _generate(llm, prompts, [params] * len(prompts))
    for ids, out in zip(prompts, got, strict=True):
        assert set(out) <= set(allowed)
        want = _hf_greedy(hf, ids, _eos(llm), prefix_allowed_tokens_fn=lambda b, s: allowed)
        assert out == want
    sampled = SamplingParams(temperature=1.0, seed=1, max_tokens=32, allowed_token_ids=allowed)
    assert all(set(o) <= set(allowed) for o in _generate(llm, prompts, [sampled] * 4))


def test_bad_words_match_transformers_bad_words_ids(llm, hf) -> None:
    tokenizer = llm.get_tokenizer()
    prompts = _prompts(6, 4)
    plain = _generate(llm, prompts, [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)] * 4)
    for ids, out in zip(prompts, plain, strict=True):
        # Words the model would write: one whole token, and a two-token stretch.
        words = [tokenizer.decode(out[2:3]), tokenizer.decode(out[5:7])]
        words = [w for w in words if w.strip()]
        sequences = BadWords.from_words(tokenizer, words)
        bad_ids = [[t] for t in sequences.always] + [list(s) for s in sequences.sequences]
        if any(ids[-len(s) + 1 :] == s[:-1] for s in bad_ids if len(s) > 1):
            continue  # Transformers also matches the prompt's tail; vLLM only outputs
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, bad_words=words)
        (got,) = _generate(llm, [ids], [params])
        assert got == _hf_greedy(hf, ids, _eos(llm), bad_words_ids=bad_ids)
        for seq in bad_ids:
            assert not any(got[i : i + len(seq)] == seq for i in range(len(got)))


def test_biases_and_bans_add_no_compilation_after_warm_up(llm) -> None:
    prompts = _prompts(8, 6)
    # Warm-up compiled the programs; a plain batch first brings any lazily built ones.
    _generate(llm, prompts, [SamplingParams(temperature=0.0, max_tokens=4)] * 6)
    before = llm.get_metrics()["num_compilations"]
    rng = np.random.default_rng(9)
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, logit_bias={int(rng.integers(512)): 50.0}),
        SamplingParams(max_tokens=12, seed=1, logit_bias={int(t): -3.0 for t in range(300)}),
        SamplingParams(max_tokens=12, seed=2, allowed_token_ids=list(range(6, 200))),
        SamplingParams(max_tokens=12, seed=3, bad_words=["the quick", "fox"]),
        SamplingParams(max_tokens=12, seed=4, min_tokens=6, logit_bias={1: 5.0}),
        SamplingParams(temperature=0.0, max_tokens=12),
    ]
    _generate(llm, prompts, params)
    assert llm.get_metrics()["num_compilations"] == before


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
        ({"bad_words": ["ok", " "]}, "bad_words"),
    ],
)
def test_bad_values_are_refused_by_name(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_token_ids_outside_the_vocabulary_are_refused(llm) -> None:
    for kwargs, name in [
        ({"logit_bias": {10**6: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [3, 10**6]}, "allowed_token_ids"),
    ]:
        with pytest.raises(ValueError, match=name):
            llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(**kwargs), use_tqdm=False)
