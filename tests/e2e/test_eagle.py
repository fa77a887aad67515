"""Speculative decoding with an EAGLE-1 head.

Every draft jvllm's head proposes equals the draft a Transformers-built head proposes
for the same sequence recomputed from scratch (`jvllm.testing.eagle`), under chunked
prefill, preemption and a mixed batch; the outputs are those of plain decoding. The
head's loader names what does not fit the target.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from jvllm import LLM, SamplingParams
from jvllm.config import SpeculativeConfig

K = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A vocabulary-8 llama with spread logits and a random head for it: drafts are
    often right, so both outcomes of verification are exercised."""
    from jvllm.testing import make_checkpoint
    from jvllm.testing.checkpoints import write_word_tokenizer
    from jvllm.testing.eagle import make_eagle_head

    root = tmp_path_factory.mktemp("eagle")
    write_word_tokenizer(root / "tok", 8)
    target = make_checkpoint("llama", root / "target", root / "tok", initializer_range=0.5)
    head = make_eagle_head(target, root / "head", seed=3, init_std=0.5)
    return str(target), str(head)


def _record_drafts(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """(sequence, drafts proposed after it) for every proposal the engine makes that a
    later step took up. A device proposal's drafts are read here only when the next
    proposal comes (the engine itself reads them once their step's forward is queued)."""
    speculator = llm.llm_engine.speculator
    seen: list[tuple[list[int], list[int]]] = []
    unread: list[tuple[list[int], Any, str, int]] = []  # the latest proposal's
    propose = speculator.propose

    def recording(sequences):
        seen.extend((tokens, flight.drafts(rid, n)) for tokens, flight, rid, n in unread)
        unread.clear()
        propose(sequences)
        flight = speculator.in_flight
        for seq in sequences:
            request = seq.request
            if not request.spec_token_ids:
                continue
            if flight is None:  # n-gram lookup: on the host
                seen.append((list(request.all_token_ids), list(request.spec_token_ids)))
            else:
                n = len(request.spec_token_ids)
                unread.append((list(request.all_token_ids), flight, request.request_id, n))

    speculator.propose = recording
    return seen


def _record_draft_feeds(llm: LLM) -> list[bool]:
    """For each forward carrying drafts of a device proposal: whether the host had
    read them when it queued the forward (it should not have: they are fed on the
    device)."""
    engine = llm.llm_engine
    runner, read = engine.runner, []
    forward = runner.forward

    def recording(sched):
        if sched.draft_sources is not None:
            read.append(engine.speculator.in_flight.pending._host is not None)
        forward(sched)

    runner.forward = recording
    return read


# Six prompts of repetitive tokens (the tiny heads' drafts get kept), 3 to 41 tokens long.
DRAFT_PROMPTS = [
    {"prompt_token_ids": [4 + (i * 7 + j * 3) % 4 for j in range(n)]}
    for i, n in enumerate((3, 9, 20, 33, 5, 41))
]


def speculated_like_plain(
    target: str, engine: dict, config: dict
) -> tuple[LLM, list[tuple[list[int], list[int]]]]:
    """Greedy tokens of DRAFT_PROMPTS with `config`'s speculation equal plain decoding's,
    with preemptions, some drafts kept and some not, and every block back; the
    speculating engine and (sequence, drafts) for each proposal it made."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(target, **engine)
    want = [o.outputs[0].token_ids for o in plain.generate(DRAFT_PROMPTS, greedy, use_tqdm=False)]
    del plain
    llm = LLM(target, speculative_config=config, **engine)
    seen = _record_drafts(llm)
    read = _record_draft_feeds(llm)
    got = [o.outputs[0].token_ids for o in llm.generate(DRAFT_PROMPTS, greedy, use_tqdm=False)]
    assert got == want
    # Each step's drafts reached its forward on the device, unread by the host.
    assert len(read) > 10 and not any(read)
    m = llm.get_metrics()
    assert m["num_preemptions"] > 0
    assert 0 < m["spec_decode_num_accepted_tokens"] < m["spec_decode_num_draft_tokens"]
    assert m["num_free_blocks"] == m["num_total_blocks"]
    return llm, seen


def seeded_draws_alone_as_batched(llm: LLM) -> None:
    """Seeded sampling under speculation: a request draws the same alone as beside others."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    seeded = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True) for s in (1, 2)
    ]
    prompts = DRAFT_PROMPTS[:2]
    batch = llm.generate(prompts * 2, [greedy, greedy, *seeded], use_tqdm=False)
    for prompt, params, out in zip(prompts, seeded, batch[2:], strict=True):
        alone = llm.generate([prompt], params, use_tqdm=False)
        assert alone[0].outputs[0].token_ids == out.outputs[0].token_ids


@pytest.mark.slow
def test_eagle_drafts_match_a_transformers_head(tiny):
    from transformers import AutoModelForCausalLM

    from jvllm.testing.eagle import load_head, reference_drafts

    target, head = tiny
    # Budget 16 chunks the longer prompts; 9 blocks of 16 force preemptions.
    engine = dict(
        max_model_len=96, max_num_seqs=6, max_num_batched_tokens=16, num_gpu_blocks_override=9
    )
    config = {"method": "eagle", "model": head, "num_speculative_tokens": K}
    llm, seen = speculated_like_plain(target, engine, config)

    hf = AutoModelForCausalLM.from_pretrained(target).eval()
    reference = load_head(head)
    assert len(seen) > 60
    for sequence, drafts in seen:
        assert reference_drafts(hf, reference, sequence, len(drafts)) == drafts, sequence

    seeded_draws_alone_as_batched(llm)


def test_an_eagle_head_must_fit_the_target(tiny, tmp_path):
    target, head = tiny
    config = json.loads((Path(head) / "config.json").read_text())
    cases = {
        "eagle3": ({**config, "architectures": ["Eagle3LlamaForCausalLM"]}, "EAGLE-3 heads"),
        "wide": ({**config, "hidden_size": config["hidden_size"] * 2}, "hidden_size="),
        "hass": ({**config, "add_para_norm": True}, "add_para_norm"),
        "mistral": ({**config, "architectures": ["MistralForCausalLM"]}, "not an EAGLE-1"),
    }
    for name, (bad, message) in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            LLM(
                target,
                speculative_config={
                    "method": "eagle",
                    "model": str(tmp_path / name),
                    "num_speculative_tokens": 2,
                },
                max_model_len=64,
            )
    with pytest.raises(ValueError, match="needs 'model'"):
        SpeculativeConfig.from_dict({"method": "eagle", "num_speculative_tokens": 2})
