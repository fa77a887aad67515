"""LLM.sleep and wake_up (vLLM's levels): the device bytes the engine holds while asleep,
and greedy outputs after waking equal to those before sleeping."""

from __future__ import annotations

import gc

import jax
import pytest

from jvllm import LLM, SamplingParams
from tests.helpers import prompts, token_prompts

PROMPTS = token_prompts(prompts(seed=5, lengths=[6, 30]))
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def device_bytes() -> int:
    """Bytes of every live array on the devices."""
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())


@pytest.fixture(scope="module")
def engine(checkpoints) -> tuple[LLM, int]:
    """The engine and the device bytes live before it was made."""
    baseline = device_bytes()
    # A KV cache about the weights' size, so that neither dominates the count.
    llm = LLM(
        str(checkpoints["llama"]),
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=16,
    )
    return llm, baseline


def greedy(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_sleep_levels_release_device_memory_and_wake_up_restores_outputs(engine, checkpoints):
    llm, baseline = engine
    before_tokens = greedy(llm)
    compiled = llm.get_metrics()["num_compilations"]
    awake = device_bytes() - baseline

    llm.sleep(level=1)
    assert llm.is_sleeping()
    print(f"device bytes: awake {awake}, level 1 {device_bytes() - baseline}")
    assert device_bytes() - baseline <= awake / 10  # the weights went to host memory
    with pytest.raises(RuntimeError, match="sleep"):
        llm.generate("hi", use_tqdm=False)
    llm.wake_up()
    assert not llm.is_sleeping()
    assert greedy(llm) == before_tokens

    llm.sleep(level=2)
    print(f"device bytes: level 2 {device_bytes() - baseline}")
    assert device_bytes() - baseline <= awake / 10
    llm.wake_up(tags=["weights"])  # level 2: weights come back as zeros
    assert llm.is_sleeping()  # the KV cache is still released
    llm.update_weights(str(checkpoints["llama"]))
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert greedy(llm) == before_tokens
    assert llm.get_metrics()["num_compilations"] == compiled


def test_level_two_weights_reload_while_asleep(engine, checkpoints):
    llm, _ = engine
    before_tokens = greedy(llm)
    llm.sleep(level=2)
    llm.update_weights(str(checkpoints["llama"]))  # straight into the released slots
    llm.wake_up()
    assert greedy(llm) == before_tokens


def test_bad_levels_and_tags_are_refused(engine):
    llm, _ = engine
    with pytest.raises(ValueError, match="sleep level must be 0, 1 or 2, got 3"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="wake_up tags"):
        llm.wake_up(tags=["weights", "everything"])
