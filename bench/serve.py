"""Online serving benchmark, like `vllm bench serve`, against `jvllm serve`.

Sends the workload to /v1/completions with streaming on (or, with --no-stream, off:
then only throughput and end-to-end latency are measured), at each given request rate
(Poisson arrivals; `inf` sends everything at once), optionally capped at a maximum number
of requests in flight. Per rate it reports throughput, TTFT, TPOT (mean time per output
token after the first), ITL (gaps between streamed chunks) and end-to-end latency, as mean
/ p50 / p99, and goodput: completed requests per second that met every given SLO.
Without --base-url it starts `jvllm serve` on the preset's model and stops it afterwards.

    python bench/serve.py --preset cpu --request-rate 1,2,4,inf
    python bench/serve.py --base-url http://127.0.0.1:8000 --preset cpu --request-rate 2
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import asyncio
import contextlib
import json
import math
import shlex
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench import common
from bench.common import BenchRequest, Preset

SLO_KEYS = ("ttft", "tpot", "e2el")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", help="a running server; default: start `jvllm serve`")
    p.add_argument("--preset", choices=sorted(common.PRESETS), default="cpu")
    p.add_argument("--models-dir", type=Path, default=common.DEFAULT_MODELS_DIR)
    p.add_argument("--model", help="model name in requests (default: the server's first)")
    p.add_argument("--server-args", default="", help='extra `jvllm serve` flags, "--a 1 --b 2"')
    p.add_argument("--speculative-config", help="the server's --speculative-config (a JSON object)")
    p.add_argument("--num-prompts", type=int, help="default: the preset's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset", type=Path, help="ShareGPT JSON; default: synthetic lengths")
    p.add_argument("--tokenizer", help="tokenizer that counts --dataset tokens")
    p.add_argument("--request-rate", default="inf", help="comma-separated req/s; inf = burst")
    p.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    p.add_argument(
        "--goodput",
        nargs="*",
        default=[],
        metavar="KEY:MS",
        help="SLOs in ms, keys ttft, tpot, e2el, e.g. ttft:2000 tpot:200",
    )
    p.add_argument("--no-stream", action="store_true", help="whole responses, not streamed")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--output", type=Path, help="default: bench/results/serve_<preset>.json")
    args = p.parse_args(argv)
    try:
        args.rates = [float(r) for r in args.request_rate.split(",")]
    except ValueError:
        p.error(f"--request-rate must be like 1,2,inf, got {args.request_rate!r}")
    if any(r <= 0 for r in args.rates):
        p.error("--request-rate values must be > 0")
    args.slos = _parse_slos(p, args.goodput)
    if args.no_stream and {"ttft", "tpot"} & set(args.slos):
        p.error("--no-stream measures no TTFT or TPOT: only an e2el goodput SLO applies")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    return args


def _parse_slos(p: argparse.ArgumentParser, items: list[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        key, _, value = item.partition(":")
        if key not in SLO_KEYS:
            p.error(f"--goodput key must be one of {SLO_KEYS}, got {item!r}")
        try:
            slos[key] = float(value)
        except ValueError:
            p.error(f"--goodput {item!r}: the value must be milliseconds, like ttft:500")
    return slos


# -- one request -----------------------------------------------------------------------------


@dataclass
class RequestResult:
    prompt_len: int
    expected_output_len: int
    ok: bool = False
    error: str = ""
    output_len: int = 0
    ttft: float | None = 0.0  # seconds from send to the first streamed text (None: unstreamed)
    itl: list[float] = field(default_factory=list)  # gaps between later chunks
    e2el: float = 0.0

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_len < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_len - 1)


async def send_one(
    client: Any, url: str, model: str, req: BenchRequest, stream: bool = True
) -> RequestResult:
    """One completion, streamed unless `stream` is False; token ids go in as the prompt,
    EOS is ignored."""
    body: dict[str, Any] = dict(
        model=model,
        prompt=req.prompt_token_ids,
        max_tokens=req.output_len,
        temperature=0.0,
        ignore_eos=True,
        stream=stream,
    )
    result = RequestResult(len(req.prompt_token_ids), req.output_len)
    if not stream:
        return await _send_whole(client, url, body, result)
    body["stream_options"] = {"include_usage": True}
    chunks, last = 0, 0.0
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.output_len = int(chunk["usage"]["completion_tokens"])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    chunks, last = chunks + 1, now
        result.e2el = time.perf_counter() - start
        result.output_len = result.output_len or chunks
        result.ok = chunks > 0
        if not result.ok:
            result.error = "the stream carried no text"
    except Exception as e:  # a failed request is counted, not fatal
        result.error = f"{type(e).__name__}: {e}"
    return result


async def _send_whole(
    client: Any, url: str, body: dict[str, Any], result: RequestResult
) -> RequestResult:
    result.ttft = None
    start = time.perf_counter()
    try:
        resp = await client.post(url, json=body)
        result.e2el = time.perf_counter() - start
        if resp.status_code != 200:
            result.error = f"HTTP {resp.status_code}: {resp.content[:200]!r}"
            return result
        data = resp.json()
        result.output_len = int(data["usage"]["completion_tokens"])
        result.ok = bool(data["choices"] and data["choices"][0]["text"])
        if not result.ok:
            result.error = "the response carried no text"
    except Exception as e:  # a failed request is counted, not fatal
        result.error = f"{type(e).__name__}: {e}"
    return result


# -- one request rate ------------------------------------------------------------------------


async def run_rate(
    base_url: str, model: str, requests: list[BenchRequest], rate: float, args: argparse.Namespace
) -> dict[str, Any]:
    import httpx

    rng = np.random.default_rng(args.seed)
    gaps = (
        rng.exponential(1.0 / rate, len(requests)) if math.isfinite(rate) else [0.0] * len(requests)
    )
    arrivals = np.cumsum(gaps) - gaps[0]  # the first request goes at once
    limit = asyncio.Semaphore(args.max_concurrency or len(requests))
    url = base_url.rstrip("/") + "/v1/completions"
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        started = time.perf_counter()

        async def one(req: BenchRequest, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
            async with limit:  # over --max-concurrency, an arrival waits for a free slot
                return await send_one(client, url, model, req, not args.no_stream)

        results = await asyncio.gather(
            *(one(r, a) for r, a in zip(requests, arrivals, strict=True))
        )
        duration = time.perf_counter() - started
    return dict(
        request_rate=rate if math.isfinite(rate) else "inf",
        max_concurrency=args.max_concurrency,
        **summarise(results, duration, args.slos),
    )


def _dist(values: list[float]) -> dict[str, float | None]:
    if not values:
        return dict(mean=None, p50=None, p99=None)
    ms = 1e3 * np.asarray(values)
    return dict(
        mean=float(ms.mean()), p50=float(np.percentile(ms, 50)), p99=float(np.percentile(ms, 99))
    )


def _meets(r: RequestResult, slos: dict[str, float]) -> bool:
    seconds = {"ttft": r.ttft or 0.0, "tpot": r.tpot or 0.0, "e2el": r.e2el}
    return all(1e3 * seconds[key] <= slo for key, slo in slos.items())


def summarise(
    results: list[RequestResult], duration: float, slos: dict[str, float]
) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    good = [r for r in done if _meets(r, slos)]
    errors = sorted({r.error for r in results if not r.ok})
    return dict(
        completed=len(done),
        failed=len(results) - len(done),
        errors=errors[:5],
        duration_s=duration,
        request_throughput=len(done) / duration,
        output_throughput=out_tokens / duration,
        total_token_throughput=(in_tokens + out_tokens) / duration,
        goodput=len(good) / duration if slos else None,
        slos_ms=slos,
        short_outputs=sum(r.output_len < r.expected_output_len for r in done),
        ttft_ms=_dist([r.ttft for r in done if r.ttft is not None]),
        tpot_ms=_dist([r.tpot for r in done if r.tpot is not None]),
        itl_ms=_dist([g for r in done for g in r.itl]),
        e2el_ms=_dist([r.e2el for r in done]),
    )


# -- the server under test -------------------------------------------------------------------


class ServerProcess:
    """`jvllm serve` on the preset's model and engine sizes, in a subprocess of its own."""

    def __init__(self, command: list[str], proc: subprocess.Popen, port: int, log: Path) -> None:
        self.command = shlex.join(command)
        self.proc = proc
        self.base_url = f"http://127.0.0.1:{port}"
        self.log = log

    @classmethod
    def start(
        cls, model_dir: Path, preset: Preset, extra: list[str], timeout: float = 900.0
    ) -> ServerProcess:
        with socket.socket() as s:  # a free port, released for the server to take
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # This environment's `jvllm` (another one on PATH may lack its packages).
        exe = Path(sys.executable).with_name("jvllm")
        command = [
            *([str(exe)] if exe.is_file() else [sys.executable, "-m", "jvllm.cli"]),
            "serve", str(model_dir), "--port", str(port), "--dtype", preset.dtype,
            "--max-model-len", str(preset.max_model_len),
            "--max-num-seqs", str(preset.max_num_seqs),
            "--max-num-batched-tokens", str(preset.max_num_batched_tokens),
            *(["--num-gpu-blocks-override", str(preset.num_kv_blocks)]
              if preset.num_kv_blocks else []),
            "--disable-access-log", *extra,
        ]  # fmt: skip
        log = Path(tempfile.mkstemp(prefix="jvllm-serve-", suffix=".log")[1])
        common.log(f"starting: {shlex.join(command)} (log: {log})")
        with log.open("w") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        server = cls(command, proc, port, log)
        server.wait_ready(timeout)
        return server

    def wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text()[-3000:]
                raise RuntimeError(f"jvllm serve exited with {self.proc.returncode}:\n{tail}")
            try:
                if httpx.get(self.base_url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"jvllm serve was not healthy after {timeout:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # graceful: in-flight requests may finish
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# -- the whole run ---------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    result = common.envelope(__file__, argv)
    preset = common.PRESETS[args.preset]
    if args.num_prompts:
        preset = Preset(**(preset.__dict__ | {"num_prompts": args.num_prompts}))
    model_dir = common.build_checkpoint(preset, args.models_dir)
    requests, workload = common.make_workload(
        preset, args.seed, args.dataset, args.tokenizer or str(model_dir)
    )
    print(
        f"workload: {len(requests)} requests, mean {workload['mean_input']:.1f} in / "
        f"{workload['mean_output']:.1f} out (lengths scaled by {preset.length_scale:g})"
    )
    server = None
    if args.base_url is None:
        extra = shlex.split(args.server_args)
        if args.speculative_config:
            extra += ["--speculative-config", args.speculative_config]
        server = ServerProcess.start(model_dir, preset, extra)
    try:
        base_url = args.base_url or server.base_url
        model = args.model or _first_model(base_url)
        asyncio.run(_warm_up(base_url, model))
        runs = []
        for index, rate in enumerate(args.rates):
            common.log(f"request rate {rate}: sending {len(requests)} requests ...")
            fresh = index > 0 and args.dataset is None
            batch = _fresh_prompts(requests, preset, args.seed + index) if fresh else requests
            before = _scrape(base_url)
            run = asyncio.run(run_rate(base_url, model, batch, rate, args))
            run["server_counters"] = _counter_deltas(before, _scrape(base_url))
            runs.append(run)
    finally:
        if server is not None:
            server.stop()
    result.update(
        preset=preset.__dict__ | {"hf_batch_sizes": list(preset.hf_batch_sizes)},
        base_url=args.base_url,
        server_command=None if server is None else server.command,
        model=model,
        workload=workload,
        runs=runs,
    )
    print_report(result)
    common.write_result(args.output or common.RESULTS_DIR / f"serve_{preset.name}.json", result)
    return result


def _fresh_prompts(requests: list[BenchRequest], preset: Preset, seed: int) -> list[BenchRequest]:
    """The same lengths with new random prompt ids, so that a later rate finds nothing of
    an earlier one in the server's prefix cache."""
    rng = np.random.default_rng(seed)
    low = len(common.SPECIAL_TOKENS)
    return [
        BenchRequest(
            rng.integers(low, preset.vocab_size, len(r.prompt_token_ids)).tolist(), r.output_len
        )
        for r in requests
    ]


def _first_model(base_url: str) -> str:
    import httpx

    models = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30).json()["data"]
    return models[0]["id"]


