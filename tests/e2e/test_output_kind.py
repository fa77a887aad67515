"""RequestOutputKind (vLLM's `SamplingParams.output_kind`): what each step's output of a
request holds. DELTA outputs, folded in order, give the CUMULATIVE result (tokens, text
with a stop string cut out, logprobs), and no delta ever sends text that the finished
output does not start with; FINAL_ONLY gives one output, the finished one. Through
AsyncLLM a reader that falls behind gets DELTA outputs folded together."""

from __future__ import annotations

import asyncio
import copy
import threading

import pytest

from jvllm import LLM, RequestOutputKind, SamplingParams
from jvllm.engine.async_llm import AsyncLLM
from jvllm.engine.request_timing import E2E, FinishedRequestStats
from jvllm.outputs import RequestOutput
from tests.helpers import prompts

ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def llm(checkpoints) -> LLM:
    return LLM(str(checkpoints["llama"]), **ENGINE)


def cases(llm: LLM) -> list[SamplingParams]:
    """Greedy with a stop string met mid-way (found from a first greedy run), seeded n = 2
    with logprobs and prompt logprobs, and one request of each that runs to its length."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    text = llm.generate([{"prompt_token_ids": prompts()[0]}], greedy, use_tqdm=False)
    text = text[0].outputs[0].text
    # Three characters from the middle of the text (no replacement character: a token
    # that ends inside a UTF-8 sequence decodes to one until the rest arrives).
    starts = [i for i in range(len(text) // 3, len(text) - 3) if "\ufffd" not in text[i : i + 3]]
    stop = text[starts[0] : starts[0] + 3]
    return [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=stop),
        SamplingParams(
            temperature=0.9,
            seed=3,
            n=2,
            max_tokens=20,
            logprobs=2,
            prompt_logprobs=1,
            ignore_eos=True,
        ),  # fmt: skip
        SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True, logprobs=1),
    ]


def run(llm: LLM, params: list[SamplingParams], kind: RequestOutputKind) -> dict[str, list]:
    """Every output the engine's step loop hands back, per request."""
    engine = llm.engine
    got: dict[str, list[RequestOutput]] = {}
    for i, p in enumerate(params):
        engine.add_request(f"{kind.name}-{i}", {"prompt_token_ids": prompts()[0]},
                           p.clone(output_kind=kind))  # fmt: skip
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).append(copy.deepcopy(out))
    return {k.split("-")[1]: v for k, v in got.items()}


def summary(out: RequestOutput) -> list[tuple]:
    return [
        (c.text, c.token_ids, c.finish_reason, c.stop_reason, len(c.logprobs or []),
         None if c.cumulative_logprob is None else round(c.cumulative_logprob, 4))
        for c in out.outputs
    ]  # fmt: skip


def test_deltas_fold_into_the_cumulative_output(llm):
    params = cases(llm)
    whole = run(llm, params, RequestOutputKind.CUMULATIVE)
    deltas = run(llm, params, RequestOutputKind.DELTA)
    assert whole.keys() == deltas.keys() == {"0", "1", "2"}
    stopped = whole["0"][-1].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == params[0].stop
    for key, outs in deltas.items():
        final = whole[key][-1]
        folded = copy.deepcopy(outs[0])
        for out in outs[1:]:
            folded.add(out)
            # Text once sent stays: the finished text starts with all sent so far.
            for c, f in zip(folded.outputs, final.outputs, strict=True):
                assert f.text.startswith(c.text)
        assert folded.finished and summary(folded) == summary(final)
        # Prompt logprobs come with the first delta only.
        if params[int(key)].prompt_logprobs is not None:
            assert outs[0].prompt_logprobs == final.prompt_logprobs
            assert all(o.prompt_logprobs is None for o in outs[1:])
        # Each delta carries only its new tokens: they add up to the whole.
        assert sum(len(o.outputs[0].token_ids) for o in outs) == len(final.outputs[0].token_ids)
        assert len(outs) > 1


def test_cumulative_outputs_share_the_sequence_lists(llm):
    """As vLLM's: a CUMULATIVE output's token ids and logprobs are the sequence's own
    lists, which later steps extend (no whole-output copy per step); its text is its
    step's, and the token count read at that step matches it."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    engine.add_request("live", {"prompt_token_ids": prompts()[0]}, params)
    seen = []  # (completion, its text then, its token count then)
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            seen.append((c, c.text, len(c.token_ids)))
    final = seen[-1][0]
    assert len(seen) == 12 and final.finish_reason == "length"
    assert all(c.token_ids is final.token_ids and c.logprobs is final.logprobs for c, *_ in seen)
    assert [n for *_, n in seen] == list(range(1, 13))
    assert all(final.text.startswith(text) for _, text, _ in seen)
    assert len(seen[0][1]) <= len(seen[-2][1]) <= len(final.text)


def test_final_only_gives_one_output(llm):
    params = cases(llm)
    whole = run(llm, params, RequestOutputKind.CUMULATIVE)
    final = run(llm, params, RequestOutputKind.FINAL_ONLY)
    for key, outs in final.items():
        assert len(outs) == 1 and outs[0].finished
        assert summary(outs[0]) == summary(whole[key][-1])


def test_offline_generate_returns_whole_outputs_for_any_kind(llm):
    params = cases(llm)
    batch = [{"prompt_token_ids": prompts()[0]}] * len(params)
    want = [summary(o) for o in llm.generate(batch, params, use_tqdm=False)]
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY):
        with_kind = [p.clone(output_kind=kind) for p in params]
        assert [summary(o) for o in llm.generate(batch, with_kind, use_tqdm=False)] == want


def test_a_slow_reader_gets_folded_deltas(checkpoints):
    llm = LLM(str(checkpoints["llama"]), **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = llm.generate([{"prompt_token_ids": prompts()[1]}], params, use_tqdm=False)[0]

    class Finish:
        """Told by the engine thread when the request's last output is made."""

        def __init__(self) -> None:
            self.done = threading.Event()

        def observe(self, name: str, seconds: float) -> None:
            if name == E2E:
                self.done.set()

        def finished(self, stats: FinishedRequestStats) -> None:
            pass

    async def read_slowly() -> tuple[RequestOutput, int]:
        finish = Finish()
        engine = AsyncLLM(llm.engine, observer=finish)
        engine.start()
        try:
            delta = params.clone(output_kind=RequestOutputKind.DELTA)
            stream = await engine.add_request("slow", {"prompt_token_ids": prompts()[1]}, delta)
            folded, reads = None, 0
            async for out in stream:
                reads += 1
                if folded is None:
                    folded = copy.deepcopy(out)
                    # Read nothing more until the request is done: every later delta
                    # piles up in the stream meanwhile.
                    assert await asyncio.to_thread(finish.done.wait, 120)
                else:
                    folded.add(out)
            return folded, reads
        finally:
            await engine.shutdown()

    folded, reads = asyncio.run(read_slowly())
    assert summary(folded) == summary(want)
    # The first read, then the rest folded (the final delta may come on its own).
    assert reads <= 3 < len(want.outputs[0].token_ids)


def test_bad_output_kind_is_refused():
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind=7)
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA
