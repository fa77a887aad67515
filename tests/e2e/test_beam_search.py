"""LLM.beam_search against Transformers' beam search (float32, CPU), on shared KV blocks.

Every architecture, beam widths 1-8, three length penalties, with EOS (two EOS ids, one
of them a token the random model often picks, so beams do end) and without (ignore_eos),
and Transformers' three early-stopping rules; then block sharing, preemption and
chunked prefill, and the bad inputs.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from jvllm import LLM, BeamSearchParams

MAX_TOKENS = 12
PROMPT_LENGTHS = (5, 23)
# Transformers' scores and ours sum the same float32 log-softmax values.
SCORE_ATOL = 1e-4


def prompts(lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(6, 512, size=n)] for n in lengths]


def hf_beam_search(model, ids, width, eos, length_penalty=1.0, early_stopping=False, new=12):
    """Transformers' ranked hypotheses (generated ids) and their scores."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            num_beams=width,
            num_return_sequences=width,
            max_new_tokens=new,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            eos_token_id=eos,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    eos_ids = set(eos or [])
    seqs = []
    for row in out.sequences[:, len(ids) :].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        seqs.append(row[:end])
    # Greedy search (one beam) has no sequences_scores.
    scores = out.sequences_scores.tolist() if width > 1 else None
    return seqs, scores


@pytest.fixture(scope="module")
def eos_ids(hf_models, tokenizer_dir) -> dict[str, list[int]]:
    """arch -> [the tokenizer's EOS, the token the model picks most] as EOS ids."""
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tokenizer_dir).eos_token_id
    picks = {}
    for arch, model in hf_models.items():
        counts: Counter[int] = Counter()
        for ids in prompts():
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_TOKENS, pad_token_id=0
                )
            counts.update(out[0, len(ids) :].tolist())
        picks[arch] = [eos, counts.most_common(1)[0][0]]
    return picks


@pytest.fixture(scope="module")
def beam_llms(checkpoints, eos_ids, tmp_path_factory) -> dict[str, LLM]:
    """arch -> an LLM over the checkpoint, with `eos_ids` in its generation_config.json."""
    llms = {}
    for arch, path in checkpoints.items():
        out = tmp_path_factory.mktemp(f"beam-{arch}")
        for f in Path(path).iterdir():
            (out / f.name).symlink_to(f)
        (out / "generation_config.json").unlink()
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids[arch]}))
        llms[arch] = LLM(str(out), max_model_len=256, max_num_seqs=16, max_num_batched_tokens=128)
    return llms


def check_against_hf(llm, hf_model, params: BeamSearchParams, eos: list[int] | None) -> None:
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts()], params)
    for ids, out in zip(prompts(), outs, strict=True):
        want, scores = hf_beam_search(
            hf_model,
            ids,
            params.beam_width,
            None if params.ignore_eos else eos,
            params.length_penalty,
            params.early_stopping,
            params.max_tokens,
        )
        got = [s.tokens[len(ids) :] for s in out.sequences]
        assert got == want
        assert all(s.tokens[: len(ids)] == ids for s in out.sequences)
        if scores is not None:
            np.testing.assert_allclose([s.score for s in out.sequences], scores, atol=SCORE_ATOL)
        for s in out.sequences:
            n = len(s.tokens) - len(ids)
            assert math.isclose(s.score, s.cum_logprob / n**params.length_penalty, rel_tol=1e-9)
            assert len(s.logprobs) == n
            chosen = [next(iter(position)) for position in s.logprobs]
            assert chosen == s.tokens[len(ids) :]
            total = sum(next(iter(position.values())).logprob for position in s.logprobs)
            assert math.isclose(total, s.cum_logprob, rel_tol=1e-6, abs_tol=1e-6)
            ended = s.tokens[-1] in eos and not params.ignore_eos
            assert s.finish_reason == ("stop" if ended else "length")


@pytest.mark.slow
@pytest.mark.parametrize("with_eos", [True, False], ids=["eos", "ignore_eos"])
def test_beam_search_matches_hf(arch, beam_llms, hf_models, eos_ids, with_eos):
    llm, hf_model = beam_llms[arch], hf_models[arch]
    for width in (1, 2, 4, 8):
        for length_penalty in (0.5, 1.0, 2.0):
            params = BeamSearchParams(
                beam_width=width,
                max_tokens=MAX_TOKENS,
                length_penalty=length_penalty,
                ignore_eos=not with_eos,
            )
            check_against_hf(llm, hf_model, params, eos_ids[arch])
    assert llm.get_metrics()["num_allocated_slots"] == 0


@pytest.mark.parametrize("early_stopping", [True, "never"], ids=str)
def test_early_stopping_rules_match_hf(beam_llms, hf_models, eos_ids, early_stopping):
    for length_penalty in (0.5, 2.0):
        params = BeamSearchParams(
            4, MAX_TOKENS, length_penalty=length_penalty, early_stopping=early_stopping
        )
        check_against_hf(beam_llms["llama"], hf_models["llama"], params, eos_ids["llama"])


