"""Speculative decoding: output tokens/s and TPOT with and without a proposer.

The demo model (its text is not noise), greedy, on its corpus' chat prompts, with a
fixed output length (ignore_eos), so each configuration emits the same tokens
(checked). The demo model does not copy passages from its prompt (4.2M parameters,
trained on 256-token cookies: a prompt holding a passage twice and then half of it is
not continued with the rest), so n-gram lookup hits where its greedy text repeats
itself, as small models' greedy text does. At each concurrency (requests in flight:
`max_num_seqs`), the configurations run alternating (A B A B) and the medians are
reported, with the draft acceptance rate and the mean tokens a verifying row emits.
TPOT is measured per request from the engine's steps: (last token's time - first
token's) / (tokens - 1).

    python bench/spec_decode.py [--concurrency 1,4] [--num-prompts 8] [--max-tokens 128]
        [--speculative-config '{"method": "ngram", "num_speculative_tokens": 4, ...}']
        [--draft-model demo] [--eagle demo] [--num-draft-tokens 3]
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import statistics
import time
from typing import Any

from bench import common
from jvllm import LLM, SamplingParams
from jvllm.demo import DEMO_ENGINE_DEFAULTS, demo_eagle_path, demo_model_path
from jvllm.demo.corpus import PROMPTS

DEFAULT_SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}


def chat_prompts(num: int) -> list[list[int]]:
    """The demo corpus' chat prompts in its chat template, as token ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model_path())
    out = []
    for i in range(num):
        messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append(tok.encode(text, add_special_tokens=False))
    return out


def timed_run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """All prompts through the engine step by step; tokens, wall time and per-request TPOT."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = llm.get_metrics()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    seen: dict[str, list[float]] = {}  # request -> the time of each token's arrival
    outputs: dict[str, list[int]] = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            times = seen.setdefault(out.request_id, [])
            times += [now] * (len(out.outputs[0].token_ids) - len(times))
            outputs[out.request_id] = list(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    after = llm.get_metrics()
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in seen.values() if len(t) > 1]
    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    rows = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
    num_out = sum(len(v) for v in outputs.values())
    return dict(
        seconds=elapsed,
        output_tok_s=num_out / elapsed,
        tpot_median_ms=1e3 * statistics.median(tpots),
        acceptance_rate=accepted / drafted if drafted else None,
        mean_emitted_per_verify=1 + accepted / rows if rows else None,
        outputs=[outputs[f"r{i}"] for i in range(len(prompts))],
    )


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="1,4", help="comma-separated max_num_seqs values")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--speculative-config", type=json.loads, default=DEFAULT_SPEC)
    ap.add_argument(
        "--draft-model",
        help="also run a draft model (a checkpoint with the demo's vocabulary; 'demo': "
        "the demo model drafting for itself, every greedy draft kept: the ceiling)",
    )
    ap.add_argument(
        "--eagle",
        help="also run an EAGLE-1 head for the demo model (a directory; 'demo': the shipped one)",
    )
    ap.add_argument("--num-draft-tokens", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR / "spec_decode.json")
    args = ap.parse_args(argv)
    result = common.envelope(__file__, argv)
    prompts = chat_prompts(args.num_prompts)
    configs = {"none": None, args.speculative_config["method"]: args.speculative_config}
    if args.draft_model:
        draft = str(demo_model_path()) if args.draft_model == "demo" else args.draft_model
        configs["draft"] = {"model": draft, "num_speculative_tokens": args.num_draft_tokens}
    if args.eagle:
        head = str(demo_eagle_path()) if args.eagle == "demo" else args.eagle
        configs["eagle"] = {
            "method": "eagle",
            "model": head,
            "num_speculative_tokens": args.num_draft_tokens,
        }
    table, runs = [], {}
    for c in [int(x) for x in args.concurrency.split(",")]:
        engine_args = {**DEMO_ENGINE_DEFAULTS, "max_num_seqs": c}
        llms = {
            name: LLM(str(demo_model_path()), speculative_config=spec, **engine_args)
            for name, spec in configs.items()
        }
        for llm in llms.values():  # warm-up: every shape the workload uses
            timed_run(llm, prompts[:c], 8)
        got: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
        for _ in range(args.repeats):
            for name, llm in llms.items():
                got[name].append(timed_run(llm, prompts, args.max_tokens))
                common.log(f"c={c} {name}: {got[name][-1]['output_tok_s']:.0f} tok/s")
        outputs = {name: r[0].pop("outputs") for name, r in got.items()}
        assert all(o == outputs["none"] for o in outputs.values()), "a proposer changed outputs"
        for name, rs in got.items():
            for r in rs:
                r.pop("outputs", None)
            tok_s = statistics.median(r["output_tok_s"] for r in rs)
            tpot = statistics.median(r["tpot_median_ms"] for r in rs)
            summary = dict(runs=rs, output_tok_s=tok_s, tpot_median_ms=tpot)
            summary["acceptance_rate"] = rs[0]["acceptance_rate"]
            summary["mean_emitted_per_verify"] = rs[0]["mean_emitted_per_verify"]
            runs[f"c{c}_{name}"] = summary
            base = runs[f"c{c}_none"]["output_tok_s"]
            rate = summary["acceptance_rate"]
            table.append(
                [c, name, tok_s, tpot, "-" if rate is None else f"{100 * rate:.0f}%", tok_s / base]
            )
        del llms
    result.update(
        model=str(demo_model_path()),
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
        speculative_configs={k: v for k, v in configs.items() if v},
        results=runs,
        same_outputs=True,
    )
    headers = ["concurrency", "proposer", "output tok/s", "TPOT p50 ms", "accepted", "speed-up"]
    print(common.format_table(headers, table))
    common.write_result(args.out, result)


if __name__ == "__main__":
    main(sys.argv[1:])
