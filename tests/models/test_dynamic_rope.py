"""Dynamic NTK rope scaling in the Llama-family classes against Transformers.

A tiny Llama checkpoint whose rope is `dynamic` (factor 2) over an original window of
64 positions: each row's logits of a step equal Transformers' forward of its prompt
alone, past the window and within it; greedy tokens (slow) equal Transformers'
`generate` for prompts within the
window, decoding across it, and prompts past it (each prompt prefilled in one step, as
`rotary.step_cos_sin` requires for equality). Transformers' rotary module keeps the
largest length it has seen, so its prompts run in increasing length, each longer than
everything generated before it: every forward then recomputes its frequencies.
"""

from __future__ import annotations

import numpy as np
import pytest

from jvllm import LLM, SamplingParams
from jvllm.testing.checkpoints import make_checkpoint
from tests.helpers import hf_greedy, token_prompts
from tests.models.test_forward import Row, assert_close, hf_logits, make_runner, random_ids

WINDOW = 64
PROMPT_LENGTHS = (30, 58, 90, 110)  # within, decoding across, past and far past the window
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def dynamic_llama(tmp_path_factory, tokenizer_dir):
    return make_checkpoint(
        "llama",
        tmp_path_factory.mktemp("dynamic") / "llama",
        tokenizer_dir,
        rope_scaling=dict(rope_type="dynamic", factor=2.0),
        max_position_embeddings=WINDOW,
    )


def _hf(path):
    """A fresh Transformers model (its dynamic rope keeps state across forwards)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    assert hf.config.rope_parameters["rope_type"] == "dynamic"
    return hf


def test_each_rows_logits_take_its_own_length(dynamic_llama):
    """One step holding an 80-token prompt (past the window: the base grows to its
    length) and a 40-token one (within it: unscaled): every position's logits equal
    Transformers' forward of that prompt alone."""
    long, short = random_ids(80, seed=80), random_ids(40, seed=40)
    runner = make_runner(dynamic_llama)
    ours = runner.forward_logits(
        [Row(long, 0, list(range(1, 8))), Row(short, 0, list(range(8, 12)))], every_token=True
    )
    hf = _hf(dynamic_llama)
    assert_close(ours[0], hf_logits(hf, long))
    assert_close(ours[1], hf_logits(hf, short))  # shorter than the window: reset


@pytest.mark.slow  # an engine and Transformers' generate: about 40 s
def test_dynamic_ntk_greedy_tokens_equal_transformers(dynamic_llama, tokenizer_dir):
    from transformers import AutoTokenizer

    rng = np.random.default_rng(3)
    ps = [[int(t) for t in rng.integers(6, 512, size=n)] for n in PROMPT_LENGTHS]
    eos = AutoTokenizer.from_pretrained(tokenizer_dir).eos_token_id
    hf = _hf(dynamic_llama)
    expected = [hf_greedy(hf, p, NEW_TOKENS, eos) for p in ps]  # increasing lengths
    llm = LLM(str(dynamic_llama), max_num_batched_tokens=128)  # max_model_len 64 x 2
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    # One prompt at a time: each is prefilled in one step.
    outs = [llm.generate(token_prompts([p]), params, use_tqdm=False)[0] for p in ps]
    assert [o.outputs[0].token_ids for o in outs] == expected
    # A test of the test: past the window the scaling changes the tokens.
    plain = make_plain_rope_tokens(dynamic_llama, ps[-1], eos)
    assert plain != expected[-1]


def make_plain_rope_tokens(path, prompt: list[int], eos: int) -> list[int]:
    """Transformers' greedy tokens of the same weights with the rope left unscaled."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    config.max_position_embeddings = 256
    model = AutoModelForCausalLM.from_pretrained(path, config=config, attn_implementation="eager")
    return hf_greedy(model.eval(), prompt, NEW_TOKENS, eos)


def test_dynamic_rope_turns_prefix_caching_off(dynamic_llama):
    """Cached keys carry the rotation of the request that wrote them, which dynamic NTK
    takes from that request's length: a block cannot serve another request."""
    from jvllm.engine_resolution import resolve_prefix_caching
    from jvllm.models.loader import read_config
    from jvllm.models.registry import read_spec

    spec = read_spec(read_config(dynamic_llama))
    assert spec.rope.rope_type == "dynamic"
    assert resolve_prefix_caching(True, spec) is False
    assert resolve_prefix_caching(False, spec) is False
