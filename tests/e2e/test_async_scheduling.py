"""Async (overlapped) scheduling changes nothing but speed.

The same requests through an engine that schedules step N + 1 while step N runs and
through one that waits for every step give identical outputs: greedy and seeded
sampling, penalties (whose history then ends in a token still on the device),
min_tokens, stop tokens, logprobs, n > 1, with chunked prefill and preemption.
Token ids are compared exactly; logprobs to 1e-5, since the two loops batch rows
differently (a row dispatched for a request that then stopped takes budget) and a
float32 sum in another order moves the last bits.
"""

from __future__ import annotations

import pytest

from jvllm import LLM, SamplingParams
from tests.helpers import approx_logprobs, mixed_params, prompts, token_prompts

# Small budget and cache: chunked prefill and preemptions in the same run.
ENGINE = dict(
    max_model_len=512, max_num_seqs=16, max_num_batched_tokens=64, num_gpu_blocks_override=40
)


def run(path, async_scheduling: bool, params: list[SamplingParams]) -> list:
    llm = LLM(str(path), async_scheduling=async_scheduling, **ENGINE)
    outs = llm.generate(token_prompts(prompts(seed=3)), params, use_tqdm=False)
    assert llm.get_metrics()["num_preemptions"] > 0  # the cache is too small on purpose
    return [
        [
            (c.token_ids, c.finish_reason, c.stop_reason, approx_logprobs(c.logprobs))
            for c in o.outputs
        ]
        for o in outs
    ]


@pytest.mark.slow
def test_overlap_on_and_off_give_identical_outputs(arch, checkpoints, tokenizer_dir):
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tokenizer_dir).eos_token_id
    params = mixed_params(eos)
    assert run(checkpoints[arch], True, params) == run(checkpoints[arch], False, params)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_no_token_past_a_stop(checkpoints, async_scheduling):
    """A request that stops on a token still gets no token after it, although the
    overlapped engine has already dispatched the next step for it."""
    llm = LLM(str(checkpoints["llama"]), async_scheduling=async_scheduling, **ENGINE)
    free = llm.generate(token_prompts(prompts()[:4]), SamplingParams(temperature=0, max_tokens=20))
    stops = [o.outputs[0].token_ids[5] for o in free]
    params = [SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[t]) for t in stops]
    outs = llm.generate(token_prompts(prompts()[:4]), params, use_tqdm=False)
    for out, full, stop in zip(outs, free, stops, strict=True):
        ids = full.outputs[0].token_ids
        assert out.outputs[0].token_ids == ids[: ids.index(stop) + 1]
        assert out.outputs[0].finish_reason == "stop"
