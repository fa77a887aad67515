"""The shipped demo model against Transformers, and where real text matters: greedy
tokens and perplexity equal HF's; top-p and min-p keep exactly HF's nucleus; stop
strings cut real words; multi-byte text detokenizes incrementally; answers are English.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from jvllm import LLM, SamplingParams
from jvllm.demo import DEMO_MODEL_DIR, corpus_words, training_report
from jvllm.engine.detokenizer import IncrementalDetokenizer

# Written for these tests, so the model never saw them.
HELD_OUT = [
    "A good friend is someone who listens to your troubles and then tells you a joke.",
    "The computer said it could not find the file, so I looked under the desk.",
    "Never trust a cat that has learned to open the refrigerator.",
    "If you want to be happy for a day, go fishing; for a lifetime, learn to cook.",
]
PROMPTS = ["The meaning of life is", "Q: Why did the chicken cross the road?\nA:", "Love is"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def hf():
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()


def hf_next_probs(hf, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -1].double()
    return torch.softmax(logits, -1).numpy()


def test_greedy_tokens_equal_hf(llm, hf):
    import torch

    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tok.encode(prompt)
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=24,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )[0, len(ids) :].tolist()
        got = list(out.outputs[0].token_ids)
        assert got == ref[: len(got)], prompt
        assert len(got) == len(ref)


def test_held_out_perplexity_equals_hf(llm, hf):
    import torch

    tok = llm.get_tokenizer()
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outs = llm.generate(HELD_OUT, params, use_tqdm=False)
    ours, theirs, count = 0.0, 0.0, 0
    for text, out in zip(HELD_OUT, outs, strict=True):
        ids = tok.encode(text)
        assert list(out.prompt_token_ids) == ids
        ours += sum(pos[t].logprob for pos, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True))
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
        theirs += float(logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum())
        count += len(ids) - 1
    ppl, ref = math.exp(-ours / count), math.exp(-theirs / count)
    assert abs(ppl - ref) / ref < 1e-3
    # Held-out English is far better than chance for a model that learned the language.
    assert ref < len(tok) / 10


@pytest.mark.parametrize("knob", ["top_p", "min_p"])
def test_truncation_keeps_hf_nucleus(llm, hf, knob):
    prompt = "Q: What is the best thing about computers?\nA:"
    ids = llm.get_tokenizer().encode(prompt)
    probs = hf_next_probs(hf, ids)
    order = np.argsort(-probs)
    if knob == "top_p":
        value = 0.6
        # Smallest prefix of the sorted distribution whose mass reaches top_p.
        keep = set(order[: int(np.searchsorted(np.cumsum(probs[order]), value)) + 1].tolist())
    else:
        value = 0.1
        keep = set(np.flatnonzero(probs >= value * probs.max()).tolist())
    assert 1 < len(keep) < 50  # a real model: the knob truncates, but not to one token
    params = [
        SamplingParams(temperature=1.0, max_tokens=1, seed=s, **{knob: value}) for s in range(96)
    ]
    sampled = {o.outputs[0].token_ids[0] for o in llm.generate([ids] * 96, params, use_tqdm=False)}
    assert sampled <= keep
    assert len(sampled) > 1


def test_stop_string_cuts_a_real_word(llm):
    prompt = "The meaning of life is"
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    text = base[0].outputs[0].text
    words = re.findall(r"[A-Za-z]{3,}", text)
    assert len(words) >= 2, text
    stop = " " + words[1]
    out = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=40, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]


def test_multibyte_text_detokenizes_incrementally(llm):
    tok = llm.get_tokenizer()
    text = "Café au lait — naïve Zoë said “hello” 你好 🙂 ok."
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tok, [tok.bos_token_id], True, [], False)
    for i in ids:
        detok.append(i)
        assert "\ufffd" not in detok.output_text
        assert text.startswith(detok.output_text)
    assert detok.output_text == tok.decode(ids) == text


def test_chat_answers_in_corpus_words(llm):
    out = llm.chat(
        [{"role": "user", "content": "Hello! Who are you?"}],
        SamplingParams(temperature=0, max_tokens=40),
        use_tqdm=False,
    )[0]
    words = re.findall(r"[a-z]+(?:'[a-z]+)?", out.outputs[0].text.lower())
    assert len(words) >= 5, out.outputs[0].text
    known = sum(w in corpus_words() for w in words)
    assert known >= 0.8 * len(words), out.outputs[0].text


def test_training_report_matches_checkpoint():
    import json

    report = training_report()
    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d, n = config["head_dim"], config["num_hidden_layers"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    per_layer = h * (2 * q + 2 * kv) + 3 * h * i + 2 * h
    assert report["parameters"] == v * h + h + n * per_layer
    assert report["held_out_perplexity"] == pytest.approx(math.exp(report["held_out_loss"]), 1e-3)
    assert (DEMO_MODEL_DIR / "model.safetensors").stat().st_size < 20 * 2**20


def test_the_shipped_eagle_head_drafts_as_transformers_and_is_often_right(llm, hf):
    """The demo's EAGLE-1 head (trained for it): greedy outputs equal plain decoding, most
    drafts are kept, and each proposal equals a Transformers-built head's."""
    from jvllm.demo import demo_eagle_path
    from jvllm.testing.eagle import load_head, reference_drafts
    from tests.e2e.test_eagle import _record_drafts

    config = {"method": "eagle", "model": str(demo_eagle_path()), "num_speculative_tokens": 3}
    # One token bucket: quick to warm up.
    spec = LLM(
        speculative_config=config, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=32
    )
    seen = _record_drafts(spec)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy, use_tqdm=False)] == want
    m = spec.get_metrics()
    assert m["spec_decode_num_accepted_tokens"] > 0.5 * m["spec_decode_num_draft_tokens"]
    head = load_head(demo_eagle_path())
    for sequence, drafts in seen[::4]:
        assert reference_drafts(hf, head, sequence, len(drafts)) == drafts


