"""Structured outputs: throughput with 0%, 50% and 100% of rows constrained, and step
times while a slow grammar compiles.

On the demo model (the bench presets' word-level tokenizers have no decoder, which
llguidance needs), chat prompts from its corpus: one batch of requests, the
constrained ones held to a JSON schema (an array of at least 100 {id, name, ok}
objects) by llguidance's per-step token bitmask, the others ignoring EOS, so that
every output is --max-tokens long. Each fraction runs `--repeats` times,
alternating, and reports the median output tokens/s.

Then the compile test: the same unconstrained batch decodes twice, once alone and once
while a grammar that takes seconds to compile (a schema of thousands of properties)
compiles on the engine's compiler threads, as the server does it; the median and
worst step times of the two show whether the compile holds the engine thread up.

    python bench/structured_outputs.py [--model DIR] [--num-prompts 64] [--repeats 3]
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import statistics
import time

from bench import common
from jvllm import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 9999},
            "name": {"type": "string", "maxLength": 12},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "name", "ok"],
        "additionalProperties": False,
    },
    # Longer than any --max-tokens here: every output, constrained or not, runs to it.
    "minItems": 100,
}
FRACTIONS = (0.0, 0.5, 1.0)


def slow_schema(num_properties: int) -> dict:
    alternatives = [{"type": "integer"}, {"type": "string", "maxLength": 5}]
    props = {f"p{i}": {"anyOf": alternatives} for i in range(num_properties)}
    return {"type": "object", "properties": props}


def run_batch(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs)


def step_times(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[float]:
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"steps-{time.monotonic_ns()}-{i}", {"prompt_token_ids": p}, params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step(final_only=True)
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: the demo)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--slow-properties", type=int, default=40000)
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR / "structured_outputs.json")
    args = ap.parse_args(argv)
    result = common.envelope(__file__, argv)
    llm, model, prompts = common.demo_chat_llm(args.model, args.num_prompts)
    spec = StructuredOutputsParams(json=SCHEMA)

    def params_for(fraction: float) -> list[SamplingParams]:
        constrained = round(fraction * len(prompts))
        return [
            SamplingParams(
                temperature=1.0,
                seed=i,
                max_tokens=args.max_tokens,
                ignore_eos=i >= constrained,
                structured_outputs=spec if i < constrained else None,
            )
            for i in range(len(prompts))
        ]

    run_batch(llm, prompts[:8], params_for(1.0)[:8])  # warm-up: compiles the grammar
    runs: dict[float, list[tuple[float, int]]] = {f: [] for f in FRACTIONS}
    for repeat in range(args.repeats):
        for fraction in FRACTIONS:
            seconds, tokens = run_batch(llm, prompts, params_for(fraction))
            runs[fraction].append((seconds, tokens))
            common.log(f"repeat {repeat}, {fraction:.0%} constrained: {tokens / seconds:.0f} tok/s")
    summary, rows = {}, []
    for fraction, measured in runs.items():
        rates = [tokens / seconds for seconds, tokens in measured]
        mean_len = statistics.mean(tokens for _, tokens in measured) / len(prompts)
        summary[f"{fraction:.0%}"] = dict(
            runs=[dict(seconds=s, output_tokens=t) for s, t in measured],
            median_output_tok_s=statistics.median(rates),
            mean_output_len=mean_len,
        )
        rows.append([f"{fraction:.0%}", statistics.median(rates), mean_len])
    print(common.format_table(["constrained", "median output tok/s", "mean output len"], rows))

    plain = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    batch = prompts[:32]
    step_times(llm, batch, plain)  # warm
    alone = step_times(llm, batch, plain)
    slow = StructuredOutputsParams(json=slow_schema(args.slow_properties))
    started = time.perf_counter()
    future = llm.engine.structured_outputs.compile(slow)
    during = step_times(llm, batch, plain)
    overlapped = future.running() or not future.done()
    future.exception()  # waits
    compile_s = time.perf_counter() - started
    timing = {
        "alone": dict(median_step_s=statistics.median(alone), max_step_s=max(alone)),
        "during_compile": dict(median_step_s=statistics.median(during), max_step_s=max(during)),
        "compile_s": compile_s,
        "compile_outlasted_the_batch": overlapped,
        "num_properties": args.slow_properties,
    }
    print(
        common.format_table(
            ["decode steps", "median ms", "max ms"],
            [
                ["alone", 1e3 * statistics.median(alone), 1e3 * max(alone)],
                ["during a compile", 1e3 * statistics.median(during), 1e3 * max(during)],
            ],
        )
    )
    print(f"the slow grammar compiled in {compile_s:.2f} s (outlasted the batch: {overlapped})")
    result.update(
        model=model,
        num_prompts=len(prompts),
        max_tokens=args.max_tokens,
        schema=SCHEMA,
        throughput=summary,
        compile_while_decoding=timing,
    )
    common.write_result(args.out, result)


if __name__ == "__main__":
    main(sys.argv[1:])
