"""Speculative decoding: output tokens/s, acceptance and accepted length per method.

The demo model (its text is not noise), greedy, on its corpus' chat prompts, with a
fixed output length (ignore_eos), so each configuration emits the same tokens
(checked). Methods: no speculation (with async scheduling, "overlap", on and off),
n-gram lookup, a draft model (the demo drafting for itself: every greedy draft kept, the
ceiling), the shipped EAGLE-1, EAGLE-3 and Medusa heads, and DeepSeek-V3's MTP layer
on a tiny random V3 (`jvllm.testing.mtp`, its own no-speculation baseline; its drafts
are random, so only its overhead means anything). Each speculating method runs with
async scheduling off ("<method>") and on ("<method>_overlap": the output processor
commits step N while step N + 1 runs, `engine/spec_step.py`) on the same engine, their
repeats interleaved; a device proposer's drafts stay on the device until the step
verifying them is queued, and with `--host-wait` each such method runs again as
"<method>_host_wait" (async off), the host reading every proposal at once (the
engine's `Speculator.wait_for_proposals`), on that engine too. One engine per
configuration serves every concurrency: at concurrency c, c requests are in flight
together. Reported: output tok/s (median of the repeats), the acceptance rate
(accepted / drafted tokens), the mean accepted length per verifying row (accepted
tokens / rows that verified drafts; vLLM's "mean acceptance length" is this plus one),
and TPOT from the engine's steps.

    python bench/spec_decode.py [--concurrency 1,4,32] [--max-tokens 48] [--repeats 2]
        [--methods none,ngram,draft,eagle,eagle3,medusa,mtp] [--num-draft-tokens 3]
        [--host-wait]
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import statistics
import time
from typing import Any

from bench import common
from jvllm import LLM, SamplingParams
from jvllm.demo import DEMO_ENGINE_DEFAULTS, demo_model_path
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
        mean_accepted_length=accepted / rows if rows else None,
        outputs=[outputs[f"r{i}"] for i in range(len(prompts))],
    )


METHODS = ("none", "ngram", "draft", "eagle", "eagle3", "medusa", "mtp")


def method_configs(
    methods: list[str], k: int, host_wait: bool = False
) -> dict[str, tuple[dict | None, bool]]:
    """name -> (speculative_config, async_scheduling); heads are the demo's shipped ones.
    `host_wait`: each device proposer once more as "<method>_host_wait"."""
    from jvllm.demo import with_shipped_head

    demo = str(demo_model_path())
    out: dict[str, tuple[dict | None, bool]] = {}
    for m in methods:
        if m == "none":
            out["none_overlap"], out["none"] = (None, True), (None, False)
        elif m == "ngram":
            out[m] = ({**DEFAULT_SPEC, "num_speculative_tokens": k}, False)
        elif m == "draft":
            out[m] = ({"model": demo, "num_speculative_tokens": k}, False)
        elif m in ("eagle", "eagle3", "medusa"):
            spec = {"method": m, "num_speculative_tokens": k}
            out[m] = (with_shipped_head(spec, demo), False)
        elif m != "mtp":
            raise SystemExit(f"--methods: {m!r} is not one of {METHODS}")
        if m in out:  # a speculating method: async scheduling on too
            out[f"{m}_overlap"] = out[m]
        if host_wait and m in ("draft", "eagle", "eagle3", "medusa"):
            out[f"{m}_host_wait"] = out[m]
    return out


def mtp_target(root: Path) -> tuple[str, list[list[int]]]:
    """A tiny random DeepSeek-V3 with an MTP layer, and 32 prompts of 24 tokens."""
    import numpy as np

    from jvllm.testing.checkpoints import write_word_tokenizer
    from jvllm.testing.mtp import make_mtp_checkpoint

    write_word_tokenizer(root / "tok", 256)
    path = make_mtp_checkpoint(root / "v3", root / "tok", seed=0)
    rng = np.random.default_rng(0)
    return str(path), [[int(t) for t in rng.integers(4, 256, 24)] for _ in range(32)]


def run_configs(
    model: str,
    configs: dict[str, tuple[dict | None, bool]],
    prompts: list[list[int]],
    concurrency: list[int],
    args: argparse.Namespace,
    engine_args: dict[str, Any],
) -> dict[str, dict[str, Any]]:
    """Every configuration at every concurrency; outputs checked equal to "none"'s. A
    "<method>_host_wait" configuration runs on its method's engine, its repeats
    interleaved with the method's (the shared machine's load then hits both alike)."""
    runs: dict[str, dict[str, Any]] = {}
    outputs: dict[int, dict[str, list]] = {c: {} for c in concurrency}
    top = max(concurrency)
    for name, (spec, overlap) in configs.items():
        if name.endswith("_host_wait") or (spec is not None and name.endswith("_overlap")):
            continue  # a variant run on its method's engine
        llm = LLM(
            model,
            speculative_config=spec,
            async_scheduling=overlap,
            **{**engine_args, "max_num_seqs": top},
        )
        suffixes = ("_overlap", "_host_wait") if spec is not None else ()
        variants = [name] + [f"{name}{s}" for s in suffixes if f"{name}{s}" in configs]
        for c in concurrency:  # warm-up: every shape the workload uses
            timed_run(llm, prompts[:c], 8)
        for c in concurrency:
            rs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
            for _ in range(args.repeats):
                for variant in variants:  # the host reads each proposal at once, or not
                    if len(variants) > 1:  # between runs: nothing in flight
                        engine = llm.llm_engine
                        engine.speculator.wait_for_proposals = variant.endswith("_host_wait")
                        engine.async_scheduling = overlap or variant.endswith("_overlap")
                    rs[variant].append(timed_run(llm, prompts[:c], args.max_tokens))
            for variant, vs in rs.items():
                got = [r.pop("outputs") for r in vs]
                assert all(g == got[0] for g in got), f"{variant} at c={c}: runs differ"
                outputs[c][variant] = got[0]
                common.log(f"c={c} {variant}: {vs[-1]['output_tok_s']:.0f} tok/s")
                runs[f"c{c}_{variant}"] = dict(
                    runs=vs,
                    output_tok_s=statistics.median(r["output_tok_s"] for r in vs),
                    tpot_median_ms=statistics.median(r["tpot_median_ms"] for r in vs),
                    acceptance_rate=vs[0]["acceptance_rate"],
                    mean_accepted_length=vs[0]["mean_accepted_length"],
                    speculative_config=spec,
                    async_scheduling=overlap or variant.endswith("_overlap"),
                    drafts_read_at_once=variant.endswith("_host_wait"),
                )
        del llm
    for c, by_name in outputs.items():
        for name, got in by_name.items():
            assert got == by_name["none"], f"{name} at c={c} changed the greedy outputs"
    return runs


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="1,4,32", help="comma-separated requests in flight")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--num-draft-tokens", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--host-wait", action="store_true", help="also read proposals at once")
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR / "spec_decode_methods.json")
    args = ap.parse_args(argv)
    result = common.envelope(__file__, argv)
    concurrency = [int(x) for x in args.concurrency.split(",")]
    methods = args.methods.split(",")
    prompts = chat_prompts(max(concurrency))
    configs = method_configs(methods, args.num_draft_tokens, args.host_wait)
    runs = run_configs(
        str(demo_model_path()), configs, prompts, concurrency, args, dict(DEMO_ENGINE_DEFAULTS)
    )
    if "mtp" in methods:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            v3, v3_prompts = mtp_target(Path(tmp))
            mtp = {"none": (None, False)}
            mtp["mtp"] = ({"method": "deepseek_mtp", "num_speculative_tokens": 3}, False)
            mtp["mtp_overlap"] = mtp["mtp"]
            engine = dict(max_model_len=256, max_num_batched_tokens=256, dtype="float32")
            got = run_configs(v3, mtp, v3_prompts, concurrency, args, engine)
        runs.update({f"{k}_tiny_v3": v for k, v in got.items()})
    table = []
    for key, r in runs.items():
        c, name = key.split("_", 1)
        base = runs[f"{c}_none_tiny_v3" if key.endswith("tiny_v3") else f"{c}_none"]
        rate, length = r["acceptance_rate"], r["mean_accepted_length"]
        table.append(
            [
                c[1:],
                name,
                round(r["output_tok_s"], 1),
                "-" if rate is None else f"{100 * rate:.0f}%",
                "-" if length is None else round(length, 2),
                round(r["output_tok_s"] / base["output_tok_s"], 2),
            ]
        )
    result.update(
        model=str(demo_model_path()),
        max_tokens=args.max_tokens,
        machine_note="shared 2-core CPU machine: other jobs ran at the same time; noisy",
        results=runs,
        same_outputs=True,
    )
    headers = ["c", "method", "output tok/s", "accepted", "mean accepted len", "vs none"]
    print(common.format_table(headers, table))
    common.write_result(args.out, result)


if __name__ == "__main__":
    main(sys.argv[1:])
