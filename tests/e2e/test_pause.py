"""AsyncLLM.pause_generation / resume_generation over a real engine, with requests in
flight, in each of vLLM's modes: "abort" ends them (finish_reason "abort"), "wait" lets
them finish, "keep" freezes them and they finish on resume with the tokens an
uninterrupted run gives; requests that arrive while paused wait for resume."""

from __future__ import annotations

import asyncio

import pytest

from jvllm import LLM, SamplingParams
from jvllm.engine.async_llm import AsyncLLM
from tests.helpers import prompts

PROMPTS = prompts(seed=7, lengths=[9, 21])
LONG = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)


@pytest.fixture(scope="module")
def llm_and_reference(checkpoints) -> tuple[LLM, list[list[int]]]:
    llm = LLM(
        str(checkpoints["llama"]), max_model_len=160, max_num_seqs=4, max_num_batched_tokens=64
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], LONG, use_tqdm=False)
    return llm, [list(o.outputs[0].token_ids) for o in outs]


async def start(engine: AsyncLLM, tag: str) -> list:
    return [
        await engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, LONG)
        for i, p in enumerate(PROMPTS)
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
            engine.add_request("held", {"prompt_token_ids": PROMPTS[0]}, LONG)
        )
        await asyncio.sleep(0.05)
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
        await asyncio.sleep(0.05)
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
