"""Speculative decoding with an EAGLE-3 head.

Every draft jvllm's head proposes equals the greedy draft a head built from
Transformers' layers proposes for the same sequence recomputed from scratch
(`jvllm.testing.eagle3`: the target's aux layers fused, the draft vocabulary mapped by
`d2t`), under chunked prefill, preemption and a mixed batch; the outputs are those of
plain decoding, and seeded sampling follows the target's distribution (chi-square). The
loader names what does not fit the target.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jvllm import LLM

K = 3
AUX_LAYERS = (0, 1, 2)  # the 2-layer target's embedding, layer 1's input, its output
DRAFT_IDS = (1, 3, 4, 5, 6, 7)  # the draft vocabulary: 6 of the target's 8 tokens
ENGINE = dict(max_model_len=96, max_num_seqs=6, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A vocabulary-8 llama with spread logits and a random EAGLE-3 head for it."""
    from jvllm.testing import make_checkpoint
    from jvllm.testing.checkpoints import write_word_tokenizer
    from jvllm.testing.eagle3 import make_eagle3_head

    root = tmp_path_factory.mktemp("eagle3")
    write_word_tokenizer(root / "tok", 8)
    target = make_checkpoint("llama", root / "target", root / "tok", initializer_range=0.5)
    head = make_eagle3_head(target, root / "head", DRAFT_IDS, AUX_LAYERS, seed=5)
    return str(target), str(head)


def test_eagle3_drafts_match_a_transformers_head(tiny):
    from transformers import AutoModelForCausalLM

    from jvllm.testing.eagle3 import load_head, reference_drafts
    from tests.e2e.test_eagle import seeded_draws_alone_as_batched, speculated_like_plain
    from tests.e2e.test_spec_decode import sampling_follows_target

    target, head = tiny
    # Budget 16 chunks the longer prompts; 9 blocks of 16 force preemptions.
    engine = {**ENGINE, "num_gpu_blocks_override": 9}
    config = {"method": "eagle3", "model": head, "num_speculative_tokens": K}
    llm, seen = speculated_like_plain(target, engine, config)

    hf = AutoModelForCausalLM.from_pretrained(target).eval()
    reference, target_ids = load_head(head)
    assert target_ids == list(DRAFT_IDS)
    assert len(seen) > 60
    for sequence, drafts in seen:
        assert all(d in DRAFT_IDS for d in drafts)
        want_drafts = reference_drafts(hf, reference, target_ids, AUX_LAYERS, sequence, len(drafts))
        assert want_drafts == drafts, sequence

    seeded_draws_alone_as_batched(llm)
    # The head's q covers 6 of the 8 tokens: the residual draws the other two.
    sampling_follows_target(llm, hf, 8, n=800)


def test_eagle3_speculators_names_and_own_embedding(tiny, tmp_path):
    """The `layers.0.*` spelling of the layer reads the same weights as `midlayer.*`, and
    a head's own `embed_tokens` embeds its draft tokens instead of the target's."""
    import jax
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    from jvllm.models.eagle3 import load_eagle3_head
    from jvllm.models.loader import load_model
    from jvllm.runner.drafter import Eagle3Drafter

    target, head = tiny
    state = load_file(str(Path(head) / "model.safetensors"))
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in state.items()}
    torch.manual_seed(7)
    embedding = torch.randn(8, renamed["fc.weight"].shape[0])
    save_file({**renamed, "embed_tokens.weight": embedding}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((Path(head) / "config.json").read_text())
    loaded = load_model(target)
    canonical = load_eagle3_head(head, loaded)
    variant = load_eagle3_head(tmp_path, loaded)
    assert not canonical.module.own_embedding and variant.module.own_embedding
    jax.tree.map(
        np.testing.assert_array_equal, variant.params["layers_0"], canonical.params["midlayer"]
    )
    np.testing.assert_array_equal(variant.params["draft_ids"], np.array(DRAFT_IDS))
    ids = jax.numpy.array([0, 3, 7])
    drafter = Eagle3Drafter(variant, loaded, K, 16)
    got = drafter._embeds(variant.params, loaded.params, ids)
    np.testing.assert_allclose(np.asarray(got), embedding.numpy()[[0, 3, 7]])
    own = Eagle3Drafter(canonical, loaded, K, 16)._embeds(canonical.params, loaded.params, ids)
    np.testing.assert_array_equal(own, loaded.params["model"]["embed_tokens"]["embedding"][ids])


def test_an_eagle3_head_must_fit_the_target(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    target, head = tiny
    config = json.loads((Path(head) / "config.json").read_text())
    no_layers = {k: v for k, v in config.items() if k != "eagle_aux_hidden_state_layer_ids"}
    cases = {
        "wide": ({**config, "hidden_size": config["hidden_size"] * 2}, "hidden_size="),
        "vocab": ({**config, "vocab_size": 16}, "vocab_size=16"),
        # vLLM's default layers (2, 1, -1) do not fit a 2-layer target.
        "layers": (no_layers, r"layers \[-1, 1, 2\].*eagle_aux_hidden_state_layer_ids"),
        "fc_norm": ({**config, "norm_before_fc": True}, "norm_before_fc"),
        "eagle1": ({**config, "architectures": ["LlamaForCausalLM"]}, "not an EAGLE-3"),
        "no_d2t": (config, "draft_vocab_size=6 .* no 'd2t'"),
    }
    state = load_file(str(Path(head) / "model.safetensors"))
    for name, (bad, message) in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(bad))
        kept = {k: v for k, v in state.items() if name != "no_d2t" or k != "d2t"}
        save_file(kept, str(tmp_path / name / "model.safetensors"))
        with pytest.raises(ValueError, match=message):
            LLM(
                target,
                speculative_config={
                    "method": "eagle3",
                    "model": str(tmp_path / name),
                    "num_speculative_tokens": 2,
                },
                max_model_len=64,
            )
