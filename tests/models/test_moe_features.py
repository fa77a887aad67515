"""Beam search and structured outputs on a mixture-of-experts model (Qwen3-MoE only).

Beam search: `LLM.beam_search`'s ranked hypotheses and scores equal Transformers'
`generate(num_beams=k, do_sample=False)`, with EOS and without, reusing the dense
checks of `tests/e2e/test_beam_search.py`. Structured outputs: JSON-schema constrained
rows validate with jsonschema while unconstrained rows in the same batch keep the
greedy tokens they get alone.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import jsonschema
import pytest
import torch

from jvllm import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from jvllm.testing.moe_checkpoints import make_moe_checkpoint
from tests.e2e.test_beam_search import MAX_TOKENS, check_against_hf, prompts
from tests.e2e.test_structured_outputs import random_schema

ARCH = "qwen3_moe"
ENGINE = dict(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return make_moe_checkpoint(ARCH, tmp_path_factory.mktemp("moe-features") / ARCH, tokenizer_dir)


@pytest.fixture(scope="module")
def hf_moe(moe_checkpoint: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(moe_checkpoint).eval()


@pytest.fixture(scope="module")
def eos(hf_moe, tokenizer_dir: Path) -> list[int]:
    """[the tokenizer's EOS, the token the model picks most]: beams do end on EOS."""
    from transformers import AutoTokenizer

    counts: Counter[int] = Counter()
    for ids in prompts():
        with torch.no_grad():
            out = hf_moe.generate(
                torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_TOKENS, pad_token_id=0
            )
        counts.update(out[0, len(ids) :].tolist())
    return [AutoTokenizer.from_pretrained(tokenizer_dir).eos_token_id, counts.most_common(1)[0][0]]


@pytest.fixture(scope="module")
def beam_llm(moe_checkpoint: Path, eos: list[int], tmp_path_factory) -> LLM:
    """An LLM over the checkpoint with `eos` in its generation_config.json."""
    out = tmp_path_factory.mktemp("moe-beam")
    for f in moe_checkpoint.iterdir():
        (out / f.name).symlink_to(f)
    (out / "generation_config.json").unlink(missing_ok=True)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return LLM(str(out), **ENGINE)


@pytest.mark.parametrize("with_eos", [True, False], ids=["eos", "ignore_eos"])
def test_moe_beam_search_matches_hf(beam_llm, hf_moe, eos, with_eos) -> None:
    for width, length_penalty in ((1, 1.0), (2, 0.5), (4, 2.0), (4, 0.5)):
        params = BeamSearchParams(
            beam_width=width,
            max_tokens=MAX_TOKENS,
            length_penalty=length_penalty,
            ignore_eos=not with_eos,
        )
        check_against_hf(beam_llm, hf_moe, params, eos)
    if with_eos:  # not vacuous: at width 4, penalty 0.5 some hypotheses end on an EOS id
        outs = beam_llm.beam_search([{"prompt_token_ids": p} for p in prompts()], params)
        reasons = Counter(s.finish_reason for out in outs for s in out.sequences)
        assert reasons["stop"] > 0 and reasons["length"] > 0, reasons
    assert beam_llm.get_metrics()["num_allocated_slots"] == 0


def test_moe_json_schema_rows_validate_and_plain_rows_keep_greedy(beam_llm) -> None:
    rng = random.Random(7)
    schemas = [
        {
            "type": "object",
            "properties": {"a": random_schema(rng), "b": random_schema(rng)},
            "required": ["a"],
            "additionalProperties": False,
        }
        for _ in range(6)
    ]
    constrained = [
        SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=160,
            structured_outputs=StructuredOutputsParams(json=schema),
        )
        for i, schema in enumerate(schemas)
    ]
    plain = SamplingParams(temperature=0.0, max_tokens=24)
    texts = [f"Request {i}: answer in the format asked." for i in range(4 + len(schemas))]
    alone = beam_llm.generate(texts[:4], plain, use_tqdm=False)
    outs = beam_llm.generate(texts, [plain] * 4 + constrained, use_tqdm=False)
    for a, b in zip(alone, outs[:4], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.outputs[0].token_ids) > 0
    for out, schema in zip(outs[4:], schemas, strict=True):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (completion.text, schema)
        jsonschema.validate(json.loads(completion.text), schema)
