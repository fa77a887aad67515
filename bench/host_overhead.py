"""Host overhead of one engine step, with no device work at all.

For each count of running decode sequences (64, 256 and 1024 by default) it times, per
step: `Scheduler.schedule()`, the runner's input preparation (`pack_rows` into the one
packed int32 buffer, `make_sampling_metadata`), and `update_from_output()`; then a whole
`LLMEngine.step()` whose runner only prepares inputs and returns fixed tokens (so the
figure adds the engine's bookkeeping and incremental detokenization). The goal figure is
schedule + input preparation, in microseconds per step.

Everything runs with the collector as serving sets it (`jvllm.engine.gc_heap.serving_gc`,
as in `LLM.generate` and `jvllm serve`); `--gc default` keeps CPython's settings, for
comparison. The table gives medians, and the mean of `engine.step`, which the full
collections land in.

With `--baseline-src DIR` (another jvllm checkout, e.g. a `git worktree` of an older
commit) that checkout's engine is built beside this one's in the same process (its
`jvllm` copied under the name `jvllm_baseline`) and the two engines step alternately,
so both see the same minutes of a shared machine; the report adds the baseline's
`engine.step` median and the ratio.

    python bench/host_overhead.py
    python bench/host_overhead.py --baseline-src /tmp/jvllm-base
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import contextlib
import importlib
import math
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from bench import common
from jvllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from jvllm.engine.gc_heap import serving_gc
from jvllm.engine.llm_engine import LLMEngine
from jvllm.engine.request import Request
from jvllm.engine.scheduling.scheduler import Scheduler
from jvllm.engine.step_io import SamplingRow, StepResult
from jvllm.layers.sampler import make_sampling_metadata
from jvllm.runner.input_batch import (
    BatchShape,
    pack_rows,
    pick_bucket,
    token_buckets,
    total_tokens,
)
from jvllm.runner.model_runner import MIN_TOKEN_BUCKET
from jvllm.sampling_params import RequestOutputKind, SamplingParams
from jvllm.testing.checkpoints import write_word_tokenizer

GOAL_US_AT_256 = 1000.0
_GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-seqs", default="64,256,1024", help="comma-separated running counts")
    p.add_argument("--prompt-len", type=int, default=256, help="context of every sequence")
    p.add_argument("--max-model-len", type=int, default=2048, help="sets the block-table width")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--steps", type=int, default=50, help="timed decode steps per count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--output-kind",
        choices=[k.name.lower() for k in RequestOutputKind],
        default="cumulative",
        help="what each step's RequestOutput holds (SamplingParams.output_kind)",
    )
    p.add_argument(
        "--gc",
        choices=["serving", "default"],
        default="serving",
        help="the collector as serving sets it (frozen heap, gen-0 threshold raised), or "
        "CPython's default",
    )
    p.add_argument("--baseline-src", type=Path, help="another jvllm checkout, stepped alternately")
    p.add_argument("--output", type=Path, default=common.RESULTS_DIR / "host_overhead.json")
    args = p.parse_args(argv)
    try:
        args.num_seqs = [int(n) for n in args.num_seqs.split(",")]
    except ValueError:
        p.error(f"--num-seqs must be like 64,256,1024, got {args.num_seqs!r}")
    if min(args.num_seqs) < 1 or args.steps < 1:
        p.error("--num-seqs entries and --steps must be >= 1")
    return args


class Setup:
    """Configs for N running sequences, sized so that none is ever preempted."""

    def __init__(self, args: argparse.Namespace, num_seqs: int) -> None:
        self.args = args
        self.num_seqs = num_seqs
        batched = max(2048, num_seqs)
        self.scheduler_config = SchedulerConfig(num_seqs, batched, args.max_model_len)
        # While the last prompts prefill, the first ones decode a token a step: about
        # num_seqs * prompt_len / (batched - num_seqs) steps, more than --steps when few.
        prefill_steps = math.ceil(
            num_seqs * args.prompt_len / max(batched - num_seqs, args.prompt_len)
        )
        decoded = prefill_steps + 4 * args.steps + 8
        per_seq = math.ceil((args.prompt_len + decoded) / args.block_size)
        one_full_seq = math.ceil(args.max_model_len / args.block_size)  # the scheduler checks it
        self.num_blocks = max(num_seqs * per_seq, one_full_seq) + 1
        self.cache_config = CacheConfig(args.block_size, num_gpu_blocks_override=self.num_blocks)
        # The runner's bucketing (ModelRunner.batch_shape), without building a model.
        self.buckets = token_buckets(batched, MIN_TOKEN_BUCKET)
        self.width = math.ceil(args.max_model_len / args.block_size)
        rng = np.random.default_rng(args.seed)
        low = len(common.SPECIAL_TOKENS)
        self.prompts = rng.integers(low, args.vocab_size, (num_seqs, args.prompt_len)).tolist()
        self.sampled = rng.integers(low, args.vocab_size, 1 << 16).tolist()
        self.sampled_array = np.array(self.sampled, np.int32)  # what a device hands back

    def shape(self, num_tokens: int) -> BatchShape:
        t = pick_bucket(num_tokens, self.buckets)
        return BatchShape(t, min(t, self.scheduler_config.max_num_seqs), self.width)


def time_components(setup: Setup) -> dict[str, list[float]]:
    """Drives a bare Scheduler: prefill everything untimed, then time decode steps."""
    sched = Scheduler(setup.scheduler_config, setup.cache_config, setup.num_blocks)
    requests = [Request(str(i), p, _GREEDY) for i, p in enumerate(setup.prompts)]
    for r in requests:
        sched.add_request(r)
    times: dict[str, list[float]] = {k: [] for k in ("schedule", "pack", "sampling", "update")}
    step = 0
    while len(times["schedule"]) < setup.args.steps:
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        rows = out.scheduled
        shape = setup.shape(out.num_scheduled_tokens)
        pack_rows(rows, shape, setup.args.block_size, out.block_tables)
        t2 = time.perf_counter()
        srows = [SamplingRow(_GREEDY, i, step, (), ()) for i in range(len(rows))]
        t3 = time.perf_counter()
        make_sampling_metadata(srows, shape.num_seqs)
        t4 = time.perf_counter()
        sampled = [setup.sampled[(step + i) % len(setup.sampled)] for i in range(len(rows))]
        t5 = time.perf_counter()
        sched.update_from_output(out, sampled)
        t6 = time.perf_counter()
        step += 1
        if out.preempted_request_ids:  # the sizing above is wrong: say so, not loop on
            raise RuntimeError(f"step {step} preempted {len(out.preempted_request_ids)}")
        if len(rows) == setup.num_seqs and all(len(r.token_ids) == 1 for r in rows):
            for key, dt in zip(times, (t1 - t0, t2 - t1, t4 - t3, t6 - t5), strict=True):
                times[key].append(dt)
    return times


class NoDeviceRunner:
    """The engine's runner minus the device: prepares inputs, returns preset tokens."""

    num_compilations = 0

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.calls = 0

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        pass

    def forward(self, scheduled: Any) -> None:
        rows = scheduled.scheduled
        self.shape = self.setup.shape(total_tokens(rows))  # as ModelRunner counts them
        self.rows = rows
        bs, tables = self.setup.args.block_size, scheduled.block_tables
        pack_rows(rows, self.shape, bs, tables, None, scheduled.columns)

    def sample(self, sampling: Any) -> _Done:
        make_sampling_metadata(sampling.rows, self.shape.num_seqs)
        return self._result(len(self.rows))

    def _result(self, n: int) -> _Done:
        start = (self.calls * 7919) % (len(self.setup.sampled) - n)
        self.calls += 1
        # A copy out of an array, as a device's result is (not a list's conversion).
        tokens = self.setup.sampled_array[start : start + n].copy()
        zeros = np.zeros((n, 1), np.float32)
        return _Done(StepResult(tokens, zeros[:, 0], zeros.astype(np.int32), zeros, None))


