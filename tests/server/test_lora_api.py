"""LoRA adapters over the OpenAI API, through the official `openai` client against a
real `jvllm serve --enable-lora` process: `--lora-modules` in both spellings,
`/v1/models` with each adapter's parent, completions and chat choosing an adapter by
`model` (greedy tokens equal to PEFT's `merge_and_unload()` model), loading and
unloading at run time, and every bad adapter a 400 while the server goes on serving."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import httpx
import openai
import pytest

from jvllm.testing.lora_adapters import make_peft_adapter, merged_reference
from tests.helpers import hf_greedy
from tests.server import API_KEY, SMALL_ENGINE, ServerProcess, auth_headers

MODEL = "tiny-llama"
PROMPT_IDS = [11, 57, 203, 98, 4, 77, 310, 45, 19]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(checkpoints, tmp_path_factory):
    base, root = checkpoints["llama"], tmp_path_factory.mktemp("served-adapters")
    return SimpleNamespace(
        a1=make_peft_adapter(base, root / "a1", rank=4, seed=11),
        a2=make_peft_adapter(base, root / "a2", rank=8, seed=12),
        late=make_peft_adapter(base, root / "late", rank=8, seed=13),
        too_wide=make_peft_adapter(base, root / "wide", rank=16, seed=14),
        lm_head=make_peft_adapter(base, root / "head", 2, 15, ("q_proj", "lm_head")),
    )


@pytest.fixture(scope="module")
def env(checkpoints, adapters):
    a2 = json.dumps({"name": "a2", "path": str(adapters.a2), "base_model_name": MODEL})
    server = ServerProcess(
        [
            str(checkpoints["llama"]),
            "--api-key", API_KEY,
            "--served-model-name", MODEL,
            *SMALL_ENGINE,
            "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
            "--lora-modules", f"a1={adapters.a1}", a2, "--return-tokens-as-token-ids",
        ],
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"},
    )  # fmt: skip
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
        yield SimpleNamespace(url=server.url, client=client)
    finally:
        server.stop()


def reference(checkpoints, hf_models, tokenizer_dir, adapter) -> list[int]:
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tokenizer_dir).eos_token_id
    model = hf_models["llama"]
    if adapter is not None:
        model = merged_reference(checkpoints["llama"], adapter)
    return hf_greedy(model, PROMPT_IDS, NEW_TOKENS, eos)


def completion_tokens(env, model: str) -> list[int]:
    out = env.client.completions.create(
        model=model, prompt=PROMPT_IDS, max_tokens=NEW_TOKENS, temperature=0, logprobs=0
    )
    tokens = out.choices[0].logprobs.tokens
    assert out.model == model
    return [int(t.removeprefix("token_id:")) for t in tokens]


def post(env, path: str, body: dict) -> httpx.Response:
    return httpx.post(env.url + path, json=body, headers=auth_headers(), timeout=60)


def test_models_list_names_each_adapter_and_its_parent(env, adapters):
    cards = {m.id: m for m in env.client.models.list().data}
    assert set(cards) == {MODEL, "a1", "a2"}
    assert cards["a1"].parent == MODEL and cards["a2"].parent == MODEL
    assert cards["a1"].root == str(adapters.a1) and getattr(cards[MODEL], "parent", None) is None


def test_requests_choose_their_adapter_by_model(
    env, adapters, checkpoints, hf_models, tokenizer_dir
):
    for model, path in ((MODEL, None), ("a1", adapters.a1), ("a2", adapters.a2)):
        want = reference(checkpoints, hf_models, tokenizer_dir, path)
        assert completion_tokens(env, model) == want, model
    chat = env.client.chat.completions.create(
        model="a1", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert chat.model == "a1" and chat.choices[0].message.content is not None


def test_load_use_and_unload_at_run_time(env, adapters, checkpoints, hf_models, tokenizer_dir):
    body = {"lora_name": "late", "lora_path": str(adapters.late)}
    loaded = post(env, "/v1/load_lora_adapter", body)
    assert loaded.status_code == 200, loaded.text
    assert "late" in {m.id for m in env.client.models.list().data}
    want = reference(checkpoints, hf_models, tokenizer_dir, adapters.late)
    assert completion_tokens(env, "late") == want
    again = post(env, "/v1/load_lora_adapter", body)
    assert again.status_code == 400 and "already been loaded" in again.text
    assert post(env, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    with pytest.raises(openai.NotFoundError, match="late"):
        completion_tokens(env, "late")


@pytest.mark.parametrize(
    "case, message",
    [
        ("too_wide", "LoRA rank 16 .* greater than max_lora_rank 8"),
        ("lm_head", r"expected target modules in .*lm_head"),
        ("missing", "does not exist"),
        ("corrupt", "cannot be read as safetensors"),
    ],
)
def test_bad_adapters_are_400s_and_the_server_goes_on(env, adapters, tmp_path, case, message):
    if case == "missing":
        path = tmp_path / "nowhere"
    elif case == "corrupt":
        path = tmp_path
        (path / "adapter_config.json").write_text((adapters.a1 / "adapter_config.json").read_text())
        (path / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    else:
        path = getattr(adapters, case)
    response = post(env, "/v1/load_lora_adapter", {"lora_name": case, "lora_path": str(path)})
    assert response.status_code == 400
    assert re.search(message, response.json()["error"]["message"])
    assert case not in {m.id for m in env.client.models.list().data}
    assert len(completion_tokens(env, "a1")) == NEW_TOKENS


def test_unloading_an_unknown_adapter_is_a_400(env):
    response = post(env, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert response.status_code == 400 and "cannot be found" in response.text
