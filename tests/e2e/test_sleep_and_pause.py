"""LLM.sleep and wake_up (vLLM's levels): the device bytes the engine holds while asleep,
and greedy outputs after waking equal to those before sleeping. AsyncLLM's
pause_generation / resume_generation over the same engine, with requests in flight, in
each of vLLM's modes: "abort" ends them (finish_reason "abort"), "wait" lets them
finish, "keep" freezes them and they finish on resume with the tokens an uninterrupted
run gives; requests that arrive while paused wait for resume."""

from __future__ import annotations

import asyncio
import gc

import jax
import pytest

from jvllm import LLM, SamplingParams
from jvllm.engine.async_llm import AsyncLLM
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
        max_model_len=160,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=20,
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


def test_release_kv_cache_memory_keeps_the_weights(engine):
    llm, baseline = engine
    before_tokens = greedy(llm)
    weights = sum(a.nbytes for a in jax.tree.leaves(llm.get_weights()))
    llm.release_kv_cache_memory()
    assert device_bytes() - baseline == weights
    with pytest.raises(RuntimeError, match="KV cache was released"):
        llm.generate("hi", use_tqdm=False)
    llm.wake_up(tags=["kv_cache"])
    assert greedy(llm) == before_tokens


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


PAUSE_PROMPTS = prompts(seed=7, lengths=[9, 21])
LONG = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)


@pytest.fixture(scope="module")
def llm_and_reference(engine) -> tuple[LLM, list[list[int]]]:
    llm, _ = engine
    outs = llm.generate(token_prompts(PAUSE_PROMPTS), LONG, use_tqdm=False)
    return llm, [list(o.outputs[0].token_ids) for o in outs]


async def start(engine: AsyncLLM, tag: str) -> list:
    return [
        await engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, LONG)
        for i, p in enumerate(PAUSE_PROMPTS)
    ]


async def last(stream) -> object:
    """The stream's final output."""
    outputs = [out async for out in stream]
    return outputs[-1]


def test_pause_and_resume_in_each_mode(llm_and_reference):
    llm, reference = llm_and_reference
    asyncio.run(run_modes(AsyncLLM(llm.engine), reference))


async def run_modes(engine: AsyncLLM, reference: list[list[int]]) -> None:
    engine.start()
    try:
        # abort: the requests in flight end at once.
        streams = await start(engine, "abort")
        await anext(streams[0])  # running
        await engine.pause_generation(mode="abort")
        assert await engine.is_paused()
        ends = [await last(s) for s in streams]
        assert {o.outputs[0].finish_reason for o in ends} == {"abort"}
        # Arriving while paused: held until resume, then served in full.
        held = asyncio.create_task(
            engine.add_request("held", {"prompt_token_ids": PAUSE_PROMPTS[0]}, LONG)
        )
        await asyncio.sleep(0)  # the add queues its command
        await engine.call(lambda _: None)  # applied after it, in order: the add was seen
        assert not held.done()
        await engine.resume_generation()
        assert not await engine.is_paused()
        assert list((await last(await held)).outputs[0].token_ids) == reference[0]

        # wait: the pause returns once every request in flight has finished.
        streams = await start(engine, "wait")
        await anext(streams[0])
        await engine.pause_generation(mode="wait")
        ends = [await last(s) for s in streams]
        assert [list(o.outputs[0].token_ids) for o in ends] == reference
        assert {o.outputs[0].finish_reason for o in ends} == {"length"}
        await engine.resume_generation()

        # keep: frozen where they were; no token while paused; resumed to the end.
        streams = await start(engine, "keep")
        await anext(streams[0])
        await engine.pause_generation(mode="keep")
        generated = engine.metrics()["generation_tokens"]
        for _ in range(3):  # engine-loop round trips, each between steps
            await engine.call(lambda _: None)
        assert engine.metrics()["generation_tokens"] == generated
        await engine.resume_generation()
        ends = [await last(s) for s in streams]
        assert [list(o.outputs[0].token_ids) for o in ends] == reference
    finally:
        await engine.shutdown()


def test_bad_pause_mode_is_refused(llm_and_reference):
    llm, _ = llm_and_reference

    async def pause() -> None:
        engine = AsyncLLM(llm.engine)
        engine.start()
        try:
            await engine.pause_generation(mode="later")
        finally:
            await engine.shutdown()

    with pytest.raises(ValueError, match="pause mode must be one of"):
        asyncio.run(pause())
