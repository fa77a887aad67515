"""Speculative decoding with DeepSeek-V3's MTP layer (method "deepseek_mtp").

Every draft jvllm's MTP layer proposes (one layer reused for k drafts) equals the greedy
draft of the same layer rebuilt from Transformers' own DeepseekV3 modules on
Transformers' hidden states (`jvllm.testing.mtp`), recomputed from scratch, under
chunked prefill, preemption and a mixed batch; the outputs are those of plain decoding,
and seeded sampling follows the target's distribution (chi-square).
"""

from __future__ import annotations

import dataclasses

import pytest

from jvllm.config import SpeculativeConfig

K = 3
ENGINE = dict(max_model_len=96, max_num_seqs=6, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    """A vocabulary-8 DeepSeek-V3 with spread logits and an MTP layer."""
    from jvllm.testing.checkpoints import write_word_tokenizer
    from jvllm.testing.mtp import make_mtp_checkpoint

    root = tmp_path_factory.mktemp("mtp")
    write_word_tokenizer(root / "tok", 8)
    return str(make_mtp_checkpoint(root / "target", root / "tok", seed=3, initializer_range=0.5))


def test_mtp_drafts_match_transformers_and_outputs_match_plain_decoding(target):
    from jvllm.testing.mtp import load_reference, reference_drafts
    from tests.e2e.test_eagle import seeded_draws_alone_as_batched, speculated_like_plain
    from tests.e2e.test_spec_decode import sampling_follows_target

    # Budget 16 chunks the longer prompts; 9 blocks of 16 force preemptions.
    engine = {**ENGINE, "num_gpu_blocks_override": 9}
    config = {"method": "mtp", "num_speculative_tokens": K}
    llm, seen = speculated_like_plain(target, engine, config)
    assert llm.llm_engine.config.speculative_config.method == "deepseek_mtp"

    hf, parts = load_reference(target)
    assert len(seen) > 60
    for sequence, drafts in seen[::4]:
        assert reference_drafts(hf, parts, sequence, len(drafts)) == drafts, sequence

    seeded_draws_alone_as_batched(llm)
    sampling_follows_target(llm, hf, 8, n=800)


def test_mtp_method_names_and_refusals(target):
    from jvllm.models.deepseek_mtp import load_mtp_layer
    from jvllm.models.loader import load_model

    assert SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 2}).method == (
        "deepseek_mtp"
    )
    loaded = load_model(target)
    layer = load_mtp_layer(target, loaded)
    assert layer.module.own_head and not layer.module.own_embedding
    assert layer.spec.num_layers == 1 and layer.spec.moe.sparse_layers == (0,)
    none = dataclasses.replace(
        loaded, hf_config={**loaded.hf_config, "num_nextn_predict_layers": 0}
    )
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0"):
        load_mtp_layer(target, none)
    v2 = dataclasses.replace(loaded, hf_config={**loaded.hf_config, "architectures": ["X"]})
    with pytest.raises(ValueError, match="DeepSeek-V3 or GLM-4.5 target"):
        load_mtp_layer(target, v2)
