"""`jvllm serve` with two API servers on one port and two data-parallel engine cores
(`--api-server-count 2 --data-parallel-size 2`), through the official openai client:
outputs equal Transformers' greedy ones, both engines and both API servers serve, an
abort frees every block, and killing an engine core (kill -9) fails the in-flight
request with a 503 naming it, turns /health to 503 and ends the server with a non-zero
status, leaving no process or socket behind. One server for the module: each engine
core compiles its own programs."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import TypeVar

import httpx
import openai
import pytest

from tests.helpers import prompts
from tests.server import SMALL_ENGINE, ServerProcess, descendants, left_alive

T = TypeVar("T")

MAX_TOKENS = 6


def engine_samples(url: str, name: str) -> dict[str, float]:
    """engine label -> value of the labelled family `name`."""
    text = httpx.get(url + "/metrics", timeout=10).text
    pattern = re.compile(rf'^{re.escape(name)}{{engine="(\d+)",model_name="[^"]*"}} (\S+)$', re.M)
    return {engine: float(value) for engine, value in pattern.findall(text)}


def poll(probe: Callable[[], T], done: Callable[[T], bool], timeout: float = 10.0) -> T:
    """probe() until done(its value) or `timeout` seconds; the last value. For another
    process's metrics: an API server reads an engine it is not stepping every
    WATCHDOG_INTERVAL_S, so no event here says when they are current."""
    deadline = time.monotonic() + timeout
    value = probe()
    while not done(value) and time.monotonic() < deadline:
        time.sleep(0.1)
        value = probe()
    return value


def idle_engines(url: str) -> tuple[dict[str, float], dict[str, float]]:
    """Each engine's KV usage and running requests, once both engines are idle (or not)."""
    return poll(
        lambda: (
            engine_samples(url, "vllm:kv_cache_usage_perc"),
            engine_samples(url, "vllm:num_requests_running"),
        ),
        lambda v: set(v[0]) == {"0", "1"} and not any(v[0].values()) and not any(v[1].values()),
    )


@pytest.fixture(scope="module")
def env(checkpoints):
    path = str(checkpoints["llama"])
    flags = ["--data-parallel-size", "2", "--api-server-count", "2", "--enable-log-requests"]
    flags += ["--return-tokens-as-token-ids"]  # logprobs name tokens "token_id:<id>"
    server = ServerProcess([path, *SMALL_ENGINE, *flags])
    try:
        from jvllm.testing.hf_runner import HfRunner

        token_prompts = prompts(3, lengths=[3, 9, 17, 30, 5, 12, 21, 40])
        with HfRunner(path, dtype="float32") as hf:  # built while the server warms up
            expected = hf.generate_greedy(token_prompts, MAX_TOKENS)
        server.wait_ready()
        yield SimpleNamespace(server=server, prompts=token_prompts, expected=expected, path=path)
    finally:
        server.stop()


def complete(url: str, prompt: list[int]) -> openai.types.Completion:
    # A client (a connection) per request: the kernel spreads connections across the
    # API servers listening on the port.
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        return client.completions.create(
            model=client.models.list().data[0].id,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            logprobs=1,
        )


def test_two_api_servers_and_two_engines_equal_transformers(env):
    url = env.server.url
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: complete(url, p), env.prompts * 2))
    samples = env.expected * 2
    # The server answers once one API server listens; the other may still be starting
    # and take no connection of the first batch: a few more, until both have served.
    for _ in range(40):
        if all(f"ApiServer_{i} Received request" in env.server.log() for i in (0, 1)):
            break
        results.append(complete(url, env.prompts[0]))
        samples.append(env.expected[0])
    for result, sample in zip(results, samples, strict=True):
        expected = sample[0][result.usage.prompt_tokens :]
        tokens = result.choices[0].logprobs.tokens
        assert [int(t.removeprefix("token_id:")) for t in tokens] == expected
    # Both engines generated (per-engine counters), and both API servers took requests.
    # An API server reads an engine it is not stepping every WATCHDOG_INTERVAL_S.
    generated = sum(r.usage.completion_tokens for r in results)
    tokens = poll(
        lambda: engine_samples(url, "vllm:generation_tokens_total"),
        lambda tokens: sum(tokens.values()) == generated,
    )
    assert set(tokens) == {"0", "1"} and min(tokens.values()) > 0, tokens
    assert sum(tokens.values()) == generated, tokens
    log = env.server.log()
    for index in (0, 1):
        assert re.search(rf"ApiServer_{index} Received request", log), log[-4000:]


