"""The OpenAI-compatible API through the official `openai` client and httpx, against a
real `jvllm serve` process: completions and chat, streamed and not, n=2, logprobs,
usage, echo, stop strings, the side routes, and equality with `LLM.generate`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from types import SimpleNamespace

import httpx
import openai
import pytest

from jvllm import LLM, BeamSearchParams, SamplingParams
from tests.server import (
    API_KEY,
    SMALL_ENGINE,
    ServerProcess,
    auth_headers,
    metrics,
    wait_idle,
    wait_metrics,
)

MODEL = "tiny-llama"
PROMPT = "the quick brown fox jumps over"
MESSAGES = [
    {"role": "system", "content": "you are a story teller"},
    {"role": "user", "content": "tell me a story about rivers"},
]


@pytest.fixture(scope="module")
def env(checkpoints):
    path = str(checkpoints["llama"])
    server = ServerProcess(
        [path, "--api-key", API_KEY, "--served-model-name", MODEL, *SMALL_ENGINE]
    )
    try:
        # Built while the server warms up: the reference for "same output as LLM.generate".
        llm = LLM(path, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64)
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
        yield SimpleNamespace(url=server.url, llm=llm, client=client)
    finally:
        server.stop()


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def test_models_list(env):
    models = env.client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == 256 and models[0].owned_by == "jvllm"


def test_completion_stream_equals_full_equals_llm_generate(env):
    ref = env.llm.generate(PROMPT, greedy(max_tokens=24), use_tqdm=False)[0]
    full = env.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    chunks = list(
        env.client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True
        )
    )
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert full.choices[0].text == streamed == ref.outputs[0].text
    assert full.choices[0].finish_reason == chunks[-1].choices[0].finish_reason
    assert full.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert full.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert full.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert full.model == MODEL and full.id.startswith("cmpl-")


def test_chat_stream_equals_full_equals_llm_chat(env):
    ref = env.llm.chat(MESSAGES, greedy(max_tokens=20), use_tqdm=False)[0]
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0)
    full = env.client.chat.completions.create(**kw)
    chunks = list(
        env.client.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert full.choices[0].message.content == streamed == ref.outputs[0].text
    assert full.choices[0].message.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert full.usage.prompt_tokens == len(ref.prompt_token_ids)
    # max_completion_tokens is the newer spelling of the same cap.
    newer = env.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=20, temperature=0
    )
    assert newer.choices[0].message.content == streamed


def test_n2_seeded_sampling_streamed_and_not(env):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, n=2, temperature=1.0, seed=7)
    full = env.client.completions.create(**kw)
    assert sorted(c.index for c in full.choices) == [0, 1]
    assert full.usage.completion_tokens == 24 or full.choices[0].finish_reason == "stop"
    texts = {0: "", 1: ""}
    for chunk in env.client.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == {c.index: c.text for c in full.choices}
    chat = env.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, n=2, temperature=1.0, seed=3
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_completion_logprobs_match_llm_generate(env):
    ref = env.llm.generate(PROMPT, greedy(max_tokens=8, logprobs=3), use_tqdm=False)[0].outputs[0]
    out = env.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    for i, token in enumerate(ref.token_ids):
        assert math.isclose(lp.token_logprobs[i], ref.logprobs[i][token].logprob, abs_tol=1e-4)
        # Keyed by token text: tokens that decode alike (partial UTF-8 "\ufffd") share a key.
        assert 1 <= len(lp.top_logprobs[i]) <= 4
        assert lp.top_logprobs[i][lp.tokens[i]] == lp.token_logprobs[i] or lp.tokens[i] == "\ufffd"
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    streamed = [
        x
        for c in env.client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3, stream=True
        )
        for x in (c.choices[0].logprobs.token_logprobs if c.choices else [])
    ]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_chat_logprobs(env):
    out = env.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        # Greedy: the chosen token is the most likely one.
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, abs_tol=1e-6)


def test_echo_and_prompt_forms(env):
    tok = env.llm.get_tokenizer()
    ids = tok.encode(PROMPT)
    echo = env.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True
    )
    assert echo.choices[0].text.startswith(PROMPT)
    many = env.client.completions.create(
        model=MODEL, prompt=[PROMPT, "hello world"], max_tokens=6, temperature=0, n=2
    )
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    single = env.client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    batch = env.client.completions.create(
        model=MODEL, prompt=[ids, ids[:3]], max_tokens=6, temperature=0
    )
    assert single.choices[0].text == batch.choices[0].text == many.choices[0].text
    assert len(batch.choices) == 2


def test_stop_string_streamed_equals_full(env):
    ref = env.llm.generate(PROMPT, greedy(max_tokens=24), use_tqdm=False)[0].outputs[0].text
    stop = ref[6:9]
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "zzzz"])
    full = env.client.completions.create(**kw)
    streamed = "".join(c.choices[0].text for c in env.client.completions.create(**kw, stream=True))
    assert full.choices[0].text == streamed == ref[: ref.index(stop)]
    assert full.choices[0].finish_reason == "stop"


def test_vllm_sampling_extras_accepted(env):
    out = env.client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=5,
        user="someone",
        extra_body=dict(
            top_k=5, min_p=0.05, repetition_penalty=1.1, ignore_eos=True, min_tokens=5,
            stop_token_ids=[1],
        ),
    )  # fmt: skip
    assert out.usage.completion_tokens == 5


def test_side_routes(env):
    h = auth_headers()
    tok = httpx.post(env.url + "/tokenize", json={"prompt": PROMPT}, headers=h).json()
    assert tok["tokens"] == env.llm.get_tokenizer().encode(PROMPT)
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 256
    detok = httpx.post(env.url + "/detokenize", json={"tokens": tok["tokens"][1:]}, headers=h)
    assert detok.json() == {"prompt": PROMPT}
    chat_tok = httpx.post(env.url + "/tokenize", json={"messages": MESSAGES}, headers=h).json()
    assert chat_tok["count"] > tok["count"]
    assert httpx.get(env.url + "/version").json()["version"]
    assert httpx.get(env.url + "/health").status_code == 200
    doc = httpx.get(env.url + "/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize"):
        assert path in doc["paths"]
    assert "CompletionRequest" in doc["components"]["schemas"]


def test_metrics_carry_vllms_names_types_and_labels(env):
    env.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    env.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=2, stop=["w"])
    wait_idle(env.url)
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(env.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    want = {
        "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge", "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter",
        "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter", "vllm:spec_decode_num_drafts": "counter",
        "vllm:spec_decode_num_draft_tokens": "counter",
        "vllm:spec_decode_num_accepted_tokens": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
        "vllm:request_inference_time_seconds": "histogram",
        "vllm:request_prefill_time_seconds": "histogram",
        "vllm:request_decode_time_seconds": "histogram",
        "vllm:request_time_per_output_token_seconds": "histogram",
        "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
        "vllm:request_params_n": "histogram", "vllm:request_params_max_tokens": "histogram",
        "vllm:cache_config_info": "gauge",
        # jvllm's own: swap and free blocks, which vLLM does not report.
        "jvllm:num_free_blocks": "gauge", "jvllm:num_requests_swapped": "gauge",
        "jvllm:num_swapped_out_blocks": "counter", "jvllm:num_recomputed_tokens": "counter",
    }  # fmt: skip
    for name, kind in want.items():
        assert name in families and families[name].type == kind, name
        for sample in families[name].samples:
            assert sample.labels["engine"] == "0", name
            # vLLM's info gauges carry the configuration, not the model name.
            assert sample.labels.get("model_name", MODEL) == MODEL, name
    (info,) = families["vllm:cache_config_info"].samples
    assert info.value == 1 and int(info.labels["num_gpu_blocks"]) > 0
    assert info.labels["block_size"] == "16" and info.labels["enable_prefix_caching"] == "True"
    assert not [f for f in families if f.startswith("jvllm:") and "vllm:" + f[6:] in families]
    m = metrics(env.url)
    assert m["vllm:generation_tokens"] > 0 and m["vllm:prompt_tokens"] > 0
    assert 0 <= m["vllm:prefix_cache_hits"] <= m["vllm:prefix_cache_queries"]
    assert m["vllm:prefix_cache_queries"] > 0
    success = {
        s.labels["finished_reason"]: s.value
        for s in families["vllm:request_success"].samples
        if s.name.endswith("_total")
    }
    assert set(success) == {"stop", "length", "abort", "error", "repetition"}
    assert success["length"] >= 1
    # One count per finished request in each per-request histogram; n=2 is one request.
    finished = sum(success.values()) - success["abort"]
    for name in ("vllm:request_prompt_tokens", "vllm:request_decode_time_seconds"):
        (count,) = [s.value for s in families[name].samples if s.name.endswith("_count")]
        assert count == finished, name
    n_sum = [s.value for s in families["vllm:request_params_n"].samples if s.name.endswith("_sum")]
    assert n_sum[0] >= 2  # the n=2 request


def test_disconnect_aborts_and_frees_blocks(env):
    before = metrics(env.url)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 240, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=env.url, headers=auth_headers()) as client,
        client.stream("POST", "/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        for _ in range(3):
            assert next(lines).startswith("data: ")
            next(lines)
    after = wait_idle(env.url, timeout=5)
    assert after["vllm:kv_cache_usage_perc"] == 0
    assert after["jvllm:num_free_blocks"] == before["jvllm:num_free_blocks"]
    # Aborted before its 240 tokens.
    assert after["vllm:generation_tokens"] - before["vllm:generation_tokens"] < 240


def test_disconnect_while_waiting_for_a_full_response_aborts(env):
    before = metrics(env.url)
    prompts = [f"{PROMPT} {i}" for i in range(8)]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 240, "ignore_eos": True}

    async def leave_once_generating() -> None:
        async with httpx.AsyncClient(base_url=env.url, headers=auth_headers()) as client:
            task = asyncio.ensure_future(client.post("/v1/completions", json=body, timeout=120))
            # Leave while the response is being generated: after its first tokens.
            tokens = "vllm:generation_tokens"
            await asyncio.to_thread(
                wait_metrics, env.url, lambda m: m[tokens] > before[tokens], 120
            )
            assert not task.done()
            task.cancel()  # closes the connection: the server sees the client leave
            with contextlib.suppress(asyncio.CancelledError):
                await task

    asyncio.run(leave_once_generating())
    after = wait_idle(env.url, timeout=60)
    assert after["vllm:kv_cache_usage_perc"] == 0
    assert after["vllm:generation_tokens"] - before["vllm:generation_tokens"] < 8 * 240


async def _stream_one(client: httpx.AsyncClient, prompt: str, leave_after: int | None) -> str:
    """Streams a greedy completion; returns its text, or "" if it left after a few chunks."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
    text, events = "", 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            events += 1
            if leave_after is not None and events >= leave_after:
                return ""  # leaving the block closes the connection mid-stream
            if line == "data: [DONE]":
                return text
            text += json.loads(line[6:])["choices"][0]["text"]
    raise AssertionError("stream ended without [DONE]")


