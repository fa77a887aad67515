"""Bad input never crashes the server: each case gets its 4xx and OpenAI's error envelope,
with no traceback or memory address, and afterwards the server is healthy and every KV
block is free. Also the API key: missing, wrong, and path or Host tricks."""

from __future__ import annotations

import json
import re
import socket
from types import SimpleNamespace

import httpx
import pytest

from tests.server import API_KEY, SMALL_ENGINE, ServerProcess, auth_headers, metrics, wait_idle

MODEL = "tiny-llama"
BODY_LIMIT = 65536
C, H = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hello"}]
# A 1x1 PNG as an image_url part: the text-only model refuses it.
PNG_1X1 = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
)
IMAGE_PARTS = [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + PNG_1X1}},
    {"type": "text", "text": "hello"},
]


@pytest.fixture(scope="module")
def server(checkpoints):
    args = [str(checkpoints["llama"]), "--api-key", API_KEY, "--served-model-name", MODEL]
    proc = ServerProcess([*args, *SMALL_ENGINE, "--max-request-body-bytes", str(BODY_LIMIT)])
    try:
        proc.wait_ready()
        yield SimpleNamespace(url=proc.url, start=metrics(proc.url))
    finally:
        proc.stop()


def cmpl(**kw) -> dict:
    return {"model": MODEL, "prompt": "hello world", "max_tokens": 4, **kw}


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": MSG, "max_tokens": 4, **kw}


# (id, path, body: bytes or a JSON-able object, expected status)
CASES = [
    ("invalid-json", C, b'{"prompt": "hi",', 400),
    ("body-string", C, b'"hello"', 400),
    ("body-list", C, b"[1, 2]", 400),
    ("body-number", C, b"42", 400),
    ("body-null", C, b"null", 400),
    ("body-empty", C, b"", 400),
    ("body-not-utf8", C, b'{"prompt": "\xff\xfe"}', 400),
    ("body-deeply-nested", C, b"[" * 30000 + b"]" * 30000, 400),
    ("oversized-body", C, {"prompt": "x" * (BODY_LIMIT + 10)}, 413),
    ("missing-prompt", C, {"model": MODEL}, 400),
    ("prompt-wrong-type", C, cmpl(prompt=5), 400),
    ("prompt-mixed-list", C, cmpl(prompt=["a", 3]), 400),
    ("max-tokens-string", C, cmpl(max_tokens="5"), 400),
    ("n-bool", C, cmpl(n=True), 400),
    ("unknown-model", C, cmpl(model="gpt-9"), 404),
    ("empty-prompt", C, cmpl(prompt=""), 400),
    ("empty-prompt-list", C, cmpl(prompt=[]), 400),
    ("empty-token-list", C, cmpl(prompt=[[]]), 400),
    ("too-many-prompts", C, cmpl(prompt=["a"] * 100), 400),
    ("huge-n", C, cmpl(n=100000), 400),
    ("max-tokens-zero", C, cmpl(max_tokens=0), 400),
    ("max-tokens-negative", C, cmpl(max_tokens=-1), 400),
    ("max-tokens-past-context", C, cmpl(max_tokens=1000), 400),
    ("min-tokens-over-max", C, cmpl(max_tokens=4, min_tokens=8), 400),
    ("prompt-past-context", C, cmpl(prompt="hello " * 400), 400),
    ("token-id-negative", C, cmpl(prompt=[1, -5]), 400),
    ("token-id-past-vocab", C, cmpl(prompt=[1, 100000]), 400),
    ("token-id-huge", C, cmpl(prompt=[2**40]), 400),
    ("stop-token-ids-oov", C, cmpl(stop_token_ids=[100000]), 400),
    ("logit-bias-oov", C, cmpl(logit_bias={"999999": 1.0}), 400),
    ("logit-bias-bad-key", C, cmpl(logit_bias={"abc": 1.0}), 400),
    ("temperature-negative", C, cmpl(temperature=-1), 400),
    ("temperature-nan", C, b'{"prompt": "hi", "temperature": NaN}', 400),
    ("temperature-inf", C, b'{"prompt": "hi", "temperature": Infinity}', 400),
    ("top-p-zero", C, cmpl(top_p=0), 400),
    ("top-p-above-one", C, cmpl(top_p=1.5), 400),
    ("top-k-zero", C, cmpl(top_k=0), 400),
    ("min-p-above-one", C, cmpl(min_p=2), 400),
    ("presence-penalty", C, cmpl(presence_penalty=3), 400),
    ("frequency-penalty", C, cmpl(frequency_penalty=-3), 400),
    ("repetition-penalty-zero", C, cmpl(repetition_penalty=0), 400),
    ("repetition-penalty-nan", C, b'{"prompt": "hi", "repetition_penalty": NaN}', 400),
    ("logprobs-above-cap", C, cmpl(logprobs=21), 400),
    ("huge-stop-list", C, cmpl(stop=["x"] * 1000), 400),
    ("stop-too-long", C, cmpl(stop="x" * 1000), 400),
    ("stop-empty-string", C, cmpl(stop=[""]), 400),
    ("seed-past-int64", C, cmpl(seed=2**70), 400),
    ("stream-options-type", C, cmpl(stream_options="yes"), 400),
    ("chat-empty-messages", H, chat(messages=[]), 400),
    ("chat-messages-not-list", H, chat(messages="hi"), 400),
    ("chat-missing-messages", H, {"model": MODEL}, 400),
    ("chat-bad-role", H, chat(messages=[{"role": "wizard", "content": "x"}]), 400),
    ("chat-content-type", H, chat(messages=[{"role": "user", "content": 5}]), 400),
    ("chat-top-logprobs-cap", H, chat(logprobs=True, top_logprobs=50), 400),
    ("chat-top-logprobs-alone", H, chat(top_logprobs=2), 400),
    ("chat-past-context", H, chat(max_tokens=100000), 400),
    ("chat-unknown-model", H, chat(model="nope"), 404),
    ("chat-n-huge", H, chat(n=10**9), 400),
    ("tokenize-neither", "/tokenize", {"model": MODEL}, 400),
    ("detokenize-oov", "/detokenize", {"tokens": [1, 10**6]}, 400),
    ("unknown-route", "/v1/nothing", {}, 404),
]


