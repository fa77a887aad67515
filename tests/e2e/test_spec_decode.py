"""Speculative decoding changes nothing but speed.

With n-gram prompt lookup on, `LLM.generate` gives the tokens of decoding without it:
greedy (and so Transformers' greedy continuation), seeded sampling with every
processor (top-p/top-k, penalties, min_tokens, logprobs), n > 1, stop tokens and stop
strings that fall inside a run of accepted drafts, under chunked prefill (budget 16),
forced preemption and prefix caching; with a draft model or an EAGLE head (the
head's own checks are in test_eagle.py), greedy, n > 1 and stopping requests do too.
The proposer is checked against a brute-force search, and the configuration errors
name their field.
"""

from __future__ import annotations

import numpy as np
import pytest

from jvllm import LLM, SamplingParams
from jvllm.config import SpeculativeConfig
from jvllm.engine.ngram_proposer import NgramProposer
from jvllm.engine.spec_decode import verify
from jvllm.engine_args import EngineArgs
from tests.helpers import approx_logprobs, hf_greedy, mixed_params, prompts, token_prompts

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}
# Budget 16 chunks every prompt; 26 blocks of 16 force preemptions.
# Few token buckets: quick to warm up.
SMALL = dict(max_model_len=384, max_num_seqs=8, max_num_batched_tokens=32)
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
            (c.token_ids, c.text, c.finish_reason, c.stop_reason, approx_logprobs(c.logprobs))
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


@pytest.mark.slow
def test_speculation_gives_the_tokens_of_plain_decoding(
    arch, checkpoints, drafts, heads, tokenizer_dir
):
    """n-gram lookup: every kind of request; a draft model and an EAGLE head: greedy
    ones (seeded sampling through the rejection sampler is equal in distribution, not
    token for token: see the chi-square test)."""
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tokenizer_dir).eos_token_id
    ps = prompts(seed=3)
    params = mixed_params(eos)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = LLM(str(checkpoints[arch]), **ENGINE)
    want = _outputs(plain, ps, params)
    want_greedy = _outputs(plain, ps, [greedy] * len(ps))
    pairs = [SamplingParams(temperature=0.0, max_tokens=24, n=2, ignore_eos=True)] * 4
    want_pairs = _outputs(plain, ps[:4], pairs)  # n > 1: siblings fork the prompt's blocks
    stopping = _stopping_params(want_greedy)
    want_stops = _outputs(plain, ps, stopping)
    del plain
    spec = LLM(str(checkpoints[arch]), speculative_config=NGRAM, **ENGINE)
    assert _outputs(spec, ps, params) == want
    assert _outputs(spec, ps, [greedy] * len(ps)) == want_greedy
    assert _outputs(spec, ps, stopping) == want_stops
    # A seeded request alone draws what it drew in the batch.
    seeded = [i for i, p in enumerate(params) if p.seed is not None and p.n == 1]
    assert all(_outputs(spec, ps[i : i + 1], params[i : i + 1]) == want[i : i + 1] for i in seeded)
    m = spec.get_metrics()
    assert m["num_preemptions"] > 0 and m["prefix_cache_hits"] > 0
    assert m["spec_decode_num_accepted_tokens"] > 50  # the drafts did save steps
    assert m["spec_decode_num_accepted_tokens"] == sum(m["spec_decode_num_accepted_tokens_per_pos"])
    assert m["spec_decode_num_draft_tokens"] >= m["spec_decode_num_drafts"] > 0
    assert m["num_free_blocks"] == m["num_total_blocks"]  # nothing leaked
    del spec
    # llama drafts for itself, preempting by swap: every greedy draft must be kept, so
    # the draft's K/V must come back from host memory intact.
    draft = str(checkpoints[arch]) if arch == "llama" else drafts[arch]
    swap = {"preemption_mode": "swap"} if arch == "llama" else {}
    proposers = {
        "draft": ({"model": draft, "num_speculative_tokens": 3}, swap),
        "eagle": ({"method": "eagle", "model": heads[arch], "num_speculative_tokens": 3}, {}),
    }
    for name, (config, extra) in proposers.items():
        drafted = LLM(str(checkpoints[arch]), speculative_config=config, **ENGINE, **extra)
        assert _outputs(drafted, ps, [greedy] * len(ps)) == want_greedy, name
        assert _outputs(drafted, ps[:4], pairs) == want_pairs, name
        assert _outputs(drafted, ps, stopping) == want_stops, name
        m = drafted.get_metrics()
        assert m["num_preemptions"] > 0 and m["spec_decode_num_drafts"] > 0
        assert m["num_free_blocks"] == m["num_total_blocks"]
        if name == "draft" and arch == "llama":
            assert m["spec_decode_num_accepted_tokens"] == m["spec_decode_num_draft_tokens"]
            assert m["num_swapped_out_blocks"] > 0
        del drafted


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


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
def test_no_compilations_after_warm_up_with_speculation(method, checkpoints, drafts, heads):
    config = {
        "ngram": NGRAM,
        "draft_model": {"model": drafts["mistral"], "num_speculative_tokens": 3},
        "eagle": {"method": "eagle", "model": heads["mistral"], "num_speculative_tokens": 3},
    }[method]
    llm = LLM(
        str(checkpoints["mistral"]),
        speculative_config=config,
        **SMALL,
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
        ({"method": "mlp_speculator", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "'medusa' needs 'model'"),
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


# -- a draft model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def drafts(checkpoints, tokenizer_dir, tmp_path_factory) -> dict[str, str]:
    """arch -> a one-layer draft of it with other random weights (same tokenizer)."""
    from jvllm.testing import make_checkpoint

    root = tmp_path_factory.mktemp("drafts")
    return {
        arch: str(make_checkpoint(arch, root / arch, tokenizer_dir, seed=1, num_hidden_layers=1))
        for arch in checkpoints
    }


@pytest.fixture(scope="module")
def heads(checkpoints, tmp_path_factory) -> dict[str, str]:
    """arch -> a random EAGLE-1 head for it."""
    from jvllm.testing.eagle import make_eagle_head

    root = tmp_path_factory.mktemp("heads")
    return {
        arch: str(make_eagle_head(path, root / arch, seed=2)) for arch, path in checkpoints.items()
    }


def _tiny_vocab_pair(root, vocab: int) -> tuple[str, str]:
    from jvllm.testing import make_checkpoint
    from jvllm.testing.checkpoints import write_word_tokenizer

    write_word_tokenizer(root / "tok", vocab)
    wide = dict(initializer_range=0.5)  # spread logits: distributions far from uniform
    target = make_checkpoint("llama", root / "target", root / "tok", seed=0, **wide)
    draft = make_checkpoint(
        "llama", root / "draft", root / "tok", seed=5, num_hidden_layers=1, **wide
    )
    return str(target), str(draft)


def _chi_square_pvalue(counts: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's test, cells expecting fewer than 5 pooled into one."""
    from scipy.stats import chisquare

    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep]).pvalue)