def test_200_concurrent_streams_half_disconnect(env):
    prompts = [f"{PROMPT} {w}" for w in ("dog", "cat", "river", "city")]
    refs = env.llm.generate(prompts, greedy(max_tokens=8), use_tqdm=False)
    expected = {p: r.outputs[0].text for p, r in zip(prompts, refs, strict=True)}
    jobs = [(prompts[i % 4], 2 if i % 2 else None) for i in range(200)]

    async def run() -> list[str]:
        limits = httpx.Limits(max_connections=250)
        async with httpx.AsyncClient(
            base_url=env.url, headers=auth_headers(), limits=limits, timeout=120
        ) as client:
            return await asyncio.gather(*(_stream_one(client, p, k) for p, k in jobs))

    texts = asyncio.run(run())
    for (prompt, leave), text in zip(jobs, texts, strict=True):
        if leave is None:
            assert text == expected[prompt]
    idle = wait_idle(env.url)
    assert idle["vllm:kv_cache_usage_perc"] == 0 and idle["vllm:num_requests_running"] == 0
    assert httpx.get(env.url + "/health").status_code == 200
    out = env.client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=8, temperature=0)
    assert out.choices[0].text == expected[prompts[0]]


def test_use_beam_search_equals_llm_beam_search(env):
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    (want,) = env.llm.beam_search([PROMPT], params)
    resp = env.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, n=3, extra_body={"use_beam_search": True}
    )
    choices = sorted(resp.choices, key=lambda c: c.index)
    assert [c.text for c in choices] == [s.text for s in want.sequences]
    assert [c.finish_reason for c in choices] == [s.finish_reason for s in want.sequences]
    prompt_len = resp.usage.prompt_tokens
    assert resp.usage.completion_tokens == sum(len(s.tokens) - prompt_len for s in want.sequences)
    streamed = ["", "", ""]
    for chunk in env.client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=8,
        n=3,
        stream=True,
        extra_body={"use_beam_search": True},
    ):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [s.text for s in want.sequences]

    ids = env.llm.get_tokenizer().apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    ids = env.llm.get_tokenizer().encode(ids, add_special_tokens=False)
    (want,) = env.llm.beam_search([ids], BeamSearchParams(2, 8, length_penalty=0.5))
    chat = env.client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=8,
        n=2,
        extra_body={"use_beam_search": True, "length_penalty": 0.5},
    )
    texts = [c.message.content for c in sorted(chat.choices, key=lambda c: c.index)]
    assert texts == [s.text for s in want.sequences]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"temperature": 0.5}, "temperature"),
        ({"logprobs": 2}, "logprobs"),
        ({"stop": ["fox"]}, "stop"),
        ({"top_p": 0.5}, "top_p"),
        ({"n": 9}, "n"),
    ],
)
def test_use_beam_search_refuses_what_it_cannot_honour(env, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        env.client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=4,
            **{"n": 2, **{k: v for k, v in extra.items() if k != "stop"}},
            stop=extra.get("stop"),
            extra_body={"use_beam_search": True},
        )
    assert err.value.body["param"] == param
    out = env.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert out.choices[0].finish_reason == "length"


def test_priority_needs_the_priority_policy(env):
    """vLLM's `priority` extra: refused with a 400 naming it unless the server runs
    --scheduling-policy priority (0, the default, is always accepted)."""
    ok = env.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"priority": 0}
    )
    assert ok.choices[0].text
    with pytest.raises(openai.BadRequestError) as err:
        env.client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"priority": 1}
        )
    assert "scheduling_policy" in str(err.value) and err.value.body["param"] == "priority"


def test_training_routes_do_not_exist_without_the_dev_flag(env):
    for path in ("/sleep", "/wake_up", "/pause", "/update_weights", "/collective_rpc"):
        r = httpx.post(env.url + path, headers=auth_headers(), timeout=10)
        assert r.status_code == 404, path
    assert httpx.post(env.url + "/sleep", timeout=10).status_code == 401  # the key comes first
