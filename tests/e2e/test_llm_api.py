"""LLM's user-facing behaviour: input forms, validation, stop handling, chat, abort."""

from __future__ import annotations

import math

import pytest

from jvllm import LLM, SamplingParams
from jvllm.engine.detokenizer import IncrementalDetokenizer
from jvllm.runner.model_runner import ModelRunner


@pytest.fixture(scope="module")
def llm(checkpoints) -> LLM:
    return LLM(
        str(checkpoints["llama"]), max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64
    )


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def test_prompt_forms_and_order(llm):
    tok = llm.get_tokenizer()
    text = "hello world how are you"
    ids = tok.encode(text)
    outs = llm.generate(
        [text, {"prompt": text}, {"prompt_token_ids": ids}], greedy(max_tokens=8), use_tqdm=False
    )
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
    assert outs[0].prompt_token_ids == ids == outs[2].prompt_token_ids
    assert (
        outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    )
    single = llm.generate(text, greedy(max_tokens=8), use_tqdm=False)
    assert len(single) == 1 and single[0].prompt == text


def test_one_params_per_prompt(llm):
    outs = llm.generate(
        ["a b", "c d"], [greedy(max_tokens=3), greedy(max_tokens=5)], use_tqdm=False
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(["a", "b", "c"], [greedy(), greedy()])


def test_text_matches_token_ids(llm):
    out = llm.generate("the quick brown fox", greedy(max_tokens=20), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.text == llm.get_tokenizer().decode(c.token_ids, skip_special_tokens=True)


def test_stop_string_cut_from_text(llm):
    base = llm.generate("tell me a story", greedy(max_tokens=20, ignore_eos=True), use_tqdm=False)
    text = base[0].outputs[0].text
    stop = text[5:8]
    assert stop
    out = llm.generate(
        "tell me a story", greedy(max_tokens=20, stop=[stop], ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    kept = llm.generate(
        "tell me a story",
        greedy(max_tokens=20, stop=[stop], ignore_eos=True, include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_stop_token_ids_and_min_tokens(llm):
    base = (
        llm.generate("numbers 1 2 3", greedy(max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    stop_tok = base[3]
    first = base.index(stop_tok)
    out = llm.generate(
        "numbers 1 2 3",
        greedy(max_tokens=12, stop_token_ids=[stop_tok], ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == base[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    # min_tokens: a stop token before it does not end the request.
    later = llm.generate(
        "numbers 1 2 3",
        greedy(max_tokens=12, stop_token_ids=[stop_tok], min_tokens=first + 2, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(later.token_ids) >= first + 2


def test_min_tokens_bans_stop_tokens_until_reached(llm):
    base = llm.generate("hello", greedy(max_tokens=6, ignore_eos=True), use_tqdm=False)
    first = base[0].outputs[0].token_ids[0]
    out = llm.generate(
        "hello", greedy(max_tokens=6, min_tokens=3, stop_token_ids=[first]), use_tqdm=False
    )[0].outputs[0]
    assert first not in out.token_ids[:3] and len(out.token_ids) >= 3
    eos = llm.get_tokenizer().eos_token_id
    assert eos not in out.token_ids[:3]


def test_max_model_len_stops_with_length(llm):
    tok_ids = list(range(10, 250))  # 240 tokens, max_model_len 256
    out = llm.generate(
        {"prompt_token_ids": tok_ids}, greedy(max_tokens=100, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 16


def test_chat_uses_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], greedy(max_tokens=4), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    expected = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert out.prompt == expected
    assert out.prompt_token_ids == tok.encode(expected, add_special_tokens=False)
    two = llm.chat(
        [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]],
        greedy(max_tokens=2),
        use_tqdm=False,
    )
    assert len(two) == 2


@pytest.mark.parametrize(
    "prompt, match",
    [
        ("", "prompt is empty"),
        ({"prompt_token_ids": []}, "prompt is empty"),
        ({"prompt_token_ids": [1, 99999]}, "outside the vocabulary"),
        ({"prompt_token_ids": [-1]}, "outside the vocabulary"),
        ({"prompt_token_ids": list(range(5, 261))}, "max_model_len is 256"),
        ({"text": "x"}, "needs 'prompt' or 'prompt_token_ids'"),
    ],
)
def test_bad_prompts_rejected_without_harm(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["fine prompt", prompt], greedy(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]
    assert llm.generate("still works", greedy(max_tokens=2), use_tqdm=False)[0].finished


def test_bad_stop_token_id(llm):
    with pytest.raises(ValueError, match="stop_token_ids .* outside the vocabulary"):
        llm.generate("x", greedy(stop_token_ids=[10**6]))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 0}, "top_k"),
        ({"n": 0}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"min_tokens": 5, "max_tokens": 3}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"min_p": 2.0}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ],
)
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} must be"):
        SamplingParams(**kwargs)


def test_abort_frees_blocks(llm):
    engine = llm.engine
    engine.add_request(
        "long", {"prompt_token_ids": list(range(10, 110))}, greedy(max_tokens=100, ignore_eos=True)
    )
    engine.add_request("short", "a b c", greedy(max_tokens=3))
    engine.step()
    engine.abort_request("long")
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    assert outs["long"].outputs[0].finish_reason == "abort" and outs["long"].finished
    assert outs["short"].outputs[0].finish_reason == "length"
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]


def test_unknown_llm_argument(checkpoints):
    with pytest.raises(TypeError, match="unknown arguments: \\['bogus'\\]"):
        LLM(str(checkpoints["llama"]), bogus=1)


def test_model_len_too_big_for_cache_names_knob(checkpoints, monkeypatch):
    def warm_up(self: ModelRunner) -> None:
        raise AssertionError("compiled before checking the KV cache's capacity")

    monkeypatch.setattr(ModelRunner, "warm_up", warm_up)
    with pytest.raises(ValueError, match="num_gpu_blocks_override"):
        LLM(str(checkpoints["llama"]), max_model_len=512, num_gpu_blocks_override=8)


class _ByteTokenizer:
    """Decodes ids as raw bytes, so one character can span two tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_holds_back_partial_utf8():
    detok = IncrementalDetokenizer(_ByteTokenizer(), [65], True, ["é!"], False)
    stops = [detok.append(b) for b in "aé!".encode()]
    assert stops == [None, None, None, "é!"] and detok.output_text == "a"
    detok = IncrementalDetokenizer(_ByteTokenizer(), [65], True, [], False)
    for b in "añb".encode():
        detok.append(b)
        assert "\ufffd" not in detok.output_text
    assert detok.output_text == "añb"


def test_generate_steps_with_the_serving_collector_and_restores_it(llm, monkeypatch) -> None:
    import gc

    from jvllm.engine.gc_heap import SERVING_GEN0_THRESHOLD

    before = (gc.get_freeze_count(), gc.get_threshold())
    seen = []
    step = llm.llm_engine.step

    def observed_step(*args, **kwargs):
        seen.append((gc.get_freeze_count(), gc.get_threshold()[0]))
        return step(*args, **kwargs)

    monkeypatch.setattr(llm.llm_engine, "step", observed_step)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy(max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
    assert seen and all(frozen > 0 and first >= SERVING_GEN0_THRESHOLD for frozen, first in seen)
    assert (gc.get_freeze_count(), gc.get_threshold()) == before


def _in_process_outputs(engine, requests) -> dict:
    outs: dict[str, list] = {rid: [] for rid, _, _ in requests}
    for rid, ids, params in requests:
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id].append(o)
    return outs


def _outputs_through_core(engine, requests) -> tuple[dict, list]:
    """The split's path without its processes: an `EngineCore` (token ids only) over the
    module's engine, and the front end's output processor; the requests (and choices)
    it aborted in the core, each checked gone from the engine at once."""
    import time

    from jvllm.engine.core import messages as m
    from jvllm.engine.core.core import EngineCore
    from jvllm.engine.core.detokenizing import FrontendOutputProcessor

    core = EngineCore(engine, 0)
    front = FrontendOutputProcessor(engine.tokenizer, engine.eos_token_ids)
    outs: dict[str, list] = {rid: [] for rid, _, _ in requests}
    aborted: list[str] = []
    try:
        for rid, ids, params in requests:
            add = m.AddRequest(rid, None, ids, time.monotonic(), sampling_params=params)
            assert core.handle(b"front", add).error is None
            front.add_request(rid, None, ids, params, None)
        while front.requests:
            stopped, choices = [], {}
            for wire in core.step(b"front").outputs:
                output, abort_in_core, ended = front.process(wire)
                outs[wire.request_id] += [output] if output is not None else []
                stopped += [wire.request_id] if abort_in_core else []
                choices |= {wire.request_id: ended} if ended else {}
            if stopped or choices:
                core.handle(b"front", m.Abort(stopped, choices))
                assert not set(stopped) & set(engine.output_processor.requests)
                scheduled = {r.request_id for r in [*engine.scheduler.running]}
                scheduled |= {r.request_id for r in engine.scheduler.waiting}
                ends = [(rid, i) for rid, indices in choices.items() for i in indices]
                assert not {f"{rid}#{i}" for rid, i in ends} & scheduled
                aborted += stopped + ends
        while engine.has_unfinished_requests():  # the abort's own trailing output
            engine.step()
    finally:
        engine.output_processor.detokenize = True
    return outs, aborted


def test_engine_core_token_ids_detokenized_in_front_equal_in_process(llm):
    """Through an engine core that returns token ids only, the front end's output
    processor gives the in-process engine's outputs: stop strings cut or kept (one
    across a token boundary), none before min_tokens, logprob and prompt logprob token
    texts, n = 2, deltas step by step; a request a stop string ended is aborted in the
    core, which frees its blocks."""
    from jvllm.sampling_params import RequestOutputKind

    engine, tok = llm.engine, llm.get_tokenizer()
    ids = tok.encode("once upon a time there was")

    def text(max_tokens: int) -> str:
        params = greedy(max_tokens=max_tokens, ignore_eos=True)
        return llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].text

    full, one, boundary = text(12), text(1), len(text(2))  # the first two tokens' text
    across = full[boundary - 2 : boundary + 1]
    assert full.index(across) == boundary - 2
    early = one[:1]  # in the first token's text: with min_tokens=1 it stops only later
    later = full.find(early, len(one))
    sampled = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=8, logprobs=2)
    pair = [c.text for c in llm.generate({"prompt_token_ids": ids}, sampled)[0].outputs]
    # A stop string in the first choice's text only: it ends that choice alone.
    pieces = [pair[0][i : i + 2] for i in range(len(pair[0]) - 1)]
    alone = next(piece for piece in pieces if piece not in pair[1])
    delta = RequestOutputKind.DELTA
    # An ordinary token as a stop token id: as vLLM, the text leaves it out unless
    # include_stop_str_in_output.
    greedy_ids = (
        llm.generate(
            {"prompt_token_ids": ids}, greedy(max_tokens=12, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    k = next(i for i in range(2, 12) if greedy_ids[i] not in greedy_ids[:i])
    by_token = greedy(max_tokens=12, stop_token_ids=[greedy_ids[k]], ignore_eos=True)
    requests = [
        ("stop-token", ids, by_token),
        ("stop-token-kept", ids, by_token.clone(include_stop_str_in_output=True)),
        ("cut", ids, greedy(max_tokens=12, stop=[across], ignore_eos=True)),
        ("kept", ids, greedy(max_tokens=12, stop=[across], include_stop_str_in_output=True)),
        ("cut-delta", ids, greedy(max_tokens=12, stop=[across], output_kind=delta)),
        ("min", ids, greedy(max_tokens=12, stop=[early], min_tokens=1, ignore_eos=True)),
        ("n2", ids, sampled),
        ("n2-stop", ids, sampled.clone(stop=[alone])),
        ("lp-delta", ids, greedy(max_tokens=6, logprobs=1, prompt_logprobs=1, output_kind=delta)),
    ]
    expected = _in_process_outputs(engine, requests)
    got, aborted = _outputs_through_core(engine, requests)
    for rid, _, _ in requests:
        finals = [o for o in expected[rid] if o.finished]
        if rid.endswith("delta"):
            assert got[rid] == expected[rid], rid  # every delta, step by step
        else:
            assert got[rid][-1] == finals[-1], rid
    by_id, by_id_kept = got["stop-token"][-1].outputs[0], got["stop-token-kept"][-1].outputs[0]
    assert by_id.token_ids == greedy_ids[: k + 1] and by_id.stop_reason == greedy_ids[k]
    assert (by_id.text, by_id_kept.text) == (text(k), text(k + 1))
    cut, kept = got["cut"][-1].outputs[0], got["kept"][-1].outputs[0]
    assert cut.text == full[: boundary - 2] and cut.stop_reason == across
    assert kept.text == full[: boundary + 1] and kept.finish_reason == "stop"
    assert got["min"][-1].outputs[0].text == (full if later < 0 else full[:later])
    position = got["lp-delta"][0].outputs[0].logprobs[0]
    assert all(lp.decoded_token == tok.decode([t]) for t, lp in position.items())
    assert got["lp-delta"][0].prompt_logprobs[1]
    assert sorted(map(str, aborted)) == sorted(
        ["cut", "cut-delta", "kept", str(("n2-stop", 0))] + (["min"] if later >= 0 else [])
    )
    first, second = got["n2-stop"][-1].outputs
    assert (first.finish_reason, first.stop_reason) == ("stop", alone)
    assert second.finish_reason == "length"
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]
