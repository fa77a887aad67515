"""The development routes through httpx against a real `jvllm serve` started with
--enable-dev-routes: each refuses without the API key; sleep holds requests until
wake-up and changes no output; /update_weights from a directory (paused in between)
gives Transformers' greedy tokens on the new weights with no recompilation; bad values
are 400s and the server keeps serving. Without the flag the routes are 404
(`test_openai_api.py`'s server); VLLM_SERVER_DEV_MODE=1 turns them on as the flag does."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from jvllm.server.dev_routes import dev_mode_enabled
from jvllm.testing import make_checkpoint
from tests.helpers import hf_greedy
from tests.server import API_KEY, SMALL_ENGINE, ServerProcess, auth_headers

PROMPT_IDS = [11, 57, 203, 98, 14, 77, 300, 41]
NEW_TOKENS = 8
ROUTES = [
    ("POST", "/sleep"),
    ("POST", "/wake_up"),
    ("GET", "/is_sleeping"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/collective_rpc"),
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("GET", "/is_paused"),
    ("POST", "/update_weights"),
    ("GET", "/weight_info"),
]


@pytest.fixture(scope="module")
def server(checkpoints):
    process = ServerProcess(
        [
            str(checkpoints["llama"]),
            "--api-key",
            API_KEY,
            "--return-tokens-as-token-ids",
            "--enable-dev-routes",
            *SMALL_ENGINE,
        ],
    )
    try:
        yield process.wait_ready()
    finally:
        process.stop()


def call(server, method: str, path: str, **kw) -> httpx.Response:
    return httpx.request(method, server.url + path, headers=auth_headers(), timeout=60, **kw)


def complete(server) -> list[int]:
    """Greedy token ids of PROMPT_IDS (logprobs carry them as 'token_id:N')."""
    body = {
        "model": server_model(server),
        "prompt": PROMPT_IDS,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "logprobs": 0,
    }
    r = call(server, "POST", "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens]


def server_model(server) -> str:
    return call(server, "GET", "/v1/models").json()["data"][0]["id"]


def test_every_dev_route_needs_the_api_key(server):
    for method, path in ROUTES:
        assert httpx.request(method, server.url + path, timeout=30).status_code == 401, path


def test_sleep_holds_requests_until_wake_up_and_changes_no_output(server):
    before = complete(server)
    assert call(server, "GET", "/is_sleeping").json() == {"is_sleeping": False}
    assert call(server, "POST", "/sleep", params={"level": 1}).status_code == 200
    assert call(server, "GET", "/is_sleeping").json() == {"is_sleeping": True}

    async def held_then_woken() -> list[int]:
        pending = asyncio.ensure_future(asyncio.to_thread(complete, server))
        await asyncio.sleep(0.2)
        assert not pending.done()  # held while asleep
        await asyncio.to_thread(call, server, "POST", "/wake_up")
        return await pending

    assert asyncio.run(held_then_woken()) == before
    assert call(server, "GET", "/is_sleeping").json() == {"is_sleeping": False}


def test_update_weights_from_a_directory_matches_transformers(server, tmp_path, tokenizer_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    second = make_checkpoint("llama", tmp_path / "second", tokenizer_dir, seed=2)
    model = AutoModelForCausalLM.from_pretrained(second).eval()
    eos = AutoTokenizer.from_pretrained(second).eos_token_id
    expected = hf_greedy(model, PROMPT_IDS, NEW_TOKENS, eos)
    compiled = call(server, "POST", "/collective_rpc", json={"method": "num_compilations"})
    assert call(server, "POST", "/pause", params={"mode": "wait"}).json() == {"status": "paused"}
    assert call(server, "GET", "/is_paused").json() == {"is_paused": True}
    body = {"model_path": str(second), "weight_version": "step-1"}
    r = call(server, "POST", "/update_weights", json=body)
    assert r.status_code == 200, r.text
    assert call(server, "POST", "/resume").json() == {"status": "resumed"}
    assert complete(server) == expected
    info = call(server, "GET", "/weight_info").json()
    assert info["weight_version"] == "step-1" and not info["is_sleeping"]
    again = call(server, "POST", "/collective_rpc", json={"method": "num_compilations"})
    assert again.json() == compiled.json()  # no recompilation
    assert call(server, "POST", "/reset_prefix_cache").status_code == 200


def test_bad_values_are_400_and_the_server_keeps_serving(server):
    assert call(server, "POST", "/sleep", params={"level": 5}).status_code == 400
    assert call(server, "POST", "/pause", params={"mode": "later"}).status_code == 400
    r = call(server, "POST", "/sleep", params={"level": 1, "mode": "keep"})
    assert r.status_code == 400 and "mode=keep" in r.text
    assert call(server, "POST", "/wake_up", params={"tags": "everything"}).status_code == 400
    r = call(server, "POST", "/update_weights", json={"model_path": "/no/such/dir"})
    assert r.status_code == 400 and "not a directory" in r.text
    r = call(server, "POST", "/collective_rpc", json={"method": "no_such_method"})
    assert r.status_code == 400
    assert len(complete(server)) == NEW_TOKENS


def test_vllm_dev_mode_variable_turns_the_routes_on(monkeypatch):
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    assert not dev_mode_enabled(False) and dev_mode_enabled(True)
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    assert dev_mode_enabled(False)
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "0")
    assert not dev_mode_enabled(False)
