"""Speculative decoding with Medusa heads (vLLM's `method: "medusa"`).

Every draft jvllm proposes equals the heads' argmax computed in torch from Transformers'
final hidden state for the same sequence (`jvllm.testing.medusa`), under chunked prefill,
preemption and a mixed batch; greedy outputs are those of plain decoding; FasterDecoding's
tensor names load the same heads; the loader names what does not fit the target.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jvllm import LLM
from tests.e2e.test_eagle import seeded_draws_alone_as_batched, speculated_like_plain
from tests.e2e.test_spec_decode import sampling_follows_target

K = 3
ENGINE = dict(
    max_model_len=96, max_num_seqs=6, max_num_batched_tokens=16, num_gpu_blocks_override=9
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A vocabulary-8 llama with spread logits and random two-layer heads for it (in
    both tensor layouts, the same values)."""
    from jvllm.testing import make_checkpoint
    from jvllm.testing.checkpoints import write_word_tokenizer
    from jvllm.testing.medusa import make_medusa_heads

    root = tmp_path_factory.mktemp("medusa")
    write_word_tokenizer(root / "tok", 8)
    target = make_checkpoint("llama", root / "target", root / "tok", initializer_range=0.5)
    heads = make_medusa_heads(target, root / "heads", num_heads=4, num_layers=2, seed=5)
    faster = make_medusa_heads(
        target, root / "faster", num_heads=4, num_layers=2, seed=5, layout="faster"
    )
    return str(target), str(heads), str(faster)


@pytest.mark.slow
def test_medusa_drafts_match_torch_heads_and_outputs_equal_plain_decoding(tiny):
    from transformers import AutoModelForCausalLM

    from jvllm.models.medusa import load_medusa_heads
    from jvllm.testing.medusa import load_heads, reference_drafts

    target, heads, faster = tiny
    config = {"method": "medusa", "model": heads, "num_speculative_tokens": K}
    llm, seen = speculated_like_plain(target, ENGINE, config)

    hf = AutoModelForCausalLM.from_pretrained(target).eval()
    reference = load_heads(heads)
    assert len(seen) > 40
    for sequence, drafts in seen:
        assert reference_drafts(hf, reference, sequence, len(drafts)) == drafts, sequence

    seeded_draws_alone_as_batched(llm)
    # One-hot q (the heads' argmax): sampled outputs still follow the target's.
    sampling_follows_target(llm, hf, 8)

    # FasterDecoding's names hold the same heads.
    runner = llm.llm_engine.runner
    old = load_medusa_heads(faster, runner.model, K)
    for name, value in runner.drafter.model.params.items():
        np.testing.assert_array_equal(np.asarray(old.params[name]), np.asarray(value))


def test_medusa_heads_must_fit_the_target(tiny, tmp_path):
    target, heads, _ = tiny
    config = json.loads((Path(heads) / "config.json").read_text())
    cases = {
        "wide": ({**config, "hidden_size": config["hidden_size"] * 2}, "hidden_size="),
        "truncated": ({**config, "truncated_vocab_size": 4}, "truncated_vocab_size=4"),
        "arch": ({**config, "architectures": ["LlamaForCausalLM"]}, "not a Medusa model"),
        "few": ({**config, "num_heads": 2}, "exceeds the checkpoint's 2 Medusa heads"),
    }
    for name, (bad, message) in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(bad))
        for f in Path(heads).glob("*.safetensors"):
            (tmp_path / name / f.name).symlink_to(f)
        with pytest.raises(ValueError, match=message):
            LLM(
                target,
                speculative_config={
                    "method": "medusa",
                    "model": str(tmp_path / name),
                    "num_speculative_tokens": K,
                },
                max_model_len=64,
            )
