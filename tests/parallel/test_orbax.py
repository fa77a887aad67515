"""`jvllm convert` to an orbax checkpoint and back: identical outputs, any TP size."""

from __future__ import annotations

import numpy as np
import pytest

from jvllm import LLM, SamplingParams
from jvllm.convert import convert
from jvllm.models.loader import load_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)


def run(path, tp: int) -> list[list[int]]:
    rng = np.random.default_rng(4)
    prompts = [
        {"prompt_token_ids": [int(t) for t in rng.integers(6, 500, size=n)]} for n in (9, 60)
    ]
    llm = LLM(str(path), tensor_parallel_size=tp, **ENGINE)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def converted(checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("orbax") / "llama"
    convert(str(checkpoints["llama"]), str(out), tensor_parallel_size=2)
    return out


@pytest.mark.parametrize("tp", [1, 4])
def test_round_trip_same_outputs(checkpoints, converted, tp):
    assert run(converted, tp) == run(checkpoints["llama"], 1)


def test_round_trip_same_params(checkpoints, converted):
    a, b = load_model(checkpoints["llama"]), load_model(converted)
    wa = a.params["model"]["layers_1"]["self_attn"]["k_proj"]["weight"]
    wb = b.params["model"]["layers_1"]["self_attn"]["k_proj"]["weight"]
    np.testing.assert_array_equal(np.asarray(wa), np.asarray(wb))


def test_convert_refuses_non_empty_output(checkpoints, tmp_path):
    (tmp_path / "x").write_text("keep me")
    with pytest.raises(ValueError, match="not empty"):
        convert(str(checkpoints["llama"]), str(tmp_path))


def test_cli_convert(checkpoints, tmp_path):
    from jvllm.cli import main

    out = tmp_path / "conv"
    assert main(["convert", str(checkpoints["qwen2"]), str(out), "--dtype", "bfloat16"]) == 0
    assert load_model(out).dtype == "bfloat16"
    assert main(["convert", str(checkpoints["qwen2"]), str(out)]) == 2  # not empty