def reference_text(tokenizer, prompt: list[int], output: list[int]) -> str:
    """The output's text as an incremental detokenizer gives it (the prompt's last five
    tokens as context), by Transformers' decode."""
    tail = prompt[-5:]
    context = tokenizer.decode(tail, skip_special_tokens=True)
    return tokenizer.decode(tail + output, skip_special_tokens=True)[len(context) :]


def test_stop_strings_in_the_api_server_and_blocks_freed_in_the_core(env):
    """The API server detokenizes and applies stop strings (the cores send token ids):
    a stop string across a token boundary cuts the text of both choices (n = 2), kept
    with include_stop_str_in_output when streamed, equal to Transformers' text; the
    cores abort those requests at once (blocks freed, far fewer tokens than max_tokens)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(env.path)
    for prompt, sample in zip(env.prompts, env.expected, strict=True):
        output = sample[0][len(prompt) :]
        full = reference_text(tokenizer, prompt, output)
        boundary = len(reference_text(tokenizer, prompt, output[:2]))
        across = full[boundary - 2 : boundary + 1]
        if len(across) == 3 and full.index(across) == boundary - 2:
            break
    else:
        pytest.fail("no prompt's text has a stop string across its second token's end")
    url, metric = env.server.url, "vllm:generation_tokens_total"
    before = sum(engine_samples(url, metric).values())
    extra = {"ignore_eos": True}
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        model = client.models.list().data[0].id
        cut = client.completions.create(
            model=model, prompt=prompt, max_tokens=200, n=2, temperature=0.0, stop=[across],
            extra_body=extra,
        )  # fmt: skip
        chunks = client.completions.create(
            model=model, prompt=prompt, max_tokens=200, temperature=0.0, stop=[across],
            stream=True, extra_body={**extra, "include_stop_str_in_output": True},
        )  # fmt: skip
        streamed = [(c.choices[0].text, c.choices[0].finish_reason) for c in chunks]
    assert [(c.text, c.finish_reason) for c in cut.choices] == [(full[: boundary - 2], "stop")] * 2
    assert "".join(text for text, _ in streamed) == full[: boundary + 1]
    assert streamed[-1][1] == "stop"
    usage, running = idle_engines(url)
    assert usage == {"0": 0.0, "1": 0.0} and running == {"0": 0.0, "1": 0.0}
    # Three sequences ended after 3 tokens, aborted in the cores once the front end saw
    # the stop: far fewer than the 600 tokens max_tokens allows (the steps run until the
    # abort arrives are more on a loaded machine than on a quiet one).
    assert sum(engine_samples(url, metric).values()) - before < 200


def served_by(server: ServerProcess, counts: dict[str, int]) -> str:
    """The API server that logged a request since `counts` (each one's "Received
    request" lines then), which this updates."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for index in counts:
            seen = server.log().count(f"ApiServer_{index} Received request")
            if seen > counts[index]:
                counts[index] = seen
                return index
        time.sleep(0.02)
    raise AssertionError("no API server logged the request")


def test_api_servers_balance_on_the_coordinators_one_view(env):
    """Long requests opened one after another, through both API servers, each go to an
    engine that was least loaded (waiting * 4 + running) in the DP coordinator's table
    just before, with requests of either API server running: every API server sees the
    other's requests at once. (Steps are fast: a check counts only when no request
    ended meanwhile.)"""
    import zmq

    from jvllm.engine.core.coordinator import LoadView

    server = env.server
    address = re.search(r"loads published on (\S+)", server.log()).group(1)
    context = zmq.Context()
    view = LoadView(context, address)
    body = {"prompt": env.prompts[0], "max_tokens": 250, "ignore_eos": True, "stream": True}
    counts = {i: server.log().count(f"ApiServer_{i} Received request") for i in "01"}
    checked = crossed = 0  # checks; those taken by the other API server than the last
    open_streams, last = [], None

    def table(after: list[int] | None = None):
        """The newest table once it shows a request added since `after` and none waits
        (a settled view: the API servers see the same)."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            latest = view.latest()
            if latest is not None and None not in latest.engines:
                added = [load.num_added for load in latest.engines]
                settled = not any(load.waiting for load in latest.engines)
                if settled and (after is None or sum(added) > sum(after)):
                    return latest, added
            time.sleep(0.005)
        raise AssertionError("the coordinator published no new table")

    try:
        with contextlib.ExitStack() as streams:
            for _ in range(24):  # at most 12 running per engine (16 sequences)
                if checked >= 8 and crossed >= 3:
                    break
                before, added = table()
                client = streams.enter_context(httpx.Client(base_url=server.url, timeout=60))
                response = streams.enter_context(
                    client.stream("POST", "/v1/completions", json=body)
                )
                open_streams.append(response.iter_lines())  # kept: a closed one aborts
                assert next(open_streams[-1]).startswith("data: ")
                took, previous = served_by(server, counts), last
                last = took
                after, now = table(added)
                running = [load.running for load in before.engines]
                if not any(running) or sum(a.running for a in after.engines) <= sum(running):
                    continue  # nothing to balance against, or a request ended meanwhile
                loads = [load.waiting * 4 + load.running for load in before.engines]
                chosen = [i for i in (0, 1) if now[i] > added[i]]
                assert len(chosen) == 1 and loads[chosen[0]] == min(loads), (before, after)
                checked += 1
                crossed += took != previous
    finally:
        view.close()
        context.term()
    assert checked >= 8 and crossed >= 3, (checked, crossed)


def test_abort_frees_every_engines_blocks(env):
    url = env.server.url
    body = {"prompt": env.prompts[0], "max_tokens": 200, "ignore_eos": True, "stream": True}
    # Requests an earlier test aborted may still be generating on a busy machine.
    assert idle_engines(url) == ({"0": 0.0, "1": 0.0}, {"0": 0.0, "1": 0.0})
    prompt_before = engine_samples(url, "vllm:prompt_tokens_total")
    generated_before = sum(engine_samples(url, "vllm:generation_tokens_total").values())
    # Two streams open at once, so that the balancer puts them on different engines.
    with (
        httpx.Client(base_url=url, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=body) as first,
        httpx.Client(base_url=url, timeout=60) as other,
        other.stream("POST", "/v1/completions", json=body) as second,
    ):
        for response in (first, second):
            assert next(response.iter_lines()).startswith("data: ")
    prompt_after = poll(
        lambda: engine_samples(url, "vllm:prompt_tokens_total"),
        lambda after: all(after.get(e, 0) > prompt_before.get(e, 0) for e in ("0", "1")),
    )
    assert all(prompt_after.get(e, 0) > prompt_before.get(e, 0) for e in ("0", "1")), prompt_after
    usage, running = idle_engines(url)
    assert usage == {"0": 0.0, "1": 0.0} and running == {"0": 0.0, "1": 0.0}
    generated = sum(engine_samples(url, "vllm:generation_tokens_total").values())
    assert generated - generated_before < 2 * 200  # both ended early, by the abort


def test_killed_engine_core_fails_requests_names_it_and_leaves_nothing(env):
    server = env.server
    processes = descendants(server.proc.pid)
    cores = [int(p) for p in re.findall(r"started 2 engine core\(s\): pids \[(\d+), (\d+)\]",
                                        server.log())[0]]  # fmt: skip
    sockets_dir = re.search(r"serving \['ipc://(\S+)/frontend0_core0'", server.log()).group(1)
    body = {"prompt": env.prompts[1], "max_tokens": 200, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=server.url, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=body) as first,
        httpx.Client(base_url=server.url, timeout=60) as other,
        other.stream("POST", "/v1/completions", json=body) as second,
    ):
        streams = [first.iter_lines(), second.iter_lines()]
        for lines in streams:
            assert next(lines).startswith("data: ")
        os.kill(cores[1], signal.SIGKILL)
        errors = []
        for lines in streams:
            events = [line[6:] for line in lines if line.startswith("data: {")]
            errors += [json.loads(e)["error"] for e in events if '"error"' in e]
    # The request on the killed core fails with a 503 naming it.
    assert any(
        e["code"] == "engine_dead" and f"engine core 1 (pid {cores[1]}) died" in e["message"]
        for e in errors
    ), errors
    # Each API server's watchdog sees the death within WATCHDOG_INTERVAL_S (0.5 s);
    # the first to see it exits DEAD_ENGINE_EXIT_DELAY_S (2 s) later.
    # Polled until then (a loaded machine may take longer than the watchdog's interval).
    health, deadline = [], time.monotonic() + 30
    while 503 not in health and time.monotonic() < deadline:
        health.append(httpx.get(server.url + "/health", timeout=10).status_code)
        time.sleep(0.1)
    assert health[-1] == 503, health
    assert server.wait_exit(30) != 0
    assert not left_alive(processes)
    assert not Path(sockets_dir).exists()
