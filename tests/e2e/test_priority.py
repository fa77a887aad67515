"""scheduling_policy="priority" (vLLM's): requests run by priority (lower first, ties by
arrival), and when blocks run out the lowest-ranked running request is preempted; outputs
are what they are under first come first served. A priority under the default policy is
refused, naming it."""

from __future__ import annotations

import pytest

from jvllm import LLM, SamplingParams
from jvllm.engine.validation import InvalidRequestError
from tests.helpers import prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(checkpoints) -> LLM:
    # One sequence at a time: the order requests run in is the order they finish in.
    return LLM(
        str(checkpoints["llama"]),
        max_model_len=128,
        max_num_seqs=1,
        max_num_batched_tokens=64,
        scheduling_policy="priority",
    )


def test_requests_run_by_priority_and_give_fcfs_outputs(llm, checkpoints):
    engine = llm.engine
    batch = [{"prompt_token_ids": p} for p in prompts()[:4]]
    ranks = [3, -1, 0, 3]  # the two 3s keep their arrival order
    for i, (prompt, rank) in enumerate(zip(batch, ranks, strict=True)):
        engine.add_request(str(i), prompt, GREEDY, priority=rank)
    finished: list[str] = []
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step(final_only=True):
            finished.append(out.request_id)
            outputs[out.request_id] = out.outputs[0].token_ids
    assert finished == ["1", "2", "0", "3"]
    fcfs = LLM(str(checkpoints["llama"]), max_model_len=128, max_num_batched_tokens=64)
    want = fcfs.generate(batch, GREEDY, use_tqdm=False)
    assert [outputs[str(i)] for i in range(4)] == [o.outputs[0].token_ids for o in want]
    # LLM.generate takes one priority per prompt.
    got = llm.generate(batch[:2], GREEDY, use_tqdm=False, priority=[1, 0])
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want[:2]]
    with pytest.raises(ValueError, match="2 priorities for 1 prompts"):
        llm.generate(batch[:1], GREEDY, use_tqdm=False, priority=[0, 1])
    with pytest.raises(InvalidRequestError, match="got priority 1, but scheduling_policy"):
        fcfs.generate(batch[:1], GREEDY, use_tqdm=False, priority=[1])
    with pytest.raises(InvalidRequestError, match="priority must be an int"):
        llm.generate(batch[:1], GREEDY, use_tqdm=False, priority=[0.5])
