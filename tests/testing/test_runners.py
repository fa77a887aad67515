"""The pytest plugin's runners in jvllm's own suite: `hf_runner` and `jvllm_runner` on one
tiny checkpoint, string and token prompts, greedy, logprobs and beam search, compared
with the plugin's own helpers."""

from __future__ import annotations

import pytest

from jvllm import SamplingParams
from jvllm.testing import check_logprobs_close, check_outputs_equal, hf_greedy
from tests.helpers import prompts

ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32)
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def runs(hf_runner, jvllm_runner, checkpoints, example_prompts) -> dict:
    """Each runner's outputs on four example prompts and two token prompts."""
    mixed = [*example_prompts[:4], *prompts(seed=3, lengths=[3, 40])]
    got = {"prompts": mixed}
    for name, runner, kwargs in (("hf", hf_runner, {}), ("jvllm", jvllm_runner, ENGINE)):
        with runner(checkpoints["qwen3"], **kwargs) as model:
            got[name] = {
                "greedy": model.generate_greedy(mixed, MAX_TOKENS),
                "logprobs": model.generate_greedy_logprobs(mixed, MAX_TOKENS, 4),
                "beams": model.generate_beam_search(example_prompts[:2], 3, 6),
            }
            if name == "hf":
                eos = model.tokenizer.eos_token_id
                got["hf_greedy"] = hf_greedy(model.model, mixed[-1], MAX_TOKENS, eos)
                got["eos"] = (model.eos_token_ids, eos)
            else:
                params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=4)
                got["sampled"] = model.generate(mixed[:1], params)
    return got


def test_greedy_outputs_are_equal_and_carry_the_prompt_as_vllm_does(runs):
    check_outputs_equal(
        outputs_0_lst=runs["hf"]["greedy"],
        outputs_1_lst=runs["jvllm"]["greedy"],
        name_0="hf",
        name_1="jvllm",
    )
    for prompt, (ids, text) in zip(runs["prompts"], runs["jvllm"]["greedy"], strict=True):
        if isinstance(prompt, str):
            assert text.startswith(prompt) and len(text) > len(prompt)
        else:
            assert ids[: len(prompt)] == prompt and len(ids) > len(prompt)
    # jvllm's tests' hf_greedy is the runner's greedy search (the tokenizer's EOS only here).
    assert runs["eos"][0] == [runs["eos"][1]]
    assert runs["hf_greedy"] == runs["hf"]["greedy"][-1][0][len(runs["prompts"][-1]) :]


def test_logprobs_agree_token_for_token_in_float32(runs):
    hf, ours = runs["hf"]["logprobs"], runs["jvllm"]["logprobs"]
    check_logprobs_close(outputs_0_lst=hf, outputs_1_lst=ours, name_0="hf", name_1="jvllm")
    for (ids_0, _, lps_0), (ids_1, _, lps_1) in zip(hf, ours, strict=True):
        assert ids_0 == ids_1 and len(lps_0) == len(ids_0)
        for top_hf, top_ours in zip(lps_0, lps_1, strict=True):
            assert set(top_hf) == set(top_ours)  # the chosen token is the top-1 here
            for token, value in top_hf.items():
                assert top_ours[token].logprob == pytest.approx(value, abs=1e-4)


def test_beam_search_gives_transformers_beams_and_generate_keeps_vllms_shape(runs):
    assert runs["hf"]["beams"] == runs["jvllm"]["beams"]
    ((ids, texts),) = runs["sampled"]
    assert len(ids) == len(texts) == 2 and all(t.startswith(runs["prompts"][0]) for t in texts)


def test_embed_equals_sentence_transformers(hf_runner, jvllm_runner, tokenizer_dir, tmp_path):
    """vLLM's embedding-model test shape: `hf_runner(..., is_sentence_transformer=True)`
    and `jvllm_runner(..., runner="pooling")` on one checkpoint."""
    import numpy as np

    from jvllm.testing.pooling_checkpoints import make_embedder

    path = make_embedder(tmp_path / "embedder", tokenizer_dir)
    prompts = ["rivers run to the sea", "the quick brown fox jumps over the lazy dog"]
    with hf_runner(str(path), dtype="float32", is_sentence_transformer=True) as hf_model:
        want = hf_model.encode(prompts)
    with jvllm_runner(
        str(path), dtype="float32", runner="pooling", max_model_len=64, max_num_batched_tokens=32
    ) as jvllm_model:
        got = jvllm_model.embed(prompts)
    for a, b in zip(got, want, strict=True):
        cos = np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b))
        assert cos >= 0.9999
