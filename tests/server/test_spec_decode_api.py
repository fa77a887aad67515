"""`jvllm serve --speculative-config`: the official `openai` client gets the texts of
`LLM.generate` without speculation, streamed and not; /metrics and the stats log count
the drafts; a malformed config is a start-up error naming the problem."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from jvllm import LLM, SamplingParams
from jvllm.cli import parse_serve_args
from tests.server import API_KEY, SMALL_ENGINE, ServerProcess, metrics

MODEL = "tiny-llama"
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}
PROMPTS = ["the quick brown fox", "rivers run to the sea and the sea", "a b c a b c a b", "once"]


def test_served_speculation_gives_plain_decoding_texts(checkpoints):
    path = str(checkpoints["llama"])
    args = [path, "--api-key", API_KEY, "--served-model-name", MODEL, *SMALL_ENGINE]
    server = ServerProcess(
        [*args, "--speculative-config", json.dumps(NGRAM)], env={"JVLLM_LOG_STATS_INTERVAL": "1"}
    )
    try:
        llm = LLM(path, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64)
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        want = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
        body = dict(model=MODEL, max_tokens=40, temperature=0.0, extra_body={"ignore_eos": True})
        full = client.completions.create(prompt=PROMPTS, **body)
        assert [c.text for c in sorted(full.choices, key=lambda c: c.index)] == want
        for prompt, text in zip(PROMPTS, want, strict=True):
            stream = client.completions.create(prompt=prompt, stream=True, **body)
            assert "".join(chunk.choices[0].text for chunk in stream) == text
        m = metrics(server.url)
        assert m["vllm:spec_decode_num_accepted_tokens"] > 0
        assert m["vllm:spec_decode_num_draft_tokens"] >= m["vllm:spec_decode_num_drafts"] > 0
        text = httpx.get(server.url + "/metrics").text
        assert "vllm:spec_decode_num_accepted_tokens_per_pos_total{" in text
        assert 'engine="0",model_name="tiny-llama",position="0"} ' in text
        assert server.wait_for_log("SpecDecoding metrics: Mean acceptance length", 10)
    finally:
        server.stop()


@pytest.mark.parametrize("value", ["{not json", "[1, 2]"])
def test_malformed_speculative_config_flag_is_refused(value, capsys):
    with pytest.raises(SystemExit):
        parse_serve_args(["m", "--speculative-config", value])
    assert "--speculative-config" in capsys.readouterr().err