async def _warm_up(base_url: str, model: str) -> None:
    """One short request first, so connection setup is not in the first measurement."""
    import httpx

    async with httpx.AsyncClient(timeout=120) as client:
        url = base_url.rstrip("/") + "/v1/completions"
        r = await send_one(client, url, model, BenchRequest([5, 6, 7, 8], 2))
    if not r.ok:
        raise RuntimeError(f"the warm-up request failed: {r.error}")


def _scrape(base_url: str) -> dict[str, float]:
    """`vllm:*` and `jvllm:*` samples of /metrics labelled by nothing but `model_name` and
    `engine` (the server's totals), summed over engines; empty when the server has none."""
    import httpx

    try:
        text = httpx.get(base_url.rstrip("/") + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    values: dict[str, float] = {}
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        name, _, labels = sample.partition("{")
        keys = {pair.split("=")[0] for pair in labels.rstrip("}").split(",") if pair}
        if name.startswith(("vllm:", "jvllm:")) and keys <= {"model_name", "engine"}:
            with contextlib.suppress(ValueError):  # a NaN or odd sample: leave it out
                values[name] = values.get(name, 0.0) + float(value)
    return values


def _counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Counters, and the latency histograms' observation counts, over the run."""
    grew = [k for k in after if k in before and k.endswith(("_total", "_count"))]
    return {k: after[k] - before[k] for k in grew}


def print_report(result: dict[str, Any]) -> None:
    rows = []
    for r in result["runs"]:
        rows.append(
            [
                r["request_rate"],
                r["completed"],
                r["failed"],
                r["request_throughput"],
                r["output_throughput"],
                r["ttft_ms"]["p50"],
                r["ttft_ms"]["p99"],
                r["tpot_ms"]["p50"],
                r["tpot_ms"]["p99"],
                r["itl_ms"]["p50"],
                r["itl_ms"]["p99"],
                r["e2el_ms"]["p50"],
                r["e2el_ms"]["p99"],
                "-" if r["goodput"] is None else r["goodput"],
            ]
        )
    print()
    print(
        common.format_table(
            [
                "rate",
                "done",
                "fail",
                "req/s",
                "out tok/s",
                "TTFT p50",
                "p99",
                "TPOT p50",
                "p99",
                "ITL p50",
                "p99",
                "E2E p50",
                "p99",
                "goodput",
            ],
            rows,
        )
    )
    print("latencies in ms; mean values are in the JSON")


if __name__ == "__main__":
    main()