class _Done(NamedTuple):
    """A dispatched step that is already complete (there is no device to wait for)."""

    step: StepResult

    def result(self) -> StepResult:
        return self.step


def decoding_engine(setup: Setup, tokenizer: Any) -> LLMEngine:
    """An engine on the no-device runner with every sequence prefilled: each further
    `step()` is a decode step of all of them."""
    params = _GREEDY.clone(output_kind=RequestOutputKind[setup.args.output_kind.upper()])
    cfg = EngineConfig(
        ModelConfig("host-overhead"), setup.cache_config, setup.scheduler_config, ParallelConfig()
    )
    runner = NoDeviceRunner(setup)
    engine = LLMEngine(cfg, tokenizer, runner, setup.num_blocks, setup.args.vocab_size, [1])
    for i, prompt in enumerate(setup.prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()  # prefill, untimed
    return engine


def word_tokenizer(vocab_size: int) -> Any:
    with tempfile.TemporaryDirectory() as tmp:
        from transformers import AutoTokenizer

        write_word_tokenizer(Path(tmp), vocab_size)
        return AutoTokenizer.from_pretrained(tmp)


def time_engine_steps(setup: Setup, tokenizer: Any) -> list[float]:
    engine = decoding_engine(setup, tokenizer)
    return [_timed(engine.step) for _ in range(setup.args.steps)]


@contextlib.contextmanager
def baseline_module(source: Path) -> Iterator[ModuleType]:
    """`source`'s bench/host_overhead.py, importing `source`'s jvllm (copied into a
    temporary directory as the package `jvllm_baseline`, its imports renamed) instead of
    this checkout's; unloaded afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        into = Path(tmp)
        package = into / "jvllm_baseline"
        shutil.copytree(source / "jvllm", package)
        # Checkouts from before kernels/ and server/ moved into jvllm/ mapped them there
        # through pyproject's package-dir.
        for name in ("kernels", "server"):
            if (source / name).is_dir():
                shutil.copytree(source / name, package / name)
        shutil.copy(source / "bench" / "host_overhead.py", into / "host_overhead_baseline.py")
        for path in [*package.rglob("*.py"), into / "host_overhead_baseline.py"]:
            text = path.read_text()
            path.write_text(re.sub(r"\b(from|import) jvllm\b(?!_)", r"\1 jvllm_baseline", text))
        sys.path.insert(0, tmp)
        try:
            yield importlib.import_module("host_overhead_baseline")
        finally:
            sys.path.remove(tmp)
            for name in list(sys.modules):
                if name.split(".")[0] in ("jvllm_baseline", "host_overhead_baseline"):
                    del sys.modules[name]


def time_engine_steps_alternately(
    setup: Setup, baseline: Any, tokenizer: Any
) -> tuple[list[float], list[float]]:
    """`engine.step` times of this checkout's engine and the baseline's, the two stepped
    in turn (which goes first alternates)."""
    engines = [decoding_engine(setup, tokenizer)]
    engines.append(baseline.decoding_engine(baseline.Setup(setup.args, setup.num_seqs), tokenizer))
    times: list[list[float]] = [[], []]
    for i in range(setup.args.steps):
        for k in (0, 1) if i % 2 == 0 else (1, 0):
            times[k].append(_timed(engines[k].step))
    return times[0], times[1]


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _stats(seconds: list[float]) -> dict[str, float]:
    us = [1e6 * s for s in seconds]
    return dict(median_us=statistics.median(us), mean_us=statistics.fmean(us), min_us=min(us))


def measure(
    args: argparse.Namespace, n: int, tokenizer: Any, collector: Any, baseline: Any
) -> dict[str, Any]:
    """One running count's components and engine.step times (the baseline's too)."""
    setup = Setup(args, n)
    with collector():
        comp = time_components(setup)
    total = [
        sum(parts) for parts in zip(comp["schedule"], comp["pack"], comp["sampling"], strict=True)
    ]
    entry = {k: _stats(v) for k, v in comp.items()}
    entry.update(num_seqs=n, schedule_and_prep=_stats(total))
    with collector():
        if baseline is None:
            entry["engine_step"] = _stats(time_engine_steps(setup, tokenizer))
        else:
            mine, theirs = time_engine_steps_alternately(setup, baseline, tokenizer)
            entry["engine_step"], entry["baseline_engine_step"] = _stats(mine), _stats(theirs)
    common.log(f"{n} sequences: {entry['engine_step']['median_us']:.0f} us/engine.step")
    return entry


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    result = common.envelope(__file__, argv)
    result["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    tokenizer = word_tokenizer(args.vocab_size)
    rows = []
    collector = serving_gc if args.gc == "serving" else contextlib.nullcontext
    baseline = None
    with contextlib.ExitStack() as stack:
        if args.baseline_src is not None:
            baseline = stack.enter_context(baseline_module(args.baseline_src.resolve()))
            result["baseline_src"] = str(args.baseline_src.resolve())
        for n in args.num_seqs:
            rows.append(measure(args, n, tokenizer, collector, baseline))
    result["results"] = rows
    at_256 = [r for r in rows if r["num_seqs"] == 256]
    if at_256:
        us = at_256[0]["schedule_and_prep"]["median_us"]
        result["goal"] = dict(
            target_us_at_256=GOAL_US_AT_256, measured_us=us, met=us <= GOAL_US_AT_256
        )
    print_report(result)
    common.write_result(args.output, result)
    return result


def print_report(result: dict[str, Any]) -> None:
    keys = ("schedule", "pack", "sampling", "update", "schedule_and_prep", "engine_step")
    table = [
        [
            r["num_seqs"],
            *(r[k]["median_us"] for k in keys),
            r["engine_step"]["mean_us"],
            r["schedule_and_prep"]["median_us"] / r["num_seqs"],
        ]
        for r in result["results"]
    ]
    print(
        "median microseconds per decode step, no device work "
        f"(context {result['config']['prompt_len']}+, max_model_len "
        f"{result['config']['max_model_len']}, {result['config'].get('gc', 'default')} gc):"
    )
    print(
        common.format_table(
            [
                "seqs",
                "schedule",
                "pack_rows",
                "sampling md",
                "update",
                "sched+prep",
                "engine.step",
                "step mean",
                "us/seq",
            ],
            table,
        )
    )
    if "goal" in result:
        g = result["goal"]
        verdict = (
            "met" if g["met"] else f"missed by {g['measured_us'] / g['target_us_at_256']:.1f}x"
        )
        print(f"goal: schedule + input prep <= 1 ms per step at 256 sequences: {verdict}")
    compared = [r for r in result["results"] if "baseline_engine_step" in r]
    if compared:
        print(f"engine.step, stepped alternately with {result['baseline_src']}:")
        rows = []
        for r in compared:
            mine, theirs = r["engine_step"]["median_us"], r["baseline_engine_step"]["median_us"]
            rows.append([r["num_seqs"], mine, theirs, theirs / mine])
        print(common.format_table(["seqs", "engine.step", "baseline", "speed-up"], rows))


if __name__ == "__main__":
    main()
