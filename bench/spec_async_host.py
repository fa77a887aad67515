"""Speculation with async scheduling on and off: the host's work between a step's tokens
and the next step's forward.

With a proposer, the host reads step N's sampled tokens before it schedules N + 1 (the
drafts come from them). What it does between that read and queueing N + 1's forward is
time an accelerator waits (less the proposal's own device time); the rest of the host's
work runs while N + 1 runs. Async scheduling off: verify, the scheduler's and the
output processor's commit (stop checks, text, outputs), the proposal, scheduling and
packing; on (`engine/spec_step.py`): the same without the output processor's commit.
Measured as the host thread's CPU time (`time.thread_time_ns`, not wall time: other
processes on a shared machine barely move it), median over the steps of a run, for the
demo model's shipped EAGLE-1 head, greedy, at each concurrency; both orders on one
engine, their runs interleaved; outputs checked equal.

    python bench/spec_async_host.py [--concurrency 1,4,32] [--max-tokens 32]
        [--methods eagle,ngram] [--repeats 3]
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
from bench.spec_decode import chat_prompts, method_configs, timed_run
from jvllm import LLM
from jvllm.demo import DEMO_ENGINE_DEFAULTS, demo_model_path
from jvllm.runner import step_result


class CriticalPath:
    """Host thread CPU ns from each step's tokens read to the next forward queued."""

    def __init__(self, llm: LLM) -> None:
        self.gaps: list[int] = []
        self._read_at: int | None = None
        runner = llm.llm_engine.runner
        forward, result = runner.forward, step_result.PendingStep.result

        def on_forward(sched: Any) -> None:
            if self._read_at is not None:
                self.gaps.append(time.thread_time_ns() - self._read_at)
                self._read_at = None
            forward(sched)

        def on_result(pending: Any) -> Any:
            out = result(pending)
            self._read_at = time.thread_time_ns()
            return out

        runner.forward = on_forward
        step_result.PendingStep.result = on_result  # type: ignore[method-assign]

    def take(self) -> list[int]:
        gaps, self.gaps, self._read_at = self.gaps, [], None
        return gaps


def measure(method: str, concurrency: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """`method`'s median critical path (µs) per concurrency, async scheduling on / off."""
    spec, _ = method_configs([method], 3)[method]
    llm = LLM(
        str(demo_model_path()),
        speculative_config=spec,
        async_scheduling=False,
        **{**DEMO_ENGINE_DEFAULTS, "max_num_seqs": max(concurrency)},
    )
    prompts = chat_prompts(max(concurrency))
    for c in concurrency:  # warm-up: every shape the workload uses
        timed_run(llm, prompts[:c], 8)
    path = CriticalPath(llm)
    out: dict[str, Any] = {}
    for c in concurrency:
        runs: dict[bool, list[float]] = {False: [], True: []}
        outputs: dict[bool, list] = {}
        for _ in range(args.repeats):
            for overlap in (False, True):
                llm.llm_engine.async_scheduling = overlap  # between runs: nothing in flight
                outputs[overlap] = timed_run(llm, prompts[:c], args.max_tokens)["outputs"]
                runs[overlap].append(statistics.median(path.take()) / 1e3)
        assert outputs[True] == outputs[False], f"{method} at c={c}: outputs differ"
        for overlap, name in ((False, "off"), (True, "on")):
            out[f"c{c}_async_{name}"] = dict(
                critical_path_us_median=statistics.median(runs[overlap]), runs_us=runs[overlap]
            )
        common.log(f"{method} c={c}: {out[f'c{c}_async_off']} / {out[f'c{c}_async_on']}")
    del llm
    return out


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="1,4,32")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--methods", default="eagle")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR / "spec_async_host.json")
    args = ap.parse_args(argv)
    result = common.envelope(__file__, argv)
    concurrency = [int(x) for x in args.concurrency.split(",")]
    results = {m: measure(m, concurrency, args) for m in args.methods.split(",")}
    table = []
    for m, r in results.items():
        for c in concurrency:
            off = r[f"c{c}_async_off"]["critical_path_us_median"]
            on = r[f"c{c}_async_on"]["critical_path_us_median"]
            table.append([m, c, round(off), round(on), f"{100 * (1 - on / off):.0f}%"])
    headers = ["method", "c", "async off (µs)", "async on (µs)", "saved"]
    print(common.format_table(headers, table))
    result.update(
        model=str(demo_model_path()),
        max_tokens=args.max_tokens,
        measure="host thread CPU µs from a step's tokens read to the next forward queued",
        machine_note="shared 2-core CPU machine: other jobs ran at the same time",
        results=results,
        same_outputs=True,
    )
    common.write_result(args.out, result)


if __name__ == "__main__":
    main(sys.argv[1:])
