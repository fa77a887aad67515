"""Pipeline parallelism: micro-batching against one batch in flight, on CPU host devices.

Builds one random-weight Llama (8 layers by default) and runs the same greedy workload
(64 requests, prompts of 32-256 random token ids, 32-64 outputs, EOS ignored, seeded)
on three engines built up front in one process: PP=4 with `pipeline_micro_batches` 4
(each step's rows as 4 micro-batches through the GPipe schedule), PP=4 with 1 (one
batch in flight), and PP=1 on one device as the reference, all with the prefix cache
off so that every run prefills every prompt. After a warm-up run each, the timed runs
alternate (A B C A B C ..., `--rounds` times). For each engine it reports output
tokens/s (the workload's output tokens over the median elapsed time), the tokens its
compiled steps ran (bucket padding included) against those the workload needs, and,
for the pipelined ones, the stage utilisation of the schedules the timed runs executed:
busy over capacity from `ModelRunner.pipeline_load` (a tick lasts as long as its
largest micro-batch, a stage is busy for its own micro-batch's tokens; cost is taken
as proportional to tokens). The greedy outputs must agree token for token across
engines and rounds; the script fails otherwise.

What carries over and what does not: the host "devices" here all share this machine's
few cores, so stages running side by side add no compute, and wall-clock tokens/s cannot
show the overlap a pipeline over separate accelerators gets; what shows instead is the
cost of the schedule's extra ticks and of smaller matmuls per micro-batch. The
schedule's utilisation is the figure that carries over: with M micro-batches over pp
stages it is at most M / (M + pp - 1), against 1 / pp with one batch in flight.

    python bench/pipeline.py [--rounds 2] [--num-requests 64]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Four host devices (STAGES), asked for before jax starts its CPU backend.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from bench import common

STAGES = 4


class Engine(NamedTuple):
    """One engine configuration of the comparison."""

    name: str
    pipeline_parallel_size: int
    micro_batches: int


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", default="32,256", help="inclusive range, uniform")
    p.add_argument("--output-len", default="32,64", help="inclusive range, uniform")
    p.add_argument("--layers", type=int, default=8, help="a multiple of 4 (one part per stage)")
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--intermediate-size", type=int, default=1536)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--micro-batches", type=int, default=STAGES, help="of the micro-batched run")
    p.add_argument("--rounds", type=int, default=2, help="timed runs of each engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--models-dir", type=Path, default=common.DEFAULT_MODELS_DIR)
    p.add_argument("--output", type=Path, default=common.RESULTS_DIR / "pipeline.json")
    args = p.parse_args(argv)
    args.prompt_len = _length_range(p, "--prompt-len", args.prompt_len)
    args.output_len = _length_range(p, "--output-len", args.output_len)
    if args.layers < STAGES or args.layers % STAGES:
        p.error(f"--layers must be a positive multiple of {STAGES}, got {args.layers}")
    if min(args.num_requests, args.rounds, args.micro_batches) < 1:
        p.error("--num-requests, --rounds and --micro-batches must be >= 1")
    if args.micro_batches == 1:
        p.error("--micro-batches must be > 1: 1 is the one-batch-in-flight engine")
    return args


def _length_range(p: argparse.ArgumentParser, flag: str, text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(v) for v in text.split(","))
    except ValueError:
        p.error(f"{flag} must be like 32,256 (lowest,highest), got {text!r}")
    if not 1 <= lo <= hi:
        p.error(f"{flag} needs 1 <= lowest <= highest, got {text!r}")
    return lo, hi


def make_preset(args: argparse.Namespace) -> common.Preset:
    """The model, named by its shape so that other sizes get their own cached checkpoint."""
    max_model_len = args.prompt_len[1] + args.output_len[1]
    name = (
        f"pipeline-l{args.layers}-h{args.hidden_size}-i{args.intermediate_size}"
        f"-a{args.num_heads}x{args.num_kv_heads}-v{args.vocab_size}-ctx{max_model_len}"
    )
    return common.Preset(
        name, args.hidden_size, args.intermediate_size, args.layers, args.num_heads,
        args.num_kv_heads, args.vocab_size, max_model_len, "float32", 1.0, args.num_requests,
        args.max_num_seqs, args.max_num_batched_tokens, None, (),
    )  # fmt: skip


def make_requests(args: argparse.Namespace) -> list[common.BenchRequest]:
    rng = np.random.default_rng(args.seed)
    low = len(common.SPECIAL_TOKENS)
    requests = []
    for _ in range(args.num_requests):
        n = int(rng.integers(args.prompt_len[0], args.prompt_len[1] + 1))
        prompt = rng.integers(low, args.vocab_size, n).tolist()
        output_len = int(rng.integers(args.output_len[0], args.output_len[1] + 1))
        requests.append(common.BenchRequest(prompt, output_len))
    return requests


def describe(args: argparse.Namespace, requests: Sequence[common.BenchRequest]) -> dict:
    ins = [len(r.prompt_token_ids) for r in requests]
    outs = [r.output_len for r in requests]
    return dict(
        source=f"uniform lengths, prompts {args.prompt_len}, outputs {args.output_len}, "
        f"seed {args.seed}",
        num_requests=len(requests),
        mean_input=statistics.fmean(ins),
        mean_output=statistics.fmean(outs),
        total_input_tokens=sum(ins),
        total_output_tokens=sum(outs),
        # Every token but each request's last sampled one goes through the model.
        computed_tokens=sum(ins) + sum(outs) - len(requests),
    )


def build_engine(model_dir: Path, preset: common.Preset, engine: Engine) -> Any:
    from jvllm import LLM

    started = time.perf_counter()
    llm = LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=preset.max_model_len,
        max_num_seqs=preset.max_num_seqs,
        max_num_batched_tokens=preset.max_num_batched_tokens,
        pipeline_parallel_size=engine.pipeline_parallel_size,
        pipeline_micro_batches=engine.micro_batches if engine.pipeline_parallel_size > 1 else None,
        # Every run repeats the same prompts: a prefix cache would skip their prefill.
        enable_prefix_caching=False,
    )
    common.log(f"{engine.name}: built and warmed up in {time.perf_counter() - started:.1f} s")
    return llm


def run_once(llm: Any, requests: Sequence[common.BenchRequest]) -> dict[str, Any]:
    """One timed generate of the whole workload: its elapsed time, tokens, schedule load
    and compilations."""
    from jvllm import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests
    ]
    runner = llm.llm_engine.runner
    load_before = list(runner.pipeline_load)
    programs = llm.get_metrics()["num_compilations"]
    step_tokens: list[int] = []
    shape_of = runner.batch_shape

    def counted(*args: Any, **kwargs: Any) -> Any:
        shape = shape_of(*args, **kwargs)
        step_tokens.append(shape.num_tokens)
        return shape

    runner.batch_shape = counted  # while serving, the runner asks once per step it runs
    try:
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
    finally:
        del runner.batch_shape  # the class's method again
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    wrong = [i for i, r in enumerate(requests) if len(tokens[i]) != r.output_len]
    if wrong:
        raise RuntimeError(f"requests {wrong[:5]} did not produce their requested lengths")
    busy, capacity = (a - b for a, b in zip(runner.pipeline_load, load_before, strict=True))
    return dict(
        elapsed_s=elapsed,
        tokens=tokens,
        busy=busy,
        capacity=capacity,
        step_tokens=sum(step_tokens),
        num_steps=len(step_tokens),
        new_compilations=llm.get_metrics()["num_compilations"] - programs,
    )


def summarise(engine: Engine, runs: list[dict[str, Any]], workload: dict) -> dict[str, Any]:
    """Output tokens/s over the median elapsed time; step tokens per run and utilisation
    over all timed runs."""
    elapsed = statistics.median(r["elapsed_s"] for r in runs)
    output_tokens = workload["total_output_tokens"]
    step_tokens = sum(r["step_tokens"] for r in runs) / len(runs)
    busy, capacity = sum(r["busy"] for r in runs), sum(r["capacity"] for r in runs)
    pp, m = engine.pipeline_parallel_size, engine.micro_batches
    return dict(
        pipeline_parallel_size=pp,
        micro_batches=m,
        elapsed_s=elapsed,
        elapsed_s_per_round=[r["elapsed_s"] for r in runs],
        output_tokens=output_tokens,
        output_tokens_per_s=output_tokens / elapsed,
        num_steps=sum(r["num_steps"] for r in runs) / len(runs),
        step_tokens=step_tokens,
        padding_factor=step_tokens / workload["computed_tokens"],
        stage_busy=busy,
        stage_capacity=capacity,
        stage_utilisation=busy / capacity if capacity else None,
        schedule_bound=m / (m + pp - 1) if pp > 1 else None,
        new_compilations=sum(r["new_compilations"] for r in runs),
    )


def first_difference(tokens: dict[str, list[list[int]]]) -> str | None:
    """None when every engine's greedy outputs equal the first's, else where they differ."""
    names = list(tokens)
    for name in names[1:]:
        for i, (a, b) in enumerate(zip(tokens[names[0]], tokens[name], strict=True)):
            if a != b:
                return f"request {i}: {names[0]} {a[:8]}... against {name} {b[:8]}..."
    return None


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    import jax

    if jax.device_count() < STAGES:
        raise RuntimeError(
            f"needs {STAGES} devices, jax has {jax.device_count()}: XLA_FLAGS is "
            f"{os.environ.get('XLA_FLAGS')!r} (drop its device count, or make it >= {STAGES})"
        )
    result = common.envelope(__file__, argv)
    result["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    result["devices"] = f"{jax.device_count()} x {jax.devices()[0].device_kind}"
    preset = make_preset(args)
    model_dir = common.build_checkpoint(preset, args.models_dir)
    requests = make_requests(args)
    result["workload"] = describe(args, requests)
    engines = [
        Engine(f"pp{STAGES}_m{args.micro_batches}", STAGES, args.micro_batches),
        Engine(f"pp{STAGES}_m1", STAGES, 1),
        Engine("pp1", 1, 1),
    ]
    llms = {e.name: build_engine(model_dir, preset, e) for e in engines}
    for name, llm in llms.items():
        run_once(llm, requests)  # untimed: first-call costs stay out of the figures
        common.log(f"{name}: warm-up run done")
    runs: dict[str, list[dict[str, Any]]] = {e.name: [] for e in engines}
    for i in range(args.rounds):
        for e in engines:
            runs[e.name].append(run_once(llms[e.name], requests))
            common.log(f"round {i + 1} {e.name}: {runs[e.name][-1]['elapsed_s']:.2f} s")
    result["runs"] = {e.name: summarise(e, runs[e.name], result["workload"]) for e in engines}
    tokens = {f"{n} round {i + 1}": r["tokens"] for n in runs for i, r in enumerate(runs[n])}
    difference = first_difference(tokens)
    result["greedy_identical"] = difference is None
    print_report(result)
    common.write_result(args.output, result)
    if difference is not None:
        raise RuntimeError(f"greedy outputs differ: {difference}")
    return result


def print_report(result: dict[str, Any]) -> None:
    reference = result["runs"]["pp1"]["output_tokens_per_s"]
    rows = [
        [
            name,
            r["pipeline_parallel_size"],
            r["micro_batches"],
            r["elapsed_s"],
            r["output_tokens_per_s"],
            r["output_tokens_per_s"] / reference,
            r["padding_factor"],
            "-" if r["stage_utilisation"] is None else r["stage_utilisation"],
            "-" if r["schedule_bound"] is None else r["schedule_bound"],
        ]
        for name, r in result["runs"].items()
    ]
    w = result["workload"]
    print(
        f"{w['num_requests']} requests, {w['total_output_tokens']} output tokens, "
        f"{result['devices']} (median of {result['config']['rounds']} rounds):"
    )
    headers = ["engine", "pp", "M", "elapsed s", "out tok/s", "vs pp1", "padded x"]
    headers += ["stage util", "M/(M+pp-1)"]
    print(common.format_table(headers, rows))
    print(f"greedy outputs identical across engines and rounds: {result['greedy_identical']}")


if __name__ == "__main__":
    main()