def sampling_follows_target(llm: LLM, hf, vocab: int, n: int = 2000) -> None:
    """`n` seeded requests, temperature 1, on `llm` (speculating, vocabulary `vocab`):
    the joint distribution of the first two tokens (the second verified by the rejection
    sampler) and the marginal of the third match the exact ones of `hf` (the target as
    Transformers loads it) by Pearson's chi-square at significance 1e-3, with drafts
    both kept and replaced; two seeded requests draw alone what they drew batched."""
    import torch

    prompt = [4, 5, 6]

    def probs(prefixes: list[list[int]]) -> np.ndarray:  # [len(prefixes), V]
        with torch.no_grad():
            logits = hf(torch.tensor(prefixes)).logits[:, -1, :vocab].double()
        return torch.softmax(logits, -1).numpy()

    p1 = probs([prompt])[0]
    p2 = probs([prompt + [a] for a in range(vocab)])  # [x1, x2]
    p3 = probs([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
    joint12 = p1[:, None] * p2  # [V, V]
    marginal3 = (joint12.reshape(-1, 1) * p3).sum(0)

    before = llm.get_metrics()
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=4, ignore_eos=True) for s in range(n)
    ]
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    tokens = np.array([o.outputs[0].token_ids for o in outs])  # [n, 4]
    m = llm.get_metrics()
    drafted = m["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    kept = m["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert 0.05 < kept / drafted < 0.95  # drafts were both kept and replaced
    counts12 = np.bincount(tokens[:, 0] * vocab + tokens[:, 1], minlength=vocab * vocab)
    assert _chi_square_pvalue(counts12, n * joint12.ravel()) > 1e-3
    counts3 = np.bincount(tokens[:, 2], minlength=vocab)
    assert _chi_square_pvalue(counts3, n * marginal3) > 1e-3
    # Seeded requests draw the same alone as in the batch (drafts and q included).
    for s in (0, 17):
        alone = llm.generate([{"prompt_token_ids": prompt}], params[s], use_tqdm=False)
        assert alone[0].outputs[0].token_ids == list(tokens[s])


def test_draft_model_sampling_follows_the_target_distribution(tmp_path):
    """2000 seeded requests, temperature 1, 2 drafts a step from a draft model whose
    distribution differs from the target's: sampled outputs are distributed as the
    target's (`sampling_follows_target`; the sampler's own test shows the same test
    rejects sampling without the residual correction)."""
    import torch
    from transformers import AutoModelForCausalLM

    vocab, prompt = 8, [4, 5, 6]
    target, draft = _tiny_vocab_pair(tmp_path, vocab)
    hf = {
        name: AutoModelForCausalLM.from_pretrained(path).eval()
        for name, path in (("target", target), ("draft", draft))
    }
    with torch.no_grad():
        ids = torch.tensor([prompt + [a] for a in range(vocab)])
        p2, q2 = (torch.softmax(hf[x](ids).logits[:, -1].double(), -1) for x in hf)
    assert 0.5 * (q2 - p2).abs().sum(-1).mean() > 0.2  # the draft disagrees a good deal

    config = {"model": draft, "num_speculative_tokens": 2}
    engine = dict(max_model_len=64, max_num_seqs=16, max_num_batched_tokens=48)
    llm = LLM(target, speculative_config=config, **engine)
    sampling_follows_target(llm, hf["target"], vocab)


def test_a_draft_model_must_fit_the_target(checkpoints, tokenizer_dir, tmp_path):
    from jvllm.testing import make_checkpoint
    from jvllm.testing.checkpoints import write_word_tokenizer

    write_word_tokenizer(tmp_path / "tok", 40)
    other_vocab = make_checkpoint("llama", tmp_path / "v", tmp_path / "tok")
    short = make_checkpoint("llama", tmp_path / "s", tokenizer_dir, max_position_embeddings=128)
    target = str(checkpoints["llama"])
    for draft, message in ((other_vocab, "vocabulary has 40 tokens"), (short, "shorter than")):
        config = {"model": str(draft), "num_speculative_tokens": 2}
        with pytest.raises(ValueError, match=message):
            LLM(target, speculative_config=config, max_model_len=256)
