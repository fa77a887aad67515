"""A vLLM user's launch lines, unchanged: a long `jvllm serve` command line in vLLM's
style over HTTPS, and the `api_server` alias module from a YAML config, both answered
through the official `openai` client; generation_config.json defaults, CORS, the
chat template and role, request and stats logs."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from tests.server import API_KEY, ServerProcess, auth_headers

GOOD_ORIGIN = "https://good.example"
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[bot]"
DEFAULT_MAX_TOKENS = 12  # generation_config.json's max_new_tokens


def _model_with_generation_config(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "generation_config.json").read_text())
    config.update(temperature=0.0, max_new_tokens=DEFAULT_MAX_TOKENS)
    (dst / "generation_config.json").write_text(json.dumps(config))
    return dst


def _self_signed(directory: Path) -> tuple[Path, Path]:
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return key, cert


@pytest.fixture(scope="module")
def env(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-cli")
    model = _model_with_generation_config(checkpoints["llama"], root / "model")
    key, cert = _self_signed(root)
    tls = ssl.create_default_context(cafile=str(cert))
    # The shape of a production `vllm serve` line, the tiny model in place of a Hub name.
    line = [
        "--model", str(model),
        "--served-model-name", "tiny",
        "--host", "127.0.0.1",
        "--api-key", API_KEY,
        "--tensor-parallel-size", "1",
        "--dtype", "float",
        "--seed", "0",
        "--max-model-len", "256",
        "--max-num-seqs", "16",
        "--max-num-batched-tokens", "32",
        "--block-size", "16",
        "--gpu-memory-utilization", "0.9",
        "--no-enable-prefix-caching",
        "--enable-chunked-prefill",
        "--enforce-eager",
        "--trust-remote-code",
        "--load-format", "safetensors",
        "--download-dir", str(root / "unused"),
        "--generation-config", "auto",
        "--max-logprobs", "5",
        "--chat-template", TEMPLATE,
        "--response-role", "bot",
        "--enable-log-requests",
        "--return-tokens-as-token-ids",
        "--allowed-origins", GOOD_ORIGIN,
        "--allow-credentials",
        "--root-path", "/api",
        "--ssl-keyfile", str(key),
        "--ssl-certfile", str(cert),
        "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    yaml_file = root / "config.yaml"
    yaml_file.write_text(
        f"model: {model}\n"
        "served-model-name: [tiny-b]\n"
        "max_model_len: 256\n"
        "max-num-seqs: 4\n"
        "max-num-batched-tokens: 16\n"
        "block-size: 16\n"
        "enable-prefix-caching: false\n"
        "enforce-eager: true\n"
        "generation-config: vllm\n"
        "disable-log-stats: true\n"
        "port: 1\n"  # the command line's --port wins
    )
    https = ServerProcess(line, env={"JVLLM_LOG_STATS_INTERVAL": "0.2"}, verify=tls)
    alias = ServerProcess(
        ["--config", str(yaml_file)], module="jvllm.entrypoints.openai.api_server"
    )
    try:
        https.wait_ready()
        alias.wait_ready()
        client = openai.OpenAI(
            base_url=https.url + "/v1",
            api_key=API_KEY,
            max_retries=0,
            http_client=httpx.Client(verify=tls),
        )
        alias_client = openai.OpenAI(base_url=alias.url + "/v1", api_key="x", max_retries=0)
        yield SimpleNamespace(
            https=https, alias=alias, tls=tls, client=client, alias_client=alias_client
        )
        client.close()
        alias_client.close()
    finally:
        https.stop()
        alias.stop()


def _texts(client: openai.OpenAI, model: str, seeds: range, **kw) -> list[str]:
    return [
        client.completions.create(model=model, prompt="the river", seed=s, max_tokens=8, **kw)
        .choices[0]
        .text
        for s in seeds
    ]


def test_vllm_style_line_answers_over_https(env):
    assert [m.id for m in env.client.models.list().data] == ["tiny"]
    out = env.client.completions.create(model="tiny", prompt="hello world", max_tokens=4)
    assert out.usage.completion_tokens <= 4 and out.choices[0].finish_reason
    # The no-op flags said why they do nothing, once each.
    log = env.https.log()
    for name in ("enforce_eager", "trust_remote_code", "load_format", "enable_chunked_prefill"):
        assert log.count(f"{name}=") == 1 and "has no effect in jvllm" in log


def test_alias_module_from_yaml_config(env):
    assert [m.id for m in env.alias_client.models.list().data] == ["tiny-b"]
    chat = env.alias_client.chat.completions.create(
        model="tiny-b", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.choices[0].message.role == "assistant"
    assert "enforce_eager=True has no effect" in env.alias.log()


def test_generation_config_defaults_apply_unless_the_request_sets_them(env):
    unset = _texts(env.client, "tiny", range(3))
    greedy = _texts(env.client, "tiny", range(1), temperature=0)
    assert unset == greedy * 3  # temperature 0 from generation_config.json
    sampled = _texts(env.client, "tiny", range(4), temperature=1.0)
    assert len(set(sampled)) > 1  # an explicit temperature wins
    kw = dict(model="tiny", prompt="the river", extra_body={"ignore_eos": True})
    assert env.client.completions.create(**kw).usage.completion_tokens == DEFAULT_MAX_TOKENS
    assert env.client.completions.create(**kw, max_tokens=3).usage.completion_tokens == 3


def test_generation_config_vllm_ignores_the_file(env):
    assert len(set(_texts(env.alias_client, "tiny-b", range(4)))) > 1  # temperature 1
    kw = dict(model="tiny-b", prompt="the river", extra_body={"ignore_eos": True})
    assert env.alias_client.completions.create(**kw).usage.completion_tokens == 16


def test_max_logprobs_caps_requests(env):
    ok = env.client.completions.create(model="tiny", prompt="a b", max_tokens=2, logprobs=5)
    assert len(ok.choices[0].logprobs.top_logprobs[0]) >= 5
    assert all(t.startswith("token_id:") for t in ok.choices[0].logprobs.tokens)
    with pytest.raises(openai.BadRequestError, match="max_logprobs=5"):
        env.client.completions.create(model="tiny", prompt="a b", max_tokens=2, logprobs=6)


def test_cors_preflight_only_for_allowed_origins(env):
    def preflight(origin: str) -> httpx.Response:
        headers = {"Origin": origin, "Access-Control-Request-Method": "POST"}
        url = env.https.url + "/v1/chat/completions"
        return httpx.options(url, headers=headers, verify=env.tls)

    allowed = preflight(GOOD_ORIGIN)
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == GOOD_ORIGIN
    assert allowed.headers["access-control-allow-credentials"] == "true"
    other = preflight("https://other.example")
    assert "access-control-allow-origin" not in other.headers


def test_chat_template_and_response_role(env):
    messages = [{"role": "user", "content": "hi there"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 3}
    url, headers = env.https.url, auth_headers()
    chat = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, verify=env.tls)
    assert chat.json()["choices"][0]["message"]["role"] == "bot"
    tokens = httpx.post(url + "/tokenize", json=body, headers=headers, verify=env.tls)
    ids = {"model": "tiny", "tokens": tokens.json()["tokens"]}
    text = httpx.post(url + "/detokenize", json=ids, headers=headers, verify=env.tls)
    assert text.json()["prompt"].endswith("[user] hi there\n[bot]")


def test_root_path_keeps_routes_and_open_paths(env):
    assert httpx.get(env.https.url + "/health", verify=env.tls).status_code == 200
    models = httpx.get(env.https.url + "/v1/models", verify=env.tls)
    assert models.status_code == 401  # still behind the API key


def test_request_and_stats_logs(env):
    env.client.completions.create(model="tiny", prompt="log me", max_tokens=2)
    assert env.https.wait_for_log("Avg generation throughput", timeout=30)
    log = env.https.log()
    assert "Avg generation throughput" in log and "Prefix cache hit rate" in log
    assert "Received request cmpl-" in log and "'log me'" in log
    assert "Received request" not in env.alias.log()