def check_envelope(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"] and 'File "' not in error["message"]
    assert not re.search(r"0x[0-9a-fA-F]{6,}", error["message"]), error["message"]
    return error


@pytest.mark.parametrize(
    ("path", "body", "status"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_gets_4xx_envelope(server, path, body, status):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {**auth_headers(), "Content-Type": "application/json"}
    response = httpx.post(server.url + path, content=content, headers=headers, timeout=30)
    check_envelope(response, status)


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (cmpl(prompt=""), "prompt", "invalid_value"),
        (cmpl(prompt=[[]]), "prompt", "invalid_value"),
        (cmpl(prompt=[1, 100000]), "prompt", "invalid_value"),
        (cmpl(prompt="hello " * 400), "prompt", "context_length_exceeded"),
        (cmpl(stop_token_ids=[100000]), "stop_token_ids", "invalid_value"),
        (cmpl(logit_bias={"999999": 1.0}), "logit_bias", "invalid_value"),
        (cmpl(allowed_token_ids=[999999]), "allowed_token_ids", "invalid_value"),
    ],
)
def test_engine_validation_names_the_param(server, body, param, code):
    response = httpx.post(server.url + C, json=body, headers=auth_headers(), timeout=30)
    error = check_envelope(response, 400)
    assert (error["param"], error["code"]) == (param, code)


def test_an_image_for_a_text_only_model_is_refused(server):
    body = chat(messages=[{"role": "user", "content": IMAGE_PARTS}])
    response = httpx.post(server.url + H, json=body, headers=auth_headers(), timeout=30)
    error = check_envelope(response, 400)
    assert error["param"] == "multi_modal_data" and "text only" in error["message"]


def test_bad_stream_request_fails_before_the_stream(server):
    body = cmpl(stream=True, max_tokens=100000)
    response = httpx.post(server.url + C, json=body, headers=auth_headers())
    assert check_envelope(response, 400)["code"] == "context_length_exceeded"


def test_wrong_method_gets_405_envelope(server):
    check_envelope(httpx.get(server.url + C, headers=auth_headers()), 405)


def raw(url: str, request: bytes) -> int:
    """Sends a hand-written HTTP/1.1 request; returns the status code."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    return int(data.split(b" ", 2)[1])


def post_raw(target: str, host: str = "127.0.0.1", auth: str | None = None) -> bytes:
    body = json.dumps(cmpl()).encode()
    lines = [f"POST {target} HTTP/1.1", f"Host: {host}", "Content-Type: application/json"]
    lines += [f"Authorization: {auth}"] if auth else []
    lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
    return "\r\n".join(lines).encode() + body


AUTH_CASES = [
    ("no-key", post_raw(C), 401),
    ("wrong-key", post_raw(C, auth="Bearer wrong"), 401),
    ("key-without-bearer", post_raw(C, auth=API_KEY), 401),
    ("key-prefix", post_raw(C, auth=f"Bearer {API_KEY[:-1]}"), 401),
    ("double-slash", post_raw("//v1/completions"), 401),
    ("double-slash-with-key", post_raw("//v1/completions", auth=f"Bearer {API_KEY}"), 404),
    ("dot-segments", post_raw("/health/../v1/completions"), 401),
    ("percent-encoded", post_raw("/v1/%63ompletions"), 401),
    ("percent-encoded-with-key", post_raw("/v1/%63ompletions", auth=f"Bearer {API_KEY}"), 200),
    ("host-with-path", post_raw(C, host="127.0.0.1/health"), 401),
    ("foreign-host", post_raw(C, host="internal.example"), 401),
    ("absolute-form", post_raw("http://127.0.0.1/v1/completions"), 401),
    ("health-query-trick", post_raw("/health?/v1/completions"), 405),
    ("good-key", post_raw(C, auth=f"Bearer {API_KEY}"), 200),
]


@pytest.mark.parametrize(
    ("request_bytes", "status"), [c[1:] for c in AUTH_CASES], ids=[c[0] for c in AUTH_CASES]
)
def test_api_key(server, request_bytes, status):
    assert raw(server.url, request_bytes) == status


def test_auth_envelope_and_open_routes(server):
    check_envelope(httpx.get(server.url + "/v1/models"), 401)
    two = httpx.Headers([("Authorization", f"Bearer {API_KEY}"), ("Authorization", "Bearer x")])
    check_envelope(httpx.get(server.url + "/v1/models", headers=two), 401)
    assert httpx.get(server.url + "/v1/models", headers=auth_headers()).status_code == 200
    for path in ("/health", "/metrics", "/version", "/openapi.json"):
        assert httpx.get(server.url + path).status_code == 200, path


def test_healthy_after_the_suite(server):
    out = httpx.post(
        server.url + C, json=cmpl(max_tokens=6, ignore_eos=True), headers=auth_headers()
    )
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 6
    assert httpx.get(server.url + "/health").status_code == 200
    idle = wait_idle(server.url)
    assert idle["vllm:kv_cache_usage_perc"] == 0
    assert idle["jvllm:num_free_blocks"] == server.start["jvllm:num_free_blocks"]
