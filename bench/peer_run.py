"""One offline throughput run of jvllm or of vLLM on a request file; prints one JSON line.

Run by `bench/peer.py` in a fresh process per run, with jvllm's python or with the
python of vLLM's own environment (`../shared/peer/setup-vllm-cpu.sh`), so it imports
nothing but the standard library and the engine it drives. The request file holds
`{"model": dir, "requests": [[prompt_token_ids, output_len], ...], "engine": {...}}`.
Every request is greedy (or samples at the file's "temperature", default 0) with EOS
ignored, so both engines produce the same number of tokens; the timing covers
`generate` alone (start-up is reported separately). A jvllm run also reports the
fraction of its forwards' token slots that were bucket padding.

    python bench/peer_run.py jvllm requests.json
"""

from __future__ import annotations

import json
import os
import sys
import time


def run_jvllm(spec: dict) -> tuple[float, float, list[list[int]], dict]:
    from jvllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(spec["model"], **spec["engine"])
    start_s = time.perf_counter() - started
    temperature = spec.get("temperature", 0.0)
    params = [
        SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True)
        for _, n in spec["requests"]
    ]
    prompts = [{"prompt_token_ids": ids} for ids, _ in spec["requests"]]
    runner = llm.engine.runner
    before = list(getattr(runner, "token_slots", ()))  # warm-up's forwards not counted
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    extra = {}
    if before:  # an older checkout's runner (peer.py --baseline-src) may not count them
        real, slots = (b - a for a, b in zip(before, runner.token_slots, strict=True))
        extra = {"forward_tokens": real, "forward_token_slots": slots, "padding": 1 - real / slots}
    return start_s, elapsed, [list(o.outputs[0].token_ids) for o in outs], extra


def run_vllm(spec: dict) -> tuple[float, float, list[list[int]], dict]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine = spec["engine"]
    started = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype=engine.get("dtype", "auto"),
        max_model_len=engine["max_model_len"],
        max_num_seqs=engine.get("max_num_seqs", 256),
        seed=0,
    )
    start_s = time.perf_counter() - started
    temperature = spec.get("temperature", 0.0)
    params = [
        SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True)
        for _, n in spec["requests"]
    ]
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in spec["requests"]]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return start_s, time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs], {}


def main() -> None:
    engine, path = sys.argv[1], sys.argv[2]
    if engine not in ("jvllm", "vllm"):
        sys.exit(f"engine must be jvllm or vllm, got {engine!r}")
    with open(path) as f:
        spec = json.load(f)
    start_s, elapsed, tokens, extra = (run_jvllm if engine == "jvllm" else run_vllm)(spec)
    out_tokens = sum(len(t) for t in tokens)
    module = sys.modules["jvllm" if engine == "jvllm" else "vllm"]
    result = dict(
        engine=engine,
        source=os.path.dirname(module.__file__ or ""),
        start_s=start_s,
        elapsed_s=elapsed,
        output_tokens=out_tokens,
        output_tokens_per_s=out_tokens / elapsed,
        **extra,
        tokens=tokens,
    )
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":  # vLLM's engine core starts with "spawn": keep this guard
    main()