def test_the_shipped_medusa_heads_draft_as_torch_and_are_often_right(llm, hf):
    """The demo's Medusa heads, chosen by naming the method without a model: greedy
    outputs equal plain decoding, over a quarter of the first head's drafts are kept, and
    each proposal equals the heads' argmax computed in torch on Transformers' features."""
    from jvllm.demo import demo_medusa_path
    from jvllm.testing.medusa import load_heads, reference_drafts
    from tests.e2e.test_eagle import _record_drafts

    config = {"method": "medusa", "num_speculative_tokens": 1}
    spec = LLM(
        speculative_config=config, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=32
    )
    assert spec.llm_engine.config.speculative_config.model == str(demo_medusa_path())
    seen = _record_drafts(spec)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy, use_tqdm=False)] == want
    m = spec.get_metrics()
    assert m["spec_decode_num_accepted_tokens"] > 0.25 * m["spec_decode_num_draft_tokens"]
    heads = load_heads(demo_medusa_path())
    for sequence, drafts in seen[::4]:
        assert reference_drafts(hf, heads, sequence, len(drafts)) == drafts


def test_the_shipped_eagle3_head_drafts_as_transformers_and_is_often_right(llm, hf):
    """The demo's EAGLE-3 head, chosen by naming the method without a model: greedy
    outputs equal plain decoding, over a quarter of its drafts are kept, and each proposal
    equals a head built from Transformers' layers on Transformers' aux hidden states."""
    from jvllm.demo import demo_eagle3_path
    from jvllm.testing.eagle3 import load_head, reference_drafts
    from tests.e2e.test_eagle import _record_drafts

    config = {"method": "eagle3", "num_speculative_tokens": 3}
    spec = LLM(
        speculative_config=config, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=32
    )
    assert spec.llm_engine.config.speculative_config.model == str(demo_eagle3_path())
    seen = _record_drafts(spec)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy, use_tqdm=False)] == want
    m = spec.get_metrics()
    assert m["spec_decode_num_accepted_tokens"] > 0.25 * m["spec_decode_num_draft_tokens"]
    head, target_ids = load_head(demo_eagle3_path())
    layers = spec.llm_engine.runner.drafter.aux_layers
    assert list(layers) == [1, 2, 3]
    for sequence, drafts in seen[::4]:
        assert reference_drafts(hf, head, target_ids, layers, sequence, len(drafts)) == drafts
    # Small beside the target: under half its bytes.
    size = (demo_eagle3_path() / "model.safetensors").stat().st_size
    assert size < 0.5 * (DEMO_MODEL_DIR / "model.safetensors").stat().st_size