def test_eos_does_end_beams(beam_llms, eos_ids):
    """The EOS setup is not vacuous: some hypotheses end on an EOS id before max_tokens."""
    params = BeamSearchParams(4, MAX_TOKENS)
    outs = beam_llms["llama"].beam_search([{"prompt_token_ids": p} for p in prompts()], params)
    reasons = Counter(s.finish_reason for out in outs for s in out.sequences)
    assert reasons["stop"] > 0 and reasons["length"] > 0


@pytest.mark.slow
def test_prompt_blocks_are_held_once(checkpoints):
    """Width 8 on a 500-token prompt: the beams share the prompt's blocks."""
    llm = LLM(str(checkpoints["llama"]), max_model_len=640, max_num_seqs=8, block_size=16)
    engine = llm.engine
    prompt = prompts(lengths=(500,), seed=3)[0]
    params = BeamSearchParams(8, 24, ignore_eos=True)
    engine.add_request("search", {"prompt_token_ids": prompt}, params)
    peak, outs = 0, []
    while engine.has_unfinished_requests():
        outs += engine.step(final_only=True)
        peak = max(peak, engine.scheduler.kv_cache_manager.num_allocated_blocks)
    prompt_blocks = math.ceil(500 / 16)  # 32
    unshared = 8 * math.ceil((500 + 24) / 16)  # 8 copies: 264 blocks
    # The prompt once, and per beam at most its own 24-token tail plus a partial block.
    assert prompt_blocks <= peak <= prompt_blocks + 8 * (math.ceil(24 / 16) + 1)
    assert peak < unshared / 4
    assert engine.scheduler.kv_cache_manager.num_allocated_blocks == 0
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert all(pool.ref_count(b) == 0 for b in range(pool.num_blocks))
    (out,) = outs
    assert len(out.outputs) == 8 and all(len(c.token_ids) == 24 for c in out.outputs)


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {"max_num_batched_tokens": 16},
        # 24 blocks of 16 tokens cannot hold three width-4 searches of ~70 tokens at once.
        {"num_gpu_blocks_override": 24, "max_num_batched_tokens": 64},
        {"num_gpu_blocks_override": 24, "max_num_batched_tokens": 64, "async_scheduling": False},
        {"num_gpu_blocks_override": 24, "enable_prefix_caching": False},
    ],
    ids=["chunk16", "preempt", "preempt-sync", "preempt-nocache"],
)
def test_preemption_and_chunked_prefill_give_the_same_result(checkpoints, engine_kwargs):
    path = str(checkpoints["qwen2"])
    batch = [{"prompt_token_ids": p} for p in prompts(lengths=(40, 47, 52), seed=5)]
    params = BeamSearchParams(4, 20, ignore_eos=True)
    base = LLM(path, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=128)
    want = [[s.tokens for s in o.sequences] for o in base.beam_search(batch, params)]
    llm = LLM(path, max_model_len=256, max_num_seqs=16, **engine_kwargs)
    got = [[s.tokens for s in o.sequences] for o in llm.beam_search(batch, params)]
    assert got == want
    if "num_gpu_blocks_override" in engine_kwargs:
        assert llm.get_metrics()["num_preemptions"] > 0
    assert llm.get_metrics()["num_allocated_slots"] == 0


def test_beam_search_alongside_generate(beam_llms, hf_models, eos_ids):
    """Beam searches share steps with ordinary requests; both stay exact."""
    from jvllm import SamplingParams

    llm = beam_llms["mistral"]
    engine = llm.engine
    params = BeamSearchParams(4, MAX_TOKENS)
    for i, ids in enumerate(prompts()):
        engine.add_request(f"beam{i}", {"prompt_token_ids": ids}, params)
        engine.add_request(f"greedy{i}", {"prompt_token_ids": ids}, SamplingParams(temperature=0))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step(final_only=True)})
    for i, ids in enumerate(prompts()):
        want, _ = hf_beam_search(hf_models["mistral"], ids, 4, eos_ids["mistral"])
        assert [c.token_ids for c in done[f"beam{i}"].outputs] == want
        assert done[f"greedy{i}"].outputs[0].token_ids


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"beam_width": 0}, "beam_width"),
        ({"beam_width": 9}, "beam_width"),
        ({"beam_width": True}, "beam_width"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 0.7}, "temperature"),
        ({"length_penalty": float("nan")}, "length_penalty"),
        ({"early_stopping": "sometimes"}, "early_stopping"),
    ],
)
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"BeamSearchParams.{field} must be"):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kwargs})


@pytest.mark.slow
def test_engine_limits_are_named(checkpoints):
    llm = LLM(str(checkpoints["llama"]), max_model_len=128, max_num_seqs=4)
    with pytest.raises(ValueError, match="beam_width=8 exceeds max_num_seqs"):
        llm.beam_search([{"prompt_token_ids": [5, 6, 7]}], BeamSearchParams(8, 4))
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search(["hello"], {"beam_width": 2})
    # The engine still serves after refusing.
    (out,) = llm.beam_search([[5, 6, 7]], BeamSearchParams(2, 4))
    assert len(out.sequences) == 2
