"""Structured outputs offline: every constrained output parses and validates by an
independent checker (jsonschema, `re`, a Lark parser of the same grammar), on a
random-weight model and on the demo model, sampled, with n=3 and under preemption;
unconstrained rows in the same batches keep their unconstrained outputs."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import jsonschema
import lark
import pytest

from jvllm import LLM, SamplingParams, StructuredOutputsParams

NUM_PER_KIND = 50
MAX_TOKENS = 160

# The same language twice: GBNF for the engine, Lark (Earley) for the checker.
SQL_GBNF = r"""
root ::= "SELECT " cols " FROM " table where?
cols ::= col (", " col){0,2}
col ::= "id" | "name" | "price"
table ::= "users" | "items"
where ::= " WHERE " col op value
op ::= " = " | " < " | " > "
value ::= [0-9]{1,3} | "'" [a-z]{1,6} "'"
"""
SQL_LARK = lark.Lark(
    r"""
    start: "SELECT " cols " FROM " TABLE where?
    cols: COL (", " COL)~0..2
    COL: "id" | "name" | "price"
    TABLE: "users" | "items"
    where: " WHERE " COL OP value
    OP: " = " | " < " | " > "
    value: /[0-9]{1,3}/ | /'[a-z]{1,6}'/
    """,
    parser="earley",
)

REGEXES = [
    r"[a-z]{1,6}@[a-z]{2,5}\.(com|org|net)",
    r"[0-9]{3}-[0-9]{4}",
    r"(cat|dog|bird)s? [0-9]{1,3}",
    r"[A-Z][a-z]{0,7}( [A-Z][a-z]{0,7}){0,2}",
    r"(true|false|null)",
    r"0x[0-9a-f]{2,8}",
]


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """Nested objects, enums, bounded arrays, required fields; every value bounded in
    length, so any path through the grammar ends within MAX_TOKENS."""
    kinds = ["string", "integer", "boolean", "enum", "array"] + (["object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    if kind == "integer":
        return {"type": "integer", "minimum": rng.randint(-50, 0), "maximum": rng.randint(1, 999)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {
            "enum": rng.sample(["red", "green", "blue", "cyan", 3, None, True], rng.randint(1, 4))
        }
    if kind == "array":
        return {
            "type": "array",
            "items": random_schema(rng, depth + 1) if depth < 1 else {"type": "boolean"},
            "maxItems": rng.randint(1, 3),
        }
    names = rng.sample(["id", "name", "tags", "size", "owner", "ok", "meta"], rng.randint(1, 3))
    props = {name: random_schema(rng, depth + 1) for name in names}
    required = [n for n in names if rng.random() < 0.7]
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
    }


def cases(seed: int) -> list[tuple[StructuredOutputsParams, Any]]:
    """NUM_PER_KIND (spec, checker) pairs of each kind."""
    rng = random.Random(seed)
    out: list[tuple[StructuredOutputsParams, Any]] = []
    for _ in range(NUM_PER_KIND):
        schema = {
            "type": "object",
            "properties": {"a": random_schema(rng), "b": random_schema(rng)},
            "required": ["a"],
            "additionalProperties": False,
        }
        out.append((StructuredOutputsParams(json=schema), ("json", schema)))
    for i in range(NUM_PER_KIND):
        regex = REGEXES[i % len(REGEXES)]
        out.append((StructuredOutputsParams(regex=regex), ("regex", regex)))
    for _ in range(NUM_PER_KIND):
        words = rng.sample(["alpha", "beta", "gamma", "delta", "pi", "omega", "a b"], 3)
        out.append((StructuredOutputsParams(choice=words), ("choice", words)))
    for _ in range(NUM_PER_KIND):
        out.append((StructuredOutputsParams(grammar=SQL_GBNF), ("grammar", None)))
    return out


def check(text: str, checker: Any) -> None:
    kind, arg = checker
    if kind == "json":
        jsonschema.validate(json.loads(text), arg)
    elif kind == "regex":
        assert re.fullmatch(arg, text), (text, arg)
    elif kind == "choice":
        assert text in arg, (text, arg)
    else:
        SQL_LARK.parse(text)


def run_and_check(llm: LLM, seed: int, n: int = 1) -> None:
    specs = cases(seed)
    params = [
        SamplingParams(
            n=n, temperature=1.0, seed=seed + i, max_tokens=MAX_TOKENS, structured_outputs=spec
        )
        for i, (spec, _) in enumerate(specs)
    ]
    plain = SamplingParams(temperature=0.0, max_tokens=24)
    prompts = [f"Request {i}: answer in the format asked." for i in range(len(specs))]
    alone = llm.generate(prompts[:8], plain, use_tqdm=False)
    outs = llm.generate(prompts[:8] + prompts, [plain] * 8 + params, use_tqdm=False)
    for a, b in zip(alone, outs[:8], strict=True):  # unconstrained rows: untouched
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for out, (_, checker) in zip(outs[8:], specs, strict=True):
        assert len(out.outputs) == n
        for completion in out.outputs:
            assert completion.finish_reason == "stop", (completion.text, checker)
            check(completion.text, checker)


@pytest.fixture(scope="module")
def random_llm(checkpoints) -> LLM:
    # 48 blocks of 16 tokens for up to 16 running sequences: constrained ones get
    # preempted and recomputed, their matchers untouched by it.
    return LLM(
        str(checkpoints["llama"]),
        max_model_len=256,
        max_num_seqs=16,
        max_num_batched_tokens=128,
        num_gpu_blocks_override=48,
    )


@pytest.fixture(scope="module")
def demo_llm() -> LLM:
    return LLM()


def test_random_model_outputs_validate_under_preemption(random_llm) -> None:
    run_and_check(random_llm, seed=0)
    metrics = random_llm.get_metrics()
    assert metrics["num_preemptions"] > 0
    assert metrics["num_free_blocks"] == metrics["num_total_blocks"]


def test_demo_model_outputs_validate_with_n3(demo_llm) -> None:
    run_and_check(demo_llm, seed=1, n=3)


def test_demo_model_outputs_validate_without_async_scheduling() -> None:
    llm = LLM(async_scheduling=False)
    run_and_check(llm, seed=2)


def test_json_object_and_greedy(demo_llm) -> None:
    spec = StructuredOutputsParams(json_object=True)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=spec)
    out = demo_llm.generate(["A JSON object:"], params, use_tqdm=False)[0].outputs[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:  # cut off by max_tokens: still a prefix of an object
        assert out.text.startswith("{")


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (StructuredOutputsParams(json={"type": "foo"}), "foo"),
        (StructuredOutputsParams(json="{not json"), "json"),
        (StructuredOutputsParams(regex="(ab"), "unclosed group"),
        (StructuredOutputsParams(grammar="root ::= missing_rule"), "missing_rule"),
    ],
)
def test_bad_constraints_raise_before_any_request_runs(demo_llm, spec, match) -> None:
    params = SamplingParams(max_tokens=4, structured_outputs=spec)
    with pytest.raises(ValueError, match=match):
        demo_llm.generate(["hello", "world"], [SamplingParams(max_tokens=4), params])
    metrics = demo_llm.get_metrics()
    assert metrics["num_requests_waiting"] == metrics["num_requests_running"] == 0


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"json": {}, "regex": "a"}, {"choice": []}, {"regex": ""}, {"json": 5}],
)
def test_structured_outputs_params_takes_exactly_one(kwargs) -> None:
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        StructuredOutputsParams(**kwargs)
