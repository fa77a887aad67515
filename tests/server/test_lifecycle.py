"""The server process under pressure and at its end: a full queue gives 503 with
Retry-After while accepted requests finish; SIGTERM drains (new requests 503, in-flight
ones complete, exit 0); an engine-loop crash errors in-flight requests, turns /health
to 503 and exits non-zero. Also the CLI's flags and the demo model without torch."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest

from jvllm.cli import build_parser, engine_flag_fields
from tests.server import SMALL_ENGINE, ServerProcess, descendants, left_alive


def test_every_engine_arg_is_a_flag():
    parser = build_parser()
    for name, _ in engine_flag_fields():
        flag = "--" + name.replace("_", "-")
        assert flag in parser._subparsers._group_actions[0].choices["serve"].format_help(), flag
    args = parser.parse_args(
        ["serve", "m", "--block-size", "8", "--no-enable-prefix-caching", "--dtype", "bfloat16"]
    )
    assert (args.block_size, args.enable_prefix_caching, args.dtype) == (8, False, "bfloat16")
    assert "max_num_seqs" not in args  # unset flags leave EngineArgs' defaults alone
    defaults = parser.parse_args(["serve"])
    assert (defaults.model, defaults.host, defaults.port) == (None, "127.0.0.1", 8000)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--scheduling-policy", "random"])


def test_demo_model_loads_without_torch():
    # The `serve` extra has no torch: the shipped demo checkpoint must not need it.
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # any `import torch` now fails\n"
        "from transformers import AutoTokenizer\n"
        "from jvllm.demo import demo_model_path\n"
        "from jvllm.models.loader import read_config\n"
        "path = demo_model_path()\n"
        "assert read_config(path)['architectures'] == ['LlamaForCausalLM']\n"
        "assert AutoTokenizer.from_pretrained(path).eos_token == '</s>'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


async def _stream(url: str, body: dict, first: asyncio.Event) -> list[dict]:
    """Streams a completion; sets `first` once the response headers arrived."""
    events = []
    async with (
        httpx.AsyncClient(base_url=url, timeout=120) as client,
        client.stream("POST", "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        first.set()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_full_queue_503_then_sigterm_drains(checkpoints):
    args = [str(checkpoints["llama"]), "--max-num-seqs", "2", "--max-queued-requests", "2"]
    # The engine in a core process of its own (a small host would keep it in-process).
    split = {"JVLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    server = ServerProcess(
        [*args, "--max-model-len", "512", "--max-num-batched-tokens", "64"], env=split
    )
    long = {
        "prompt": "hello world",
        "max_tokens": 480,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    async def scenario() -> list[list[dict]]:
        tasks = []
        # Two run (max_num_seqs=2), two wait: the queue is full.
        for _ in range(4):
            started = asyncio.Event()
            tasks.append(asyncio.ensure_future(_stream(server.url, long, started)))
            await asyncio.wait_for(started.wait(), 60)
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            full = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert full.status_code == 503, full.text
            assert full.headers["retry-after"] == "1"
            assert full.json()["error"]["code"] == "queue_full"
            server.proc.send_signal(15)  # SIGTERM
            # Logged once the server is draining, so the next request is refused.
            draining = "shutting down: refusing new requests"
            assert await asyncio.to_thread(server.wait_for_log, draining, 60), server.log()
            late = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
            assert (await client.get("/health")).status_code == 200  # draining, not dead
        return await asyncio.gather(*tasks)

    try:
        server.wait_ready()
        processes = descendants(server.proc.pid)  # the engine core, its resource tracker
        assert processes
        streams = asyncio.run(scenario())
        for events in streams:
            assert events[-1]["usage"]["completion_tokens"] == 480
            assert [e["choices"][0]["finish_reason"] for e in events[-2:-1]] == ["length"]
        assert server.wait_exit(60) == 0, server.log()
        assert not left_alive(processes)
    finally:
        server.stop()


# Injected into the server process: the engine's step raises once a "poison" prompt arrives.
POISON = """
import jvllm.engine.llm_engine as _m
_add, _step, _armed = _m.LLMEngine.add_request, _m.LLMEngine.step, []
def add_request(self, request_id, prompt, params, arrival_time=None):
    _add(self, request_id, prompt, params, arrival_time)
    _armed.extend(["x"] if "poison" in str(prompt) else [])
def step(self):
    if _armed:
        raise RuntimeError("injected failure of <Engine object at 0xdeadbeef0>")
    return _step(self)
_m.LLMEngine.add_request, _m.LLMEngine.step = add_request, step
"""


def test_engine_death_fails_in_flight_and_exits_nonzero(tmp_path):
    # No MODEL: the built-in demo model, with small limits from the command line.
    # The poison is injected into this process: the engine must run in it.
    env = {"JVLLM_CACHE": str(tmp_path), "JVLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    server = ServerProcess(SMALL_ENGINE, prelude=POISON, env=env)
    try:
        server.wait_ready()
        card = httpx.get(server.url + "/v1/models").json()["data"][0]
        assert card["id"] == "jvllm-demo" and "DEMO" in card["description"]
        assert "serving the built-in DEMO model" in server.log()
        body = {"prompt": "hello", "max_tokens": 240, "ignore_eos": True, "stream": True}
        with (
            httpx.Client(base_url=server.url, timeout=60) as client,
            client.stream("POST", "/v1/completions", json=body) as stream,
        ):
            lines = stream.iter_lines()
            assert next(lines).startswith("data: {")
            poison = client.post("/v1/completions", json={"prompt": "poison", "max_tokens": 4})
            assert poison.status_code == 503 and poison.json()["error"]["code"] == "engine_dead"
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert error["code"] == "engine_dead" and "0x" not in error["message"]
        assert httpx.get(server.url + "/health").status_code == 503
        assert server.wait_exit(60) != 0
        # It exits because the engine died, not after waiting out a drain.
        log = server.log()
        assert "the engine loop died: failing in-flight requests and exiting" in log
        assert "shutdown timeout" not in log and "refusing new requests" not in log, log
    finally:
        server.stop()
