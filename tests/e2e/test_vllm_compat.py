"""vLLM's spellings outside a server: `jvllm serve` parsing (groups, `--no-` forms,
`--model`, `--config`), refusals that exit before any engine starts, and `LLM(...)`
with vLLM's keywords and `get_default_sampling_params()`."""

from __future__ import annotations

import json
import shutil

import pytest

from jvllm import LLM, SamplingParams
from jvllm.cli import build_serve_parser, main, parse_serve_args
from jvllm.generation_config import RequestDefaults
from jvllm.sampling_params import RequestOutputKind
from jvllm.server.protocol import ChatCompletionRequest, CompletionRequest
from jvllm.server.serving import sampling_params
from jvllm.yaml_args import config_file_argv


def test_help_groups_flags_as_vllm_does():
    text = build_serve_parser().format_help()
    titles = ["Frontend:", "ModelConfig:", "CacheConfig:", "SchedulerConfig:", "ParallelConfig:"]
    positions = [text.index(t) for t in titles]
    assert positions == sorted(positions)
    model_section = text[text.index("ModelConfig:") : text.index("LoadConfig:")]
    assert "--model MODEL" in model_section and "--trust-remote-code" in model_section
    assert "--max-num-seqs" in text[text.index("SchedulerConfig:") :]


def test_boolean_flags_have_no_forms_and_model_has_both_spellings():
    args = parse_serve_args(["--model", "m", "--no-enable-prefix-caching", "--no-enforce-eager"])
    assert args.model_option == "m" and args.model is None
    assert args.enable_prefix_caching is False and args.enforce_eager is False
    args = parse_serve_args(["m", "--allowed-origins", '["https://a", "https://b"]', "-tp", "1"])
    assert args.model == "m" and args.allowed_origins == [["https://a", "https://b"]]
    assert args.tensor_parallel_size == 1


def test_config_file_flags_under_the_command_line(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text(
        "model: /models/m\nport: 9000\nmax_num_seqs: 8\nenable-prefix-caching: false\n"
        "served-model-name: [a, b]\ncompilation-config: {level: 3}\n"
    )
    assert config_file_argv(str(path)) == [
        "--model", "/models/m", "--port", "9000", "--max-num-seqs", "8",
        "--no-enable-prefix-caching", "--served-model-name", "a", "b",
        "--compilation-config", '{"level": 3}',
    ]  # fmt: skip
    args = parse_serve_args(["--config", str(path), "--port", "9001"])
    assert args.port == 9001 and args.max_num_seqs == 8 and args.model_option == "/models/m"
    assert args.served_model_name == ["a", "b"] and args.enable_prefix_caching is False


def test_bad_config_file_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("- not\n- a mapping\n")
    assert main(["serve", "--config", str(path)]) == 2
    assert "expected a mapping of flag names" in capsys.readouterr().err
    assert main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2


def test_refused_values_exit_before_the_engine(checkpoints, tmp_path, capsys):
    model = str(checkpoints["llama"])
    assert main(["serve", model, "--load-format", "pt"]) == 2
    assert "load_format='pt' is not supported" in capsys.readouterr().err
    foreign = tmp_path / "foreign"
    shutil.copytree(model, foreign)
    config = json.loads((foreign / "config.json").read_text())
    (foreign / "config.json").write_text(json.dumps({**config, "architectures": ["FooForLM"]}))
    assert main(["serve", str(foreign), "--trust-remote-code"]) == 2
    assert "cannot run a checkpoint's own Python" in capsys.readouterr().err
    assert main(["serve", model, "--generation-config", str(tmp_path)]) == 2
    assert "generation_config.json" in capsys.readouterr().err


def test_chat_template_is_a_file_or_the_template(tmp_path):
    from jvllm.server.chat_template import load_chat_template

    inline = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(inline)
    assert load_chat_template(inline) == inline == load_chat_template(str(tmp_path / "t.jinja"))
    assert load_chat_template(None) is None
    with pytest.raises(FileNotFoundError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_request_defaults_from_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 50, "max_new_tokens": 7})
    )
    auto = RequestDefaults.load("auto", str(tmp_path), 20)
    # top_k 50 is Transformers' default, so (as in vLLM) it sets nothing.
    assert auto.sampling == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 7}
    assert RequestDefaults.load("vllm", str(tmp_path), 20).sampling == {}
    assert RequestDefaults.load(str(tmp_path), "elsewhere", 20).sampling == auto.sampling
    with pytest.raises(ValueError, match="max_logprobs"):
        RequestDefaults({}, max_logprobs=21)


@pytest.mark.parametrize("stream", [False, True])
def test_server_asks_full_responses_for_their_final_output_only(stream):
    # As vLLM's server: a streamed response needs every step's output, a full one the last.
    want = RequestOutputKind.CUMULATIVE if stream else RequestOutputKind.FINAL_ONLY
    messages = [{"role": "user", "content": "hi"}]
    for req in (
        CompletionRequest(model="m", prompt="the river", stream=stream),
        ChatCompletionRequest(model="m", messages=messages, stream=stream),
    ):
        assert sampling_params(req, 8, RequestDefaults()).output_kind is want


def test_llm_takes_vllm_keywords(checkpoints, tmp_path, caplog):
    model = tmp_path / "model"
    shutil.copytree(checkpoints["llama"], model)
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.0}))
    with pytest.raises(ValueError, match="load_format='pt'"):
        LLM(str(model), load_format="pt")
    caplog.set_level("INFO", logger="jvllm")
    llm = LLM(
        str(model),
        tokenizer=str(model),
        trust_remote_code=True,
        enforce_eager=True,
        load_format="safetensors",
        download_dir=str(tmp_path / "unused"),
        enable_chunked_prefill=True,
        disable_log_stats=True,
        generation_config="auto",
        dtype="float",
        max_logprobs=3,
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=16,  # one token bucket: one warm-up compile
    )
    assert "enforce_eager=True has no effect in jvllm" in caplog.text
    defaults = llm.get_default_sampling_params()
    assert defaults.temperature == 0.0 and defaults.max_tokens == SamplingParams().max_tokens
    unset = llm.generate(["the river"] * 2, use_tqdm=False)
    assert unset[0].outputs[0].token_ids == unset[1].outputs[0].token_ids
    with pytest.raises(ValueError, match="max_logprobs=3"):
        llm.generate("the river", SamplingParams(logprobs=4), use_tqdm=False)
