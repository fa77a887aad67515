"""Beam search throughput: forking beams inside the engine against resubmitting them.

Runs the same searches two ways on one engine (the demo model by default), alternating
(A B A B) and taking medians:
- `engine`: `LLM.beam_search`, whose beams fork their parents' KV blocks in the
  scheduler and decode one token per step each;
- `resubmit`: vLLM's way (its `LLM.beam_search` outside the engine): every step, every
  live beam is a new one-token request over prompt + beam, with logprobs, and prefix
  caching finds the shared blocks. The selection between steps is the same code
  (`jvllm.engine.beam_search.BeamGroup`), so both must return the same sequences.
Output tokens/s counts every beam's generated tokens (ignore_eos keeps them fixed).

    python bench/beam_search.py [--model DIR] [--width 4] [--max-tokens 32] [--prompts 8]
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
from jvllm import LLM, BeamSearchParams, SamplingParams
from jvllm.engine.beam_search import BeamGroup, Candidates


def resubmit_search(
    llm: LLM, prompts: list[list[int]], params: BeamSearchParams
) -> list[list[list[int]]]:
    """The searches of every prompt, stepping together: each step, one batch of one-token
    requests, one per live beam; the ranked sequences of each prompt."""
    eos = llm.engine.eos_token_ids
    groups = [BeamGroup(f"b{i}", None, p, params, eos, 10**9, 0.0) for i, p in enumerate(prompts)]
    one = SamplingParams(temperature=0.0, max_tokens=1, logprobs=groups[0].num_candidates)
    live = list(groups)
    while live:
        beams = [b for g in live for b in g.beams]
        batch = [{"prompt_token_ids": b.request.all_token_ids} for b in beams]
        for beam, out in zip(beams, llm.generate(batch, one, use_tqdm=False), strict=True):
            (position,) = out.outputs[0].logprobs
            ranked = sorted((lp.rank, t, lp.logprob) for t, lp in position.items() if lp.rank)
            beam.candidates = Candidates([t for _, t, _ in ranked], [lp for *_, lp in ranked])
        for group in list(live):
            continuations, done = group.select()
            if done:
                live.remove(group)
                continue
            group.continue_with(continuations)
    return [[h.token_ids for h in g.finished] for g in groups]


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: the demo)")
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR / "beam_search.json")
    args = ap.parse_args(argv)
    result = common.envelope(__file__, argv)
    llm, model, prompts = common.demo_chat_llm(args.model, args.prompts)
    params = BeamSearchParams(args.width, args.max_tokens, ignore_eos=True)
    num_tokens = args.prompts * args.width * args.max_tokens

    def engine_run() -> list[list[list[int]]]:
        outs = llm.beam_search(prompts, params)
        pairs = zip(prompts, outs, strict=True)
        return [[s.tokens[len(p) :] for s in o.sequences] for p, o in pairs]

    def resubmit_run() -> list[list[list[int]]]:
        return resubmit_search(llm, prompts, params)

    times: dict[str, list[float]] = {"engine": [], "resubmit": []}
    results = {}
    engine_run(), resubmit_run()  # warm-up: compile every shape both ways use
    for _ in range(args.repeats):
        for name, fn in (("engine", engine_run), ("resubmit", resubmit_run)):
            start = time.perf_counter()
            results[name] = fn()
            times[name].append(time.perf_counter() - start)
            common.log(f"{name}: {times[name][-1]:.2f} s")
    assert results["engine"] == results["resubmit"], "the two searches disagree"
    rows, summary = [], {}
    for name, ts in times.items():
        median = statistics.median(ts)
        summary[name] = dict(seconds=ts, median_s=median, output_tok_s=num_tokens / median)
        rows.append([name, median, num_tokens / median])
    ratio = summary["resubmit"]["median_s"] / summary["engine"]["median_s"]
    result.update(
        model=model,
        width=args.width,
        max_tokens=args.max_tokens,
        num_prompts=args.prompts,
        num_output_tokens=num_tokens,
        results=summary,
        engine_speedup=ratio,
        same_sequences=True,
    )
    print(common.format_table(["method", "median s", "output tok/s"], rows))
    print(f"in-engine forking: {ratio:.2f}x the resubmitting search")
    common.write_result(args.out, result)


if __name__ == "__main__":
    main(sys.argv[1:])
