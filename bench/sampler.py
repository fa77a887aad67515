"""The sampler program alone: device time per call for each kind of batch.

Times `jvllm.layers.sampler.sample` jitted over `[rows, vocab]` float32 logits (random
normal, scale 3) with `rows - 2` real rows of one setting (greedy, temperature, top_p,
top_k) and two padding rows, and the argmax of such logits as `jnp.argmax` and as
`argmax_rows`, as a runner runs it (on CPU devices: malloc keeping freed memory, and
the rows in `GROUP_ROWS_CPU` groups of one `[--max-rows, vocab]` program, or with
older checkouts `DRAW_ROWS_CPU`). Medians and minima of `--reps` calls, alternating
the kinds, in one process. With `--baseline-src DIR` (another jvllm checkout, e.g. a
`git worktree` of an older commit) the same is timed with that checkout's sampler in a
second process, the two processes alternating `--rounds` times.

    python bench/sampler.py
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--child" in sys.argv:  # the measured checkout's jvllm, ahead of this one
    sys.path.insert(0, sys.argv[sys.argv.index("--child") + 1])

import argparse
import json
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench import common

ROOT = Path(__file__).resolve().parents[1]
SETTINGS: dict[str, dict[str, float]] = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "top_p": dict(temperature=0.8, top_p=0.9),
    "top_k": dict(temperature=0.8, top_k=20),
}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", default="16,64", help="comma-separated logits rows")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument(
        "--max-rows", type=int, default=128, help="the runner's largest logits-row bucket"
    )
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3, help="alternations with --baseline-src")
    p.add_argument("--baseline-src", type=Path, help="another jvllm checkout, timed too")
    p.add_argument("--output", type=Path, default=common.RESULTS_DIR / "sampler_cpu.json")
    p.add_argument("--child", nargs=1, help=argparse.SUPPRESS)  # SRC
    return p.parse_args(argv)


def time_calls(fn: Callable[..., Any], fn_args: tuple[Any, ...], reps: int) -> list[float]:
    import jax

    jax.block_until_ready(fn(*fn_args))  # compiled and run once, untimed
    seconds = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*fn_args))
        seconds.append(time.perf_counter() - t)
    return seconds


def child(args: argparse.Namespace) -> dict[str, Any]:
    """This process's jvllm (first on sys.path): milliseconds per call, per case."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jvllm
    from jvllm.engine.step_io import SamplingRow
    from jvllm.layers import sampler
    from jvllm.runner import memory
    from jvllm.sampling_params import SamplingParams

    # As a runner runs it: on CPU devices with these settings (checkouts before them:
    # without), elsewhere the whole batch at once.
    as_run: dict[str, Any] = {}
    grouped = False  # every row count padded to --max-rows, sampled in groups
    if jax.default_backend() == "cpu":
        if hasattr(memory, "retain_freed_host_memory"):
            memory.retain_freed_host_memory()
        if hasattr(sampler, "GROUP_ROWS_CPU"):
            as_run["group_rows"], grouped = sampler.GROUP_ROWS_CPU, True
        elif hasattr(sampler, "DRAW_ROWS_CPU"):
            as_run["draw_rows"] = sampler.DRAW_ROWS_CPU

    cases: dict[str, Any] = {}
    sample = jax.jit(lambda lg, md, li: sampler.sample(lg, md, li, **as_run).token_ids)
    for num_rows in (int(r) for r in args.rows.split(",")):
        rng = np.random.default_rng(num_rows)
        padded = max(num_rows, args.max_rows) if grouped else num_rows
        logits = jnp.asarray(3 * rng.standard_normal((padded, args.vocab)), jnp.float32)
        last = jnp.zeros(padded, jnp.int32)
        calls: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {}
        for name, knobs in SETTINGS.items():
            params = SamplingParams(**knobs)
            rows = [SamplingRow(params, i, 0, (), ()) for i in range(num_rows - 2)]
            md = jax.device_put(sampler.make_sampling_metadata(rows, padded))
            calls[f"sample {name}"] = (sample, (logits, md, last))
        real = logits[:num_rows]
        calls["jnp.argmax"] = (jax.jit(lambda x: jnp.argmax(x, -1)), (real,))
        if hasattr(sampler, "argmax_rows"):
            calls["argmax_rows"] = (jax.jit(sampler.argmax_rows), (real,))
        timed: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(5):  # the kinds alternate, a fifth of the calls at a time
            for name, (fn, fn_args) in calls.items():
                timed[name] += time_calls(fn, fn_args, max(1, args.reps // 5))
        for name, seconds in timed.items():
            cases[f"{name} @ {num_rows}"] = dict(
                median_ms=1e3 * statistics.median(seconds), min_ms=1e3 * min(seconds)
            )
    return dict(source=str(Path(jvllm.__file__).parent), cases=cases)


def run_child(source: Path, argv: Sequence[str]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, *argv, "--child", str(source)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return {}
    result = common.envelope(__file__, argv)
    child_argv = ["--rows", args.rows, "--vocab", str(args.vocab), "--reps", str(args.reps)]
    child_argv += ["--max-rows", str(args.max_rows)]
    sources = {"jvllm": ROOT}
    if args.baseline_src is not None:
        sources["baseline"] = args.baseline_src.resolve()
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in sources}
    for _ in range(args.rounds if args.baseline_src is not None else 1):
        for label, source in sources.items():
            common.log(f"{label} ({source}) ...")
            runs[label].append(run_child(source, child_argv))
    result["runs"] = runs
    # Per case and source: the median over rounds of each round's median.
    summary: dict[str, dict[str, float]] = {}
    for label, label_runs in runs.items():
        for case in label_runs[0]["cases"]:
            summary.setdefault(case, {})[label] = statistics.median(
                r["cases"][case]["median_ms"] for r in label_runs if case in r["cases"]
            )
    result["median_ms"] = summary
    headers = ["case", *(f"{label} ms" for label in sources)]
    table = [
        [case, *(row.get(label, float("nan")) for label in sources)]
        for case, row in summary.items()
    ]
    print(common.format_table(headers, table))
    common.write_result(args.output, result)
    return result


if __name__ == "__main__":
    main()
